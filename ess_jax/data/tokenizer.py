"""Tokenizers through one code path: a char-level tokenizer for the synthetic tasks,
built with `tokenizers` and saved in Hugging Face format, and any local HF tokenizer.

Both are `transformers` fast tokenizers, so `save_pretrained` / `load_tokenizer`
round-trip either one and the rest of the code never asks which it has.
"""

import json
import os
import string
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

if TYPE_CHECKING:  # transformers is imported lazily: it takes seconds (AutoTokenizer pulls torch)
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3: pad must be 0 (zero-padded buffers)
# tokenizer_config.json classes that need no model-specific tokenizer code (ours is the first).
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Covers every prompt and answer of data/tasks.py, with room for small variations.
DEFAULT_ALPHABET = string.digits + string.ascii_lowercase + " +-*/=()<>:,.?!\n"


def char_tokenizer(alphabet: str | None = None) -> "PreTrainedTokenizerFast":
    """One token per character of `alphabet` after <pad>=0, <bos>=1, <eos>=2, <unk>=3.

    Encoding with special tokens prepends <bos>; decoding joins characters with no
    separator; padding is on the left (prompts end where generation starts).
    """
    from transformers import PreTrainedTokenizerFast

    alphabet = DEFAULT_ALPHABET if alphabet is None else alphabet
    if not alphabet or len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet must be non-empty with unique characters: {alphabet!r}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # Every character, newline included, becomes its own pre-token, hence its own token.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(path: str | os.PathLike) -> "PreTrainedTokenizerBase":
    """Any HF tokenizer directory on local disk (never the network), padding on the left.

    A tokenizer without a pad token gets its EOS as pad, the usual choice for
    decoder-only models (pads are masked out everywhere anyway).
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory not found: {path}")
    config_path = os.path.join(path, "tokenizer_config.json")
    config = {}
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    if config.get("tokenizer_class") in _GENERIC_CLASSES:
        # What AutoTokenizer would build anyway, without its import of torch (seconds).
        from transformers import PreTrainedTokenizerFast as cls
    else:
        from transformers import AutoTokenizer as cls
    tok = cls.from_pretrained(path, local_files_only=True)
    tok.padding_side = "left"
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer at {path} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    return tok


def encode_prompt(
    tokenizer: "PreTrainedTokenizerBase",
    text: str,
    use_chat_template: bool | None = None,
    *,
    system_prompt: str | None = None,
) -> list[int]:
    """Token ids of a prompt, ready for generation.

    use_chat_template: None -> use the tokenizer's chat template if it has one;
    True -> require one; False -> plain text. With a template the text becomes one
    user turn plus the generation prompt (the template adds any BOS); without one
    the tokenizer's own special tokens are added (<bos> for the char tokenizer).
    A character the tokenizer can only map to <unk> is an error, not silent garbage.
    """
    return encode_prompts(tokenizer, [text], use_chat_template, system_prompt=system_prompt)[0]


def encode_prompts(
    tokenizer: "PreTrainedTokenizerBase",
    texts: Sequence[str],
    use_chat_template: bool | None = None,
    *,
    system_prompt: str | None = None,
) -> list[list[int]]:
    """`encode_prompt` of each text, tokenized in one batched call (a data set's prompts at
    startup)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if use_chat_template and not has_template:
        raise ValueError("use_chat_template=True but the tokenizer has no chat template")
    if has_template and use_chat_template is not False:
        system = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        rendered = [
            tokenizer.apply_chat_template(
                [*system, {"role": "user", "content": text}],
                tokenize=False,
                add_generation_prompt=True,
            )
            for text in texts
        ]
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"] if texts else []
    else:
        if system_prompt is not None:
            raise ValueError("system_prompt needs a chat template")
        ids = tokenizer(list(texts), add_special_tokens=True)["input_ids"] if texts else []
    unk = tokenizer.unk_token_id
    for i, (text, row) in enumerate(zip(texts, ids)):
        if unk is not None and unk in row:
            raise UnencodableError(i, text, unencodable_chars(tokenizer, text))
    return [list(row) for row in ids]


class UnencodableError(ValueError):
    """A prompt with characters the tokenizer can only map to <unk>: `index` (into the texts
    `encode_prompts` got), `text`, and `chars`, those of its characters that alone encode to
    <unk> (empty if only a run of them does)."""

    def __init__(self, index: int, text: str, chars: Sequence[str]):
        super().__init__(f"prompt has characters the tokenizer cannot encode: {text!r}")
        self.index, self.text, self.chars = index, text, tuple(chars)


def unencodable_chars(tokenizer: "PreTrainedTokenizerBase", text: str) -> list[str]:
    """The distinct characters of `text`, in order of first use, that `tokenizer` encodes to
    <unk> on their own."""
    chars = list(dict.fromkeys(text))
    rows = tokenizer(chars, add_special_tokens=False)["input_ids"] if chars else []
    return [c for c, row in zip(chars, rows) if tokenizer.unk_token_id in row]


def encode_completion(tokenizer: "PreTrainedTokenizerBase", text: str) -> list[int]:
    """Token ids of a completion (an SFT demonstration) followed by EOS; no BOS."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    unk = tokenizer.unk_token_id
    if unk is not None and unk in ids:
        raise ValueError(f"completion has characters the tokenizer cannot encode: {text!r}")
    return ids + [tokenizer.eos_token_id]


def decode_completion(tokenizer: "PreTrainedTokenizerBase", ids: Sequence[int]) -> str:
    """Text of sampled completion ids, cut at the first EOS and with pads dropped.

    Special tokens before EOS are kept in the text (not skipped) so the rewards'
    `truncate_at_eos` still sees chat end-of-turn markers such as <|im_end|>.
    """
    ids = [int(i) for i in ids]
    if tokenizer.eos_token_id in ids:
        ids = ids[: ids.index(tokenizer.eos_token_id)]
    ids = [i for i in ids if i != tokenizer.pad_token_id]
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

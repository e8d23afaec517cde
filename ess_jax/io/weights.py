"""Checkpoint import and export: Hugging Face safetensors <-> params, and the dispatch to GGUF.

HF linear weights are [out, in]; ours are [in, ..., out] with heads split out, e.g.
q_proj [H*K, D] <-> q [D, H, K] and o_proj [D, H*K] <-> o [H, K, D]. Loading streams one
tensor at a time from disk (numpy, any float dtype) to float32 and puts it straight onto its
own sharding, so no host or device ever holds more than one full tensor beyond its shards.

Public API:
  config_from_hf(hf_config) -> ModelConfig        config_to_hf(cfg) -> dict
  load_hf(path, mesh=None, dtype=None) -> (cfg, params)
  save_hf(cfg, params, path, max_shard_bytes=..., tokenizer=None)
  load_checkpoint(path, mesh=None, dtype=None) -> (cfg, params, tokenizer or None)
  load_gguf, smollm2_gguf_path: re-exported from ess_jax.io.gguf_llama (the GGUF import).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ess_jax.io import gguf_llama, hf_layout
from ess_jax.io.gguf_llama import load_gguf, smollm2_gguf_path  # noqa: F401 (re-exported)
from ess_jax.model.config import ModelConfig
from ess_jax.model.decoder import Params

log = logging.getLogger(__name__)

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_FAMILY_ARCH = {family: arch for arch, family in ARCHITECTURES.items()}
# The flags each family implies; a cfg that disagrees cannot be written as that HF class.
_FAMILY_FLAGS = {
    "llama": {"qkv_bias": False, "qk_norm": False},
    "qwen2": {"qkv_bias": True, "qk_norm": False},
    "qwen3": {"qkv_bias": False, "qk_norm": True},
    "qwen3_moe": {"qkv_bias": False, "qk_norm": True},
}
# a Qwen3-MoE config.json's expert fields and transformers' Qwen3MoeConfig defaults for them
_MOE_DEFAULTS = {
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": (),
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


def _moe_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig expert fields of a Qwen3-MoE config.json (transformers writes
    `num_experts` as `num_local_experts`, the Hub's files name it `num_experts`)."""
    out = {k: hf.get(k, default) for k, default in _MOE_DEFAULTS.items()}
    out["num_experts"] = hf.get("num_experts", hf.get("num_local_experts", 128))
    out["mlp_only_layers"] = tuple(out["mlp_only_layers"] or ())
    out["norm_topk_prob"] = bool(out["norm_topk_prob"])
    return out


def config_from_hf(hf_config: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dict (Llama, Qwen2, Qwen3, Qwen3-MoE causal
    LMs)."""
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
        **(_moe_fields(hf) if family == "qwen3_moe" else {}),
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
        if cfg.family in ("qwen3", "qwen3_moe"):
            out["attention_bias"] = False
    if cfg.family == "qwen3_moe":
        out.update({k: getattr(cfg, k) for k in _MOE_DEFAULTS})
        out["mlp_only_layers"] = list(cfg.mlp_only_layers)
    elif cfg.num_experts:
        raise ValueError(f"family {cfg.family!r} has no experts; cfg has {cfg.num_experts}")
    return out


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
    cfg = hf_layout.with_dtype(config_from_hf(_read_config(path)), dtype)
    weight_map = _weight_map(path)
    abstract = hf_layout.flat_abstract(cfg)
    # the checkpoint tensors of each param: one, or an expert stack's E (hf_layout.sources)
    sources = {p: hf_layout.sources(p, x.shape, weight_map) for p, x in abstract.items()}
    needed = [n for names in sources.values() for n in names]
    missing = [n for n in needed if n not in weight_map]
    if missing:
        raise KeyError(
            f"checkpoint {str(path)!r} is missing tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    ignored = set(weight_map) - set(needed) - {"lm_head.weight"}
    if ignored:
        log.warning("ignoring %d unexpected tensors, e.g. %s", len(ignored), sorted(ignored)[:3])

    # params in the order of their first tensor's file; each file opened once (memory-mapped)
    order = sorted(abstract, key=lambda p: weight_map[sources[p][0]])
    place = hf_layout.placer(cfg, mesh, layout)
    flat = {}
    with contextlib.ExitStack() as files:
        opened = {}

        def read(p, name):
            file = weight_map[name]
            try:
                if file not in opened:
                    opened[file] = files.enter_context(safe_open(path / file, framework="numpy"))
                w = opened[file].get_tensor(name)
            except SafetensorError as e:
                raise ValueError(f"cannot read {str(path / file)!r} (truncated?): {e}") from e
            want = hf_layout.source_shape(p, name, abstract[p].shape)
            if tuple(w.shape) != want:
                raise ValueError(
                    f"tensor {name!r} in {file!r} has shape {tuple(w.shape)}, the config "
                    f"needs {want}"
                )
            return w

        for p in order:  # one param's tensors on the host at a time
            tensors = [read(p, name) for name in sources[p]]
            flat[p] = place(p, hf_layout.from_sources(p, tensors, abstract[p].shape))
    return cfg, hf_layout.unflatten(cfg, flat)


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
    abstract = hf_layout.flat_abstract(cfg)
    leaves = hf_layout.flat(params)
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
        tensors = {
            n: w for p in shard for n, w in hf_layout.to_hf_tensors(p, _host(leaves[p])).items()
        }
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file))
        if writer:
            save_file(tensors, str(path / file), metadata={"format": "pt"})
    if writer and len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    if writer and tokenizer is not None:
        tokenizer.save_pretrained(str(path))


# ----------------------------------------------------------------------------- dispatch

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _hf_tokenizer(path: Path):
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_checkpoint(path: str | os.PathLike, mesh: Mesh | None = None, dtype=None):
    """(cfg, params, tokenizer or None) from an HF directory or a .gguf file."""
    path = Path(path)
    if path.is_dir():
        cfg, params = load_hf(path, mesh, dtype)
        return cfg, params, _hf_tokenizer(path)
    if path.suffix == ".gguf":
        return gguf_llama.load_gguf(path, mesh, dtype)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}")
    raise ValueError(f"{str(path)!r} is neither an HF checkpoint directory nor a .gguf file")


def checkpoint_config(path: str | os.PathLike):
    """(cfg, tokenizer or None) of an HF directory without reading its weights, or of a .gguf
    file (read whole: its tokenizer is in the same metadata)."""
    path = Path(path)
    if path.is_dir():
        return config_from_hf(_read_config(path)), _hf_tokenizer(path)
    cfg, _, tokenizer = load_checkpoint(path)
    return cfg, tokenizer

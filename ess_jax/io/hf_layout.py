"""Where each parameter lives in a Hugging Face checkpoint: tensor names, shapes and layouts.

HF linear weights are [out, in]; ours are [in, ..., out] with heads split out, e.g.
q_proj [H*K, D] <-> q [D, H, K] and o_proj [D, H*K] <-> o [H, K, D]. Shared by the
safetensors import/export (weights.py) and the GGUF import (gguf_llama.py), which both read
one tensor at a time and place it straight onto its sharding (`placer`).

A Qwen3-MoE layer's router is `mlp.gate.weight` [E, D] (ours `router` [D, E]). Its experts
are one stacked param each (`expert_gate` / `expert_up` [E, D, F], `expert_down` [E, F, D])
and E tensors in a checkpoint, `mlp.experts.{j}.{gate,up,down}_proj.weight`: the Hub's form,
and the one transformers' `save_pretrained` writes (its modules hold the experts fused, as
`mlp.experts.gate_up_proj` [E, 2F, D], gate rows first, and `mlp.experts.down_proj` [E, D, F],
and it converts them on save and load). `sources` reads either form; `to_hf_tensors` writes the
per-expert one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ess_jax.model import decoder as model_lib
from ess_jax.model.config import ModelConfig
from ess_jax.model.decoder import Params
from ess_jax.parallel import sharding

_LAYER_NAMES = {
    ("attn_norm",): "input_layernorm.weight",
    ("mlp_norm",): "post_attention_layernorm.weight",
    **{("attn", n): f"self_attn.{n}_proj.weight" for n in "qkvo"},
    **{("attn", f"{n}_bias"): f"self_attn.{n}_proj.bias" for n in "qkv"},
    **{("attn", f"{n}_norm"): f"self_attn.{n}_norm.weight" for n in "qk"},
    **{("mlp", n): f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")},
    ("mlp", "router"): "mlp.gate.weight",
}
# expert stack -> (its per-expert tensor's projection, the fused tensor and its rows' half)
_EXPERTS = {
    "expert_gate": ("gate_proj", "gate_up_proj", 0),
    "expert_up": ("up_proj", "gate_up_proj", 1),
    "expert_down": ("down_proj", "down_proj", None),
}
_TOP_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}
_MATRICES = {
    **{"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1},
    **{"lm_head": 1, "router": 1},
}


def path_key(entry) -> str | int:
    return entry.key if hasattr(entry, "key") else entry.idx


def flat(tree) -> dict[tuple, Any]:
    """{path: leaf} of a params-shaped tree, a path being its dict keys and list indices."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {tuple(path_key(e) for e in path): x for path, x in leaves}


def flat_abstract(cfg: ModelConfig) -> dict[tuple, jax.ShapeDtypeStruct]:
    return flat(model_lib.abstract_params(cfg))


def hf_name(path: tuple) -> str:
    if path[0] == "layers":
        return f"model.layers.{path[1]}.{_LAYER_NAMES[path[2:]]}"
    return _TOP_NAMES[path[0]]


def hf_shape(path: tuple, shape: tuple[int, ...]) -> tuple[int, ...]:
    n_in = _MATRICES.get(path[-1])
    if n_in is not None:  # torch Linear: [out, in]
        return math.prod(shape[n_in:]), math.prod(shape[:n_in])
    if path[-1] == "embed":
        return shape
    return (math.prod(shape),)


def to_ours(path: tuple, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    w = w.astype(np.float32)  # float32 masters, whatever the checkpoint's dtype
    return np.ascontiguousarray(w.T if path[-1] in _MATRICES else w).reshape(shape)


def to_hf(path: tuple, x: np.ndarray) -> np.ndarray:
    n_in = _MATRICES.get(path[-1])
    if n_in is None:
        return x.reshape(hf_shape(path, x.shape))
    return np.ascontiguousarray(x.reshape(math.prod(x.shape[:n_in]), -1).T)


def is_experts(path: tuple) -> bool:
    return path[-1] in _EXPERTS


def expert_names(path: tuple, num_experts: int) -> tuple[str, ...]:
    """The per-expert tensors of expert stack `path`, expert 0 first."""
    proj = _EXPERTS[path[-1]][0]
    return tuple(
        f"model.layers.{path[1]}.mlp.experts.{j}.{proj}.weight" for j in range(num_experts)
    )


def fused_name(path: tuple) -> str:
    return f"model.layers.{path[1]}.mlp.experts.{_EXPERTS[path[-1]][1]}"


def sources(path: tuple, shape: tuple[int, ...], available) -> tuple[str, ...]:
    """The checkpoint tensors param `path` of `shape` is read from: its own; for an expert
    stack its per-expert tensors, or the fused one when `available` (the checkpoint's names)
    has that and not those."""
    if not is_experts(path):
        return (hf_name(path),)
    per_expert = expert_names(path, shape[0])
    if per_expert[0] not in available and fused_name(path) in available:
        return (fused_name(path),)
    return per_expert


def source_shape(path: tuple, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape tensor `name` (one of `sources`) must have for param `path` of `shape`."""
    if not is_experts(path):
        return hf_shape(path, shape)
    e, n_in, n_out = shape
    if name != fused_name(path):
        return n_out, n_in  # one expert's [out, in]
    return (e, 2 * n_out, n_in) if _EXPERTS[path[-1]][2] is not None else (e, n_out, n_in)


def from_sources(path: tuple, tensors: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """Param `path` (float32, our layout) from its `sources` tensors, read in that order."""
    if not is_experts(path):
        return to_ours(path, tensors[0], shape)
    if len(tensors) == 1:  # fused [E, out, in] (gate_up_proj: gate rows, then up rows)
        w, half = tensors[0], _EXPERTS[path[-1]][2]
        if half is not None:
            w = w[:, half * shape[2] : (half + 1) * shape[2]]
        return np.ascontiguousarray(w.astype(np.float32).transpose(0, 2, 1))
    return np.stack([w.astype(np.float32).T for w in tensors])


def to_hf_tensors(path: tuple, x: np.ndarray) -> dict[str, np.ndarray]:
    """{checkpoint name: tensor} of param `path` (numpy, our layout): one tensor, or an expert
    stack as its per-expert [out, in] tensors."""
    if not is_experts(path):
        return {hf_name(path): to_hf(path, x)}
    names = expert_names(path, x.shape[0])
    return {n: np.ascontiguousarray(w.T) for n, w in zip(names, x)}


def unflatten(cfg: ModelConfig, flat: Mapping[tuple, Any]) -> Params:
    return jax.tree_util.tree_map_with_path(
        lambda path, _: flat[tuple(path_key(e) for e in path)], model_lib.abstract_params(cfg)
    )


def placer(cfg: ModelConfig, mesh: Mesh | None, layout: str):
    """Function (path, host array) -> device array, on its sharding when a mesh is given."""
    if mesh is None:
        return lambda path, x: jnp.asarray(x)
    shardings = flat(model_lib.param_shardings(cfg, mesh, layout))
    # Each device gets only its shard; with several processes, each host places only its own
    # devices' slices (every host reads the same file).
    return lambda path, x: sharding.put_host_array(x, shardings[path])


def with_dtype(cfg: ModelConfig, dtype) -> ModelConfig:
    return cfg if dtype is None else cfg.replace(dtype=jnp.dtype(dtype).name)

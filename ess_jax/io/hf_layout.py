"""Where each parameter lives in a Hugging Face checkpoint: tensor names, shapes and layouts.

HF linear weights are [out, in]; ours are [in, ..., out] with heads split out, e.g.
q_proj [H*K, D] <-> q [D, H, K] and o_proj [D, H*K] <-> o [H, K, D]. Shared by the
safetensors import/export (weights.py) and the GGUF import (gguf_llama.py), which both read
one tensor at a time and place it straight onto its sharding (`placer`).
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
}
_TOP_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}
_MATRICES = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1, "lm_head": 1}


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

"""The sampler's KV cache, per layer {"k": [B, N, K, S], "v": [B, N, S, K]}.

Keys are stored transposed so that a decode step's score product (one query per row and kv
head against S keys) streams along the cache, as the value product does (layers' module
docstring has the measurement). Forwards with several queries (the prefill) read the keys
transposed back. Axis alphabet as in decoder.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Logical axes of each entry (sharding.SAMPLE_RULES maps them), and the axis of its positions.
CACHE_AXES = {
    "k": ("batch", "kv_heads", "head_dim", None),
    "v": ("batch", "kv_heads", None, "head_dim"),
}
POSITION_AXIS = {"k": 3, "v": 2}


def init_cache(cfg, batch: int, length: int, dtype=None) -> list[dict]:
    """Zeroed cache of `length` positions for a model.ModelConfig, one dict per layer."""
    n, kd, dt = cfg.num_kv_heads, cfg.head_dim, dtype or cfg.compute_dtype
    return [
        {"k": jnp.zeros((batch, n, kd, length), dt), "v": jnp.zeros((batch, n, length, kd), dt)}
        for _ in range(cfg.num_layers)
    ]


def cache_length(layer_cache: dict) -> int:
    """Positions one layer's cache holds."""
    return layer_cache["v"].shape[POSITION_AXIS["v"]]


def write(layer_cache: dict, k_BxNxTxK, v_BxNxTxK, index) -> dict:
    """The layer's cache with T new keys and values written at positions index .. index + T - 1
    (in place under jit when the old cache is not used again)."""
    kd = k_BxNxTxK.shape[3]
    if layer_cache["k"].shape[2] != kd or layer_cache["v"].shape[3] != kd:
        raise ValueError(
            f"KV cache keys {layer_cache['k'].shape} / values {layer_cache['v'].shape} are not "
            f"[B, N, K, S] / [B, N, S, K] with K = {kd} (kv_cache.init_cache builds them)"
        )
    new = {"k": k_BxNxTxK.transpose(0, 1, 3, 2), "v": v_BxNxTxK}
    return {
        name: jax.lax.dynamic_update_slice_in_dim(
            layer_cache[name], x.astype(layer_cache[name].dtype), index, axis=POSITION_AXIS[name]
        )
        for name, x in new.items()
    }


def grow_layer(layer_cache: dict, length: int) -> dict:
    """One layer's K and V zero-padded to `length` positions."""

    def pad(name, x):
        widths = [(0, 0)] * x.ndim
        widths[POSITION_AXIS[name]] = (0, length - x.shape[POSITION_AXIS[name]])
        return jnp.pad(x, widths)

    return {name: pad(name, x) for name, x in layer_cache.items()}

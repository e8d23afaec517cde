"""The sampler's KV cache, per layer {"k": [B, N, K, S], "v": [B, N, S, K]}.

Keys are stored transposed so that a decode step's score product (one query per row and kv
head against S keys) streams along the cache, as the value product does (layers' module
docstring has the measurement). Forwards with several queries (the prefill) read the keys
transposed back. Axis alphabet as in decoder.py.

Precision (`init_cache`): the compute dtype, another float dtype (keys and values rounded to it
when written, read back in the compute dtype), or fp8: float8_e4m3fn codes with one float32
scale per token and kv head (max |x| over the head dim / 448, `layers.e4m3_quantize`), in
"k_scale" [B, N, 1, S] and "v_scale" [B, N, S, 1]; 1 + 4 / K bytes per element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ess_jax.model.layers import E4M3, e4m3_quantize

# Logical axes of each entry (sharding.SAMPLE_RULES maps them), and the axis of its positions.
CACHE_AXES = {
    "k": ("batch", "kv_heads", "head_dim", None),
    "v": ("batch", "kv_heads", None, "head_dim"),
    "k_scale": ("batch", "kv_heads", None, None),
    "v_scale": ("batch", "kv_heads", None, None),
}
POSITION_AXIS = {"k": 3, "v": 2, "k_scale": 3, "v_scale": 2}
# The head-dim axis of each entry: an fp8 cache's scales are over it.
HEAD_DIM_AXIS = {"k": 2, "v": 3}


def init_cache(cfg, batch: int, length: int, dtype=None, fp8: bool = False) -> list[dict]:
    """Zeroed cache of `length` positions for a model.ModelConfig, one dict per layer: keys
    and values in `dtype` (default the compute dtype), or, with `fp8`, float8_e4m3fn codes
    and their float32 scales (module docstring)."""
    n, kd, dt = cfg.num_kv_heads, cfg.head_dim, E4M3 if fp8 else (dtype or cfg.compute_dtype)

    def layer():
        c = {"k": jnp.zeros((batch, n, kd, length), dt), "v": jnp.zeros((batch, n, length, kd), dt)}
        if fp8:
            c["k_scale"] = jnp.zeros((batch, n, 1, length), jnp.float32)
            c["v_scale"] = jnp.zeros((batch, n, length, 1), jnp.float32)
        return c

    return [layer() for _ in range(cfg.num_layers)]


def cache_length(layer_cache: dict) -> int:
    """Positions one layer's cache holds."""
    return layer_cache["v"].shape[POSITION_AXIS["v"]]


def write(layer_cache: dict, k_BxNxTxK, v_BxNxTxK, index) -> dict:
    """The layer's cache with T new keys and values written at positions index .. index + T - 1
    (in place under jit when the old cache is not used again), rounded to the cache's dtype
    (an fp8 cache: quantized with a scale per token and kv head)."""
    kd = k_BxNxTxK.shape[3]
    if layer_cache["k"].shape[2] != kd or layer_cache["v"].shape[3] != kd:
        raise ValueError(
            f"KV cache keys {layer_cache['k'].shape} / values {layer_cache['v'].shape} are not "
            f"[B, N, K, S] / [B, N, S, K] with K = {kd} (kv_cache.init_cache builds them)"
        )
    new = {"k": k_BxNxTxK.transpose(0, 1, 3, 2), "v": v_BxNxTxK}
    if "k_scale" in layer_cache:
        for name in ("k", "v"):
            new[name], new[f"{name}_scale"] = e4m3_quantize(new[name], (HEAD_DIM_AXIS[name],))
    return {
        name: jax.lax.dynamic_update_slice_in_dim(
            layer_cache[name], x.astype(layer_cache[name].dtype), index, axis=POSITION_AXIS[name]
        )
        for name, x in new.items()
    }


def read(layer_cache: dict, dtype) -> tuple[jax.Array, jax.Array]:
    """(keys [B, N, K, S], values [B, N, S, K]) to attend over: an fp8 cache's codes times
    their scales, in `dtype`; any other cache as stored (attention casts it)."""
    if "k_scale" not in layer_cache:
        return layer_cache["k"], layer_cache["v"]
    return tuple(
        (layer_cache[n].astype(jnp.float32) * layer_cache[f"{n}_scale"]).astype(dtype)
        for n in ("k", "v")
    )


def read_block(layer_cache: dict, start, size: int, dtype) -> tuple[jax.Array, jax.Array]:
    """`read` of positions start .. start + size - 1 only (`start` may be traced; `size`
    static, the block must lie inside the cache): keys [B, N, K, size], values [B, N, size, K],
    an fp8 cache's codes times their scales in `dtype`, any other as stored."""
    block = {
        name: jax.lax.dynamic_slice_in_dim(x, start, size, axis=POSITION_AXIS[name])
        for name, x in layer_cache.items()
    }
    return read(block, dtype)


def grow_layer(layer_cache: dict, length: int) -> dict:
    """One layer's K and V (and an fp8 cache's scales) zero-padded to `length` positions."""

    def pad(name, x):
        widths = [(0, 0)] * x.ndim
        widths[POSITION_AXIS[name]] = (0, length - x.shape[POSITION_AXIS[name]])
        return jnp.pad(x, widths)

    return {name: pad(name, x) for name, x in layer_cache.items()}

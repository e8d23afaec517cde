"""A decode step's attention over the filled blocks of the KV cache only:
`model.decode_attention = "blockwise"`; `decode_step_attention` picks the path a ModelConfig
names.

`layers.decode_attention` (`"dense"`, the default) attends one query per row over the whole
cache of the current decode segment, whose length sampling/decode.py grows between segments,
so a step reads up to twice the keys and values that are filled. Here a step reads the cache
in blocks of `block` positions (`model.decode_block`) and stops after the block that holds
its own position (`query_idx`): blocks 0 .. query_idx // block, on any backend.

Which implementation: a blockwise decode in plain JAX (two `lax.fori_loop`s with a traced
trip count), not a Pallas kernel of jax's TPU ops. The pinned jax (0.10.2) ships
`paged_attention` and `ragged_paged_attention`; neither fits this cache without a copy or a
change of numbers: they read pages [N, pages, page, K] (keys and values alike; the ragged one
with K and V heads interleaved), where this cache holds keys [B, N, K, S] and values
[B, N, S, K]; they mask by length only, where a row's keys start after its left pads (the
kv mask); their quantized caches are int8 pages or one scale per tensor, where an fp8 cache
here has a scale per token and kv head; and their softmax feeds float32 probabilities to the
value product, where every attention path here rounds them to the compute dtype first. The
loops run on every backend, so the CPU tests run the same code as a TPU.

Numbers: `layers.decode_attention`'s, to float32 rounding. Pass 1 reads the key blocks: the
float32 scores of each block (the same masks as the dense path; the last block of a cache
whose length `block` does not divide starts earlier, at S - block, and masks the positions
of the block before it), their running maximum m and the running sum `total` of
exp(score - m) (rescaled by exp(m_old - m_new) when the maximum grows), the scores kept in a
float32 buffer, one slot per block. Pass 2 reads the value blocks: probabilities
exp(score - m) / total, the dense path's softmax, rounded to the compute dtype, times the
values, summed in float32.
Only summation orders differ from the dense path, so even in bfloat16 the probabilities are
rounded at the same point as there. Keys past the filled blocks add exp(MASK_VALUE - m) = 0
in the dense path and are not read here. A row whose every key is masked (no decode row is:
a step's own key is always seen) averages the values of the filled blocks where the dense
path averages all S. The two products are einsums of compute-dtype operands with float32
accumulation (`product`), where the dense path multiplies float32 copies elementwise and sums
(faster on XLA:CPU, layers' module docstring): products of two bfloat16 numbers are exact in
float32, so both give the same numbers to summation order.

Cost per step, layer and row: the filled blocks' keys and values (the dense path: the whole
segment's), and the score buffer [N, G, S] in float32 (G x 4 bytes per position, initialised
over all S, read in pass 2 over the filled blocks). On a TPU (bench/tpu_decode.py: the
compiler's bytes accessed at E3's sampler shapes on v5p, one layer, per device, cache of
5120 positions whose K + V are 336 MB) a blockwise step reads 260-393 MB over the last
segment (block 256), the dense path 1795 MB: its elementwise float32 products are counted at
5.3x the cache, where the einsums over one block of the whole cache read 456 MB. The loops'
trip count is traced, so XLA runs them as while loops, and its cost analysis counts one body.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ess_jax.model import kv_cache
from ess_jax.model.layers import MASK_VALUE, decode_attention


def product(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum `spec` of two compute-dtype operands with float32 products and sums (HIGHEST:
    no reduced-precision passes for float32 operands on a TPU; bfloat16 products are exact
    in float32 at any precision)."""
    return jnp.einsum(
        spec, a, b, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST
    )


def filled_blocks(query_idx, block: int):
    """How many blocks of `block` positions hold keys 0 .. query_idx (the ones a query at
    `query_idx` may see): query_idx // block + 1."""
    return query_idx // block + 1


def blockwise_decode_attention(q_BxNxGxK, layer_cache, kv_mask_BxS, query_idx, block: int):
    """One query per row (position `query_idx`, a traced scalar) against one layer's KV cache
    (kv_cache's dict, an fp8 cache's codes and scales included), reading only the blocks
    that hold positions 0 .. query_idx; returns [B, N, G, K] in the compute dtype of q, as
    `layers.decode_attention` on the whole cache does (module docstring: the numbers). Key s
    is seen when s <= query_idx and kv_mask_BxS[b, s]; kv_mask_BxS may be longer than the
    cache (positions past it are never read)."""
    dt = q_BxNxGxK.dtype
    b, n, g, kd = q_BxNxGxK.shape
    length = kv_cache.cache_length(layer_cache)
    size = min(block, length)
    slots = -(-length // size)  # blocks in the whole cache: the score buffer's

    def start(j):  # the last block of a cache that `size` does not divide starts earlier
        return jnp.minimum(j * size, length - size)

    def scores(j):  # [B, N, G, size] float32, masked: the dense path's for these positions
        first = start(j)
        k, _ = kv_cache.read_block(layer_cache, first, size, dt)
        s = product("bngk,bnks->bngs", q_BxNxGxK, k.astype(dt)) / math.sqrt(kd)
        pos = first + jnp.arange(size)
        seen = (pos >= j * size) & (pos <= query_idx)  # not block j - 1's again, not unfilled
        seen = seen[None] & jax.lax.dynamic_slice_in_dim(kv_mask_BxS, first, size, axis=1)
        return jnp.where(seen[:, None, None], s, MASK_VALUE)

    def pass1(j, carry):
        buf, m, total = carry
        s = scores(j)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        total = total * jnp.exp(m - m_new) + jnp.sum(jnp.exp(s - m_new[..., None]), axis=-1)
        return jax.lax.dynamic_update_index_in_dim(buf, s, j, axis=0), m_new, total

    used = filled_blocks(query_idx, size)
    init = (
        jnp.full((slots, b, n, g, size), MASK_VALUE, jnp.float32),
        jnp.full((b, n, g), MASK_VALUE, jnp.float32),
        jnp.zeros((b, n, g), jnp.float32),
    )
    buf, m, total = jax.lax.fori_loop(0, used, pass1, init)

    def pass2(j, acc):
        s = jax.lax.dynamic_index_in_dim(buf, j, axis=0, keepdims=False)
        probs = (jnp.exp(s - m[..., None]) / total[..., None]).astype(dt)
        _, v = kv_cache.read_block(layer_cache, start(j), size, dt)
        return acc + product("bngs,bnsk->bngk", probs, v.astype(dt))

    out = jax.lax.fori_loop(0, used, pass2, jnp.zeros((b, n, g, kd), jnp.float32))
    return out.astype(dt)


def decode_step_attention(cfg, q_BxNxGxK, layer_cache, kv_mask_BxS, query_idx, attend_len=None):
    """A decode step's attention (one query per row at position `query_idx`) over one layer's
    cache, after the step's write, as `cfg.decode_attention` picks: "dense" reads the first
    `attend_len` positions (None: the whole cache), "blockwise" the blocks up to query_idx
    (they hold every key the query may see, so `attend_len` changes nothing)."""
    if cfg.decode_attention == "blockwise":
        return blockwise_decode_attention(
            q_BxNxGxK, layer_cache, kv_mask_BxS, query_idx, cfg.decode_block
        )
    k, v = kv_cache.read(layer_cache, q_BxNxGxK.dtype)
    if attend_len is not None:
        k, v, kv_mask_BxS = k[..., :attend_len], v[:, :, :attend_len], kv_mask_BxS[:, :attend_len]
    return decode_attention(q_BxNxGxK, k, v, kv_mask_BxS, query_idx)

"""Stateless pieces of the decoder: projections, RMSNorm, rotary embeddings, the attention core.

Axis alphabet as in decoder.py: B batch, T queries, S keys, N kv heads, G query heads per kv
head, K head dim. decoder.py holds the parameters and wires these together.

Attention has two code paths with the same numbers (both checked against teacher forcing and
Hugging Face through the model and sampler tests):
  - several queries (training forwards, the sampler's prefill): einsum contractions, optionally
    `chunk` queries at a time with each chunk recomputed in the backward pass; unchunked, in
    causal blocks that skip the keys past each block's last query (`causal_blocks`);
  - one query per row against the KV cache (a decode step, `decode_attention`): elementwise
    multiply-and-sum over the keys, which the cache stores transposed, [B, N, K, S]. XLA:CPU
    hands the score product to one YNNPACK fusion (multiply, then reduce over K), which then
    streams along S as the value product does (with keys as [B, N, S, K] it reduces along
    the minor axis). The sampler on bench/cpu.py's model, batch 32, 64-token prompts,
    sampled: 28.8-28.9 ms per step at 256 new tokens against 31.2-32.3 with [B, N, S, K]
    keys, 25.1-25.3 against 27.2-27.4 at 128 (BENCHMARKS.md, design decisions). As on the
    einsum path, scores are float32 products and sums, the softmax probabilities are rounded
    to the compute dtype before the value product (as bf16 attention kernels do), and the
    output is in the compute dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Large finite negative instead of -inf: fully masked rows (left pads) must give finite
# softmax outputs, never NaN, or NaNs leak into the cache and the gradients.
MASK_VALUE = -1e30


def dense(x: jax.Array, w: jax.Array, n_in: int = 1, out_dtype=None) -> jax.Array:
    """x [..., *I] times w [*I, *O] -> [..., *O]: the last `n_in` axes of x against the first
    `n_in` of w, as ONE 2-D matmul [prod(...), prod(I)] x [prod(I), prod(O)].

    Same numbers as the einsum ("btd,df->btf", "bthk,hkd->btd"), but the backward pass differs
    on XLA:CPU: with the leading axes kept apart, each weight gradient contracts over two axes
    (b, t), which XLA normalises with a transpose of the [B*T, F] activation (a copy per weight
    gradient, ~14% of the train step's op time at bench/cpu.py's shapes); merged, it is one
    transposed-operand GEMM. MLP block forward + backward, [8, 256, 512] x 1408: 160 ms, 216
    as einsums.
    The merges are reshapes of the major axes, so batch and head shardings carry through.
    """
    lead, ins = x.shape[: x.ndim - n_in], x.shape[x.ndim - n_in :]
    if w.shape[:n_in] != ins:
        raise ValueError(f"dense: input axes {ins} do not match the weight's {w.shape[:n_in]}")
    outs = w.shape[n_in:]
    y = jnp.dot(
        x.reshape(-1, math.prod(ins)),
        w.reshape(math.prod(ins), -1),
        preferred_element_type=out_dtype,
    )
    return y.reshape(*lead, *outs)


# float8_e4m3fn, the fp8 format of the sampler's activations and KV cache: largest finite 448.
E4M3 = jnp.float8_e4m3fn
E4M3_MAX = float(jnp.finfo(E4M3).max)


def e4m3_quantize(x: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """x as float8_e4m3fn codes and float32 scales, one per slice over `axes` (kept, size 1):
    scale = max|x| / 448 over the slice (1 for an all-zero slice), codes = x / scale rounded to
    nearest (ties to even) by the cast, so codes * scale ~ x with the slice's max exact."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    return (x32 / scale).astype(E4M3), scale


def fp8_activation(x: jax.Array, n_in: int = 1) -> jax.Array:
    """A matmul input rounded through float8_e4m3fn with one dynamic scale per row (max |x| over
    its last `n_in` axes, the contraction axes, / 448), back in x's dtype: what an fp8 GEMM with
    per-token activation scales sees of its input (the product then runs in x's dtype with
    float32 accumulation)."""
    codes, scale = e4m3_quantize(x, tuple(range(x.ndim - n_in, x.ndim)))
    return (codes.astype(jnp.float32) * scale).astype(x.dtype)


def matmul_input(x: jax.Array, fp8: bool, n_in: int = 1) -> jax.Array:
    """A block matmul's input as the model computes with it: `fp8_activation` when `fp8` (the
    ModelConfig's activation_fp8), else x unchanged."""
    return fp8_activation(x, n_in) if fp8 else x


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # Statistics in float32 whatever the compute dtype (HF does the same).
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight * y.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> jax.Array:
    k = head_dim
    inv = 1.0 / (theta ** (jnp.arange(0, k, 2, dtype=jnp.float32) / k))
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (default, llama3)")
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = old_len / low, old_len / high
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = jnp.where(wavelen > low_wl, inv / factor, inv)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen <= low_wl) & (wavelen >= high_wl)
    return jnp.where(is_mid, mid, scaled)


def apply_rope(x_BxTxHxK: jax.Array, positions_BxT: jax.Array, inv_freq: jax.Array) -> jax.Array:
    # Non-interleaved (rotate-half) convention, as in the HF Llama/Qwen checkpoints.
    angles = positions_BxT[..., None].astype(jnp.float32) * inv_freq  # B,T,K/2
    cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)[:, :, None, :]
    x = x_BxTxHxK.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return (x * cos + rotated * sin).astype(x_BxTxHxK.dtype)


# Several queries with chunk == 0: at least this many queries per causal block (below 2x that,
# one block); see `attention`.
CAUSAL_BLOCKS, MIN_CAUSAL_BLOCK = 4, 64


def attention(
    q_BxTxNxGxK,
    k_BxNxSxK,
    v_BxNxSxK,
    kv_mask_BxS,
    query_idx_T,
    chunk: int,
    query_offset: int | None = None,
):
    """Causal, masked softmax attention; returns [B, T, N, G, K] in the compute dtype of q.

    Query t attends to key s when s <= query_idx_T[t] and kv_mask_BxS[b, s], or, for integer
    kv_mask_BxS (packed rows' segment ids), s is in t's segment (`visible`). `chunk` > 0 (with
    T > chunk) computes `chunk` queries at a time, each recomputed in the backward pass, so no
    [B, N, G, T, S] scores exist at once.

    `query_offset`: a static int when the queries are key positions offset .. offset + T - 1
    (query_idx_T == offset + arange(T): full-sequence forwards, the prefill). Then, with chunk
    == 0, the queries go in up to CAUSAL_BLOCKS blocks and each block's scores cover only the
    keys up to its last query, which the causal mask would zero anyway: the same numbers, about
    5/8 of the score work at 4 blocks (train step attention at bench/cpu.py's 8 x 256 shapes,
    forward + backward per layer: ~40 ms, ~50 over all keys). Chunked attention keeps one
    `lax.map` over same-shaped chunks (its memory bound), so every chunk attends over all S
    keys.
    """
    t, dt = q_BxTxNxGxK.shape[1], q_BxTxNxGxK.dtype
    k_all, v_all = k_BxNxSxK.astype(dt), v_BxNxSxK.astype(dt)

    if chunk <= 0 or t <= chunk:
        if query_offset is None:
            return _attend(q_BxTxNxGxK, query_idx_T, k_all, v_all, kv_mask_BxS)
        outs = [
            _attend(
                q_BxTxNxGxK[:, a:z],
                query_idx_T[a:z],
                k_all[:, :, :keys],
                v_all[:, :, :keys],
                kv_mask_BxS[:, :keys],
            )
            for a, z, keys in causal_blocks(t, query_offset)
        ]
        return jnp.concatenate(outs, axis=1)
    b, rest = q_BxTxNxGxK.shape[0], q_BxTxNxGxK.shape[2:]
    pad = -t % chunk
    qs = jnp.pad(q_BxTxNxGxK, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    qs = jnp.moveaxis(qs.reshape(b, -1, chunk, *rest), 1, 0)
    idx = jnp.pad(query_idx_T, (0, pad)).reshape(-1, chunk)
    attend = jax.checkpoint(_attend)
    out = jax.lax.map(lambda a: attend(*a, k_all, v_all, kv_mask_BxS), (qs, idx))
    return jnp.moveaxis(out, 0, 1).reshape(b, -1, *rest)[:, :t]


def decode_attention(q_BxNxGxK, k_BxNxKxS, v_BxNxSxK, kv_mask_BxS, query_idx):
    """One query per row (position `query_idx`, a scalar) against the KV cache, keys stored
    as [B, N, K, S] (module docstring); returns [B, N, G, K] in the compute dtype of q. Key s
    is seen when s <= query_idx and kv_mask_BxS[b, s]: `attention`'s numbers for T = 1."""
    dt, kd = q_BxNxGxK.dtype, q_BxNxGxK.shape[-1]
    mask_BxS = (jnp.arange(k_BxNxKxS.shape[3]) <= query_idx)[None] & kv_mask_BxS
    q = q_BxNxGxK[..., None].astype(jnp.float32)  # B,N,G,K,1
    k = k_BxNxKxS.astype(dt).astype(jnp.float32)[:, :, None]  # B,N,1,K,S
    scores = jnp.sum(q * k, axis=-2) / math.sqrt(kd)  # B,N,G,S
    scores = jnp.where(mask_BxS[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt).astype(jnp.float32)
    v = v_BxNxSxK.astype(dt).astype(jnp.float32)[:, :, None]  # B,N,1,S,K
    return jnp.sum(probs[..., None] * v, axis=-2).astype(dt)


def fused_attention(
    q_BxTxNxGxK,
    k_BxNxSxK,
    v_BxNxSxK,
    kv_mask_BxS,
    query_idx_T,
    implementation: str,
    causal: bool = False,
):
    """`attention`'s numbers (same masks, float32 scores and softmax, probabilities rounded to
    the compute dtype) through jax.nn.dot_product_attention. `implementation` "cudnn" is
    cuDNN's fused flash attention on NVIDIA GPUs (bfloat16 / float16 only), which never holds
    the [T, S] scores; "xla" is jax's reference einsum, here so that CPU tests check this
    function's layouts, mask, padding and head grouping against `attention` (it holds the
    whole [B, H, T, S] scores: `logits_chunk` does not apply).

    The mask (causal and the left pads) goes in as a boolean [B, 1, T, S] `mask`, never as a
    float `bias`: from jax 0.11 on, cuDNN's backward computes the gradient of a float bias (a
    [B, 1, T, S] output nobody reads), and skips it for a boolean mask, which jax turns into a
    constant bias of -2**41 in bfloat16 ("xla": -0.7 x the float32 maximum). Fully masked rows
    (queries at left pads) stay finite, as MASK_VALUE keeps them in `attention`, but their
    numbers differ: `attention` averages all S values; "cudnn" (with `causal`) the values of
    the keys up to the row's own position; "xla" all keys, the odd-length padded one too. No
    loss reads them (the RL step scores from the prompt width; SFT batches have no pads), and
    no real query sees them (pads are masked keys). `causal` (static: the queries are key
    positions 0 .. T - 1, as in training forwards and the prefill) also sets `is_causal`, so
    the kernel may skip the blocks above the diagonal. jax's cuDNN checks refuse a bias (a
    mask is one) in training when T or S is odd (`check_is_flash_attention`): an odd length
    gets one more query (sliced off) and one more key, masked for every query."""
    b, t, n, g, kd = q_BxTxNxGxK.shape
    s, dt = k_BxNxSxK.shape[2], q_BxTxNxGxK.dtype
    mask_BxTxS = visible(kv_mask_BxS, query_idx_T)
    q = q_BxTxNxGxK.reshape(b, t, n * g, kd)  # query head n * g + j uses kv head n, as in jax
    k = k_BxNxSxK.transpose(0, 2, 1, 3).astype(dt)  # [B, S, N, K]
    v = v_BxNxSxK.transpose(0, 2, 1, 3).astype(dt)
    pt, ps = t % 2, s % 2
    if pt or ps:
        q = jnp.pad(q, ((0, 0), (0, pt), (0, 0), (0, 0)))
        k, v = (jnp.pad(x, ((0, 0), (0, ps), (0, 0), (0, 0))) for x in (k, v))
        mask_BxTxS = jnp.pad(mask_BxTxS, ((0, 0), (0, pt), (0, ps)))  # padding: False
    out = jax.nn.dot_product_attention(
        q, k, v, mask=mask_BxTxS[:, None], is_causal=causal, implementation=implementation
    )
    return out[:, :t].reshape(b, t, n, g, kd)


def visible(kv_mask_BxS: jax.Array, query_idx_T: jax.Array) -> jax.Array:
    """[B, T, S]: whether query t (at key position query_idx_T[t]) sees key s. Causal (s <=
    query_idx_T[t]) and, by the mask's dtype: a bool mask, the keys it marks (the left pads
    off); integer segment ids (packed rows, data/packing.py; full-sequence forwards, where
    the queries are the keys), the keys of the query's own segment, never segment 0 (the
    pads): attention never crosses from one packed sequence into another."""
    causal_TxS = jnp.arange(kv_mask_BxS.shape[1])[None, :] <= query_idx_T[:, None]
    if kv_mask_BxS.dtype == jnp.bool_:
        return causal_TxS[None] & kv_mask_BxS[:, None]
    segment_BxT = jnp.take(kv_mask_BxS, query_idx_T, axis=1)
    same = (kv_mask_BxS[:, None, :] == segment_BxT[:, :, None]) & (kv_mask_BxS[:, None, :] != 0)
    return causal_TxS[None] & same


def causal_blocks(t: int, query_offset: int = 0) -> list[tuple[int, int, int]]:
    """(first query, end query, keys attended) of each causal block of `attention` for T = t
    queries at key positions offset .. offset + t - 1 (one block below 2 * MIN_CAUSAL_BLOCK):
    a block's queries see no key past its last query."""
    if t < 2 * MIN_CAUSAL_BLOCK:
        return [(0, t, query_offset + t)]
    size = max(MIN_CAUSAL_BLOCK, -(-t // CAUSAL_BLOCKS))
    return [(a, min(a + size, t), query_offset + min(a + size, t)) for a in range(0, t, size)]


def _attend(q_BxCxNxGxK, query_idx_C, k_BxNxSxK, v_BxNxSxK, kv_mask_BxS):
    """C queries against all S keys given: the einsum path of `attention`."""
    b, c, n, g, kd = q_BxCxNxGxK.shape
    mask_BxCxS = visible(kv_mask_BxS, query_idx_C)
    # Queries as [B, N, G*C, K]: both products are then plain batched GEMMs over (b, n),
    # whose backward needs no transposes of the [.., C, S] scores (with the queries as
    # [B, C, N, G, K] XLA:CPU copies 12 of them per layer; attention forward + backward
    # at the bench's 8 x 256 shapes: 54 ms per layer, 86 with that layout).
    q_BxNxMxK = q_BxCxNxGxK.transpose(0, 2, 3, 1, 4).reshape(b, n, g * c, kd)
    scores = jnp.einsum("bnmk,bnsk->bnms", q_BxNxMxK, k_BxNxSxK, preferred_element_type=jnp.float32)
    scores = scores.reshape(b, n, g, c, -1) / math.sqrt(kd)
    scores = jnp.where(mask_BxCxS[:, None, None], scores, MASK_VALUE)
    probs = _softmax(scores).astype(q_BxCxNxGxK.dtype).reshape(b, n, g * c, -1)
    out = jnp.einsum("bnms,bnsk->bnmk", probs, v_BxNxSxK)
    return out.reshape(b, n, g, c, kd).transpose(0, 3, 1, 2, 4)


def _softmax(x: jax.Array) -> jax.Array:
    """Softmax over the last axis as exp(x - logsumexp(x)): jax.nn.softmax's numbers to float
    rounding (a fully masked row is uniform in both), but a cheaper backward on XLA:CPU, which
    for jax.nn.softmax materialises the broadcast 1 / sum as a [.., C, S] array per layer.
    Attention forward + backward at bench/cpu.py's 8 x 256 shapes (4 causal blocks): 26 ms
    per layer, 38 with jax.nn.softmax (8 alternated rounds)."""
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return jnp.exp(shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True)))

"""Splash attention, the flash-attention kernel of jax's Pallas TPU ops, for the trainer's and the
scorer's full-sequence forwards: `model.attention_impl = "splash"` (TPU only).

Which kernel: `jax.experimental.pallas.ops.tpu.splash_attention`, shipped inside the pinned
jax (0.10.2), so it is versioned with the jax that lowers it and adds no dependency. tokamax
(a Pallas kernel library, pip-installable) wraps the same splash kernel; it would be a second
package to pin against jax for nothing the forward needs here (causal mask, segment ids, GQA).

Contract of `splash_attention` (same layouts as layers.attention; B rows, T queries = keys,
N kv heads, G query heads per kv head, K head dim):
  - q [B, T, N, G, K], k and v [B, N, T, K], segment_ids [B, T] int; returns [B, T, N, G, K]
    in q's dtype (float32 or bfloat16);
  - causal self-attention: query t sees key s when s <= t and segment_ids[b, s] ==
    segment_ids[b, t]. Left pads are one segment (the model passes its key mask: pads 0, real
    tokens 1), so real queries never see a pad; packed rows (sequences 1, 2, ... in one row)
    never attend across sequences. A query always sees itself, so no row is empty. Pad
    queries see only pads: their outputs differ from layers.attention's (which averages all
    values for a fully masked row), and no loss reads them;
  - GQA: query head n * G + j uses kv head n (the kernel's h // G, as in layers.attention);
  - scores: q is scaled by 1 / sqrt(K) before the kernel (the kernel does not scale), in
    float32 and rounded back to q's dtype (in bfloat16 one more rounding than the einsum path:
    the tests' tolerance); products accumulate in float32, the softmax is float32 and the
    value product reads float32 probabilities (the einsum path rounds them to the compute
    dtype first);
  - lengths: the kernel's blocks are multiples of 128 (TPU lanes; segment ids need it). T is
    zero-padded at the end to a multiple of 128 (`padded_length`), the padded positions one
    segment of their own (-1); causality keeps every real query off them, and their outputs
    are sliced off. Block size: the largest of 512, 256, 128 dividing the padded length;
  - sharding: under a context mesh (the trainer's steps: sharding.under_mesh) the kernel runs
    in a shard_map, rows over the data-parallel axes and heads over `tensor` where they
    divide (as shard_rows and TRAIN_RULES place them), replicated where they do not: GSPMD
    cannot partition a Mosaic call (jax refuses to compile one: "Mosaic kernels cannot be
    automatically partitioned"). `model.logits_chunk` does not apply: the kernel never holds
    a [T, S] score matrix.

The kernel only lowers for TPU. `INTERPRET` (False) runs it in Pallas interpret mode on any
backend instead: the tests set it (monkeypatch) to check its numbers on the CPU; a run never
does (experiment.validate refuses "splash" off a TPU backend).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ess_jax.model.mosaic import under_precision
from ess_jax.parallel.sharding import row_axes

# Pallas interpret mode instead of the TPU kernel; tests only (module docstring).
INTERPRET = False
LANES = 128  # lengths and blocks are multiples of this
BLOCKS = (512, 256, 128)  # the largest that divides the padded length
PAD_SEGMENT = -1  # the segment of the positions padded to a multiple of LANES


def takes(dtype) -> bool:
    """The compute dtypes the kernel runs in; a forward in another (a float16 behaviour model
    that pi_b's rescore runs beside the policy) keeps the einsum path."""
    return jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16)


def padded_length(t: int) -> int:
    """T rounded up to a multiple of the kernel's 128-wide blocks."""
    return -(-t // LANES) * LANES


def block_size(t_padded: int) -> int:
    return next(b for b in BLOCKS if t_padded % b == 0)


def _kernel(heads: int, length: int, interpret: bool):
    """The splash kernel for one row: causal over `length`, `heads` query heads."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b = block_size(length)
    blocks = sa.BlockSizes(
        block_q=b,
        block_kv=b,
        block_kv_compute=b,
        block_q_dkv=b,
        block_kv_dkv=b,
        block_kv_dkv_compute=b,
        block_q_dq=b,
        block_kv_dq=b,
    )
    mask = sa.MultiHeadMask([sa.CausalMask((length, length))] * heads)
    kernel = sa.make_splash_mha(
        mask, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret
    )
    return lambda q, k, v, seg: kernel(q, k, v, sa.SegmentIds(q=seg, kv=seg))


def _shard_specs(b: int, n: int):
    """(row axes, head axis) of the context mesh that divide B rows and N kv heads, or None
    without a mesh of more than one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return None
    rows = row_axes(mesh, b) or None
    heads = "tensor" if mesh.shape.get("tensor", 1) > 1 else None
    if heads and n % mesh.shape["tensor"]:
        heads = None
    return rows, heads


def splash_attention(q_BxTxNxGxK, k_BxNxTxK, v_BxNxTxK, segment_ids_BxT, interpret=None):
    """Causal attention within segments through the splash kernel (module docstring: the
    contract). `interpret` None reads INTERPRET."""
    interpret = INTERPRET if interpret is None else interpret
    b, t, n, g, kd = q_BxTxNxGxK.shape
    dt, tp = q_BxTxNxGxK.dtype, padded_length(t)
    scale = 1.0 / math.sqrt(kd)
    q = (q_BxTxNxGxK.astype(jnp.float32) * scale).astype(dt)
    q = q.transpose(0, 2, 3, 1, 4).reshape(b, n * g, t, kd)  # head n * g + j
    k, v = k_BxNxTxK.astype(dt), v_BxNxTxK.astype(dt)
    seg = segment_ids_BxT.astype(jnp.int32)
    precision = "default" if dt == jnp.bfloat16 else None  # mosaic.under_precision
    if tp != t:
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, tp - t), (0, 0))) for x in (q, k, v))
        seg = jnp.pad(seg, ((0, 0), (0, tp - t)), constant_values=PAD_SEGMENT)

    def attend(q, k, v, seg):  # one device's rows and heads
        kernel = jax.vmap(_kernel(q.shape[1], tp, interpret))
        return under_precision(kernel, precision, 3)(q, k, v, seg)

    specs = _shard_specs(b, n)
    if specs is not None:
        rows, heads = specs
        qkv = PartitionSpec(rows, heads, None, None)
        attend = jax.shard_map(
            attend,
            in_specs=(qkv, qkv, qkv, PartitionSpec(rows, None)),
            out_specs=qkv,
            check_vma=False,
        )
    out = attend(q, k, v, seg)[:, :, :t]
    return out.reshape(b, n, g, t, kd).transpose(0, 3, 1, 2, 4)

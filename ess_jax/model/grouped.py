"""The grouped expert matmul of a mixture-of-experts block: `model.moe_impl = "grouped"` (TPU).

moe.py's dense path computes every expert on every token (E / X times the routed flops, a
[B, T, E, F] activation). The grouped path computes each token's X experts only: the N tokens'
N X (token, expert) rows are sorted by expert, so that each expert's rows are one contiguous
group, and each of the three SwiGLU matmuls is one grouped matmul (row group e times expert
e's matrix) over the [N X, .] rows; the outputs are put back in token order and each token's
X rows summed.

Which kernel: megablox's `gmm` (`jax.experimental.pallas.ops.tpu.megablox`), the grouped
matmul of jax's Pallas TPU ops, with its custom VJP (`tgmm` for the weights' gradient). It
ships inside the pinned jax (0.10.2), so it is versioned with the jax that lowers it and adds
no dependency (tokamax, not installed, would be a second package to pin against jax); it has
Pallas interpret mode, so its numbers are checked on the CPU; it is the kernel MaxText's MoE
layer uses on TPUs. `jax.lax.ragged_dot` computes the same products, but its TPU lowering is
the compiler's, not a kernel whose tiling this module sets.

Contract of `expert_ffn` (N = B T tokens, D width, E experts, X per token, F an expert's
width):
  - x [B, T, D] in the compute dtype; weights [B, T, X] (the routing weights, as moe.route
    gives them); experts [B, T, X] int32 (distinct per token); gate, up [E, D, F], down
    [E, F, D] in the compute dtype. Returns [B, T, D] in x's dtype: per token
    sum_j w_j down_e(silu(x gate_e) * (x up_e)), e = experts[b, t, j], as the dense path's;
  - rounding points as the dense path's: the gate and up products in the compute dtype, the
    SwiGLU activation rounded (fp8 per (token, expert) row with `fp8`), times the routing
    weight before the down projection; the down projection's rows and their sum over a
    token's X experts in float32, rounded once (the dense path rounds the one (E, F)
    contraction once). In bfloat16 the two paths differ by at most about one rounding
    (tests/test_moe_grouped.py);
  - dtypes: the kernel takes float32 and bfloat16; another compute dtype (a float16 sampler)
    runs it in float32 and rounds the output back;
  - rows: N X is zero-padded at the end to a multiple of the row tile, the pad rows counted
    in the last expert's group (zero rows: zero outputs, zero gradients);
  - tiles: rows 512 (all of them, padded to a multiple of 16, when fewer); the contraction
    and the output one size, the largest of 512, 256, 128 dividing D and F (the backward
    reuses the tiling with the two swapped). On a TPU, D and F must be multiples of 128 (every
    Qwen3-MoE's are: 2048 and 768 in Qwen3-30B-A3B); interpret mode takes any width;
  - sharding: under a context mesh of more than one device the kernel runs in a shard_map
    (GSPMD cannot partition a Mosaic call): rows over the data-parallel axes that divide B
    (sharding.BATCH, as decoder.shard_rows places them). With mesh.expert > 1 (dividing E)
    each expert rank takes its E / expert experts (their stacks gathered over fsdp and
    tensor, as FSDP gathers a dense MLP's weights). Dispatch is Megatron's "allgather": the
    ranks of an expert group all-gather their rows (tokens, routing weights, experts), each
    routes and sorts all of them and computes its own groups (megablox's group_offset; the
    other groups' rows are zeros), and the float32 outputs are reduce-scattered over
    `expert`, each row's sum landing on its own rank, then rounded once. Rows that do not
    split over `expert` stay replicated on its ranks, the outputs summed (psum). Each rank
    holds the group's [N X, .] rows. Why not an all-to-all (`jax.lax.ragged_all_to_all`,
    each (token, expert) row sent to its expert's rank only): its receive buffer has a static
    shape, so it must hold the worst case, every row routed to one rank's experts: expert x
    the local rows x min(local experts, X) rows, which is the group's N X rows whenever a rank
    holds X experts or more (Qwen3-30B-A3B on v5p-64: 16 local experts, X 8; MaxText sizes
    its ragged all-to-all's buffer the same way). A smaller buffer drops rows when the
    routing is unbalanced, and a dropped row makes the trainer compute another function than
    the sampler did: a mismatch this codebase measures, not one it adds. The bytes moved are
    equal too: this dispatch moves the group's [N, D] per layer each way, which at X =
    expert (8 and 8 there) is what an all-to-all moves.

Each layer's expert weight gradients are computed within its own backward: `expert_ffn` passes
its input and the three stacks through one `optimization_barrier`, whose transpose yields the
input's cotangent and the stacks' together. Without it the TPU compiler schedules every
layer's weight-gradient kernels (tgmm) at the end of the backward and keeps their inputs live
until then (the dispatched rows, their gradient, the SwiGLU rows: 2.77 GB per layer for
Qwen3-30B-A3B at fsdp 4 x expert 8; a 2-layer rl_step compiles to 17.46 GB per device without
the barrier, 12.22 GB with it: docs/memory.md).

The kernel only lowers for TPU. `INTERPRET` (False) runs it in Pallas interpret mode on any
backend instead: the tests set it (monkeypatch) to check its numbers on the CPU; a run never
does (experiment.validate refuses "grouped" off a TPU backend).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ess_jax.model.layers import matmul_input
from ess_jax.model.mosaic import under_precision
from ess_jax.parallel.sharding import row_axes

# Pallas interpret mode instead of the TPU kernel; tests only (module docstring).
INTERPRET = False
ROW_TILE = 512  # rows per tile, at most
WIDTH_TILES = (512, 256, 128)  # the contraction and output tile: the largest dividing both
ROW_ALIGN = 16  # rows are padded to a multiple of this (bfloat16 sublanes) before tiling
KERNEL_DTYPES = (jnp.float32, jnp.bfloat16)


def row_tile(rows: int) -> int:
    """The row tile for `rows` (token, expert) rows: ROW_TILE, or all of them, rounded up to
    ROW_ALIGN, when fewer."""
    return min(ROW_TILE, -(-rows // ROW_ALIGN) * ROW_ALIGN)


def width_tile(k: int, n: int) -> tuple[int, int]:
    """(contraction, output) tiles of a [., k] x [k, n] product: one size for both, since the
    kernel's backward reuses the tiling with k and n swapped; the largest of WIDTH_TILES that
    divides k and n, else (k, n) (one block each: interpret mode only, see the contract)."""
    t = next((t for t in WIDTH_TILES if k % t == 0 and n % t == 0), None)
    return (t, t) if t else (k, n)


def _gmm(lhs_MxK, rhs_GxKxN, sizes_E, first, out_dtype, interpret: bool):
    """lhs's row group e times rhs[e - first] for the groups e in first .. first + G - 1 (the
    experts on this device); the rows of the other groups are zeros."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    (m, k), n = lhs_MxK.shape, rhs_GxKxN.shape[2]
    tiling = (row_tile(m), *width_tile(k, n))
    precision = "default" if lhs_MxK.dtype == jnp.bfloat16 else None  # mosaic.under_precision

    def kernel(lhs, rhs, sizes, first):
        return gmm(lhs, rhs, sizes, out_dtype, tiling, first, None, False, interpret)

    return under_precision(kernel, precision, 2)(lhs_MxK, rhs_GxKxN, sizes_E, first)


def _local_ffn(x_NxD, weights_NxX, experts_NxX, stacks, e: int, first, fp8: bool, interpret):
    """`expert_ffn` on one device's tokens and its experts `first` .. of the stacks (gate, up,
    down) of E = `e` experts in all; `first` None: all of them."""
    gate, up, down = stacks
    n, d = x_NxD.shape
    x = experts_NxX.shape[1]
    dt = x_NxD.dtype
    kt = dt if dt in KERNEL_DTYPES else jnp.dtype(jnp.float32)
    rows = n * x
    padded = -(-rows // row_tile(rows)) * row_tile(rows)
    flat = experts_NxX.reshape(rows)
    order = jnp.argsort(flat, stable=True)  # (token, expert) rows grouped by expert
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32).at[e - 1].add(padded - rows)
    pad = ((0, padded - rows), (0, 0))
    x_MxD = jnp.pad(jnp.take(x_NxD, order // x, axis=0), pad).astype(kt)
    w_M = jnp.pad(jnp.take(weights_NxX.reshape(rows), order)[:, None], pad)
    gate, up, down = gate.astype(kt), up.astype(kt), down.astype(kt)
    g = _gmm(x_MxD, gate, sizes, first, kt, interpret)
    u = _gmm(x_MxD, up, sizes, first, kt, interpret)
    h_MxF = matmul_input(jax.nn.silu(g) * u, fp8) * w_M.astype(kt)
    y_MxD = _gmm(h_MxF, down, sizes, first, jnp.float32, interpret)
    back = jnp.argsort(order)  # row r of the token order is row back[r] of the sorted one
    return jnp.take(y_MxD, back, axis=0).reshape(n, x, d).sum(1)  # float32


def _mesh_axes(b: int, e: int):
    """(row axes, expert axis) of the context mesh: the data-parallel axes that divide B rows
    (() where they do not: rows replicated) and "expert" where it has more than one rank and
    divides E (else None); None without a mesh of more than one device (no shard_map)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return None
    rows = row_axes(mesh, b)
    ranks = mesh.shape.get("expert", 1)
    return rows, ("expert" if ranks > 1 and e % ranks == 0 else None)


def expert_ffn(
    x_BxTxD, weights_BxTxX, experts_BxTxX, gate, up, down, fp8=False, interpret=None
) -> jax.Array:
    """[B, T, D]: the MoE block's experts on its (normed) input through megablox's grouped
    matmul (module docstring: the contract). `interpret` None reads INTERPRET."""
    interpret = INTERPRET if interpret is None else interpret
    # The backward then yields the input's gradient and the stacks' together: each layer's
    # weight-gradient kernels (tgmm) run within its own backward (module docstring).
    x_BxTxD, gate, up, down = jax.lax.optimization_barrier((x_BxTxD, gate, up, down))
    b, t, d = x_BxTxD.shape
    x, e = experts_BxTxX.shape[-1], gate.shape[0]
    dt = x_BxTxD.dtype
    axes = _mesh_axes(b, e)
    expert_axis = axes[1] if axes else None

    def local(x_BxTxD, w_BxTxX, e_BxTxX, gate, up, down):  # one device's rows and experts
        scatter = expert_axis is not None and expert_axis in axes[0]
        if scatter:  # dispatch: the expert group's rows, on each of its ranks
            gather = functools.partial(jax.lax.all_gather, axis_name=expert_axis, tiled=True)
            x_BxTxD, w_BxTxX, e_BxTxX = gather(x_BxTxD), gather(w_BxTxX), gather(e_BxTxX)
        rb = x_BxTxD.shape[0]
        first = None
        if expert_axis:
            first = jax.lax.axis_index(expert_axis).astype(jnp.int32) * gate.shape[0]
        out = _local_ffn(
            x_BxTxD.reshape(rb * t, d),
            w_BxTxX.reshape(rb * t, x),
            e_BxTxX.reshape(rb * t, x),
            (gate, up, down),
            e,
            first,
            fp8,
            interpret,
        )
        if scatter:  # combine: each row's sum over the ranks' experts, on the row's own rank
            out = jax.lax.psum_scatter(out, expert_axis, scatter_dimension=0, tiled=True)
            rb //= jax.lax.axis_size(expert_axis)
        elif expert_axis:  # rows replicated over the ranks: the sum, on every rank
            out = jax.lax.psum(out, expert_axis)
        return out.astype(dt).reshape(rb, t, d)

    if axes is not None:
        act = PartitionSpec(axes[0] or None, None, None)
        stack = PartitionSpec(expert_axis, None, None)
        local = jax.shard_map(
            local,
            in_specs=(act, act, act, stack, stack, stack),
            out_specs=act,
            check_vma=False,
        )
    return local(x_BxTxD, weights_BxTxX, experts_BxTxX, gate, up, down)

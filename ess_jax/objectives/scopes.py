"""The three ESS scopes: how one optimizer batch's statistics, losses and metrics combine over
micro-batches. Pure functions; the gradient loop that uses them is the RL update's
(`ess_jax/rl/update.py`, `ess_jax/rl/accumulate.py`).

A micro-batch is a strided set of rows (`core.split_microbatches`), so with the batch sharded
over devices every micro-batch has rows on every device and its statistics are pooled over all
of them, as the reference code all-reduces a micro-batch's ESS over its data-parallel ranks. In
the two micro-batch scopes, given a key, the rows are first shuffled within each device's
block (`shuffle_rows`), as the reference code shuffles its micro-batches: a rollout batch lays its
groups out as rows i*G + g (`RowLayout`), the external model's samples first in each group, so
the strided split alone gives micro-batches that are all external or all policy whenever M is a
multiple of G (G = 4, M = 16, 50% external: per-micro-batch ESS 0.32-0.998, the reference
code's 0.29-0.875). "step" never shuffles: its results do not depend on the split. ess_scope:
  "step"             a no-grad statistics pass fixes the ESS and the token / sequence counts of
                     the whole optimizer batch, so micro-batch losses and gradients add up to the
                     batch's (invariant to micro-batching and device count). Default.
                     Only objectives whose loss reads the ESS (`Objective.ess_in_loss`) need
                     that pass, and from 3 micro-batches on the last one's forward in it also
                     serves its gradient: M - 1 extra micro-batch forwards (M = 2: 2;
                     `rl/accumulate.statistics_pass` says why). For the others the counts need
                     only the mask, and the step's ESS metrics come from the micro-batches' own
                     log-probs after the gradient pass.
  "microbatch"       the reference code's default (normalize_loss=True): each micro-batch's own
                     ESS, but the token / sequence counts of the whole optimizer batch (they need
                     only the mask, no extra pass); micro-batch losses and gradients are summed.
  "microbatch_local" each micro-batch's own ESS and counts; losses and gradients are averaged
                     over micro-batches (the reference with normalize_loss=False, except that it
                     pools a micro-batch over devices where that code normalises per rank).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ess_jax.objectives.config import ObjectiveConfig
from ess_jax.objectives.core import CONST_METRICS, MAX_METRICS, STAT_KEYS, Batch, Metrics

COUNT_KEYS = ("num_tokens", "num_seqs")
# Scopes whose results depend on which rows share a micro-batch: their rows are shuffled.
SHUFFLED_SCOPES = ("microbatch", "microbatch_local")
# The caller-supplied step statistics each scope keeps (the rest come from each micro-batch).
KEPT_STATISTICS = {"step": STAT_KEYS, "microbatch": COUNT_KEYS, "microbatch_local": ()}


def rows_and_shared(batch: Batch, config: ObjectiveConfig) -> tuple[Batch, Batch]:
    """(rows, shared) of an optimizer batch: the arrays with a leading row axis, which the
    micro-batches split, and the scalars every micro-batch shares. A caller-supplied step
    statistic (ess, ess_prox, num_tokens, num_seqs) is shared only where the scope keeps it
    (KEPT_STATISTICS); elsewhere it is dropped and each micro-batch computes its own."""
    kept = KEPT_STATISTICS[config.ess_scope]
    shared = {
        k: v for k, v in batch.items() if jnp.ndim(v) == 0 and (k not in STAT_KEYS or k in kept)
    }
    rows = {k: v for k, v in batch.items() if jnp.ndim(v) > 0}
    return rows, shared


def shuffled(config: ObjectiveConfig, num_microbatches: int) -> bool:
    """Whether the update shuffles its rows before the micro-batch split: the micro-batch
    scopes with M > 1."""
    return config.ess_scope in SHUFFLED_SCOPES and num_microbatches > 1


def combine_metrics(metrics_M: Metrics, ess_scope: str) -> Metrics:
    """Reduce metrics stacked over micro-batches (leading axis M) to step metrics.

    "step" and "microbatch": token means were divided by the step's token count, so they add up
    (to the step's token means); ESS values are averaged (shared by every micro-batch in "step",
    the reference code's logged mean in "microbatch"); ratio_max is a max. "microbatch_local":
    every micro-batch normalised by its own counts, so the mean over micro-batches is taken.
    """
    out = {}
    for key, value in metrics_M.items():
        if key in MAX_METRICS:
            out[key] = jnp.max(value, axis=0)
        elif ess_scope != "microbatch_local" and key not in CONST_METRICS:
            out[key] = jnp.sum(value, axis=0)
        else:
            out[key] = jnp.mean(value, axis=0)
    return out


def row_permutation(key: jax.Array, batch_size: int, row_blocks: int = 1) -> jax.Array:
    """A permutation of range(batch_size) that moves rows only within each of `row_blocks`
    contiguous blocks (one device's rows under a batch sharded `row_blocks` ways); one block
    when `row_blocks` does not divide the batch. Row r of the shuffled batch is row perm[r]."""
    local_KxC = _block_permutations(key, batch_size, row_blocks)
    blocks, size = local_KxC.shape
    return (local_KxC + size * jnp.arange(blocks)[:, None]).reshape(-1)


def shuffle_rows(rows: Batch, key: jax.Array, row_blocks: int = 1) -> Batch:
    """Every row array permuted by `row_permutation`, gathered block by block: a block's rows
    stay on its device, so the shuffle moves no data between devices, and with the strided
    split after it every micro-batch still has rows on every device (when the block size is a
    multiple of M)."""
    local_KxC = _block_permutations(key, rows["mask"].shape[0], row_blocks)

    def gather(x):
        x_KxC = x.reshape(*local_KxC.shape, *x.shape[1:])
        return jax.vmap(lambda xb, p: xb[p])(x_KxC, local_KxC).reshape(x.shape)

    return {k: gather(v) for k, v in rows.items()}


def _block_permutations(key: jax.Array, batch_size: int, row_blocks: int) -> jax.Array:
    """[K, C]: one permutation of range(C) per block of C = batch_size / K rows."""
    blocks = row_blocks if row_blocks > 0 and batch_size % row_blocks == 0 else 1
    keys = jax.random.split(key, blocks)
    return jax.vmap(lambda k: jax.random.permutation(k, batch_size // blocks))(keys)

"""The three ESS scopes: one optimizer batch's loss, gradient and metrics over micro-batches.

A micro-batch is a strided set of rows (`core.split_microbatches`), so with the batch sharded
over devices every micro-batch has rows on every device and its statistics are pooled over all
of them, as the reference code all-reduces a micro-batch's ESS over its data-parallel ranks. In
the two micro-batch scopes, given a `key`, the rows are first shuffled within each device's
block (`shuffle_rows`), as the reference code shuffles its micro-batches: a rollout batch lays its
groups out as rows i*G + g with the external model's samples first in each group, so the
strided split alone gives micro-batches that are all external or all policy whenever M is a
multiple of G (G = 4, M = 16, 50% external: per-micro-batch ESS 0.32-0.998, the reference
code's 0.29-0.875). "step" never shuffles: its results do not depend on the split. ess_scope:
  "step"             a no-grad statistics pass fixes the ESS and the token / sequence counts of
                     the whole optimizer batch, so micro-batch losses and gradients add up to the
                     batch's (invariant to micro-batching and device count). Default.
                     Only objectives whose loss reads the ESS (`Objective.ess_in_loss`) need
                     that pass, and from 3 micro-batches on the last one's forward in it also
                     serves its gradient: M - 1 extra micro-batch forwards (M = 2: 2;
                     `_statistics_pass` says why). For the others the counts need only the
                     mask, and the step's ESS metrics come from the micro-batches' own log-probs
                     after the gradient pass.
  "microbatch"       the reference code's default (normalize_loss=True): each micro-batch's own
                     ESS, but the token / sequence counts of the whole optimizer batch (they need
                     only the mask, no extra pass); micro-batch losses and gradients are summed.
  "microbatch_local" each micro-batch's own ESS and counts; losses and gradients are averaged
                     over micro-batches (the reference with normalize_loss=False, except that it
                     pools a micro-batch over devices where that code normalises per rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ess_jax.objectives.config import ObjectiveConfig
from ess_jax.objectives.core import (
    CONST_METRICS,
    MAX_METRICS,
    STAT_KEYS,
    Batch,
    Metrics,
    merge_microbatches,
    mismatch_metrics,
    split_microbatches,
    step_statistics,
    token_counts,
)
from ess_jax.objectives.registry import Objective, get_objective

COUNT_KEYS = ("num_tokens", "num_seqs")
# Scopes whose results depend on which rows share a micro-batch: their rows are shuffled.
SHUFFLED_SCOPES = ("microbatch", "microbatch_local")
# The caller-supplied step statistics each scope keeps (the rest come from each micro-batch).
KEPT_STATISTICS = {"step": STAT_KEYS, "microbatch": COUNT_KEYS, "microbatch_local": ()}


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


def step_loss_and_grad(
    logp_fn: Callable[[Any, Batch], Any],
    params: Any,
    batch: Batch,
    config: ObjectiveConfig,
    num_microbatches: int = 1,
    key: jax.Array | None = None,
    row_blocks: int = 1,
    group_size: int | None = None,
) -> tuple[jax.Array, Any, Metrics]:
    """Loss, gradient and metrics of one optimizer batch, accumulated over micro-batches.

    `logp_fn(params, micro_batch)` returns logp_BxT (float32), or (logp_BxT, extras) whose
    extras (e.g. "entropy" [B, T]) are added to the micro-batch. Arrays of `batch` with a
    leading batch axis are split; scalars are shared, and caller-supplied step statistics
    (ess, ess_prox, num_tokens, num_seqs) win where the scope keeps them (KEPT_STATISTICS).
    ObjectiveConfig.ess_scope picks `_step_scope`, `_microbatch_scope` or `_local_scope`.
    `key` (a PRNG key; None: no shuffle) and `row_blocks` (the batch's shards along its rows)
    shuffle the rows before the split in the micro-batch scopes with M > 1 (`shuffle_rows`).
    An objective whose record has a `batch_pass` (vcpo) first runs it on the whole batch, in
    rollout row order (`group_size` consecutive rows per prompt); its rows and scalars join the
    batch. The metrics include `core.mismatch_metrics` of the whole batch (one sort of its
    B x T log-ratios: the micro-batches' log-probs are kept for it).
    """
    m = num_microbatches
    batch_size = batch["mask"].shape[0]
    if m < 1 or batch_size % m:
        raise ValueError(f"batch size {batch_size} is not divisible by num_microbatches={m}")
    kept = KEPT_STATISTICS[config.ess_scope]
    shared = {
        k: v for k, v in batch.items() if jnp.ndim(v) == 0 and (k not in STAT_KEYS or k in kept)
    }
    rows = {k: v for k, v in batch.items() if jnp.ndim(v) > 0}
    acc = _Accumulator(logp_fn, get_objective(config.name), config, params)
    if acc.objective.batch_pass is not None:
        added_rows, added_shared = acc.objective.batch_pass(
            logp_fn, params, rows, config, m, group_size
        )
        rows, shared = {**rows, **added_rows}, {**shared, **added_shared}
    if m == 1:  # one micro-batch: the objective's own statistics are the step's
        (loss, (metrics, logp)), grads = acc.grad_fn(params, {**rows, **shared})
        return loss, grads, {**metrics, **mismatch_metrics(logp, rows)}
    if key is not None and config.ess_scope in SHUFFLED_SCOPES:
        rows = shuffle_rows(rows, key, row_blocks)
    scope = {"step": _step_scope, "microbatch": _microbatch_scope, "microbatch_local": _local_scope}
    loss, grads, metrics, logp_M = scope[config.ess_scope](acc, rows, shared, m)
    return loss, grads, {**metrics, **mismatch_metrics(merge_microbatches(logp_M), rows)}


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


def _step_scope(acc: _Accumulator, rows: Batch, shared: Batch, m: int):
    """The whole step's ESS and counts in every micro-batch's loss; losses and gradients sum.

    A loss that reads the ESS needs it before any gradient: `_statistics_pass`. The others take
    the counts from the mask, and their ESS metrics from the micro-batches' own log-probs."""
    micro = {k: split_microbatches(v, m) for k, v in rows.items()}
    needed = ("ess", "num_tokens", "num_seqs") + (("ess_prox",) if "prox_logp" in rows else ())
    missing = not all(k in shared for k in needed)
    ess_after = ()  # step ESS metrics computed after the gradient pass
    reused = None  # the last micro-batch's loss, metrics and gradient, from the statistics pass
    if missing and acc.objective.ess_in_loss:
        shared, reused = _statistics_pass(acc.logp_fn, acc.loss_of, acc.params, micro, rows, shared)
        if reused is not None:  # the last one's gradient is done
            micro = {k: v[:-1] for k, v in micro.items()}
    elif missing:
        ess_after = tuple(k for k in ("ess", "ess_prox") if k in needed and k not in shared)
        shared = {**token_counts(rows), **shared}
    init = None if reused is None else reused[2]
    grads, loss_M, metrics_M, logp_M = acc.scan(micro, shared, init)
    if reused is not None:  # the last micro-batch, back in its place
        loss_M = jnp.append(loss_M, reused[0])
        metrics_M = jax.tree.map(lambda a, b: jnp.append(a, b[None], axis=0), metrics_M, reused[1])
        logp_M = jnp.concatenate([logp_M, reused[3][None]])
    metrics = combine_metrics(metrics_M, "step")
    if ess_after:  # the step's ESS, as the statistics pass would have given it
        stats = step_statistics(merge_microbatches(logp_M), rows)
        metrics.update({k: stats[k] for k in ess_after if k in metrics})
    return jnp.sum(loss_M), acc.cast(grads), metrics, logp_M


def _microbatch_scope(acc: _Accumulator, rows: Batch, shared: Batch, m: int):
    """The reference code's default: each micro-batch's own ESS, the step's token counts (they
    need only the mask); losses and gradients sum."""
    shared = {**token_counts(rows), **shared}
    grads, loss_M, metrics_M, logp_M = acc.scan(
        {k: split_microbatches(v, m) for k, v in rows.items()}, shared
    )
    return jnp.sum(loss_M), acc.cast(grads), combine_metrics(metrics_M, "microbatch"), logp_M


def _local_scope(acc: _Accumulator, rows: Batch, shared: Batch, m: int):
    """Each micro-batch's own ESS and counts; losses and gradients are averaged."""
    grads, loss_M, metrics_M, logp_M = acc.scan(
        {k: split_microbatches(v, m) for k, v in rows.items()}, shared
    )
    scale = 1.0 / m
    return (
        jnp.sum(loss_M) * scale,
        acc.cast(grads, scale),
        combine_metrics(metrics_M, "microbatch_local"),
        logp_M,
    )


class _Accumulator:
    """One step's objective and gradient function, and the scan that sums micro-batch
    gradients (float32 accumulation even for low-precision params: M partial sums lose bits)."""

    def __init__(self, logp_fn, objective: Objective, config: ObjectiveConfig, params):
        self.logp_fn, self.objective, self.config, self.params = logp_fn, objective, config, params
        self.grad_fn = jax.value_and_grad(self._loss, has_aux=True)

    def loss_of(self, out, mb):
        """The objective on a log-prob function's output for micro-batch mb."""
        logp, extras = _unpack(out)
        return self.objective.loss(logp, {**mb, **extras}, self.config)

    def _loss(self, p, mb):
        out = self.logp_fn(p, mb)
        loss, metrics = self.loss_of(out, mb)
        return loss, (metrics, jax.lax.stop_gradient(_logp_of(out)))

    def scan(self, micro, shared, init=None):
        """Summed gradients and per-micro-batch losses, metrics and log-probs [M, b, T]."""

        def accumulate(grads_acc, mb):
            (loss, (metrics, logp)), grads = self.grad_fn(self.params, {**mb, **shared})
            grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
            return grads_acc, (loss, metrics, logp)

        if init is None:
            init = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), self.params)
        else:
            init = jax.tree.map(lambda g: g.astype(jnp.float32), init)
        grads, (loss_M, metrics_M, logp_M) = jax.lax.scan(accumulate, init, micro)
        return grads, loss_M, metrics_M, logp_M

    def cast(self, grads, scale: float = 1.0):
        """Summed float32 gradients, scaled, in the params' dtypes."""
        return jax.tree.map(lambda g, p: (g * scale).astype(jnp.result_type(p)), grads, self.params)


def _statistics_pass(logp_fn, loss_of, params, micro, rows, shared):
    """ess_scope "step" for a loss that reads the ESS: the step's statistics before any gradient.

    Needs every micro-batch's log-probs first, so it costs one more forward over the batch. From
    M = 3 on, the last micro-batch's forward keeps its residuals (jax.vjp) and serves for its own
    gradient once the statistics are known, so the extra forwards are M - 1 micro-batches', not
    M. Keeping more of them would hold several micro-batches' activations at once, which is
    what micro-batching avoids; and no cheaper exact pass exists: the cap min(rho_t, ESS)
    decides per token how it enters the gradient, so the ESS must be known before any backward.
    Not at M = 2: the scans over the other micro-batch would have one step, XLA inlines a
    one-step loop, and the straight-line program then holds both micro-batches' activations at
    once (twice the compiled temp memory on CPU; XLA:CPU drops optimization barriers before
    scheduling, so none can order it). Returns the shared scalars with the statistics added, and
    (loss, metrics, grads, logp) of the last micro-batch, or None when its forward was not kept.
    """
    frozen = jax.lax.stop_gradient(params)
    reuse = micro["mask"].shape[0] > 2
    head = {k: v[:-1] for k, v in micro.items()} if reuse else micro

    def stats_pass(_, mb):
        return None, _logp_of(logp_fn(frozen, {**mb, **shared}))

    _, logp_head = jax.lax.scan(stats_pass, None, head)
    if not reuse:
        return {**step_statistics(merge_microbatches(logp_head), rows), **shared}, None
    last = {k: v[-1] for k, v in micro.items()}
    out, backward = jax.vjp(lambda p: logp_fn(p, {**last, **shared}), params)
    logp_MxBxT = jnp.concatenate([logp_head, _logp_of(out)[None]])
    shared = {**step_statistics(merge_microbatches(logp_MxBxT), rows), **shared}
    loss, loss_backward, metrics = jax.vjp(
        lambda out: loss_of(out, {**last, **shared}), out, has_aux=True
    )
    (grads,) = backward(*loss_backward(jnp.ones_like(loss)))
    return shared, (loss, metrics, grads, _logp_of(out))


def _unpack(out) -> tuple[jax.Array, dict]:
    """(logp, extras) of a log-prob function's output: logp_BxT or (logp_BxT, extras)."""
    return out if isinstance(out, tuple) else (out, {})


def _logp_of(out) -> jax.Array:
    return _unpack(out)[0].astype(jnp.float32)

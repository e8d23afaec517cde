"""Accumulation: one optimizer batch's loss, gradient and metrics over micro-batches.

A micro-batch is a strided set of rows (`_split`), so with the batch sharded over devices every
micro-batch has rows on every device and its statistics are pooled over all of them, as the
reference code all-reduces a micro-batch's ESS over its data-parallel ranks. ess_scope:
  "step"             a no-grad statistics pass fixes the ESS and the token / sequence counts of
                     the whole optimizer batch, so micro-batch losses and gradients add up to the
                     batch's (PAPER.md: invariant to micro-batching and device count). Default.
                     Only objectives whose loss reads the ESS (ESS_IN_LOSS) need that pass: for
                     the others the counts need only the mask, and the step's ESS metrics come
                     from the micro-batches' own log-probs after the gradient pass.
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

from ess_jax.objectives import (
    _CONST_METRICS,
    _MAX_METRICS,
    ESS_IN_LOSS,
    STAT_KEYS,
    Batch,
    Metrics,
    ObjectiveConfig,
    get_objective,
    step_statistics,
    token_counts,
)

COUNT_KEYS = ("num_tokens", "num_seqs")


def combine_metrics(metrics_M: Metrics, ess_scope: str) -> Metrics:
    """Reduce metrics stacked over micro-batches (leading axis M) to step metrics.

    "step" and "microbatch": token means were divided by the step's token count, so they add up
    (to the step's token means); ESS values are averaged (shared by every micro-batch in "step",
    the reference code's logged mean in "microbatch"); ratio_max is a max. "microbatch_local":
    every micro-batch normalised by its own counts, so the mean over micro-batches is taken.
    """
    out = {}
    for key, value in metrics_M.items():
        if key in _MAX_METRICS:
            out[key] = jnp.max(value, axis=0)
        elif ess_scope != "microbatch_local" and key not in _CONST_METRICS:
            out[key] = jnp.sum(value, axis=0)
        else:
            out[key] = jnp.mean(value, axis=0)
    return out


def _split(x: jax.Array, m: int) -> jax.Array:
    # Strided micro-batches (rows m, m + M, ...): with the batch sharded over "data", every
    # micro-batch keeps rows on every device, so no resharding happens inside the scan.
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def _merge(x_M: jax.Array) -> jax.Array:
    return x_M.swapaxes(0, 1).reshape(-1, *x_M.shape[2:])


def step_loss_and_grad(
    logp_fn: Callable[[Any, Batch], Any],
    params: Any,
    batch: Batch,
    config: ObjectiveConfig,
    num_microbatches: int = 1,
) -> tuple[jax.Array, Any, Metrics]:
    """Loss, gradient and metrics of one optimizer batch, accumulated over micro-batches.

    `logp_fn(params, micro_batch)` returns logp_BxT (float32), or (logp_BxT, extras) whose
    extras (e.g. "entropy" [B, T]) are added to the micro-batch. Arrays of `batch` with a
    leading batch axis are split; scalars are shared. ess_scope (module docstring) "step": a
    no-grad statistics pass over all micro-batches fixes ess / ess_prox / num_tokens / num_seqs
    (caller-supplied ones win), then a lax.scan sums the micro-batch losses and gradients.
    "microbatch": num_tokens / num_seqs of the whole batch (caller-supplied ones win), ess /
    ess_prox per micro-batch, sums. "microbatch_local": every statistic per micro-batch, means.
    """
    objective = get_objective(config.name)
    m = num_microbatches
    batch_size = batch["mask"].shape[0]
    if m < 1 or batch_size % m:
        raise ValueError(f"batch size {batch_size} is not divisible by num_microbatches={m}")
    scope = config.ess_scope
    step_scope, local_scope = scope == "step", scope == "microbatch_local"

    def loss_fn(p, mb):
        out = logp_fn(p, mb)
        logp, extras = out if isinstance(out, tuple) else (out, {})
        loss, metrics = objective(logp, {**mb, **extras}, config)
        return loss, (metrics, jax.lax.stop_gradient(logp).astype(jnp.float32))

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    shared = {k: v for k, v in batch.items() if jnp.ndim(v) == 0}
    if not step_scope:  # the ESS is each micro-batch's own, and so are local counts
        kept = () if local_scope else COUNT_KEYS
        shared = {k: v for k, v in shared.items() if k not in STAT_KEYS or k in kept}
    rows = {k: v for k, v in batch.items() if jnp.ndim(v) > 0}
    if m == 1:  # one micro-batch: the objective's own statistics are the step's
        (loss, (metrics, _)), grads = grad_fn(params, {**rows, **shared})
        return loss, grads, metrics

    micro = {k: _split(v, m) for k, v in rows.items()}
    needed = ("ess", "num_tokens", "num_seqs") + (("ess_prox",) if "prox_logp" in batch else ())
    missing = step_scope and not all(k in shared for k in needed)
    ess_after = ()  # step ESS metrics computed after the gradient pass
    if missing and config.name in ESS_IN_LOSS:
        frozen = jax.lax.stop_gradient(params)

        def stats_pass(_, mb):
            out = logp_fn(frozen, {**mb, **shared})
            return None, (out[0] if isinstance(out, tuple) else out).astype(jnp.float32)

        _, logp_MxBxT = jax.lax.scan(stats_pass, None, micro)
        shared = {**step_statistics(_merge(logp_MxBxT), rows), **shared}
    elif missing or scope == "microbatch":  # the counts need only the mask
        if missing:  # the loss does not read the ESS: the step's, for the metrics, afterwards
            ess_after = tuple(k for k in ("ess", "ess_prox") if k in needed and k not in shared)
        shared = {**token_counts(rows), **shared}

    def accumulate(grads_acc, mb):
        (loss, (metrics, logp)), grads = grad_fn(params, {**mb, **shared})
        # Accumulate in float32 even for low-precision params: M partial sums lose bits.
        grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
        return grads_acc, (loss, metrics, logp if ess_after else None)

    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    grads, (loss_M, metrics_M, logp_M) = jax.lax.scan(accumulate, zeros, micro)
    scale = 1.0 / m if local_scope else 1.0
    grads = jax.tree.map(lambda g, p: (g * scale).astype(jnp.result_type(p)), grads, params)
    metrics = combine_metrics(metrics_M, scope)
    if ess_after:  # the step's ESS, as the statistics pass would have given it
        stats = step_statistics(_merge(logp_M), rows)
        metrics.update({k: stats[k] for k in ess_after if k in metrics})
    return jnp.sum(loss_M) * scale, grads, metrics

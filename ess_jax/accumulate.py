"""Step-scope accumulation: one optimizer batch's loss, gradient and metrics over micro-batches.

With ess_scope "step" a no-grad statistics pass fixes the ESS and the token / sequence counts of
the whole optimizer batch, so micro-batch losses and gradients add up to the batch's (PAPER.md:
invariant to micro-batching and device count). "microbatch" is the reference-code behaviour.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ess_jax.objectives import (
    _CONST_METRICS,
    _MAX_METRICS,
    STAT_KEYS,
    Batch,
    Metrics,
    ObjectiveConfig,
    get_objective,
    step_statistics,
)


def combine_metrics(metrics_M: Metrics, ess_scope: str) -> Metrics:
    """Reduce metrics stacked over micro-batches (leading axis M) to step metrics.

    "step": token means were divided by the global token count, so they add up; ESS values are
    shared (mean); ratio_max is a max. "microbatch": every micro-batch normalised locally, so
    the reference-code mean over micro-batches is taken (ratio_max still a max).
    """
    out = {}
    for key, value in metrics_M.items():
        if key in _MAX_METRICS:
            out[key] = jnp.max(value, axis=0)
        elif ess_scope == "step" and key not in _CONST_METRICS:
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
    leading batch axis are split; scalars are shared. ess_scope "step": a no-grad statistics
    pass over all micro-batches fixes ess / ess_prox / num_tokens / num_seqs (caller-supplied
    ones win), then a lax.scan sums the micro-batch losses and gradients. "microbatch": each
    micro-batch uses its own statistics and the results are averaged (reference code).
    """
    objective = get_objective(config.name)
    m = num_microbatches
    batch_size = batch["mask"].shape[0]
    if m < 1 or batch_size % m:
        raise ValueError(f"batch size {batch_size} is not divisible by num_microbatches={m}")
    step_scope = config.ess_scope == "step"

    def loss_fn(p, mb):
        out = logp_fn(p, mb)
        logp, extras = out if isinstance(out, tuple) else (out, {})
        return objective(logp, {**mb, **extras}, config)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    shared = {k: v for k, v in batch.items() if jnp.ndim(v) == 0}
    if not step_scope:
        shared = {k: v for k, v in shared.items() if k not in STAT_KEYS}
    rows = {k: v for k, v in batch.items() if jnp.ndim(v) > 0}
    if m == 1:  # one micro-batch: the objective's own statistics are the step's
        (loss, metrics), grads = grad_fn(params, {**rows, **shared})
        return loss, grads, metrics

    micro = {k: _split(v, m) for k, v in rows.items()}
    needed = ("ess", "num_tokens", "num_seqs") + (("ess_prox",) if "prox_logp" in batch else ())
    if step_scope and not all(k in shared for k in needed):
        frozen = jax.lax.stop_gradient(params)

        def stats_pass(_, mb):
            out = logp_fn(frozen, {**mb, **shared})
            return None, (out[0] if isinstance(out, tuple) else out).astype(jnp.float32)

        _, logp_MxBxT = jax.lax.scan(stats_pass, None, micro)
        shared = {**step_statistics(_merge(logp_MxBxT), rows), **shared}

    def accumulate(grads_acc, mb):
        (loss, metrics), grads = grad_fn(params, {**mb, **shared})
        # Accumulate in float32 even for low-precision params: M partial sums lose bits.
        grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
        return grads_acc, (loss, metrics)

    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    grads, (loss_M, metrics_M) = jax.lax.scan(accumulate, zeros, micro)
    scale = 1.0 if step_scope else 1.0 / m
    grads = jax.tree.map(lambda g, p: (g * scale).astype(jnp.result_type(p)), grads, params)
    return jnp.sum(loss_M) * scale, grads, combine_metrics(metrics_M, config.ess_scope)

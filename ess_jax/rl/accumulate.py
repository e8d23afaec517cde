"""The gradient loop of one RL update over its micro-batches: the three ESS scopes' gradient
passes (their meanings: ess_jax/objectives/scopes.py), the "step" scope's statistics pass, and
the per-row gradient norms an objective's batch pass reads (vcpo). `update.step_loss_and_grad`
calls them; the losses, statistics and metric combination they apply are the objectives' own.

Axis alphabet: M micro-batches, b rows of one micro-batch, B = M b rows of the update, T
response length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ess_jax.objectives.config import ObjectiveConfig
from ess_jax.objectives.core import (
    Batch,
    kept_mask,
    merge_microbatches,
    split_microbatches,
    step_statistics,
    token_counts,
)
from ess_jax.objectives.registry import Objective
from ess_jax.objectives.scopes import combine_metrics

LogpFn = Callable[[Any, Batch], Any]  # (params, rows) -> logp_BxT or (logp_BxT, extras)


def keeps_last_microbatch(objective: Objective, ess_scope: str, m: int) -> bool:
    """Whether an update of `m` micro-batches runs the statistics pass and keeps its last
    micro-batch's forward for that micro-batch's gradient (`statistics_pass` from M = 3 on):
    its gradient then runs outside the gradient scan, and its micro-batch loops run M - 1
    times."""
    return objective.ess_in_loss and ess_scope == "step" and m > 2


def step_scope(acc: Accumulator, rows: Batch, shared: Batch, m: int):
    """The whole step's ESS and counts in every micro-batch's loss; losses and gradients sum.

    A loss that reads the ESS needs it before any gradient: `statistics_pass`. The others take
    the counts from the mask, and their ESS metrics from the micro-batches' own log-probs."""
    micro = {k: split_microbatches(v, m) for k, v in rows.items()}
    needed = ("ess", "num_tokens", "num_seqs") + (("ess_prox",) if "prox_logp" in rows else ())
    missing = not all(k in shared for k in needed)
    ess_after = ()  # step ESS metrics computed after the gradient pass
    reused = None  # the last micro-batch's loss, metrics and gradient, from the statistics pass
    if missing and acc.objective.ess_in_loss:
        keep = keeps_last_microbatch(acc.objective, "step", m)
        shared, reused = statistics_pass(
            acc.logp_fn, acc.loss_of, acc.params, micro, rows, shared, keep
        )
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


def microbatch_scope(acc: Accumulator, rows: Batch, shared: Batch, m: int):
    """The reference code's default: each micro-batch's own ESS, the step's token counts (they
    need only the mask); losses and gradients sum."""
    shared = {**token_counts(rows), **shared}
    grads, loss_M, metrics_M, logp_M = acc.scan(
        {k: split_microbatches(v, m) for k, v in rows.items()}, shared
    )
    return jnp.sum(loss_M), acc.cast(grads), combine_metrics(metrics_M, "microbatch"), logp_M


def local_scope(acc: Accumulator, rows: Batch, shared: Batch, m: int):
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


# ObjectiveConfig.ess_scope -> its pass:
# (acc, rows, shared, M) -> (loss, grads, metrics, logp_MxbxT)
SCOPES = {"step": step_scope, "microbatch": microbatch_scope, "microbatch_local": local_scope}


class Accumulator:
    """One step's objective and gradient function, and the scan that sums micro-batch
    gradients (float32 accumulation even for low-precision params: M partial sums lose bits).

    A log-prob function whose extras hold "router_loss" (an MoE router's load-balancing loss,
    steps.logp_fn_for) adds `router_coef` times its mean over the M micro-batches to the loss,
    and reports that mean as the metric "router_loss": each micro-batch's share is 1 / M where
    the scope sums the micro-batches' losses and metrics, 1 where it averages them."""

    def __init__(
        self,
        logp_fn: LogpFn,
        objective: Objective,
        config: ObjectiveConfig,
        params,
        router_coef: float = 0.0,
        num_microbatches: int = 1,
    ):
        self.logp_fn, self.objective, self.config, self.params = logp_fn, objective, config, params
        averaged = config.ess_scope == "microbatch_local"
        self.router_share = 1.0 if averaged else 1.0 / num_microbatches
        self.router_coef = router_coef
        self.grad_fn = jax.value_and_grad(self._loss, has_aux=True)

    def loss_of(self, out, mb):
        """The objective on a log-prob function's output for micro-batch mb, plus its share of
        the router's load-balancing loss if the output has one."""
        logp, extras = _unpack(out)
        extras = dict(extras)
        router = extras.pop("router_loss", None)
        loss, metrics = self.objective.loss(logp, {**mb, **extras}, self.config)
        if router is None:
            return loss, metrics
        share = self.router_share * router
        return loss + self.router_coef * share, {**metrics, "router_loss": share}

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


def statistics_pass(logp_fn, loss_of, params, micro, rows, shared, keep_last: bool):
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
    (loss, metrics, grads, logp) of the last micro-batch, or None when its forward was not kept
    (`keep_last`: keeps_last_microbatch of the step).
    """
    frozen = jax.lax.stop_gradient(params)
    head = {k: v[:-1] for k, v in micro.items()} if keep_last else micro

    def stats_pass(_, mb):
        return None, _logp_of(logp_fn(frozen, {**mb, **shared}))

    _, logp_head = jax.lax.scan(stats_pass, None, head)
    if not keep_last:
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


def seq_grad_sq(
    logp_fn: LogpFn, params: Any, rows: Batch, num_microbatches: int = 1
) -> tuple[jax.Array, jax.Array]:
    """Per row i, ||grad_theta sum_t logp_it||^2 over its kept tokens [B] (float32), and the
    log-probs [B, T] at `params`. One gradient per row, vmapped over the rows of a micro-batch
    (strided, as the update splits them) and mapped over the M micro-batches: M * b per-row
    gradients are never held at once, b of them are."""
    m = num_microbatches

    def row_sum(p, row):
        one = {k: v[None] for k, v in row.items()}
        out = logp_fn(p, one)
        logp = (out[0] if isinstance(out, tuple) else out).astype(jnp.float32)
        keep = kept_mask(logp, one)
        return jnp.sum(jnp.where(keep, logp, 0.0)), logp[0]

    grad_fn = jax.vmap(jax.grad(row_sum, has_aux=True), in_axes=(None, 0))

    def micro(mb):
        grads, logp_bxT = grad_fn(params, mb)
        sq = [
            jnp.sum(jnp.square(g.astype(jnp.float32)).reshape(g.shape[0], -1), -1)
            for g in jax.tree.leaves(grads)
        ]
        return sum(sq), logp_bxT

    split = {k: split_microbatches(v, m) for k, v in rows.items()}
    sq_MxB, logp_MxBxT = jax.lax.map(micro, split)
    return merge_microbatches(sq_MxB), merge_microbatches(logp_MxBxT)


def _unpack(out) -> tuple[jax.Array, dict]:
    """(logp, extras) of a log-prob function's output: logp_BxT or (logp_BxT, extras)."""
    return out if isinstance(out, tuple) else (out, {})


def _logp_of(out) -> jax.Array:
    return _unpack(out)[0].astype(jnp.float32)

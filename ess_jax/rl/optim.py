"""The optax chain from config: grad-norm clipping, AdamW, linear warmup, then a constant or
cosine-decayed learning rate (optim.schedule); `apply_update`, one optimizer update of a train
state that a non-finite loss or gradient skips."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ess_jax.config.domains import LR_SCHEDULES


def learning_rate_schedule(cfg: Mapping[str, Any]) -> optax.Schedule:
    """Linear warmup to `lr`, then `schedule`: "constant" holds `lr`, "cosine" decays it to
    `lr * final_lr_fraction` at `total_steps`. Any other schedule, or none, is a ValueError (no
    fallback: a misspelt one would silently run another schedule)."""
    schedule = cfg.get("schedule")
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: one of {', '.join(LR_SCHEDULES)}")
    lr, warmup = float(cfg["lr"]), int(cfg.get("warmup_steps", 0))
    total = max(int(cfg.get("total_steps", 1)), warmup + 1)
    final = lr * float(cfg.get("final_lr_fraction", 1.0))
    if schedule == "constant":
        if not warmup:
            return optax.constant_schedule(lr)
        return optax.linear_schedule(0.0, lr, warmup)
    return optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), total, end_value=final)


def make_optimizer(cfg: Mapping[str, Any]) -> optax.GradientTransformation:
    """AdamW with global-norm clipping. `cfg` keys: lr, warmup_steps, total_steps, b1, b2, eps,
    weight_decay, max_grad_norm (0 disables), schedule (LR_SCHEDULES), final_lr_fraction."""
    chain = []
    if float(cfg.get("max_grad_norm", 0.0)) > 0:
        chain.append(optax.clip_by_global_norm(float(cfg["max_grad_norm"])))
    chain.append(
        optax.adamw(
            learning_rate_schedule(cfg),
            b1=float(cfg.get("b1", 0.9)),
            b2=float(cfg.get("b2", 0.999)),
            eps=float(cfg.get("eps", 1e-8)),
            weight_decay=float(cfg.get("weight_decay", 0.0)),
        )
    )
    return optax.chain(*chain)


def apply_update(state, tx: optax.GradientTransformation, loss, grads, lr_scale=None):
    """(new state, grad_norm, ok): one optimizer update of `state` (rl/steps.TrainState),
    skipped (state kept, `nonfinite` counter bumped) if the loss or the gradients are not finite.

    `lr_scale` (a scalar; None: no factor, the update as tx gives it) multiplies the update tx
    returns, i.e. the learning rate of this one step (for AdamW the decoupled weight decay too,
    which optax multiplies by the lr): an objective's metric "lr_scale" (vcpo). Adam divides a
    factor on the gradient out, so the loss cannot carry it."""
    grad_norm = optax.global_norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    grads = jax.tree.map(lambda g: jnp.where(ok, g, 0.0), grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    if lr_scale is not None:
        updates = jax.tree.map(lambda u: u * jnp.asarray(lr_scale, u.dtype), updates)
    ok = ok & jnp.isfinite(optax.global_norm(updates))  # e.g. a NaN learning rate
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    new = state.replace(
        params=keep(params, state.params),
        opt_state=keep(opt_state, state.opt_state),
        step=state.step + ok.astype(jnp.int32),
        nonfinite=jnp.where(ok, 0, state.nonfinite + 1),
    )
    return new, grad_norm, ok

"""The optax chain from config: grad-norm clipping, AdamW, linear warmup, then a constant or
cosine-decayed learning rate (optim.schedule)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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

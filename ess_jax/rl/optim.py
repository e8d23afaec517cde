"""The optax chain from config: grad-norm clipping, AdamW, linear warmup + cosine decay."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optax


def learning_rate_schedule(cfg: Mapping[str, Any]) -> optax.Schedule:
    """Linear warmup to `lr`, then cosine decay to `lr * final_lr_fraction` at `total_steps`."""
    lr, warmup = float(cfg["lr"]), int(cfg.get("warmup_steps", 0))
    total = max(int(cfg.get("total_steps", 1)), warmup + 1)
    final = lr * float(cfg.get("final_lr_fraction", 1.0))
    if cfg.get("schedule", "cosine") == "constant":
        if not warmup:
            return optax.constant_schedule(lr)
        return optax.linear_schedule(0.0, lr, warmup)
    return optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), total, end_value=final)


def make_optimizer(cfg: Mapping[str, Any]) -> optax.GradientTransformation:
    """AdamW with global-norm clipping. `cfg` keys: lr, warmup_steps, total_steps, b1, b2, eps,
    weight_decay, max_grad_norm (0 disables), schedule (cosine | constant), final_lr_fraction."""
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

"""Parts every objective shares: the step statistics (ESS, token and sequence counts), the
per-token context (masking, ratios, aggregation weights), the common metrics and how they
combine over micro-batches, and the PPO clip.

An objective is `loss(logp_BxT, batch, config) -> (loss, metrics)` (losses.py); it starts with
`prepare` and ends with `finish`, so every objective reports the same metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ess_jax.objectives.config import ObjectiveConfig
from ess_jax.objectives.kl import effective_sample_size, get_kl_estimator, kl_k3

Batch = Mapping[str, jax.Array]
Metrics = dict[str, jax.Array]

STAT_KEYS = ("ess", "ess_prox", "num_tokens", "num_seqs")
# clipfrac is logged at a fixed [0.8, 1.2] band so every objective is comparable to PPO.
NOMINAL_CLIP = 0.2
# The metrics every objective reports (`finish`).
METRIC_KEYS = (
    "ess",
    "ratio_mean",
    "ratio_max",
    "capped_frac",
    "clip_frac",
    "kl_behaviour",
    "entropy_proxy",
    "loss",
)
# How metrics of micro-batches combine (scopes.combine_metrics); all other keys are additive.
MAX_METRICS = ("ratio_max", "rescore_err")
CONST_METRICS = ("ess", "ess_prox", "ess_mix")

# ------------------------------------------------------------------ step statistics


def seq_sum(x_BxT: jax.Array, seq_ids_BxT: jax.Array | None) -> jax.Array:
    """Per token, the sum of x over the token's sequence (its row, or its packed segment)."""
    if seq_ids_BxT is None:
        return jnp.broadcast_to(x_BxT.sum(-1, keepdims=True), x_BxT.shape)
    b, t = x_BxT.shape
    ids = (jnp.arange(b)[:, None] * t + seq_ids_BxT.astype(jnp.int32)).reshape(-1)
    sums = jax.ops.segment_sum(x_BxT.reshape(-1), ids, num_segments=b * t)
    return sums[ids].reshape(b, t)


def token_counts(batch: Batch) -> dict[str, jax.Array]:
    """num_tokens and num_seqs (the loss normalisers) of the arrays given; needs only the mask."""
    mask = batch["mask"].astype(bool)
    counts = {"num_tokens": jnp.sum(mask, dtype=jnp.int32).astype(jnp.float32)}
    if batch.get("seq_ids") is None:
        counts["num_seqs"] = jnp.sum(mask.any(-1), dtype=jnp.int32).astype(jnp.float32)
    else:  # each valid token carries 1/len(its sequence): the sum counts sequences.
        maskf = mask.astype(jnp.float32)
        seq_len = jnp.maximum(seq_sum(maskf, batch["seq_ids"]), 1.0)
        counts["num_seqs"] = jnp.round(jnp.sum(maskf / seq_len))
    return counts


def step_statistics(logp_BxT: jax.Array, batch: Batch) -> dict[str, jax.Array]:
    """ess (vs pi_b), ess_prox (if prox_logp), num_tokens and num_seqs of the arrays given."""
    mask = batch["mask"].astype(bool)
    logp = jnp.where(mask, jax.lax.stop_gradient(logp_BxT).astype(jnp.float32), 0.0)
    stats = {"ess": effective_sample_size(logp - batch["behaviour_logp"], mask)}
    stats.update(token_counts(batch))
    if "prox_logp" in batch:
        stats["ess_prox"] = effective_sample_size(logp - batch["prox_logp"], mask)
    return stats


# ------------------------------------------------------------ shared objective parts


class Context(NamedTuple):
    """Per-token quantities of a batch, masked (pads 0), as every objective reads them."""

    mask: jax.Array  # bool
    maskf: jax.Array
    logp: jax.Array  # pads zeroed; carries the gradient
    blogp: jax.Array
    adv: jax.Array
    log_ratio: jax.Array  # logp - blogp, 0 on pads; carries the gradient
    rho: jax.Array
    stats: dict[str, jax.Array]
    loss_w: jax.Array  # per-token aggregation weights (0 on pads)
    metric_w: jax.Array  # per-token weights of token-mean metrics: 1 / global num_tokens


def aux_logp(batch: Batch, key: str, mask: jax.Array, objective: str) -> jax.Array:
    """batch[key] (a log-prob array the objective needs), stop-gradient, float32, pads 0."""
    if key not in batch:
        raise ValueError(f"objective {objective!r} needs batch[{key!r}]")
    return jnp.where(mask, jax.lax.stop_gradient(batch[key]).astype(jnp.float32), 0.0)


def prepare(logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig) -> Context:
    """The per-token context of a batch: statistics the caller supplies win over this batch's."""
    mask = batch["mask"].astype(bool)
    maskf = mask.astype(jnp.float32)
    # Pads may hold anything (0, -inf, garbage): replace them before any arithmetic so neither
    # the value nor the gradient can meet inf * 0 = nan.
    logp = jnp.where(mask, logp_BxT.astype(jnp.float32), 0.0)
    blogp = aux_logp(batch, "behaviour_logp", mask, config.name)
    adv = aux_logp(batch, "advantages", mask, config.name)
    given = {k: jnp.asarray(batch[k], jnp.float32) for k in STAT_KEYS if k in batch}
    # Statistics not supplied by the caller come from this batch (unused ones are DCE'd by XLA).
    stats = jax.lax.stop_gradient({**step_statistics(logp, batch), **given})
    n_tok, n_seq = jnp.maximum(stats["num_tokens"], 1.0), jnp.maximum(stats["num_seqs"], 1.0)
    if config.aggregation == "token_mean":
        loss_w = maskf / n_tok
    elif config.aggregation == "seq_mean_token_mean":
        seq_len = jnp.maximum(seq_sum(maskf, batch.get("seq_ids")), 1.0)
        loss_w = maskf / (seq_len * n_seq)
    elif config.aggregation == "seq_mean_token_sum":
        loss_w = maskf / n_seq
    else:  # Dr.GRPO: a constant (e.g. the max generation length) per sequence
        loss_w = maskf / (n_seq * config.constant_normalizer)
    log_ratio = logp - blogp
    return Context(
        mask, maskf, logp, blogp, adv, log_ratio, jnp.exp(log_ratio), stats, loss_w, maskf / n_tok
    )


def finish(
    c: Context,
    batch: Batch,
    config: ObjectiveConfig,
    loss_BxT: jax.Array,
    pg_BxT: jax.Array,
    capped_BxT: jax.Array,
    extras: Metrics | None = None,
) -> tuple[jax.Array, Metrics]:
    """Adds the optional reference-KL and entropy terms, aggregates, and builds the metrics."""
    sg = jax.lax.stop_gradient
    metrics = dict(extras or {})
    if config.beta_kl:
        ref_logp = aux_logp(batch, "ref_logp", c.mask, config.name)
        kl_ref = get_kl_estimator(config.ref_kl_estimator)(c.logp, ref_logp)
        loss_BxT = loss_BxT + config.beta_kl * kl_ref
        metrics["kl_ref"] = jnp.sum(c.metric_w * sg(kl_ref))
    if config.beta_ent:
        ent = -c.logp if "entropy" not in batch else jnp.where(c.mask, batch["entropy"], 0.0)
        loss_BxT = loss_BxT - config.beta_ent * ent
    loss = jnp.sum(c.loss_w * loss_BxT)
    rho = sg(c.rho)
    outside = (rho > 1.0 + NOMINAL_CLIP) | (rho < 1.0 - NOMINAL_CLIP)
    metrics.update(
        ess=c.stats["ess"],
        ratio_mean=jnp.sum(c.metric_w * rho),
        ratio_max=jnp.max(jnp.where(c.mask, rho, 0.0)),
        capped_frac=jnp.sum(c.metric_w * capped_BxT),
        clip_frac=jnp.sum(c.metric_w * outside),
        kl_behaviour=jnp.sum(c.metric_w * kl_k3(sg(c.logp), c.blogp)),
        entropy_proxy=-jnp.sum(c.metric_w * sg(c.logp)),
        pg_loss=jnp.sum(c.loss_w * sg(pg_BxT)),
        loss=sg(loss),
    )
    return loss, metrics


def ppo_clip(ratio: jax.Array, adv: jax.Array, config: ObjectiveConfig):
    """-min(r A, clip(r) A) and where the clipped branch is strictly active (zero gradient)."""
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high) * adv
    return -jnp.minimum(unclipped, clipped), jax.lax.stop_gradient(clipped < unclipped)

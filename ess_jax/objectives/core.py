"""Parts every objective shares: the step statistics (ESS, token and sequence counts), the
per-token context (masking, ratios, aggregation weights), the common metrics and how they
combine over micro-batches, and the PPO clip.

An objective is `loss(logp_BxT, batch, config) -> (loss, metrics)` (losses.py); it starts with
`prepare` and ends with `finish`, so every objective reports the same metrics.

Two numerical guards hold for every objective (docs/method.md, "Numerical edges"):
- Non-finite log-probs (`kept_mask`): a token of the loss mask whose trainer log-prob, or any
  log-prob the batch carries for it (LOGP_KEYS), is not finite (-inf from a bf16 / fp8 trainer
  or a masked vocabulary) is dropped: it adds nothing to the loss, the gradient, the ESS or any
  metric sum, and per-sequence quantities (lengths, GSPO's sequence ratio, sequence-level IS
  weights) are over the kept tokens. It still counts in the batch normalisers N and S
  (`token_counts`, from the loss mask alone): the "step" and "microbatch" scopes must know them
  before any forward (scopes.py), so they cannot depend on the log-probs. Metric
  `nonfinite_frac`: the dropped share of N.
- Ratio overflow (`ratio`): every importance ratio is exp(clip(log ratio, -20, 20)), as verl
  clamps its log-ratio before exp (`core_algos.compute_policy_loss_vanilla`). Nothing changes
  for |log ratio| < 20; beyond, the ratio is e^+-20 and its gradient through the clip is 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ess_jax.objectives.config import ObjectiveConfig
from ess_jax.objectives.kl import K3_EXP_CLAMP, effective_sample_size, get_kl_estimator, kl_k3

Batch = Mapping[str, jax.Array]
Metrics = dict[str, jax.Array]

STAT_KEYS = ("ess", "ess_prox", "num_tokens", "num_seqs")
# Log-prob arrays a batch may carry for its tokens: a token whose value in any of them present
# (or whose trainer log-prob) is not finite is dropped (`kept_mask`).
LOGP_KEYS = ("behaviour_logp", "prox_logp", "ref_logp")
# verl's clamp of a log importance ratio before exp (core_algos.compute_policy_loss_vanilla):
# exp(20) ~ 4.9e8 keeps ratio * advantage and its gradient far from float32 overflow (exp(89)).
LOG_RATIO_CLAMP = 20.0
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
    "nonfinite_frac",
    "lr_beyond_clamp_low",
    "lr_beyond_clamp_high",
    "loss",
)
# Train/sampler mismatch of a whole update batch (`mismatch_metrics`); rl/train.py reports a
# batch's first update, where pi_theta is the policy that sampled it (with lag 0).
MISMATCH_KEYS = ("logratio_p95", "logratio_max", "frac_outside_clip", "seq_logratio_mean")
# How metrics of micro-batches combine (scopes.combine_metrics); all other keys are additive.
MAX_METRICS = ("ratio_max", "rescore_err")
CONST_METRICS = ("ess", "ess_prox", "ess_mix", "ess_seq", "lr_scale")

# ------------------------------------------------------------------ step statistics


def seq_sum(x_BxT: jax.Array, seq_ids_BxT: jax.Array | None) -> jax.Array:
    """Per token, the sum of x over the token's sequence (its row, or its packed segment)."""
    if seq_ids_BxT is None:
        return jnp.broadcast_to(x_BxT.sum(-1, keepdims=True), x_BxT.shape)
    b, t = x_BxT.shape
    ids = (jnp.arange(b)[:, None] * t + seq_ids_BxT.astype(jnp.int32)).reshape(-1)
    sums = jax.ops.segment_sum(x_BxT.reshape(-1), ids, num_segments=b * t)
    return sums[ids].reshape(b, t)


def kept_mask(logp_BxT: jax.Array, batch: Batch) -> jax.Array:
    """The loss mask less the tokens whose trainer log-prob, or whose value in a log-prob array
    of the batch (LOGP_KEYS present), is not finite: the tokens every sum runs over."""
    keep = batch["mask"].astype(bool) & jnp.isfinite(logp_BxT)
    for key in LOGP_KEYS:
        if key in batch:
            keep = keep & jnp.isfinite(batch[key])
    return keep


def ratio(log_ratio: jax.Array) -> jax.Array:
    """An importance ratio exp(log_ratio), its log clamped to [-20, 20] (LOG_RATIO_CLAMP, as
    verl): identical for |log_ratio| < 20, finite with a zero gradient beyond."""
    return jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def token_counts(batch: Batch) -> dict[str, jax.Array]:
    """num_tokens and num_seqs (the loss normalisers) of the arrays given; needs only the mask
    (tokens with non-finite log-probs count: `kept_mask` drops them from the sums only)."""
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
    """ess (vs pi_b), ess_prox (if prox_logp), num_tokens and num_seqs of the arrays given. The
    ESS values are over the kept tokens (`kept_mask`, as the loss), the counts over the mask."""
    logp = jax.lax.stop_gradient(logp_BxT).astype(jnp.float32)
    keep = kept_mask(logp, batch)
    logp = jnp.where(keep, logp, 0.0)
    stats = {"ess": effective_sample_size(logp - batch["behaviour_logp"], keep)}
    stats.update(token_counts(batch))
    if "prox_logp" in batch:
        stats["ess_prox"] = effective_sample_size(logp - batch["prox_logp"], keep)
    return stats


def masked_percentile(x_BxT: jax.Array, keep_BxT: jax.Array, q: float) -> jax.Array:
    """The q-th percentile of x over the kept entries, exactly as numpy's default (linear
    interpolation between the two nearest ranks); 0 when nothing is kept. One sort of the
    B x T entries."""
    n = jnp.sum(keep_BxT, dtype=jnp.int32)
    flat = jnp.where(keep_BxT, x_BxT.astype(jnp.float32), -jnp.inf).reshape(-1)
    ordered = jnp.sort(flat)  # the dropped entries (-inf) first
    pos = (q / 100.0) * jnp.maximum(n - 1, 0).astype(jnp.float32)
    lo = jnp.floor(pos).astype(jnp.int32)
    hi = jnp.minimum(lo + 1, jnp.maximum(n - 1, 0))
    start = flat.shape[0] - n
    v_lo, v_hi = ordered[start + lo], ordered[start + hi]
    value = v_lo + (pos - lo.astype(jnp.float32)) * (v_hi - v_lo)
    return jnp.where(n > 0, value, 0.0)


def mismatch_metrics(logp_BxT: jax.Array, batch: Batch) -> dict[str, jax.Array]:
    """How far the trainer's log-probs are from the recorded pi_b on the batch's kept tokens:
    logratio_p95 and logratio_max of |log(pi_theta / pi_b)|, frac_outside_clip (the share of
    the loss mask's tokens with the ratio outside [0.8, 1.2], NOMINAL_CLIP) and
    seq_logratio_mean (a sequence's summed log-ratio, the log of its sequence-level ratio,
    averaged over sequences). Statistics only: no gradient flows through them."""
    logp = jax.lax.stop_gradient(logp_BxT).astype(jnp.float32)
    keep = kept_mask(logp, batch)
    log_ratio = jnp.where(keep, logp - batch["behaviour_logp"].astype(jnp.float32), 0.0)
    counts = token_counts(batch)
    rho = ratio(log_ratio)
    outside = keep & ((rho > 1.0 + NOMINAL_CLIP) | (rho < 1.0 - NOMINAL_CLIP))
    return {
        "logratio_p95": masked_percentile(jnp.abs(log_ratio), keep, 95.0),
        "logratio_max": jnp.max(jnp.abs(log_ratio)),
        "frac_outside_clip": jnp.sum(outside) / jnp.maximum(counts["num_tokens"], 1.0),
        "seq_logratio_mean": jnp.sum(log_ratio) / jnp.maximum(counts["num_seqs"], 1.0),
    }


def split_microbatches(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [M, B / M, ...], strided micro-batches (rows m, m + M, ...): with the batch
    sharded over "data", every micro-batch keeps rows on every device, so no resharding happens
    inside a scan over them."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def merge_microbatches(x_M: jax.Array) -> jax.Array:
    """The inverse of `split_microbatches`: rows back in their batch order."""
    return x_M.swapaxes(0, 1).reshape(-1, *x_M.shape[2:])


# ------------------------------------------------------------ shared objective parts


class Context(NamedTuple):
    """Per-token quantities of a batch, masked (pads and dropped tokens 0), as every objective
    reads them."""

    mask: jax.Array  # bool: the kept tokens (`kept_mask`: the loss mask less non-finite ones)
    maskf: jax.Array
    logp: jax.Array  # pads zeroed; carries the gradient
    blogp: jax.Array
    adv: jax.Array
    log_ratio: jax.Array  # logp - blogp, 0 on pads; carries the gradient
    rho: jax.Array
    stats: dict[str, jax.Array]
    loss_w: jax.Array  # per-token aggregation weights (0 on pads and dropped tokens)
    metric_w: jax.Array  # per-token weights of token-mean metrics: 1 / global num_tokens
    dropped: jax.Array  # float: tokens of the loss mask that `kept_mask` drops


def aux_logp(batch: Batch, key: str, mask: jax.Array, objective: str) -> jax.Array:
    """batch[key] (a log-prob array the objective needs), stop-gradient, float32, pads 0."""
    if key not in batch:
        raise ValueError(f"objective {objective!r} needs batch[{key!r}]")
    return jnp.where(mask, jax.lax.stop_gradient(batch[key]).astype(jnp.float32), 0.0)


def prepare(logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig) -> Context:
    """The per-token context of a batch: statistics the caller supplies win over this batch's."""
    logp_BxT = logp_BxT.astype(jnp.float32)
    # Kept tokens: the loss mask less those with a non-finite log-prob (module docstring).
    mask = kept_mask(logp_BxT, batch)
    maskf = mask.astype(jnp.float32)
    # Pads and dropped tokens may hold anything (0, -inf, garbage): replace them before any
    # arithmetic so neither the value nor the gradient can meet inf * 0 = nan.
    logp = jnp.where(mask, logp_BxT, 0.0)
    blogp = aux_logp(batch, "behaviour_logp", mask, config.name)
    adv = aux_logp(batch, "advantages", mask, config.name)
    given = {k: jnp.asarray(batch[k], jnp.float32) for k in STAT_KEYS if k in batch}
    # Statistics not supplied by the caller come from this batch (unused ones are DCE'd by XLA).
    stats = jax.lax.stop_gradient({**step_statistics(logp_BxT, batch), **given})
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
    dropped = batch["mask"].astype(bool) & ~mask
    return Context(
        mask,
        maskf,
        logp,
        blogp,
        adv,
        log_ratio,
        ratio(log_ratio),
        stats,
        loss_w,
        maskf / n_tok,
        dropped.astype(jnp.float32),
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
    # Where k3's exponent is clamped (kl.K3_EXP_CLAMP): below -10 its gradient has the wrong sign.
    log_ratio = sg(c.log_ratio)
    metrics.update(
        ess=c.stats["ess"],
        ratio_mean=jnp.sum(c.metric_w * rho),
        ratio_max=jnp.max(jnp.where(c.mask, rho, 0.0)),
        capped_frac=jnp.sum(c.metric_w * capped_BxT),
        clip_frac=jnp.sum(c.metric_w * outside),
        kl_behaviour=jnp.sum(c.metric_w * kl_k3(sg(c.logp), c.blogp)),
        entropy_proxy=-jnp.sum(c.metric_w * sg(c.logp)),
        nonfinite_frac=jnp.sum(c.dropped) / jnp.maximum(c.stats["num_tokens"], 1.0),
        lr_beyond_clamp_low=jnp.sum(c.metric_w * (log_ratio < -K3_EXP_CLAMP)),
        lr_beyond_clamp_high=jnp.sum(c.metric_w * (log_ratio > K3_EXP_CLAMP)),
        pg_loss=jnp.sum(c.loss_w * sg(pg_BxT)),
        loss=sg(loss),
    )
    return loss, metrics


def ppo_clip(ratio: jax.Array, adv: jax.Array, config: ObjectiveConfig):
    """-min(r A, clip(r) A) and where the clipped branch is strictly active (zero gradient)."""
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high) * adv
    return -jnp.minimum(unclipped, clipped), jax.lax.stop_gradient(clipped < unclipped)

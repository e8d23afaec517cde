"""Newer train/inference-mismatch baselines: DPPO's trust region anchored to pi_b (prime-rl's
default loss), IcePop's token mask, and verl's sequence-level masked IS (Seq-MIS) and geometric
rejection (Geo-RS). Each is re-derived from its source's equations; docs/method.md has the table.

Axis alphabet: B batch (sequences / packed rows), T time.

Every loss follows losses.py's contract: `loss(logp_BxT, batch, config) -> (loss, metrics)`,
`core.prepare` first and `core.finish` last (so the shared metrics and the aggregation are
those of every objective), and a masked or rejected token keeps its place in the normalisers
N and S (they come from the loss mask alone, core.py's docstring). IcePop, Seq-MIS and Geo-RS
take their weight w = pi_old / pi_b from the proximal snapshot (`batch["prox_logp"]`, the
trainer's re-score before the first update, the "old" policy of their sources' decoupled
mode) and multiply it onto PPO's clip against pi_old, as grpo_tis / grpo_mis do; DPPO reads
pi_b only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ess_jax.objectives.config import ObjectiveConfig
from ess_jax.objectives.core import (
    Batch,
    Context,
    Metrics,
    aux_logp,
    finish,
    ppo_clip,
    prepare,
    ratio,
    seq_sum,
)


def dppo(logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig) -> tuple[jax.Array, Metrics]:
    """DPPO-Binary-TV with a squared log-ratio penalty: prime-rl's default RL loss.

    Sources: Qi et al., "Rethinking the Trust Region in LLM Reinforcement Learning" (arXiv
    2602.04879), as prime-rl codes it: `src/prime_rl/trainer/rl/loss.py:default_loss_fn` and its
    knobs `DefaultLossConfig` (`packages/prime-rl-configs/src/prime_rl/configs/trainer.py`),
    PrimeIntellect-ai/prime-rl at commit 559b44772e47 (2026-08-21). Per token, with
    p = pi_theta(y_t), mu = pi_b(y_t) (the binary TV of the sampled token is |p - mu|):

        masked_t = (p - mu > dppo_mask_high)   if A_t > 0
                   (p - mu < -dppo_mask_low)   otherwise
        loss_t   = -(1 - masked_t) A_t rho_t + dppo_kl_tau (log rho_t)^2

    rho_t carries the gradient (-A rho grad logp where kept), the mask does not; the penalty
    (prime-rl's Kimi-K2.5 term) runs over every token, masked or not. Defaults 0.2 / 0.2 / 1e-3
    (prime-rl's). prime-rl sums and divides by the step's loss-token count: aggregation
    "token_mean", masked tokens in N. Differences: rho is `core.ratio` (log clamped at +-20;
    prime-rl's exp is unclamped) and prime-rl's `adv_tau` (1) is left out. Metrics:
    `capped_frac` the masked share, `tv_mean` the token mean of |p - mu|."""
    c = prepare(logp_BxT, batch, config)
    sg = jax.lax.stop_gradient
    # probabilities <= 1: exp(min(log p, 0)), so a log-prob above 0 cannot overflow
    diff = sg(jnp.exp(jnp.minimum(c.logp, 0.0)) - jnp.exp(jnp.minimum(c.blogp, 0.0)))
    masked = jnp.where(c.adv > 0, diff > config.dppo_mask_high, diff < -config.dppo_mask_low)
    masked = masked & c.mask
    pg = -jnp.where(masked, 0.0, c.rho * c.adv)
    penalty = config.dppo_kl_tau * jnp.square(c.log_ratio)
    extras = {"tv_mean": jnp.sum(c.metric_w * jnp.abs(diff))}
    return finish(c, batch, config, pg + penalty, pg, masked, extras)


def _banded_ppo(
    c: Context,
    batch: Batch,
    config: ObjectiveConfig,
    old: jax.Array,
    log_stat: jax.Array,
    band: tuple[float, float],
    weighted: bool,
) -> tuple[jax.Array, Metrics]:
    """-sg(M) min(r A, clip(r) A), r = pi / pi_old: M = exp(log_stat) (weighted) or 1 where
    band[0] <= exp(log_stat) <= band[1] (compared in log space; band[0] = 0: no lower edge),
    M = 0 outside. Rejected tokens keep their place in N."""
    low, high = band
    lo = jnp.log(low) if low > 0 else -jnp.inf
    inside = (log_stat >= lo) & (log_stat <= jnp.log(high)) & c.mask
    weight = jax.lax.stop_gradient(jnp.where(inside, ratio(log_stat) if weighted else 1.0, 0.0))
    clip_loss, capped = ppo_clip(ratio(c.logp - old), c.adv, config)
    pg = weight * clip_loss
    extras = {
        "ess_prox": c.stats["ess_prox"],
        "behaviour_weight_mean": jnp.sum(c.metric_w * weight),
        "behaviour_capped_frac": jnp.sum(c.metric_w * (c.mask & ~inside)),
    }
    return finish(c, batch, config, pg, pg, capped, extras)


def _old_log_weight(c: Context, batch: Batch, config: ObjectiveConfig):
    """pi_old (batch["prox_logp"], pads 0) and log w_t = log(pi_old / pi_b) on the kept tokens."""
    old = aux_logp(batch, "prox_logp", c.mask, config.name)
    return old, (old - c.blogp) * c.maskf


def icepop(logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig) -> tuple[jax.Array, Metrics]:
    """IcePop: PPO's clip against pi_old times M(w_t) = w_t inside [icepop_low, icepop_high],
    0 outside, w_t = pi_old(y_t) / pi_b(y_t) per token (stop-gradient).

    Sources: Ling Team, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
    Thinking Model" (arXiv 2510.18855), as OpenRLHF codes it (`openrlhf/models/loss.py:
    PolicyLoss.forward`, `vllm_is_correction_type == "icepop"`; band
    `--algo.advantage.is_correction_threshold`, default 0.5 5.0 in `openrlhf/cli/
    train_ppo_ray.py`; OpenRLHF/OpenRLHF at commit 3c3be6234e0c) and slime
    (`slime/backends/megatron_utils/loss.py:icepop_function`, band `--tis-clip-low` /
    `--tis-clip`; THUDM/slime at commit 624b824a898a). Both keep the ratio inside the band
    (they multiply the PPO loss by w_t, not by 1) and test it inclusively. Defaults 0.5 / 5
    (OpenRLHF's, the paper's). The same loss as grpo_mis at is_level "token" with the band
    [0.5, 5]; its own record so the name carries IcePop's band."""
    c = prepare(logp_BxT, batch, config)
    old, log_w = _old_log_weight(c, batch, config)
    band = (config.icepop_low, config.icepop_high)
    return _banded_ppo(c, batch, config, old, log_w, band, weighted=True)


def seq_mis(
    logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig
) -> tuple[jax.Array, Metrics]:
    """Sequence-level masked IS (Seq-MIS): PPO's clip against pi_old times the sequence weight
    w_i = prod_t pi_old / pi_b (exp of the summed log-ratio over the sequence's kept tokens)
    where seq_mis_low <= w_i <= seq_mis_high, 0 (the sequence rejected) outside.

    Source: verl's rollout correction, preset `RolloutCorrectionConfig.decoupled_seq_is_rs`
    (`verl/trainer/config/algorithm.py`: rollout_is "sequence", rollout_is_threshold 2.0,
    rollout_rs "seq_sum_k1", rollout_rs_threshold "0.5_2.0") and
    `verl/trainer/ppo/rollout_corr_helper.py` (`compute_rollout_correction_weights`,
    `compute_rollout_rejection_mask`), volcengine/verl at commit b178a3cd56f5 (2026-01-29);
    after Liu et al., "When Speed Kills Stability" (richardli.xyz/rl-collapse). Defaults
    0.5 / 2 (verl's). Differences: verl truncates the weight at rollout_is_threshold apart from
    the rejection band (the same 2.0 in the preset, so inactive there; here one band does both);
    verl's "k1" bounds apply to -log w, i.e. to 1 / w (the same band when low = 1 / high, as
    at its defaults); verl's decoupled mode removes rejected tokens from the token-mean
    denominator, here they stay in N (house rule). The same loss as grpo_mis at is_level
    "sequence" with the band [0.5, 2]."""
    c = prepare(logp_BxT, batch, config)
    old, log_w = _old_log_weight(c, batch, config)
    log_seq = seq_sum(log_w, batch.get("seq_ids"))
    band = (config.seq_mis_low, config.seq_mis_high)
    return _banded_ppo(c, batch, config, old, log_seq, band, weighted=True)


def geo_rs(logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig) -> tuple[jax.Array, Metrics]:
    """Geometric rejection sampling (Geo-RS): PPO's clip against pi_old on the sequences whose
    geometric-mean weight g_i = exp(mean_t log(pi_old / pi_b)) (over the sequence's kept tokens)
    lies in [geo_rs_low, geo_rs_high]; rejected sequences get weight 0, kept ones weight 1 (no
    IS weight).

    Source: verl's rollout correction, preset `RolloutCorrectionConfig.decoupled_geo_rs`
    (`verl/trainer/config/algorithm.py`: rollout_is None, rollout_rs "seq_mean_k1",
    rollout_rs_threshold "0.999_1.001") and `verl/trainer/ppo/rollout_corr_helper.py:
    compute_rollout_rejection_mask`, volcengine/verl at commit b178a3cd56f5 (2026-01-29).
    Defaults 0.999 / 1.001 (verl's: a +-0.1% band, which rejects most sequences of a
    low-precision sampler). Differences: verl's "k1" bounds apply to -mean log w, i.e. to 1 / g
    (at its defaults a band [1 / 1.001, 1 / 0.999] on g, 1e-6 away); rejected tokens stay in
    N (verl's decoupled mode drops them from the token-mean denominator)."""
    c = prepare(logp_BxT, batch, config)
    old, log_w = _old_log_weight(c, batch, config)
    seq_ids = batch.get("seq_ids")
    log_geo = seq_sum(log_w, seq_ids) / jnp.maximum(seq_sum(c.maskf, seq_ids), 1.0)
    band = (config.geo_rs_low, config.geo_rs_high)
    return _banded_ppo(c, batch, config, old, log_geo, band, weighted=False)

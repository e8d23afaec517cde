"""The policy losses: the ESS objective (P3O), its dual anchor, and the baselines.

Axis alphabet: B batch (sequences / packed rows), T time.

Each is `loss(logp_BxT, batch, config) -> (loss, metrics)`, registered with its facts in
registry.py. `logp_BxT` is the trainer's float32 log-prob of the sampled tokens (it carries the
gradient) and `batch` holds
  behaviour_logp, advantages, mask      [B, T]  (required; mask bool or float)
  prox_logp, ref_logp, entropy          [B, T]  (optional)
  kl_full, rescored_behaviour_logp      [B, T]  (p3o with kl_estimator "full": sampling/rescore.py)
  seq_ids                               [B, T]  int, index in [0, T) of a packed sequence in its row
  ess, ess_prox, num_tokens, num_seqs   scalars (optional step statistics, core.step_statistics)
Every importance ratio is `core.ratio` (log clamped to [-20, 20], as verl) and every sum runs over
`core.kept_mask`'s tokens (non-finite log-probs dropped); core.py's docstring says both rules.
A loss is a SUM over the tokens given divided by normalisers from the step statistics. When the
normalisers (num_tokens, num_seqs) describe the whole optimizer batch, the losses, gradients and
additive metrics of micro-batches add up to the batch's; the ESS scopes (scopes.py, and the RL
update's gradient loop, rl/accumulate.py) rely on this to apply ObjectiveConfig.ess_scope.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ess_jax.objectives.config import FULL_KL, ObjectiveConfig
from ess_jax.objectives.core import (
    Batch,
    Metrics,
    aux_logp,
    finish,
    ppo_clip,
    prepare,
    ratio,
    seq_sum,
)
from ess_jax.objectives.kl import get_kl_estimator


def p3o(logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig) -> tuple[jax.Array, Metrics]:
    """-sg(min(rho, e)) logp A + (1 - e) KL(pi || pi_b): no hyper-parameters (docs/method.md)."""
    c = prepare(logp_BxT, batch, config)
    ess = c.stats["ess"]
    weight = c.rho if config.p3o_drop_cap else jnp.minimum(c.rho, ess)
    pg = -jax.lax.stop_gradient(weight) * c.logp * c.adv
    kl_w = 0.0 if config.p3o_drop_kl else 1.0 - ess
    if config.kl_estimator == FULL_KL:
        kl, extras = _full_kl(c, batch)
    else:
        kl, extras = get_kl_estimator(config.kl_estimator)(c.logp, c.blogp), None
    capped = jnp.zeros_like(c.mask) if config.p3o_drop_cap else c.rho > ess
    return finish(c, batch, config, pg + kl_w * kl, pg, capped, extras)


def _full_kl(c, batch: Batch) -> tuple[jax.Array, Metrics]:
    """batch["kl_full"] (it carries pi's gradient) and its metrics: the token mean, and the
    largest gap between the re-scored and the recorded log pi_b(y_t) (float32 rounding, ~1e-6,
    unless the re-score is not the distribution the sampler drew from)."""
    if "kl_full" not in batch:
        raise ValueError(
            "kl_estimator='full' needs batch['kl_full'], the train step's re-score of pi_b "
            "(ess_jax/sampling/rescore.py)"
        )
    kl = jnp.where(c.mask, batch["kl_full"].astype(jnp.float32), 0.0)
    gap = jnp.abs(aux_logp(batch, "rescored_behaviour_logp", c.mask, "p3o") - c.blogp)
    sg = jax.lax.stop_gradient
    return kl, {"kl_behaviour_full": jnp.sum(c.metric_w * sg(kl)), "rescore_err": jnp.max(gap)}


def p3o_dual(
    logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig
) -> tuple[jax.Array, Metrics]:
    """Dual anchor (P4O): caps at min(e_b, e_prox); "two_kl" or "mixture" trust region."""
    c = prepare(logp_BxT, batch, config)
    prox = aux_logp(batch, "prox_logp", c.mask, config.name)
    kl_fn = get_kl_estimator(config.kl_estimator)
    e_b, e_p = c.stats["ess"], c.stats["ess_prox"]
    e_mix = jnp.minimum(e_b, e_p)
    pg = -jax.lax.stop_gradient(jnp.minimum(c.rho, e_mix)) * c.logp * c.adv
    if config.dual_version == "two_kl":
        trust = (1.0 - e_b) * kl_fn(c.logp, c.blogp) + (1.0 - e_p) * kl_fn(c.logp, prox)
    else:
        w_b, w_p = jnp.maximum(0.0, 1.0 - e_b), jnp.maximum(0.0, 1.0 - e_p)
        gate = (1.0 - e_mix) > config.dual_kl_gate
        # 1e-30 (reference eps_log) keeps log finite when one weight is 0; the live anchor then
        # dominates. With the gate closed, w_b + w_p may be 0: divide by 1 instead (term is 0).
        log_mix = jnp.logaddexp(
            jnp.log(w_b + 1e-30) + c.blogp, jnp.log(w_p + 1e-30) + prox
        ) - jnp.log(jnp.where(gate, w_b + w_p, 1.0))
        trust = jnp.where(gate, 1.0 - e_mix, 0.0) * kl_fn(c.logp, log_mix)
    extras = {"ess_prox": e_p, "ess_mix": e_mix}
    return finish(c, batch, config, pg + trust, pg, c.rho > e_mix, extras)


def grpo(logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig) -> tuple[jax.Array, Metrics]:
    """PPO clip: -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A). Also DAPO's loss."""
    c = prepare(logp_BxT, batch, config)
    pg, capped = ppo_clip(c.rho, c.adv, config)
    return finish(c, batch, config, pg, pg, capped)


def cispo(logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig) -> tuple[jax.Array, Metrics]:
    """-sg(clip(rho, 1 - eps_low, 1 + eps_high)) logp A (two-sided clip, as the reference code)."""
    c = prepare(logp_BxT, batch, config)
    lo, hi = 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high
    pg = -jax.lax.stop_gradient(jnp.clip(c.rho, lo, hi)) * c.logp * c.adv
    return finish(c, batch, config, pg, pg, (c.rho > hi) | (c.rho < lo))


def _gspo(logp_BxT, batch, config, token_level: bool):
    c = prepare(logp_BxT, batch, config)
    seq_ids = batch.get("seq_ids")
    seq_len = jnp.maximum(seq_sum(c.maskf, seq_ids), 1.0)
    seq_log_ratio = seq_sum(c.log_ratio * c.maskf, seq_ids) / seq_len  # length-normalised
    if token_level:  # s_i,t = sg(s_i) * pi / sg(pi): per-token advantages allowed
        sg = jax.lax.stop_gradient
        seq_log_ratio = sg(seq_log_ratio) + c.logp - sg(c.logp)
    pg, capped = ppo_clip(ratio(seq_log_ratio), c.adv, config)
    return finish(c, batch, config, pg, pg, capped)


def gspo(logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig) -> tuple[jax.Array, Metrics]:
    """GSPO: PPO clip on the sequence ratio exp(mean_t log rho); the GSPO paper's aggregation
    is seq_mean_token_mean (the reference code uses the global token mean)."""
    return _gspo(logp_BxT, batch, config, token_level=False)


def gspo_token(
    logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig
) -> tuple[jax.Array, Metrics]:
    """GSPO-token: same value and (for per-sequence A) same gradient as GSPO."""
    return _gspo(logp_BxT, batch, config, token_level=True)


def decoupled_ppo(
    logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig
) -> tuple[jax.Array, Metrics]:
    """-w min(r A, clip(r) A), r = pi / pi_prox, w = pi_prox / pi_b (capped if configured)."""
    c = prepare(logp_BxT, batch, config)
    prox = aux_logp(batch, "prox_logp", c.mask, config.name)
    weight = ratio(prox - c.blogp)
    weight_capped = jnp.zeros_like(c.mask)
    if config.behaviour_weight_cap is not None:
        weight_capped = weight > config.behaviour_weight_cap
        weight = jnp.minimum(weight, config.behaviour_weight_cap)
    clip_loss, capped = ppo_clip(ratio(c.logp - prox), c.adv, config)
    pg = weight * clip_loss
    extras = {
        "ess_prox": c.stats["ess_prox"],
        "behaviour_weight_mean": jnp.sum(c.metric_w * weight),
        "behaviour_capped_frac": jnp.sum(c.metric_w * weight_capped),
    }
    return finish(c, batch, config, pg, pg, capped, extras)


def _truncated_is(logp_BxT, batch, config, masked: bool):
    """GRPO's clip against pi_old (the trainer's re-score before the first update, batch
    "prox_logp") times the stop-gradient behaviour weight w = pi_old / pi_b: truncated at
    is_cap (TIS) or masked outside [is_cap_low, is_cap] (MIS); per token or per sequence
    (w = prod_t over the sequence, computed in log space). With is_veto > 0 a sequence any of
    whose tokens has w_t < is_veto gets weight 0, per token whatever is_level (verl's
    rollout_is_veto_threshold, applied in both modes). Masked and vetoed tokens keep their
    place in N."""
    c = prepare(logp_BxT, batch, config)
    old = aux_logp(batch, "prox_logp", c.mask, config.name)
    log_w_token = (old - c.blogp) * c.maskf
    log_w = log_w_token
    if config.is_level == "sequence":
        log_w = seq_sum(log_w_token, batch.get("seq_ids"))
    log_cap = jnp.log(config.is_cap)
    if masked:
        low = jnp.log(config.is_cap_low) if config.is_cap_low > 0 else -jnp.inf
        outside = (log_w > log_cap) | (log_w < low)
        weight = jnp.where(outside, 0.0, jnp.exp(jnp.minimum(log_w, log_cap)))
    else:
        outside = log_w > log_cap
        weight = jnp.exp(jnp.minimum(log_w, log_cap))
    if config.is_veto > 0:
        below = ((log_w_token < jnp.log(config.is_veto)) & c.mask).astype(jnp.float32)
        vetoed = seq_sum(below, batch.get("seq_ids")) > 0
        outside = outside | vetoed
        weight = jnp.where(vetoed, 0.0, weight)
    weight = jax.lax.stop_gradient(jnp.where(c.mask, weight, 0.0))
    clip_loss, capped = ppo_clip(ratio(c.logp - old), c.adv, config)
    pg = weight * clip_loss
    extras = {
        "ess_prox": c.stats["ess_prox"],
        "behaviour_weight_mean": jnp.sum(c.metric_w * weight),
        "behaviour_capped_frac": jnp.sum(c.metric_w * (outside & c.mask)),
    }
    return finish(c, batch, config, pg, pg, capped, extras)


def grpo_tis(
    logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig
) -> tuple[jax.Array, Metrics]:
    """GRPO with truncated importance sampling: -min(w, C) min(r A, clip(r) A), r = pi / pi_old."""
    return _truncated_is(logp_BxT, batch, config, masked=False)


def grpo_mis(
    logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig
) -> tuple[jax.Array, Metrics]:
    """GRPO with masked importance sampling: tokens (sequences) whose w leaves the band drop out.
    Defaults keep [0, is_cap] and no veto; verl's are [1 / is_cap, is_cap] and (in its
    configs) a 1e-4 sequence veto: `is_cap_low=0.5, is_veto=1e-4` at is_cap 2."""
    return _truncated_is(logp_BxT, batch, config, masked=True)


def m2po_mask(log_ratio: jax.Array, mask: jax.Array, threshold: float) -> jax.Array:
    """M2PO's second-moment mask: the kept tokens less the fewest largest-(log rho)^2 ones whose
    removal brings the mean (log rho)^2 of the rest strictly under `threshold`; if no such set
    leaves a token, only the token with the smallest (log rho)^2 is kept (AReaL's
    `get_m2po_loss_mask`: its `num_to_mask = n - 1`). Over the arrays given. Stop-gradient."""
    m2 = jnp.where(mask, jnp.square(jax.lax.stop_gradient(log_ratio)), -1.0).reshape(-1)
    order = jnp.argsort(-m2, stable=True)  # kept tokens first, largest (log rho)^2 first
    sorted_m2 = jnp.where(m2[order] >= 0.0, m2[order], 0.0)
    n = jnp.sum(mask, dtype=jnp.int32)
    i = jnp.arange(m2.size)
    # mean of the sorted suffix [i, n): the tokens left after masking the first i
    before = jnp.cumsum(sorted_m2) - sorted_m2
    suffix_mean = (jnp.sum(sorted_m2) - before) / jnp.maximum(n - i, 1).astype(jnp.float32)
    below = (i < n) & (suffix_mean < threshold)
    num_masked = jnp.where(below.any(), jnp.argmax(below), n - 1)
    rank = jnp.zeros_like(i).at[order].set(i)
    return mask & (rank >= num_masked).reshape(mask.shape)


def m2po(logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig) -> tuple[jax.Array, Metrics]:
    """M2PO (Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with
    Stale Data on LLMs?"), as AReaL documents it (docs/en/algorithms/m2po.md) and codes its mask
    (its PPO actor's `get_m2po_loss_mask`; `actor.m2_threshold`, 0.04 in
    examples/math/gsm8k_m2po.yaml): -M_t rho_t A_t, no clip (the documented objective). M_t
    (`m2po_mask`) drops the tokens with the largest M2_t = (log rho_t)^2 until the rest's mean
    M2 is under m2_threshold.
    Differences: rho and M2 are against the recorded pi_b (AReaL's mask uses pi_prox - pi_b, its
    ratio pi_theta / pi_prox with decoupled PPO; the documented formula's M2 is log pi_theta /
    pi_behav); the mask is over the arrays given (a micro-batch, as AReaL's loss function);
    masked tokens keep their place in N (AReaL divides by the unmasked count). The "mask" form
    of `objective.m2po_form`; m2po_forms.py runs the others as AReaL and the authors do."""
    c = prepare(logp_BxT, batch, config)
    keep = m2po_mask(c.log_ratio, c.mask, config.m2_threshold)
    pg = -jnp.where(keep, c.rho * c.adv, 0.0)
    masked = c.mask & ~keep
    m2 = jnp.square(jax.lax.stop_gradient(c.log_ratio))
    extras = {"m2": jnp.sum(c.metric_w * m2)}  # token mean of (log rho)^2 before the mask
    return finish(c, batch, config, pg, pg, masked, extras)


def reinforce(
    logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig
) -> tuple[jax.Array, Metrics]:
    """Plain on-policy REINFORCE: -logp A (no importance weight)."""
    c = prepare(logp_BxT, batch, config)
    pg = -c.logp * c.adv
    return finish(c, batch, config, pg, pg, jnp.zeros_like(c.mask))

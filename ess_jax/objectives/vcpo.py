"""VCPO: Variance Controlled Policy Optimization (Huang, Zhang, Hu, Yang, Han, "Stable Asynchrony:
Variance-Controlled Off-Policy RL for LLMs", arXiv 2602.17616; code github.com/mit-han-lab/vcpo).

Axis alphabet: B rows (one sequence each), T time, M micro-batches, G group, Ng groups.

Its two parts act outside a per-token loss, so VCPO is a loss (`vcpo`) plus a pass over the
whole optimizer batch before the gradients (`batch_pass`, run by the RL update,
rl/update.step_loss_and_grad, for the objectives whose record names one). With
w_i = pi_theta(y_i) / pi_b(y_i) the sequence importance weight (exp of the sum of the kept
tokens' log rho, pi_theta the params of this update, stop-gradient):
- ESS-guided step size (paper eq. for eta_eff; their `megatron_actor.py`
  `_optimizer_step_with_buffer`, `ess_scaling` with `scaling_rule="sqrt"`): the update's
  learning rate is multiplied by lr_scale = sqrt(min(1, (ESS / B) / vcpo_base_ess_ratio)),
  ESS = (sum_i w_i)^2 / sum_i w_i^2 over the B sequences of the update (their
  `staleness_utils.compute_ess_info`, unclipped w: `use_clipped=False`). The loss reports
  `lr_scale` as a metric and rl/optim.apply_update multiplies the optimizer's update by it:
  AdamW's update is lr (m / (sqrt(v) + eps) + weight_decay p), so this scales the decoupled
  weight decay too, as their code does by setting the optimizer's lr for the step. A factor on the
  loss would not do it: Adam divides it out.
- Off-policy optimal baseline, OPOB (the paper's b* = sum_i W_i R_i / sum_i W_i with
  W_i = w_i^2 ||grad_theta log pi_theta(y_i)||^2; their `compute_opob_baseline`, scope "group",
  `agg_mode="mean"`, `use_is_weights=True`, `normalize_by_length=False`): per group g of G
  samples of one prompt, A'_i = A_i - sum_{j in g} W_j A_j / (sum_{j in g} W_j + 1e-8). With
  GRPO advantages A = (R - mean_g) / (std_g + 1e-8) this is (R_i - b*_g) / (std_g + 1e-8): the
  baseline commutes with the group's shift and scale. ||grad log pi(y_i)||^2 is exact: one
  gradient per sequence (the RL update's rl/accumulate.seq_grad_sq), as their code takes one
  backward per trajectory (micro-batch size 1) and reads its norm. `objective.vcpo_baseline`
  picks W_i: "paper" (the default) is the paper's and their README's w_i^2 ||grad log pi(y_i)||^2;
  "authors" is what their code computes (commit c7f030f0b77237cfb0e75e720669e2917a1bb56e):
  `update_policy_per_traj` backpropagates each trajectory's loss with advantage 1 and the
  sequence IS weight min(w_i, 8) (`rollout_is_weights`), `_compute_grad_norms` undoes the
  seq-mean-token-mean 1/L_i and the 1/B loss multiplier, and `compute_opob_baseline`
  multiplies that norm squared by rollout_seq_is^2 = w_i^2 (`use_clipped_is_ratios=False`):
  W_i = w_i^2 min(w_i, vcpo_is_cap)^2 ||grad log pi(y_i)||^2.
- The loss (their math / gsm8k scripts: `loss_mode` vanilla with the clip opened,
  clip_ratio_low 1 / high 1e9 / c 1e9, old log-probs = the current ones detached, rollout_is
  "sequence" at threshold 8): -sg(min(w_i, vcpo_is_cap)) A'_i logp_t, aggregated by
  `objective.aggregation` (their scripts: seq-mean-token-mean).

Differences from their code:
- With vcpo_baseline "paper", W_i lacks their min(w_i, 8)^2 (above).
- Their advantages are divided by the population std of the group (`norm_by_std`); the
  rollout's GRPO advantages here use the Bessel std (a factor sqrt(G / (G - 1)) per step).
- ESS = (sum w)^2 / sum w^2 from max-shifted log-weights (no 1e-8 in the denominator, no
  float32 overflow of exp) over the rows with a kept token; their count includes every record.
- Their final gradient is assembled from the per-trajectory gradients (no second backward);
  here the RL update takes one forward and a per-row backward over the batch for `batch_pass`
  before the usual loss-and-gradient pass: 3.4x grpo's loss-and-gradient time at the
  configs/mini shapes (B 128, P 16, T 6, embedded model; median of 15, side by side in one
  process, 8 fake CPU devices).
- Packed rows (`seq_ids`) are refused: the per-row gradient would mix sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ess_jax.data.layout import RowLayout
from ess_jax.objectives.config import ObjectiveConfig
from ess_jax.objectives.core import (
    Batch,
    Metrics,
    aux_logp,
    finish,
    kept_mask,
    prepare,
    ratio,
    seq_sum,
)

# their get_weighted_mean's eps: keeps the baseline finite for a group whose weights are all 0
BASELINE_EPS = 1e-8


def seq_log_weights(logp_BxT: jax.Array, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """log w_i = sum over the row's kept tokens of (logp - blogp) [B], and whether the row has a
    kept token [B]; stop-gradient."""
    logp = jax.lax.stop_gradient(logp_BxT).astype(jnp.float32)
    keep = kept_mask(logp, batch)
    blogp = jnp.asarray(batch["behaviour_logp"], jnp.float32)
    log_w = jnp.sum(jnp.where(keep, logp - blogp, 0.0), axis=-1)
    return log_w, keep.any(-1)


def ess_ratio(log_w_B: jax.Array, rows_B: jax.Array) -> jax.Array:
    """(sum w)^2 / (n sum w^2) over the n rows in `rows_B`, from max-shifted log-weights (the
    ratio is invariant to a common factor of w); 0 when no row is given."""
    shift = jnp.max(jnp.where(rows_B, log_w_B, -jnp.inf))
    w = jnp.where(rows_B, jnp.exp(log_w_B - jnp.where(jnp.isfinite(shift), shift, 0.0)), 0.0)
    n = jnp.sum(rows_B, dtype=jnp.float32)
    return jnp.where(n > 0, jnp.square(w.sum()) / jnp.maximum(n * jnp.sum(w * w), 1e-30), 0.0)


def lr_scale(ess_ratio_: jax.Array, base_ess_ratio: float) -> jax.Array:
    """sqrt(min(1, ess_ratio / base_ess_ratio)): their `ess_scaling`, rule "sqrt" (the base
    floored at 1e-8 as theirs)."""
    return jnp.sqrt(jnp.minimum(1.0, ess_ratio_ / max(float(base_ess_ratio), 1e-8)))


def opob_baseline(adv_B: jax.Array, weight_B: jax.Array, group_size: int) -> jax.Array:
    """Per row, its group's sum_j W_j A_j / (sum_j W_j + 1e-8); the groups are those of the
    rollout's row layout (data/layout.py `RowLayout`: `group_size` consecutive rows)."""
    try:
        layout = RowLayout.of_rows(adv_B.shape[0], group_size)
    except ValueError as e:
        raise ValueError(
            f"vcpo's baseline needs whole groups in each update: {e} (rollout.group_size; "
            "data.prompts_per_step must be a multiple of train.updates_per_batch)"
        ) from None
    a_NgxG, w_NgxG = layout.grouped(adv_B), layout.grouped(weight_B)
    b_Ng = jnp.sum(w_NgxG * a_NgxG, -1) / (jnp.sum(w_NgxG, -1) + BASELINE_EPS)
    return layout.repeat(b_Ng)


def batch_pass(
    sq_B: jax.Array,
    logp_BxT: jax.Array,
    rows: Batch,
    config: ObjectiveConfig,
    group_size: int | None = None,
) -> tuple[Batch, Batch]:
    """What VCPO needs of the whole optimizer batch before any gradient: (rows to add:
    opob_advantages [B, T]; shared scalars to add: lr_scale, ess_seq). `rows` are the update's
    rows in the rollout's row layout (`RowLayout`: groups of `group_size` consecutive rows),
    before any shuffle; `sq_B` is each row's ||grad_theta sum_t logp_t||^2 over its kept tokens
    and `logp_BxT` its log-probs, both at the update's params (the RL update's per-row gradient
    pass, rl/accumulate.seq_grad_sq)."""
    if group_size is None:
        raise ValueError("vcpo needs the rollout's group_size for its per-group baseline")
    if "seq_ids" in rows:
        raise ValueError("vcpo needs one sequence per row (packed rows, seq_ids, are refused)")
    log_w, has_token = seq_log_weights(logp_BxT, rows)
    ess = ess_ratio(log_w, has_token)
    keep = kept_mask(logp_BxT, rows)
    adv_BxT = jnp.where(keep, jnp.asarray(rows["advantages"], jnp.float32), 0.0)
    adv_B = adv_BxT.sum(-1) / jnp.maximum(keep.sum(-1), 1)  # the row's advantage
    weight_B = jnp.square(ratio(log_w)) * sq_B
    if config.vcpo_baseline == "authors":  # their norm is of the min(w, cap)-weighted gradient
        weight_B = weight_B * jnp.square(jnp.minimum(ratio(log_w), config.vcpo_is_cap))
    weight_B = jnp.where(has_token, weight_B, 0.0)
    base_B = opob_baseline(adv_B, weight_B, group_size)
    opob = jnp.where(keep, adv_BxT - base_B[:, None], 0.0)
    shared = {"lr_scale": lr_scale(ess, config.vcpo_base_ess_ratio), "ess_seq": ess}
    return {"opob_advantages": jax.lax.stop_gradient(opob)}, jax.lax.stop_gradient(shared)


def vcpo(logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig) -> tuple[jax.Array, Metrics]:
    """-sg(min(w_i, vcpo_is_cap)) A'_i logp_t, A' the OPOB advantages of `batch_pass`; reports
    the step's `lr_scale` (rl/optim.apply_update applies it to the update) and `ess_seq`
    (ESS / B).

    In the train step `batch_pass` always runs first (rl/update.step_loss_and_grad). Called on a
    batch without its arrays (the loss alone, as the objective-generic tests call every loss),
    the advantages are taken as given (no baseline: the per-sequence gradient norms need the
    params) and lr_scale / ess_seq come from this batch's rows."""
    c = prepare(logp_BxT, batch, config)
    if "opob_advantages" in batch:
        adv = aux_logp(batch, "opob_advantages", c.mask, config.name)
    else:
        adv = c.adv
    if "lr_scale" in batch:
        scale, ess = batch["lr_scale"], batch["ess_seq"]
    else:
        ess = ess_ratio(*seq_log_weights(logp_BxT, batch))
        scale = lr_scale(ess, config.vcpo_base_ess_ratio)
    log_w = seq_sum(jax.lax.stop_gradient(c.log_ratio) * c.maskf, None)
    weight = jnp.where(c.mask, jnp.minimum(ratio(log_w), config.vcpo_is_cap), 0.0)
    pg = -weight * adv * c.logp
    capped = c.mask & (log_w > jnp.log(config.vcpo_is_cap))
    extras = {
        "lr_scale": jnp.asarray(scale, jnp.float32),
        "ess_seq": jnp.asarray(ess, jnp.float32),
        "is_weight_mean": jnp.sum(c.metric_w * weight),
        "opob_shift": jnp.sum(c.metric_w * jnp.abs(c.adv - adv)),  # token mean of |b|
    }
    return finish(c, batch, config, pg, pg, capped, extras)

"""Policy losses: the ESS objective (P3O), its dual anchor, baselines, and step-scope accumulation.

Spec: shared/PAPER.md. Axis alphabet: B batch (sequences / packed rows), T time, M micro-batches.

Every objective is `OBJECTIVES[name](logp_BxT, batch, config) -> (loss, metrics)` where `logp_BxT`
is the trainer's float32 log-prob of the sampled tokens (it carries the gradient) and `batch` holds
  behaviour_logp, advantages, mask      [B, T]  (required; mask bool or float)
  prox_logp, ref_logp, entropy          [B, T]  (optional)
  kl_full, rescored_behaviour_logp      [B, T]  (p3o with kl_estimator "full": ess_jax/rescore.py)
  seq_ids                               [B, T]  int, index in [0, T) of a packed sequence in its row
  ess, ess_prox, num_tokens, num_seqs   scalars (optional step statistics, see `step_statistics`)
A loss is a SUM over the tokens given divided by normalisers from the step statistics. When the
normalisers (num_tokens, num_seqs) describe the whole optimizer batch the losses, gradients and
additive metrics of micro-batches add up to the batch's; `accumulate.step_loss_and_grad` relies on
this. ObjectiveConfig.ess_scope (applied there) picks the statistics each micro-batch sees:
  "step"             ESS and normalisers of the whole optimizer batch (default; the loss and
                     gradient are invariant to micro-batching and device count)
  "microbatch"       the reference code's default (FeynRL, normalize_loss=True): ESS per
                     micro-batch (pooled over devices), normalisers of the whole optimizer batch
  "microbatch_local" ESS and normalisers per micro-batch, mean over micro-batches
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ess_jax.config_checks import ESS_SCOPES
from ess_jax.kl import (  # noqa: F401  (re-exported: objectives is the public entry point)
    KL_ESTIMATORS,
    EssSums,
    combine_ess_sums,
    effective_sample_size,
    entropy_from_logits,
    ess_from_sums,
    ess_sums,
    full_kl,
    get_kl_estimator,
    kl_k1,
    kl_k2,
    kl_k3,
)
from ess_jax.objective_core import (  # noqa: F401  (step_statistics & co. re-exported)
    NOMINAL_CLIP,
    STAT_KEYS,
    Batch,
    Metrics,
    _aux,
    _finish,
    _ppo_clip,
    _prepare,
    _seq_sum,
    step_statistics,
    token_counts,
)

SCOPES = ESS_SCOPES  # see the module docstring
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")
DUAL_VERSIONS = ("two_kl", "mixture")
IS_LEVELS = ("token", "sequence")
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
# kl_estimator "full": the exact KL to pi_b's whole distribution, which the train step re-scores
# (ess_jax/rescore.py) and hands over as batch["kl_full"]; P3O only.
FULL_KL = "full"
# How metrics of micro-batches combine (see combine_metrics); all other keys are additive.
_MAX_METRICS = ("ratio_max", "rescore_err")
_CONST_METRICS = ("ess", "ess_prox", "ess_mix")
# Clip ranges from the papers, applied by ObjectiveConfig.paper_defaults.
_PAPER_CLIPS = {"dapo": (0.2, 0.28), "gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4)}


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """Objective knobs; defaults are the P3O reference-code behaviour, except ess_scope ("step",
    PAPER.md's default; "microbatch" is the reference code's)."""

    name: str = "p3o"  # a key of OBJECTIVES
    # "step" (invariant to micro-batching) | "microbatch" (reference code default) |
    # "microbatch_local" (per-micro-batch denominators too); see the module docstring
    ess_scope: str = "step"
    kl_estimator: str = "k3"  # KL to pi_b / pi_prox / pi_mix: k1 | k2 | k3 | full (p3o only)
    ref_kl_estimator: str = "k3"  # KL to the frozen reference (beta_kl)
    aggregation: str = "token_mean"  # see AGGREGATIONS
    constant_normalizer: float = 1.0  # "constant": sum / (num_seqs * constant_normalizer)
    clip_eps_low: float = 0.2  # grpo/dapo/cispo/gspo/decoupled_ppo (paper_defaults for dapo/gspo)
    clip_eps_high: float = 0.2
    dual_version: str = "mixture"  # p3o_dual: "two_kl" | "mixture" (reference HEAD)
    dual_kl_gate: float = 1e-6  # mixture: KL term skipped when 1 - e_mix <= gate
    behaviour_weight_cap: float | None = None  # decoupled_ppo: cap on pi_prox / pi_b
    beta_kl: float = 0.0  # KL to frozen reference (needs batch["ref_logp"])
    beta_ent: float = 0.0  # entropy bonus (batch["entropy"] if given, else proxy -logp)
    # P3O taken apart (ablations, PAPER.md): "cap only" drops the (1 - ESS) KL term; "KL only"
    # weights the score function by sg(rho) instead of sg(min(rho, ESS)). Off by default.
    p3o_drop_kl: bool = False
    p3o_drop_cap: bool = False
    # grpo_tis / grpo_mis: behaviour weight w = pi_old / pi_b, token- or sequence-level;
    # TIS multiplies the loss by min(w, is_cap); MIS masks tokens (sequences) with w outside
    # [is_cap_low, is_cap].
    is_level: str = "token"
    is_cap: float = 2.0
    is_cap_low: float = 0.0

    def __post_init__(self):
        choices = {
            "name": OBJECTIVES,
            "ess_scope": SCOPES,
            "kl_estimator": (*KL_ESTIMATORS, FULL_KL),
            "ref_kl_estimator": KL_ESTIMATORS,
            "aggregation": AGGREGATIONS,
            "dual_version": DUAL_VERSIONS,
            "is_level": IS_LEVELS,
        }
        for field, valid in choices.items():
            if getattr(self, field) not in valid:
                raise ValueError(f"{field}={getattr(self, field)!r}; valid: {sorted(valid)}")
        if self.constant_normalizer <= 0:
            raise ValueError(f"constant_normalizer must be > 0, got {self.constant_normalizer}")
        if min(self.clip_eps_low, self.clip_eps_high) < 0:
            raise ValueError("clip_eps_low and clip_eps_high must be >= 0")
        if self.behaviour_weight_cap is not None and self.behaviour_weight_cap <= 0:
            raise ValueError(f"behaviour_weight_cap must be > 0, got {self.behaviour_weight_cap}")
        if (self.p3o_drop_kl or self.p3o_drop_cap) and self.name != "p3o":
            raise ValueError(f"p3o_drop_kl / p3o_drop_cap apply to p3o only, not {self.name!r}")
        if self.kl_estimator == FULL_KL:
            self._check_full_kl()
        if not 0.0 <= self.is_cap_low < self.is_cap:
            raise ValueError(
                f"need 0 <= is_cap_low < is_cap, got is_cap_low={self.is_cap_low}, "
                f"is_cap={self.is_cap}"
            )

    def _check_full_kl(self):
        if self.name == "p3o_dual":
            why = "its KL terms would also need pi_prox's whole distribution (not implemented)"
        elif self.name != "p3o":
            why = f"{self.name!r} has no KL(pi || pi_b) term"
        elif self.p3o_drop_kl:
            why = "p3o_drop_kl=True drops the KL term"
        else:
            return
        raise ValueError(
            f"kl_estimator='full' applies to p3o's KL(pi || pi_b) term only: {why}; the "
            "re-score of pi_b would cost a second forward for nothing (use k1 / k2 / k3)"
        )

    @classmethod
    def from_dict(cls, d: Any) -> ObjectiveConfig:
        """From a dict or ml_collections ConfigDict; unknown keys raise ValueError. Clip
        ranges not given (or None) take the objective's paper values (`paper_defaults`)."""
        d = d.to_dict() if hasattr(d, "to_dict") else dict(d)
        d = {k: v for k, v in d.items() if v is not None}  # None: the field's default
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown ObjectiveConfig keys: {unknown}")
        return cls.paper_defaults(d.pop("name", "p3o"), **d)

    @classmethod
    def paper_defaults(cls, name: str, **overrides: Any) -> ObjectiveConfig:
        """Config for `name` with its paper clip range (DAPO 0.2/0.28, GSPO 3e-4/4e-4)."""
        low, high = _PAPER_CLIPS.get(name, (0.2, 0.2))
        return cls(**{"name": name, "clip_eps_low": low, "clip_eps_high": high, **overrides})


# ------------------------------------------------------------------------ objectives


def p3o(logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig) -> tuple[jax.Array, Metrics]:
    """-sg(min(rho, e)) logp A + (1 - e) KL(pi || pi_b): PAPER.md, no hyper-parameters."""
    c = _prepare(logp_BxT, batch, config)
    ess = c.stats["ess"]
    weight = c.rho if config.p3o_drop_cap else jnp.minimum(c.rho, ess)
    pg = -jax.lax.stop_gradient(weight) * c.logp * c.adv
    kl_w = 0.0 if config.p3o_drop_kl else 1.0 - ess
    if config.kl_estimator == FULL_KL:
        kl, extras = _full_kl(c, batch)
    else:
        kl, extras = get_kl_estimator(config.kl_estimator)(c.logp, c.blogp), None
    capped = jnp.zeros_like(c.mask) if config.p3o_drop_cap else c.rho > ess
    return _finish(c, batch, config, pg + kl_w * kl, pg, capped, extras)


def _full_kl(c, batch: Batch) -> tuple[jax.Array, Metrics]:
    """batch["kl_full"] (it carries pi's gradient) and its metrics: the token mean, and the
    largest gap between the re-scored and the recorded log pi_b(y_t) (float32 rounding, ~1e-6,
    unless the re-score is not the distribution the sampler drew from)."""
    if "kl_full" not in batch:
        raise ValueError(
            "kl_estimator='full' needs batch['kl_full'], the train step's re-score of pi_b "
            "(ess_jax/rescore.py)"
        )
    kl = jnp.where(c.mask, batch["kl_full"].astype(jnp.float32), 0.0)
    gap = jnp.abs(_aux(batch, "rescored_behaviour_logp", c.mask, "p3o") - c.blogp)
    sg = jax.lax.stop_gradient
    return kl, {"kl_behaviour_full": jnp.sum(c.metric_w * sg(kl)), "rescore_err": jnp.max(gap)}


def p3o_dual(
    logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig
) -> tuple[jax.Array, Metrics]:
    """Dual anchor (P4O): caps at min(e_b, e_prox); "two_kl" or "mixture" trust region."""
    c = _prepare(logp_BxT, batch, config)
    prox = _aux(batch, "prox_logp", c.mask, config.name)
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
    return _finish(c, batch, config, pg + trust, pg, c.rho > e_mix, extras)


def grpo(logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig) -> tuple[jax.Array, Metrics]:
    """PPO clip: -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A). Also DAPO's loss."""
    c = _prepare(logp_BxT, batch, config)
    pg, capped = _ppo_clip(c.rho, c.adv, config)
    return _finish(c, batch, config, pg, pg, capped)


def cispo(logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig) -> tuple[jax.Array, Metrics]:
    """-sg(clip(rho, 1 - eps_low, 1 + eps_high)) logp A (two-sided clip, as the reference code)."""
    c = _prepare(logp_BxT, batch, config)
    lo, hi = 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high
    pg = -jax.lax.stop_gradient(jnp.clip(c.rho, lo, hi)) * c.logp * c.adv
    return _finish(c, batch, config, pg, pg, (c.rho > hi) | (c.rho < lo))


def _gspo(logp_BxT, batch, config, token_level: bool):
    c = _prepare(logp_BxT, batch, config)
    seq_ids = batch.get("seq_ids")
    seq_len = jnp.maximum(_seq_sum(c.maskf, seq_ids), 1.0)
    seq_log_ratio = _seq_sum(c.log_ratio * c.maskf, seq_ids) / seq_len  # length-normalised
    if token_level:  # s_i,t = sg(s_i) * pi / sg(pi): per-token advantages allowed
        sg = jax.lax.stop_gradient
        seq_log_ratio = sg(seq_log_ratio) + c.logp - sg(c.logp)
    pg, capped = _ppo_clip(jnp.exp(seq_log_ratio), c.adv, config)
    return _finish(c, batch, config, pg, pg, capped)


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
    c = _prepare(logp_BxT, batch, config)
    prox = _aux(batch, "prox_logp", c.mask, config.name)
    weight = jnp.exp(prox - c.blogp)
    weight_capped = jnp.zeros_like(c.mask)
    if config.behaviour_weight_cap is not None:
        weight_capped = weight > config.behaviour_weight_cap
        weight = jnp.minimum(weight, config.behaviour_weight_cap)
    clip_loss, capped = _ppo_clip(jnp.exp(c.logp - prox), c.adv, config)
    pg = weight * clip_loss
    extras = {
        "ess_prox": c.stats["ess_prox"],
        "behaviour_weight_mean": jnp.sum(c.metric_w * weight),
        "behaviour_capped_frac": jnp.sum(c.metric_w * weight_capped),
    }
    return _finish(c, batch, config, pg, pg, capped, extras)


def _truncated_is(logp_BxT, batch, config, masked: bool):
    """GRPO's clip against pi_old (the trainer's re-score before the first update, batch
    "prox_logp") times the stop-gradient behaviour weight w = pi_old / pi_b: truncated at
    is_cap (TIS) or masked outside [is_cap_low, is_cap] (MIS); per token or per sequence
    (w = prod_t over the sequence, computed in log space)."""
    c = _prepare(logp_BxT, batch, config)
    old = _aux(batch, "prox_logp", c.mask, config.name)
    log_w = (old - c.blogp) * c.maskf
    if config.is_level == "sequence":
        log_w = _seq_sum(log_w, batch.get("seq_ids"))
    log_cap = jnp.log(config.is_cap)
    if masked:
        low = jnp.log(config.is_cap_low) if config.is_cap_low > 0 else -jnp.inf
        outside = (log_w > log_cap) | (log_w < low)
        weight = jnp.where(outside, 0.0, jnp.exp(jnp.minimum(log_w, log_cap)))
    else:
        outside = log_w > log_cap
        weight = jnp.exp(jnp.minimum(log_w, log_cap))
    weight = jax.lax.stop_gradient(jnp.where(c.mask, weight, 0.0))
    clip_loss, capped = _ppo_clip(jnp.exp(c.logp - old), c.adv, config)
    pg = weight * clip_loss
    extras = {
        "ess_prox": c.stats["ess_prox"],
        "behaviour_weight_mean": jnp.sum(c.metric_w * weight),
        "behaviour_capped_frac": jnp.sum(c.metric_w * (outside & c.mask)),
    }
    return _finish(c, batch, config, pg, pg, capped, extras)


def grpo_tis(
    logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig
) -> tuple[jax.Array, Metrics]:
    """GRPO with truncated importance sampling: -min(w, C) min(r A, clip(r) A), r = pi / pi_old."""
    return _truncated_is(logp_BxT, batch, config, masked=False)


def grpo_mis(
    logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig
) -> tuple[jax.Array, Metrics]:
    """GRPO with masked importance sampling: tokens (sequences) whose w leaves the band drop out."""
    return _truncated_is(logp_BxT, batch, config, masked=True)


def reinforce(
    logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig
) -> tuple[jax.Array, Metrics]:
    """Plain on-policy REINFORCE: -logp A (no importance weight)."""
    c = _prepare(logp_BxT, batch, config)
    pg = -c.logp * c.adv
    return _finish(c, batch, config, pg, pg, jnp.zeros_like(c.mask))


Objective = Callable[[jax.Array, Batch, ObjectiveConfig], tuple[jax.Array, Metrics]]
OBJECTIVES: dict[str, Objective] = {
    "p3o": p3o,
    "p3o_dual": p3o_dual,
    "grpo": grpo,
    "dapo": grpo,  # DAPO = clip-higher (paper_defaults) + token mean + advantages.py filters
    "cispo": cispo,
    "gspo": gspo,
    "gspo_token": gspo_token,
    "decoupled_ppo": decoupled_ppo,
    "grpo_tis": grpo_tis,
    "grpo_mis": grpo_mis,
    "reinforce": reinforce,
}
# Objectives whose loss reads the step statistics ess / ess_prox (the others report them as
# metrics only): with ess_scope "step" and several micro-batches, only these need the no-grad
# statistics pass before the gradients (accumulate.py).
ESS_IN_LOSS = frozenset({"p3o", "p3o_dual"})
# Objectives whose batch needs "prox_logp": the policy re-scored by the trainer before the
# first update on a rollout batch (the proximal anchor / pi_old).
NEEDS_PROX = frozenset({"p3o_dual", "decoupled_ppo", "grpo_tis", "grpo_mis"})


def get_objective(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; valid: {sorted(OBJECTIVES)}")
    return OBJECTIVES[name]

"""ObjectiveConfig: the knobs of every objective, one flat record (the experiment config's
`objective` section), with the checks that need no objective record.

Which fields an objective reads, its paper clip range and what it refuses are its record's
(`registry.Objective`); `registry.objective_config` builds an ObjectiveConfig from the
experiment config and applies both.
"""

from __future__ import annotations

import dataclasses

from ess_jax.config.domains import (
    AGGREGATIONS,
    DUAL_VERSIONS,
    ESS_SCOPES,
    IS_LEVELS,
    M2PO_FORMS,
    REF_KL_ESTIMATORS,
    VCPO_BASELINES,
)
from ess_jax.objectives.kl import KL_ESTIMATORS

SCOPES = ESS_SCOPES  # meanings: scopes.py
# kl_estimator "full": the exact KL to pi_b's whole distribution, which the train step re-scores
# (ess_jax/sampling/rescore.py) and hands over as batch["kl_full"].
FULL_KL = "full"


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """Objective knobs; defaults are the P3O reference-code behaviour, except ess_scope ("step",
    invariant to micro-batching; "microbatch" is the reference code's)."""

    name: str = "p3o"  # a key of registry.OBJECTIVES
    # "step" (invariant to micro-batching) | "microbatch" (reference code default) |
    # "microbatch_local" (per-micro-batch denominators too); see scopes.py
    ess_scope: str = "step"
    # KL to pi_b / pi_prox / pi_mix: k1 | k2 | k3 | k3_tangent | k3_is | forward | full (p3o only)
    kl_estimator: str = "k3"
    ref_kl_estimator: str = "k3"  # KL to the frozen reference (beta_kl): k1 | k2 | k3 | k3_tangent
    aggregation: str = "token_mean"  # see AGGREGATIONS
    constant_normalizer: float = 1.0  # "constant": sum / (num_seqs * constant_normalizer)
    clip_eps_low: float = 0.2  # grpo/dapo/cispo/gspo/decoupled_ppo (paper clips for dapo/gspo)
    clip_eps_high: float = 0.2
    dual_version: str = "mixture"  # p3o_dual: "two_kl" | "mixture" (reference HEAD)
    dual_kl_gate: float = 1e-6  # mixture: KL term skipped when 1 - e_mix <= gate
    behaviour_weight_cap: float | None = None  # decoupled_ppo: cap on pi_prox / pi_b
    beta_kl: float = 0.0  # KL to frozen reference (needs batch["ref_logp"])
    beta_ent: float = 0.0  # entropy bonus (batch["entropy"] if given, else proxy -logp)
    # P3O taken apart (ablations, docs/method.md): "cap only" drops the (1 - ESS) KL term; "KL
    # only" weights the score function by sg(rho) instead of sg(min(rho, ESS)). Off by default.
    p3o_drop_kl: bool = False
    p3o_drop_cap: bool = False
    # grpo_tis / grpo_mis: behaviour weight w = pi_old / pi_b, token- or sequence-level;
    # TIS multiplies the loss by min(w, is_cap); MIS masks tokens (sequences) with w outside
    # [is_cap_low, is_cap] (verl's rollout_is_threshold_lower defaults to 1 / is_cap).
    is_level: str = "token"
    is_cap: float = 2.0
    is_cap_low: float = 0.0
    # grpo_tis / grpo_mis: a sequence with any token weight w_t < is_veto gets weight 0; 0 = off
    # (verl's rollout_is_veto_threshold, 1e-4 in its configs).
    is_veto: float = 0.0
    # m2po: tokens with the largest (log rho)^2 are masked until the rest's mean is below it
    # (AReaL's actor.m2_threshold, 0.04 in its gsm8k_m2po example).
    m2_threshold: float = 0.04
    # m2po's form (objectives/m2po_forms.py): "mask" (AReaL's mask vs pi_b, no clip) |
    # "areal" (as AReaL runs it: mask vs pi_prox, zero-width decoupled clip, rejection at 5,
    # normalised by the tokens left) | "authors" (Infini-AI-Lab/M2PO's adaptive clip bound).
    m2po_form: str = "mask"
    # vcpo (objectives/vcpo.py): lr x sqrt(min(1, (ESS / B) / vcpo_base_ess_ratio)) (their
    # ess_scaling.base_ess_ratio: 1.0 in their math / gsm8k scripts, 0.55 multi-turn); the
    # sequence IS weight truncated at vcpo_is_cap (their rollout_is_threshold, 8.0).
    vcpo_base_ess_ratio: float = 1.0
    vcpo_is_cap: float = 8.0
    # vcpo's baseline weight W_i: "paper" w_i^2 ||grad log pi(y_i)||^2 (paper and README) |
    # "authors" (mit-han-lab/vcpo's code) w_i^2 min(w_i, vcpo_is_cap)^2 ||grad log pi(y_i)||^2.
    vcpo_baseline: str = "paper"
    # dppo (objectives/correction.py): a token is masked when A > 0 and pi - pi_b > dppo_mask_high,
    # or A <= 0 and pi - pi_b < -dppo_mask_low; dppo_kl_tau weighs (log rho)^2 (prime-rl's
    # DefaultLossConfig: 0.2, 0.2, 1e-3).
    dppo_mask_low: float = 0.2
    dppo_mask_high: float = 0.2
    dppo_kl_tau: float = 1e-3
    # Kept bands of w = pi_old / pi_b (0 low: no lower edge): icepop per token (OpenRLHF's
    # 0.5, 5), seq_mis the product over a sequence and geo_rs its geometric mean (verl's
    # decoupled_seq_is_rs 0.5, 2 and decoupled_geo_rs 0.999, 1.001).
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    seq_mis_low: float = 0.5
    seq_mis_high: float = 2.0
    geo_rs_low: float = 0.999
    geo_rs_high: float = 1.001

    def __post_init__(self):
        choices = {
            "ess_scope": SCOPES,
            "kl_estimator": (*KL_ESTIMATORS, FULL_KL),
            "ref_kl_estimator": REF_KL_ESTIMATORS,
            "aggregation": AGGREGATIONS,
            "dual_version": DUAL_VERSIONS,
            "is_level": IS_LEVELS,
            "m2po_form": M2PO_FORMS,
            "vcpo_baseline": VCPO_BASELINES,
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
        if not 0.0 <= self.is_cap_low < self.is_cap:
            raise ValueError(
                f"need 0 <= is_cap_low < is_cap, got is_cap_low={self.is_cap_low}, "
                f"is_cap={self.is_cap}"
            )
        if not 0.0 <= self.is_veto < 1.0:
            raise ValueError(f"need 0 <= is_veto < 1 (0: off), got is_veto={self.is_veto}")
        if self.m2_threshold <= 0:
            raise ValueError(f"m2_threshold must be > 0, got {self.m2_threshold}")
        for field in ("vcpo_base_ess_ratio", "vcpo_is_cap"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")
        for field in ("dppo_mask_low", "dppo_mask_high", "dppo_kl_tau"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must be >= 0, got {getattr(self, field)}")
        for band in ("icepop", "seq_mis", "geo_rs"):
            low, high = getattr(self, f"{band}_low"), getattr(self, f"{band}_high")
            if not 0.0 <= low < high:
                raise ValueError(f"need 0 <= {band}_low < {band}_high, got {low}, {high}")


FIELDS = tuple(f.name for f in dataclasses.fields(ObjectiveConfig))

"""The objective section's record: every knob of every objective, declared once with its
default, domain and meaning (`knobs.knob`). ess_jax/objectives/config.py's ObjectiveConfig is
this record with the checks between its fields; defaults.base_config's `objective` section is
built from it, so each knob can be set from the command line.

Defaults are the P3O reference code's, except ess_scope ("step", invariant to
micro-batching). An optional knob (`Domain(optional=True)`) is None in base_config: the
objective's own value (DAPO's and GSPO's paper clip ranges, registry.py), else this default.
Which knobs an objective reads is its registry record's `fields`.
"""

from __future__ import annotations

import dataclasses

from ess_jax.config.domains import (
    AGGREGATIONS,
    DUAL_VERSIONS,
    ESS_SCOPES,
    FINITE,
    FLAG,
    IS_LEVELS,
    KL_ESTIMATOR_NAMES,
    M2PO_FORMS,
    NONNEG,
    POSITIVE,
    REF_KL_ESTIMATORS,
    UNIT_OPEN_HI,
    VCPO_BASELINES,
    Choice,
    Domain,
    Free,
)
from ess_jax.config.knobs import knob


@dataclasses.dataclass(frozen=True)
class ObjectiveFields:
    """objective: the loss and its knobs (ess_jax/objectives/); each loss reads its own."""

    name: str = knob(
        "p3o",
        Free("a key of objectives/registry.py's OBJECTIVES (validate)"),
        "the loss: p3o | p3o_dual | grpo | dapo | cispo | gspo | gspo_token | ...",
    )
    # The statistics each micro-batch's loss uses (train.num_microbatches > 1; all agree at 1),
    # meanings in objectives/scopes.py:
    #   step: ESS and token count of the whole optimizer step (micro-batch / device invariant);
    #     for p3o / p3o_dual it costs M - 1 extra micro-batch forwards at M >= 3, 2 at M = 2
    #     (+24% per update at 4 micro-batches on bench/cpu.py's CPU model; BENCHMARKS.md)
    #   microbatch: the reference code's default: ESS per micro-batch (pooled over devices),
    #     divided by the token count of the whole optimizer step
    #   microbatch_local: ESS and token count per micro-batch, mean over micro-batches
    ess_scope: str = knob(
        "step", Choice(ESS_SCOPES), "the ESS and token count a micro-batch's loss uses"
    )
    # full: the whole vocabulary, p3o only: pi_b re-scored by a second forward per update;
    # needs model.logits_chunk > 0, a float32 sampler and temperature > 0 (docs/configs.md,
    # "The KL term")
    kl_estimator: str = knob(
        "k3", Choice(KL_ESTIMATOR_NAMES), "KL to pi_b / pi_prox / pi_mix: k1 | k2 | k3 | ... | full"
    )
    ref_kl_estimator: str = knob(
        "k3", Choice(REF_KL_ESTIMATORS), "KL to the frozen reference (beta_kl)"
    )
    aggregation: str = knob(
        "token_mean", Choice(AGGREGATIONS), "how token losses reduce to the step's loss"
    )
    constant_normalizer: float = knob(
        1.0, POSITIVE, 'aggregation "constant": sum / (num_seqs * constant_normalizer)'
    )
    # grpo / dapo / cispo / gspo / decoupled_ppo; None in base_config: the objective's paper
    # clips (DAPO 0.2 / 0.28, GSPO 3e-4 / 4e-4), else this
    clip_eps_low: float = knob(0.2, Domain(lo=0.0, optional=True), "PPO clip: 1 - low")
    clip_eps_high: float = knob(0.2, Domain(lo=0.0, optional=True), "PPO clip: 1 + high")
    dual_version: str = knob(
        "mixture", Choice(DUAL_VERSIONS), "p3o_dual: two_kl | mixture (reference HEAD)"
    )
    dual_kl_gate: float = knob(1e-6, NONNEG, "mixture: KL term skipped when 1 - e_mix <= gate")
    behaviour_weight_cap: float | None = knob(
        None, Domain(lo=0.0, lo_open=True, optional=True), "decoupled_ppo: cap on pi_prox / pi_b"
    )
    beta_kl: float = knob(0.0, NONNEG, "weight of the KL to the frozen reference")
    # batch["entropy"] if given, else the proxy -logp
    beta_ent: float = knob(0.0, FINITE, "entropy bonus (> 0) or penalty (< 0)")
    # P3O taken apart (ablations, docs/method.md). Off by default.
    p3o_drop_kl: bool = knob(
        False, FLAG, 'ablation: P3O without its (1 - ESS) KL term ("cap only")'
    )
    p3o_drop_cap: bool = knob(False, FLAG, 'ablation: P3O weighting by sg(rho), no cap ("KL only")')
    # grpo_tis / grpo_mis: behaviour weight w = pi_old / pi_b, token- or sequence-level; TIS
    # multiplies the loss by min(w, is_cap); MIS masks tokens (sequences) with w outside
    # [is_cap_low, is_cap] (verl's rollout_is_threshold_lower defaults to 1 / is_cap).
    is_level: str = knob("token", Choice(IS_LEVELS), "grpo_tis / grpo_mis: token | sequence weight")
    is_cap: float = knob(2.0, POSITIVE, "TIS truncation C (MIS: upper edge of the kept band)")
    is_cap_low: float = knob(0.0, NONNEG, "MIS: lower edge of the kept band (< is_cap)")
    # verl's rollout_is_veto_threshold, 1e-4 in its configs
    is_veto: float = knob(
        0.0, UNIT_OPEN_HI, "TIS / MIS: zero a sequence with any w_t below it; 0: off"
    )
    # tokens with the largest (log rho)^2 are masked until the rest's mean is below it (AReaL's
    # actor.m2_threshold, 0.04 in its gsm8k_m2po example)
    m2_threshold: float = knob(0.04, POSITIVE, "m2po: bound on the kept tokens' mean (log rho)^2")
    # "mask" (AReaL's mask vs pi_b, no clip) | "areal" (as AReaL runs it: mask vs pi_prox,
    # zero-width decoupled clip, rejection at 5, normalised by the tokens left) | "authors"
    # (Infini-AI-Lab/M2PO's adaptive clip bound)
    m2po_form: str = knob(
        "mask", Choice(M2PO_FORMS), "m2po's form: mask | areal | authors (m2po_forms.py)"
    )
    # their ess_scaling.base_ess_ratio: 1.0 in their math / gsm8k scripts, 0.55 multi-turn
    vcpo_base_ess_ratio: float = knob(1.0, POSITIVE, "vcpo: lr x sqrt(min(1, (ESS / B) / this))")
    vcpo_is_cap: float = knob(
        8.0, POSITIVE, "vcpo: sequence IS weight truncation (their rollout_is_threshold)"
    )
    # "paper": w_i^2 ||grad log pi(y_i)||^2 (paper and README) | "authors"
    # (mit-han-lab/vcpo's code): w_i^2 min(w_i, vcpo_is_cap)^2 ||grad log pi(y_i)||^2
    vcpo_baseline: str = knob(
        "paper", Choice(VCPO_BASELINES), "vcpo: the baseline weight W_i, paper | authors"
    )
    # dppo (objectives/correction.py): prime-rl's DefaultLossConfig: 0.2, 0.2, 1e-3
    dppo_mask_low: float = knob(0.2, NONNEG, "dppo: mask A <= 0 tokens with pi - pi_b < -low")
    dppo_mask_high: float = knob(0.2, NONNEG, "dppo: mask A > 0 tokens with pi - pi_b > high")
    dppo_kl_tau: float = knob(1e-3, NONNEG, "dppo: the weight of (log rho)^2")
    # Kept bands [low, high] of w = pi_old / pi_b (low 0: no lower edge): icepop per token
    # (OpenRLHF's 0.5, 5), seq_mis the product over a sequence and geo_rs its geometric mean
    # (verl's decoupled_seq_is_rs 0.5, 2 and decoupled_geo_rs 0.999, 1.001)
    icepop_low: float = knob(0.5, NONNEG, "icepop: the kept band's lower edge, per token")
    icepop_high: float = knob(5.0, POSITIVE, "icepop: the kept band's upper edge, per token")
    seq_mis_low: float = knob(0.5, NONNEG, "seq_mis: the kept band's lower edge, per sequence")
    seq_mis_high: float = knob(2.0, POSITIVE, "seq_mis: the kept band's upper edge, per sequence")
    geo_rs_low: float = knob(0.999, NONNEG, "geo_rs: the kept band's lower edge, geometric mean")
    geo_rs_high: float = knob(1.001, POSITIVE, "geo_rs: the kept band's upper edge, geometric mean")

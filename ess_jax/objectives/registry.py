"""One record per objective: its loss and every fact the rest of the code asks about it.

`OBJECTIVES[name]` is an `Objective`: the loss function (losses.py), whether its batch needs the
proximal snapshot (`prox_logp`: the policy re-scored by the trainer before the first update on
a rollout batch), whether its loss reads the step ESS (then ess_scope "step" runs a statistics
pass before the gradients, scopes.py), a pass of its own over the batch before the gradients
(`batch_pass`: vcpo's baseline from per-sequence gradient norms), its paper clip range, and the
ObjectiveConfig fields its loss reads beyond the shared ones. `objective_config` builds an
ObjectiveConfig from the experiment config's `objective` section and refuses what no record
allows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from ess_jax.objectives import correction, losses, m2po_forms, vcpo
from ess_jax.objectives.config import DEFAULT_CLIPS, FIELDS, FULL_KL, ObjectiveConfig
from ess_jax.objectives.core import Batch, Metrics

Loss = Callable[[jax.Array, Batch, ObjectiveConfig], tuple[jax.Array, Metrics]]
# (sq_B, logp_BxT, rows, config, group_size) -> (rows, shared scalars) added to the optimizer
# batch before the gradients (vcpo.batch_pass); sq_B is each row's squared gradient norm
# ||grad sum_t logp_t||^2 and logp_BxT its log-probs, which the RL update computes
# (rl/accumulate.seq_grad_sq): the objective itself takes no gradient.
BatchPass = Callable[..., tuple[Batch, Batch]]
# Fields every loss reads (core.prepare / core.finish) or the step reads (ess_scope).
SHARED_FIELDS = (
    "name",
    "ess_scope",
    "aggregation",
    "constant_normalizer",
    "beta_kl",
    "ref_kl_estimator",
    "beta_ent",
)
# Switches that change one loss: set on an objective that does not read them, they are refused
# (a silent no-op would mislabel an ablation arm).
EXCLUSIVE = ("p3o_drop_kl", "p3o_drop_cap")
_CLIPS = ("clip_eps_low", "clip_eps_high")


@dataclasses.dataclass(frozen=True)
class Objective:
    """An objective and its facts; `loss(logp_BxT, batch, config) -> (loss, metrics)`."""

    name: str
    loss: Loss
    fields: tuple[str, ...] = ()  # ObjectiveConfig fields it reads beyond SHARED_FIELDS
    needs_prox: bool = False  # batch["prox_logp"] required
    ess_in_loss: bool = False  # the loss reads ess / ess_prox (not only as a metric)
    paper_clips: tuple[float, float] = DEFAULT_CLIPS  # clip_eps_low / high when not given
    # Why kl_estimator "full" is refused ("" = accepted); the default names the missing term.
    no_full_kl: str | None = None
    # A pass over the whole optimizer batch before any gradient, in rollout row order (groups
    # of G consecutive rows), whose outputs join the batch (rl/update.step_loss_and_grad).
    batch_pass: BatchPass | None = None
    # (field, value) pairs of ObjectiveConfig whose loss reads batch["prox_logp"] though the
    # record's other forms do not (m2po's "areal"): `needs_prox(config)` reads both.
    prox_forms: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        unknown = (set(self.fields) | {f for f, _ in self.prox_forms}) - set(FIELDS)
        if unknown:
            raise ValueError(f"objective {self.name!r}: no ObjectiveConfig fields {unknown}")


def _records(*objectives: Objective) -> dict[str, Objective]:
    return {o.name: o for o in objectives}


_IS = ("is_level", "is_cap", "is_veto")
OBJECTIVES: dict[str, Objective] = _records(
    Objective(
        "p3o",
        losses.p3o,
        fields=("kl_estimator", "p3o_drop_kl", "p3o_drop_cap"),
        ess_in_loss=True,
        no_full_kl="",
    ),
    Objective(
        "p3o_dual",
        losses.p3o_dual,
        fields=("kl_estimator", "dual_version", "dual_kl_gate"),
        needs_prox=True,
        ess_in_loss=True,
        no_full_kl="its KL terms would also need pi_prox's whole distribution (not implemented)",
    ),
    Objective("grpo", losses.grpo, fields=_CLIPS),
    # DAPO = GRPO's loss with clip-higher, token-mean aggregation and the rollout's dynamic
    # sampling / overlong penalty (rollout.dynamic_sampling, rollout.overlong_buffer).
    Objective("dapo", losses.grpo, fields=_CLIPS, paper_clips=(0.2, 0.28)),
    Objective("cispo", losses.cispo, fields=_CLIPS),
    Objective("gspo", losses.gspo, fields=_CLIPS, paper_clips=(3e-4, 4e-4)),
    Objective("gspo_token", losses.gspo_token, fields=_CLIPS, paper_clips=(3e-4, 4e-4)),
    Objective(
        "decoupled_ppo",
        losses.decoupled_ppo,
        fields=(*_CLIPS, "behaviour_weight_cap"),
        needs_prox=True,
    ),
    Objective("grpo_tis", losses.grpo_tis, fields=(*_CLIPS, *_IS), needs_prox=True),
    Objective("grpo_mis", losses.grpo_mis, fields=(*_CLIPS, *_IS, "is_cap_low"), needs_prox=True),
    Objective(
        "m2po",
        m2po_forms.m2po,
        fields=("m2_threshold", "m2po_form"),
        prox_forms=(("m2po_form", "areal"),),
    ),
    Objective(
        "vcpo",
        vcpo.vcpo,
        fields=("vcpo_base_ess_ratio", "vcpo_is_cap", "vcpo_baseline"),
        batch_pass=vcpo.batch_pass,
    ),
    Objective("reinforce", losses.reinforce),
    # Newer train/inference-mismatch baselines (objectives/correction.py, docs/method.md).
    Objective(
        "dppo",
        correction.dppo,
        fields=("dppo_mask_low", "dppo_mask_high", "dppo_kl_tau"),
        no_full_kl="its penalty is prime-rl's (log rho)^2 on the sampled token",
    ),
    Objective(
        "icepop", correction.icepop, fields=(*_CLIPS, "icepop_low", "icepop_high"), needs_prox=True
    ),
    Objective(
        "seq_mis",
        correction.seq_mis,
        fields=(*_CLIPS, "seq_mis_low", "seq_mis_high"),
        needs_prox=True,
    ),
    Objective(
        "geo_rs", correction.geo_rs, fields=(*_CLIPS, "geo_rs_low", "geo_rs_high"), needs_prox=True
    ),
)


def get_objective(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; valid: {sorted(OBJECTIVES)}")
    return OBJECTIVES[name]


def needs_prox(config: ObjectiveConfig) -> bool:
    """Whether the step re-scores the batch with the params before its first update
    (batch["prox_logp"]): the record's `needs_prox`, or a form of its loss that reads it."""
    record = get_objective(config.name)
    return record.needs_prox or any(getattr(config, f) == v for f, v in record.prox_forms)


def check(config: ObjectiveConfig) -> None:
    """What the objective's record refuses: an unknown name, a switch of another objective, the
    full-vocabulary KL where no KL(pi || pi_b) term would use it. ValueError naming it."""
    record = get_objective(config.name)
    for field in EXCLUSIVE:
        if getattr(config, field) and field not in record.fields:
            owners = [o.name for o in OBJECTIVES.values() if field in o.fields]
            raise ValueError(f"{field} applies to {', '.join(owners)} only, not {config.name!r}")
    if config.kl_estimator != FULL_KL:
        return
    why = record.no_full_kl
    if why is None:
        why = f"{config.name!r} has no KL(pi || pi_b) term"
    elif not why and config.p3o_drop_kl:
        why = "p3o_drop_kl=True drops the KL term"
    if why:
        raise ValueError(
            f"kl_estimator='full' applies to p3o's KL(pi || pi_b) term only: {why}; the "
            "re-score of pi_b would cost a second forward for nothing (use k1 / k2 / k3)"
        )


def paper_config(name: str, **overrides: Any) -> ObjectiveConfig:
    """ObjectiveConfig for `name` with its paper clip range (DAPO 0.2/0.28, GSPO 3e-4/4e-4),
    checked against its record."""
    low, high = OBJECTIVES[name].paper_clips if name in OBJECTIVES else DEFAULT_CLIPS
    config = ObjectiveConfig(
        **{"name": name, "clip_eps_low": low, "clip_eps_high": high, **overrides}
    )
    check(config)
    return config


def objective_config(d: Any) -> ObjectiveConfig:
    """From a dict or ml_collections ConfigDict (the experiment's `objective` section); unknown
    keys raise ValueError. Fields not given (or None) take their defaults, clip ranges the
    objective's paper values."""
    d = d.to_dict() if hasattr(d, "to_dict") else dict(d)
    d = {k: v for k, v in d.items() if v is not None}  # None: the field's default
    unknown = sorted(set(d) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown ObjectiveConfig keys: {unknown}")
    return paper_config(d.pop("name", "p3o"), **d)

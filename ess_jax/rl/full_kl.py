"""objective.kl_estimator "full" in the RL update, in one place: whether a run needs it, the
behaviour params and batch column each update takes for it, and the update's log-prob
function with pi_b's whole distribution re-scored.

The sampler records only log pi_b(y_t) of the token it drew; the exact KL(pi || pi_b) over the
whole vocabulary needs pi_b's distribution at every response position, so each update runs a
second forward with the params the sampler held, under the sampler's temperature and top-k /
top-p (`sampling/rescore.py`: the distribution, the KL and its costs). `config/schema.py
check_full_kl` refuses the rollouts that cannot be re-scored exactly; the loss reads the
re-score as batch["kl_full"] (objectives/losses.py, p3o).

Axis alphabet: B rows, T response length.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ess_jax import objectives as obj_lib
from ess_jax.model import lora
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.sampling import rescore

# Where pi_b's policy params come from (FullKL.policy):
CURRENT = "current"  # the update's own params (lag 0, one update per batch): no argument
HISTORY = "history"  # the lagged version from the policy history, in the train layout
COPY = "copy"  # lag 0 with several updates: the params before the batch's first update, copied


class BehaviourParams(NamedTuple):
    """An update's third argument under the full KL and its shardings:
    {"policy"?: params, "external"?: params} (`FullKL.sources`)."""

    params: dict
    shardings: dict


@dataclasses.dataclass(frozen=True)
class FullKL:
    """How a run's updates re-score pi_b; static and hashable: part of the compiled update's
    key (`update.StepKey`)."""

    behaviour: rescore.Behaviour  # the sampler's temperature, top-k / top-p, external model
    policy: str = CURRENT  # CURRENT | HISTORY | COPY

    @classmethod
    def for_run(
        cls, objective_cfg, rcfg, lag: int, updates_per_batch: int, external=None
    ) -> FullKL | None:
        """None unless objective.kl_estimator is "full". `lag` (rollout.lag) and
        `updates_per_batch` decide whether pi_b's policy params are the update's own; the
        external model (its engine, rollout.external_engine: `cfg` and `params`) matters only
        with rollout.external_fraction > 0: then each row is re-scored under the model that
        drew it (`policy_version` -1)."""
        if objective_cfg.kl_estimator != obj_lib.FULL_KL:
            return None
        policy = HISTORY if lag else COPY if updates_per_batch > 1 else CURRENT
        ext_cfg = None
        if external is not None and float(rcfg.external_fraction) > 0:
            ext_cfg = external.cfg
        return cls(rescore.Behaviour.from_rollout(rcfg, ext_cfg), policy)

    @property
    def sources(self) -> tuple[str, ...]:
        """The behaviour params each update takes as its third argument."""
        out = () if self.policy == CURRENT else ("policy",)
        return out + (("external",) if self.behaviour.external_cfg is not None else ())

    def inputs(self, params_b, policy_sh, external=None) -> BehaviourParams:
        """The third argument of a batch's updates: pi_b's policy params `params_b` (its
        history version) moved to the train layout `policy_sh`, or, at lag 0 with several
        updates, copied (the history then holds the train params' own buffers, which the first
        update donates): one more copy of the params; and the external model's params."""
        params, shardings = {}, {}
        if self.policy != CURRENT:
            policy = sharding_lib.reshard(params_b, policy_sh)
            params["policy"] = policy if self.policy == HISTORY else jax.tree.map(jnp.copy, policy)
            shardings["policy"] = policy_sh
        if "external" in self.sources:
            params["external"] = external.params
            shardings["external"] = jax.tree.map(lambda x: x.sharding, external.params)
        return BehaviourParams(params, shardings)

    def batch_rows(self, rollout) -> dict:
        """The batch column the re-score reads: policy_version [B, 1] (which model drew each
        row; rank 2 like every batch array: the update shards them all with one spec)."""
        return {"policy_version": rollout.policy_version[:, None]}

    def logp_fn(self, cfg, prompt_len: int, state, behaviour_params: dict, entropy: bool):
        """The update's `logp_fn(params, rows)`: the policy's response log-probs and, as
        extras, kl_full, rescored_behaviour_logp (and entropy) [B, T] (`rescore.logp_fn_for`).
        Without "policy" among `behaviour_params`, pi_b is the update's own params
        (`state.params`: the params the sampler held); a LoRA base (`state.frozen`) is joined
        to pi_b's adapters."""
        bparams = {"policy": state.params, **behaviour_params}
        bparams["policy"] = lora.join(state.frozen, bparams["policy"])
        return rescore.logp_fn_for(cfg, prompt_len, self.behaviour, bparams, entropy)

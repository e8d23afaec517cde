"""ObjectiveConfig: the knobs of every objective, one flat record (the experiment config's
`objective` section), with the checks that need no objective record.

Each knob's default, domain and meaning are declared once, in config/objective_fields.py's
`ObjectiveFields`; ObjectiveConfig is that record, checked: every value in its domain, and the
rules between knobs. Which fields an objective reads, its paper clip range and what it refuses
are its record's (`registry.Objective`); `registry.objective_config` builds an ObjectiveConfig
from the experiment config and applies both.
"""

from __future__ import annotations

import dataclasses

from ess_jax.config.domains import ESS_SCOPES
from ess_jax.config.knobs import refuse_outside
from ess_jax.config.objective_fields import ObjectiveFields

SCOPES = ESS_SCOPES  # meanings: scopes.py
# kl_estimator "full": the exact KL to pi_b's whole distribution, which the train step re-scores
# (ess_jax/sampling/rescore.py) and hands over as batch["kl_full"].
FULL_KL = "full"


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig(ObjectiveFields):
    """Objective knobs (config/objective_fields.py: each one's default, domain and meaning);
    a value outside its domain, or a band whose edges cross, is a ValueError naming it."""

    def __post_init__(self):
        refuse_outside(self)  # each knob in its domain first: the rules below compare them
        if not 0.0 <= self.is_cap_low < self.is_cap:
            raise ValueError(
                f"need 0 <= is_cap_low < is_cap, got is_cap_low={self.is_cap_low}, "
                f"is_cap={self.is_cap}"
            )
        for band in ("icepop", "seq_mis", "geo_rs"):
            low, high = getattr(self, f"{band}_low"), getattr(self, f"{band}_high")
            if not 0.0 <= low < high:
                raise ValueError(f"need 0 <= {band}_low < {band}_high, got {low}, {high}")


FIELDS = tuple(f.name for f in dataclasses.fields(ObjectiveConfig))
# The clip range of an objective without paper clips of its own (registry.Objective).
DEFAULT_CLIPS = (ObjectiveConfig.clip_eps_low, ObjectiveConfig.clip_eps_high)

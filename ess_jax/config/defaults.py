"""The default experiment config, built from the field records (fields.py). Experiment files in
configs/ start from it and override; the command line (`--config.x=y`) sets its fields."""

from __future__ import annotations

import ml_collections

from ess_jax.config.fields import ConfigFields
from ess_jax.config.knobs import to_configdict


def base_config() -> ml_collections.ConfigDict:
    """Every field of `fields.ConfigFields` at its default, in declaration order; an optional
    objective knob is a placeholder of its type (None: the objective's own value)."""
    return to_configdict(ConfigFields)

"""The experiment config: its defaults (defaults.py), the schema every field is checked against
before jax is imported (schema.py, with its tables of allowed values in domains.py), field names
and the "did you mean" for a name that is none (names.py), and the hardware presets and known
model shapes the paper configs and the memory planner read (presets.py). Imports nothing else
of ess_jax, and no jax."""

from ess_jax.config.defaults import base_config
from ess_jax.config.domains import CHOICES, DOMAINS, Domain
from ess_jax.config.names import explain_flag_error, unknown_field
from ess_jax.config.schema import (
    ConfigError,
    UserError,
    check,
    check_names,
    fail,
)

__all__ = [
    "base_config",
    "CHOICES",
    "DOMAINS",
    "ConfigError",
    "Domain",
    "UserError",
    "check",
    "check_names",
    "explain_flag_error",
    "fail",
    "unknown_field",
]

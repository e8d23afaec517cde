"""The experiment config: every field declared once with its default, domain and meaning
(fields.py and objective_fields.py, through knobs.py; the kinds of domain in domains.py), the
default config built from them (defaults.py), the checks every field passes before jax is
imported (schema.py), field names and the "did you mean" for a name that is none (names.py),
and the hardware presets and known model shapes the paper configs and the memory planner read
(presets.py). Imports nothing else of ess_jax, and no jax."""

from ess_jax.config.defaults import base_config
from ess_jax.config.domains import Domain
from ess_jax.config.fields import CHOICES, DOMAINS, RECORDS
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
    "RECORDS",
    "UserError",
    "check",
    "check_names",
    "explain_flag_error",
    "fail",
    "unknown_field",
]

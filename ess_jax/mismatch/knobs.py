"""One knob setting of the mismatch command: how the sampler draws and how the trainer scores.

A setting is written on the command line as comma-separated `key=value` pairs, e.g.
`precision=bfloat16`, `temperature=1.5`, `top_k=20,top_p=0.9`, `precision=bfloat16,
trainer=bfloat16` (the decode path against the full forward at equal precision), `lag=4,lr=5e-4`
or `external=/path/to/hf`. Keys left out keep the on-policy value: the float32 sampler at
temperature 1 over the full vocabulary, the float32 trainer, no lag, the model itself.

  precision    the sampler's numeric mode (`rollout.precision`; its values: config/schema.py
               PRECISIONS, meanings: sampling/precision.py)
  kv_cache     the KV cache's precision (`rollout.kv_cache_precision`: compute | bfloat16 |
               fp8, model/kv_cache.py)
  temperature  the sampler's temperature (> 0: a greedy pi_b is a point mass, no ratio)
  top_k, top_p the sampler's truncation (`draw.kept_support`)
  trainer      the trainer's forward dtype: float32 (the RL default) or bfloat16
  lag, lr      pi_b is the model, pi_theta the model after `lag` SFT steps at `lr` on the task's
               demonstrations (AdamW, `rl/steps.make_sft_step`): the ratio of a sampler that is
               `lag` updates behind
  external     pi_b is another checkpoint (same tokenizer), sampling in `precision`
  label        the setting's name in the tables (default: the pairs as written)
"""

from __future__ import annotations

import dataclasses

from ess_jax.config.domains import KV_CACHE_PRECISIONS, PRECISIONS
from ess_jax.config.schema import UserError

TRAINER_DTYPES = ("float32", "bfloat16")


class SettingError(UserError, ValueError):
    """A knob setting or mismatch-command argument the user can fix (one line)."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row of the atlas. Defaults are the on-policy pair (ratio 1 up to float rounding)."""

    precision: str = "float32"
    kv_cache: str = "compute"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    trainer: str = "float32"
    lag: int = 0
    lr: float = 5e-4
    external: str | None = None
    label: str = "float32"

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise SettingError(f"precision={self.precision!r}: not one of {', '.join(PRECISIONS)}")
        if self.kv_cache not in KV_CACHE_PRECISIONS:
            raise SettingError(
                f"kv_cache={self.kv_cache!r}: not one of {', '.join(KV_CACHE_PRECISIONS)}"
            )
        if not self.temperature > 0:
            raise SettingError(
                f"temperature={self.temperature}: must be > 0 (a greedy sampler draws from a point "
                "mass, its ratio to the trainer is not defined)"
            )
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise SettingError(
                f"top_k={self.top_k}, top_p={self.top_p}: need top_k >= 0, 0 < top_p <= 1"
            )
        if self.trainer not in TRAINER_DTYPES:
            raise SettingError(f"trainer={self.trainer!r}: not one of {', '.join(TRAINER_DTYPES)}")
        if self.lag < 0 or not self.lr > 0:
            raise SettingError(f"lag={self.lag}, lr={self.lr}: need lag >= 0 and lr > 0")
        if self.lag and self.external:
            raise SettingError("lag and external in one setting: pick one behaviour model")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_TYPES = {f.name: f.type for f in dataclasses.fields(Setting)}
_CAST = {"float": float, "int": int, "str": str, "str | None": str}


def parse_setting(text: str) -> Setting:
    """`key=value[,key=value...]` -> Setting; SettingError naming the bad pair."""
    kw: dict = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in _TYPES:
            raise SettingError(
                f"setting {text!r}: {pair!r} is not key=value with key in {', '.join(_TYPES)}"
            )
        try:
            kw[key] = _CAST[_TYPES[key]](value.strip())
        except ValueError:
            raise SettingError(
                f"setting {text!r}: {key}={value!r} is not a {_TYPES[key]}"
            ) from None
    if not kw:
        raise SettingError(f"setting {text!r}: empty; write e.g. precision=bfloat16")
    kw.setdefault("label", text)
    return Setting(**kw)

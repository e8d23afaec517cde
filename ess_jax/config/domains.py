"""The values a config field may take: the kinds of domain a field record carries (`Domain`,
an interval of numbers; `Choice`, a fixed set of strings; `Free`, a string without a fixed set,
with what checks it; `Flag`, a bool; `FreeForm`, a mapping whose keys a config chooses), the
common intervals, and the named sets of choices that other layers import (`PRECISIONS`,
`KV_CACHE_PRECISIONS`, `ATTENTION_IMPLS`, `ESS_SCOPES`, `TRAIN_MODES`, `ASYNC_ROLES`,
`LORA_BASE_PRECISIONS`, `COLLECTIVE_MATMULS`, `MODEL_DTYPES`, `LR_SCHEDULES`,
`ADVANTAGE_MODES`, the objective's) and `LORA_TARGETS`.

Every kind answers `contains(value)` and `describe()` (what a refusal says the value must be).
The field records that use them are fields.py's and objective_fields.py's.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Domain:
    """An interval of numbers (integers only with `integer`); `optional`: None is allowed (the
    objective's own value: base_config leaves the field None); `also`: extra allowed values
    outside the interval (mesh's -1). A sequence field (data.buckets) is checked element by
    element."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    optional: bool = False
    also: tuple = ()

    def contains(self, v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            return False
        if self.integer and not isinstance(v, numbers.Integral):
            return False
        if v in self.also:
            return True
        v = float(v)
        if not math.isfinite(v):
            return False
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return above and below

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        if self.hi == math.inf and self.lo == -math.inf:
            text = f"{kind} (finite)"
        elif self.hi == math.inf:
            text = f"{kind} {'>' if self.lo_open else '>='} {self.lo:g}"
        else:
            left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            text = f"{kind} in {left}{self.lo:g}, {self.hi:g}{right}"
        return text + "".join(f" or {a}" for a in self.also) + (" or None" * self.optional)


@dataclasses.dataclass(frozen=True)
class Choice:
    """A string field with a fixed set of values."""

    values: tuple[str, ...]
    optional = False

    def contains(self, v: Any) -> bool:
        return isinstance(v, str) and v in self.values

    def describe(self) -> str:
        return f"one of {', '.join(map(repr, self.values))}"


@dataclasses.dataclass(frozen=True)
class Free:
    """A string field without a fixed set of values; `checked_by`: what checks it and where
    (a registry of its own, in experiment.validate, or schema.check)."""

    checked_by: str
    optional = False

    def contains(self, v: Any) -> bool:
        return isinstance(v, str)

    def describe(self) -> str:
        return f"a string: {self.checked_by}"


@dataclasses.dataclass(frozen=True)
class Flag:
    """A bool field."""

    optional = False

    def contains(self, v: Any) -> bool:
        return isinstance(v, bool)

    def describe(self) -> str:
        return "True or False"


@dataclasses.dataclass(frozen=True)
class FreeForm:
    """A mapping whose keys a config chooses (the synthetic task's dials); `checked_by`: what
    checks its keys and values."""

    checked_by: str
    optional = False

    def contains(self, v: Any) -> bool:
        return isinstance(v, Mapping)

    def describe(self) -> str:
        return f"a mapping: {self.checked_by}"


def ints(lo: int, **kw) -> Domain:
    """The integers >= lo."""
    return Domain(lo=lo, integer=True, **kw)


POSITIVE = Domain(lo=0.0, lo_open=True)  # > 0
NONNEG = Domain(lo=0.0)  # >= 0
UNIT = Domain(lo=0.0, hi=1.0)  # [0, 1]
UNIT_OPEN_HI = Domain(lo=0.0, hi=1.0, hi_open=True)  # [0, 1)
FINITE = Domain()
MESH_AXIS = ints(1, also=(-1,))  # -1: all remaining devices
FLAG = Flag()

# ObjectiveConfig.ess_scope (meanings: ess_jax/objectives/scopes.py). Here,
# not in objectives/, so that the CLI refuses a bad name before jax is imported.
ESS_SCOPES = ("step", "microbatch", "microbatch_local")

# ModelConfig.attention_impl (meanings: ess_jax/model/config.py; "cudnn" also needs a CUDA backend,
# "splash" a TPU one, checked in experiment.validate).
ATTENTION_IMPLS = ("einsum", "xla", "cudnn", "splash")

# ModelConfig.decode_attention (meanings: ess_jax/model/blockwise_decode.py); both run on any
# backend.
DECODE_ATTENTIONS = ("dense", "blockwise")

# Sampler precisions (meanings: ess_jax/sampling/precision.py).
PRECISIONS = (
    "float32",
    "bfloat16",
    "float16",
    "fp8",
    "fp8_e4m3_tensor",
    "fp8_e5m2",
    "int8",
    "int4",
    "fp8_act",
)
# The sampler's KV cache (meanings: ess_jax/model/kv_cache.py): "compute" = the sampler's
# compute dtype.
KV_CACHE_PRECISIONS = ("compute", "bfloat16", "fp8")
# model.lora.base_precision (meanings: ess_jax/model/quant.py): the frozen base's block matrices
# in the param dtype ("compute") or as int8 / int4 codes with per-output-channel scales (QLoRA)
LORA_BASE_PRECISIONS = ("compute", "int8", "int4")

# model.routing_replay (meanings: ess_jax/model/moe.py): a mixture-of-experts trainer routes
# every token itself ("none") or replays the experts the sampler recorded ("sampler", R3).
ROUTING_REPLAYS = ("none", "sampler")

# model.moe_impl (meanings: ess_jax/model/moe.py, grouped.py): the experts of a mixture-of-experts
# block as dense contractions over every expert ("dense", any backend) or megablox's grouped
# matmul over each token's top-k ("grouped", a TPU kernel, checked in experiment.validate).
MOE_IMPLS = ("dense", "grouped")

# model.collective_matmul (meanings: ess_jax/parallel/sharding.py `compiler_options`): libtpu's
# collective matmuls of the train mesh's programs as its compiler chooses ("auto") or none.
COLLECTIVE_MATMULS = ("auto", "none")

# train.mode (meanings: ess_jax/rl/actor_learner.py).
TRAIN_MODES = ("sync", "async")

# train.async_role (meanings: ess_jax/rl/groups.py): both sides in one process, or one group of
# a two-program run.
ASYNC_ROLES = ("both", "trainer", "sampler")

# model.dtype: the trainer's compute dtype (params stay float32 masters; model/config.py).
MODEL_DTYPES = ("float32", "bfloat16", "float16")

# optim.schedule (ess_jax/rl/optim.py): after the linear warmup, "constant" holds optim.lr and
# "cosine" decays it to lr * optim.final_lr_fraction at the run's last update.
LR_SCHEDULES = ("constant", "cosine")

# rollout.advantage_mode (meanings: ess_jax/rl/advantages.py).
ADVANTAGE_MODES = ("grpo", "drgrpo", "rloo")

# The objective's string knobs (meanings: objective_fields.py and ess_jax/objectives/kl.py,
# whose KL_ESTIMATORS implement every kl_estimator name but "full", the re-scored exact KL).
KL_ESTIMATOR_NAMES = ("k1", "k2", "k3", "k3_tangent", "k3_is", "forward", "full")
REF_KL_ESTIMATORS = ("k1", "k2", "k3", "k3_tangent")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")
DUAL_VERSIONS = ("two_kl", "mixture")
IS_LEVELS = ("token", "sequence")
M2PO_FORMS = ("mask", "areal", "authors")  # objectives/m2po_forms.py
VCPO_BASELINES = ("paper", "authors")  # objectives/vcpo.py

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # model/lora.py's TARGETS

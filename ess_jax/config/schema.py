"""Config checks that need no jax: each numeric field's domain, required fields, the values of
fixed-choice string fields, field names, and the rollouts whose pi_b objective.kl_estimator
"full" cannot re-score exactly.

`check(config)` runs first in `experiment.validate`, and in `main` before jax is even imported,
so `--config.optim.lr=-0.5` fails in well under a second, before the workdir is touched, with
one line naming `config.optim.lr`. A typo'd field name, on the command line or inside a config
file, gets the closest valid one (or the field a name from another framework means, names.py).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable
from typing import Any

from ess_jax.config import names
from ess_jax.config.defaults import base_config
from ess_jax.config.names import as_dict, leaves, unknown_field


class UserError(Exception):
    """Something the user can fix: a config value, a busy workdir, an unreadable checkpoint.
    `main` reports it as one line (the traceback only with --verbose)."""


class ConfigError(UserError, ValueError):
    """A config value or field name the user can fix; the message starts with `config.<path>`."""


def fail(path: str, msg: str):
    raise ConfigError(f"config.{path}: {msg}")


@dataclasses.dataclass(frozen=True)
class Domain:
    """An interval of numbers (integers only with `integer`); `optional`: None is allowed (the
    field's own default); `also`: extra allowed values outside the interval (mesh's -1)."""

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


def _ints(lo: int, **kw) -> Domain:
    return Domain(lo=lo, integer=True, **kw)


_POS = Domain(lo=0.0, lo_open=True)  # > 0
_NONNEG = Domain(lo=0.0)  # >= 0
_UNIT = Domain(lo=0.0, hi=1.0)  # [0, 1]
_UNIT_OPEN_HI = Domain(lo=0.0, hi=1.0, hi_open=True)  # [0, 1)
_MESH = _ints(1, also=(-1,))  # -1: all remaining devices

# Every int / float field of defaults.base_config (a test keeps this table complete). Sequences
# (data.buckets, rollout.stop_ids) are checked element by element. task.difficulty is the task's
# own (checked by constructing the task in experiment.validate).
DOMAINS: dict[str, Domain] = {
    "seed": _ints(0),
    "mesh.data": _MESH,
    "mesh.fsdp": _MESH,
    "mesh.tensor": _MESH,
    "model.logits_chunk": _ints(0),
    "model.hidden_size": _ints(1),
    "model.intermediate_size": _ints(1),
    "model.num_layers": _ints(1),
    "model.num_heads": _ints(1),
    "model.num_kv_heads": _ints(1),
    "model.head_dim": _ints(1),
    "model.rope_theta": _POS,
    "model.init_seed": _ints(0),
    "task.num_train": _ints(0),  # 0: all
    "task.num_test": _ints(0),
    "data.prompts_per_step": _ints(1),
    "data.buckets": _ints(1),
    "rollout.group_size": _ints(1),
    "rollout.max_new_tokens": _ints(1),
    "rollout.temperature": _NONNEG,  # 0: greedy
    "rollout.top_k": _ints(0),  # 0: off
    "rollout.top_p": Domain(lo=0.0, hi=1.0, lo_open=True),
    "rollout.lag": _ints(0),
    "rollout.external_fraction": _UNIT_OPEN_HI,
    "rollout.stop_ids": _ints(0),
    "rollout.overlong_buffer": _ints(0),
    "rollout.sample_microbatches": _ints(1),
    "rollout.max_resample_rounds": _ints(0),
    "objective.constant_normalizer": _POS,
    "objective.clip_eps_low": Domain(lo=0.0, optional=True),
    "objective.clip_eps_high": Domain(lo=0.0, optional=True),
    "objective.dual_kl_gate": _NONNEG,
    "objective.behaviour_weight_cap": Domain(lo=0.0, lo_open=True, optional=True),
    "objective.beta_kl": _NONNEG,
    "objective.beta_ent": Domain(),  # a bonus (> 0) or a penalty (< 0)
    "objective.is_cap": _POS,
    "objective.is_cap_low": _NONNEG,
    "objective.is_veto": _UNIT_OPEN_HI,
    "objective.m2_threshold": _POS,
    "optim.lr": _POS,
    "optim.warmup_steps": _ints(0),
    "optim.final_lr_fraction": _UNIT,
    "optim.b1": _UNIT_OPEN_HI,
    "optim.b2": _UNIT_OPEN_HI,
    "optim.weight_decay": _NONNEG,
    "optim.max_grad_norm": _NONNEG,  # 0: no clipping
    "train.steps": _ints(0),
    "train.updates_per_batch": _ints(1),
    "train.num_microbatches": _ints(1),
    "train.checkpoint_every": _ints(1),
    "train.keep_checkpoints": _ints(1),
    "sft.steps": _ints(0),
    "sft.batch_size": _ints(1),
    "sft.lr": _POS,
    "sft.warmup_steps": _ints(0),
    "sft.seq_len": _ints(1),
    "sft.demo_noise": _UNIT,
    "eval.every": _ints(0),  # 0: no eval
    "eval.num_examples": _ints(0),  # 0: the whole held-out split
    "eval.batch_size": _ints(1),
    "eval.k": _ints(1),
    "eval.temperature": _NONNEG,
    "eval.max_new_tokens": _ints(1),
}


# ObjectiveConfig.ess_scope (meanings: ess_jax/objectives/scopes.py). Here,
# not in objectives.py, so that the CLI refuses a bad name before jax is imported.
ESS_SCOPES = ("step", "microbatch", "microbatch_local")

# ModelConfig.attention_impl (meanings: ess_jax/model/decoder.py; "cudnn" also needs a CUDA backend,
# checked in experiment.validate).
ATTENTION_IMPLS = ("einsum", "xla", "cudnn")

# Sampler precisions (meanings: ess_jax/sampling/precision.py).
PRECISIONS = ("float32", "bfloat16", "fp8")

# String fields with a fixed set of values. Names with a registry of their own (objective.name,
# task.name, task.reward) are checked by that registry in experiment.validate.
CHOICES: dict[str, tuple[str, ...]] = {
    "objective.ess_scope": ESS_SCOPES,
    "model.attention_impl": ATTENTION_IMPLS,
    "rollout.precision": PRECISIONS,
    "rollout.external_precision": PRECISIONS,
}


def check(config) -> None:
    """Every field is one of base_config's (`check_fields`), required fields are set, every
    numeric field is in its domain, every field of CHOICES is one of its values, the rollout can
    be re-scored for objective.kl_estimator "full", and the rules between fields hold
    (`check_rules`); else ConfigError naming the first bad field."""
    check_fields(config)
    _check_values(config)
    check_full_kl(config)
    check_rules(config)


def check_fields(config) -> None:
    """Every field of `config` is a field of defaults.base_config (or a key of a free-form
    mapping, names.FREE_FORM): a typo inside a config file (`c.optim.lrr = 1`) would otherwise
    run with the default and land in config.json. Only extra fields are refused (a partial
    config passes)."""
    for path, _ in leaves(as_dict(config)):
        if not names.is_known(path):
            msg = unknown_field(base_config(), path)
            raise ConfigError(msg or f"config.{path}: no such field")


def check_rules(config) -> None:
    """Rules between fields that need no devices, files or task (those are experiment.validate's:
    the mesh's data ranks, checkpoint paths, the task's own dials). A rule whose fields a partial
    config lacks is skipped."""
    c = as_dict(config)

    def get(*paths):
        values = [names.lookup(c, p) for p in paths]
        return None if any(v is names.MISSING for v in values) else values

    if v := get("model.source", "model.num_heads", "model.num_kv_heads"):
        source, heads, kv_heads = v
        if source == "embedded" and heads % kv_heads:
            fail("model.num_kv_heads", f"{kv_heads} does not divide num_heads={heads}")
    if (v := get("model.attention_impl", "model.dtype")) and v[0] == "cudnn" and v[1] != "bfloat16":
        fail("model.attention_impl", f"'cudnn' needs model.dtype 'bfloat16', got {v[1]!r}")
    if v := get("rollout.max_resample_rounds", "rollout.dynamic_sampling", "rollout.group_size"):
        rounds, dynamic, group = v
        if rounds and not dynamic:
            fail("rollout.max_resample_rounds", "resampling needs rollout.dynamic_sampling=True")
        if rounds and group < 2:
            fail(
                "rollout.max_resample_rounds",
                f"every group of rollout.group_size={group} has a constant reward: "
                "resampling could never fill the batch",
            )
    _check_learnable(get)
    if v := get("rollout.external_fraction", "rollout.external_checkpoint", "rollout.group_size"):
        fraction, checkpoint, group = v
        if fraction > 0 and not checkpoint:
            fail("rollout.external_checkpoint", "needed when rollout.external_fraction > 0")
        if fraction > 0 and round(fraction * group) in (0, group):
            fail(
                "rollout.external_fraction",
                f"{fraction} of a group of {group} rounds to no or all samples",
            )
    paths = ("data.prompts_per_step", "rollout.group_size", "train.updates_per_batch")
    if v := get(*paths, "train.num_microbatches", "rollout.sample_microbatches"):
        prompts, group, updates, micro, sample_micro = v
        batch = prompts * group
        if batch % updates:
            fail(
                "train.updates_per_batch",
                f"rollout batch {batch} (data.prompts_per_step x "
                f"rollout.group_size) is not divisible by it",
            )
        if prompts % sample_micro:
            fail("rollout.sample_microbatches", "does not divide data.prompts_per_step")
        if (batch // updates) % micro:
            fail(
                "train.num_microbatches", f"update batch {batch // updates} is not divisible by it"
            )


def _check_learnable(get) -> None:
    """Refuse the RL runs whose every advantage is 0 by construction: every advantage_mode
    (grpo, drgrpo, rloo) centres a reward on its group's mean, so a group of one sample, or of
    greedy samples (one completion drawn G times, one reward), gives no policy gradient; only
    the KL and entropy terms would move the policy. An external model's samples differ from the
    policy's, so greedy groups that mix both can still learn."""
    v = get("train.steps", "rollout.group_size", "rollout.temperature", "rollout.external_fraction")
    if not v or not v[0]:
        return  # no RL steps (an SFT warm start)
    _, group, temperature, external = v
    if group == 1:
        fail(
            "rollout.group_size",
            "1: each reward is its group's mean, so every group-relative advantage is 0 and RL "
            "cannot learn; use >= 2 samples per prompt",
        )
    if temperature == 0 and not external:
        fail(
            "rollout.temperature",
            f"0 (greedy) draws one completion rollout.group_size={group} times per prompt: each "
            "group's rewards are equal, every advantage is 0 and RL cannot learn; use a "
            "temperature > 0 (eval.temperature=0 evaluates greedily)",
        )


def check_full_kl(config) -> None:
    """objective.kl_estimator "full" re-scores pi_b's whole distribution in the train step
    (ess_jax/sampling/rescore.py). Refuse what cannot be re-scored exactly instead of
    approximating it."""
    c = as_dict(config)
    objective = c.get("objective", {})
    if objective.get("kl_estimator") != "full" or objective.get("name") != "p3o":
        return  # other objectives: ObjectiveConfig refuses "full" (they have no use for it)
    r, why = c.get("rollout", {}), "cannot be re-scored exactly for objective.kl_estimator='full'"
    lowp = (
        "the sampler's low-precision decode rounds differently from any full-sequence forward "
        "(log-probs ~1e-2 apart, as large as the precision mismatch itself)"
    )
    if r.get("precision", "float32") != "float32":
        fail("rollout.precision", f"{r['precision']!r} {why}: {lowp}; use float32 or k1/k2/k3")
    if r.get("external_fraction", 0) > 0 and r.get("external_precision", "float32") != "float32":
        fail(
            "rollout.external_precision",
            f"{r['external_precision']!r} {why}: {lowp}; use float32 or k1/k2/k3",
        )
    if r.get("temperature", 1.0) == 0:
        fail("rollout.temperature", f"0 (greedy) {why}: pi_b is a point mass, the KL is infinite")
    if c.get("model", {}).get("logits_chunk", 0) <= 0:
        fail(
            "model.logits_chunk",
            "objective.kl_estimator='full' needs it > 0: the policy's and pi_b's logits are "
            "held for logits_chunk positions at a time, never [B, T, V] twice (e.g. 256)",
        )


def _check_values(config) -> None:
    for path, value in leaves(as_dict(config)):
        dom = DOMAINS.get(path)
        if value is None:
            if dom is None or not dom.optional:
                fail(path, f"required and not set: give it, e.g. --config.{path}=...")
            continue
        if path in CHOICES and value not in CHOICES[path]:
            fail(path, f"must be one of {', '.join(map(repr, CHOICES[path]))}, got {value!r}")
        if dom is None:
            continue
        values = value if isinstance(value, (list, tuple)) else (value,)
        for v in values:
            if not dom.contains(v):
                fail(path, f"must be {dom.describe()}, got {value!r}")


def check_names(config, paths: Iterable[str], what: str) -> None:
    """Each of `paths` (a field, a section, or `section.*`) exists in `config`."""
    for p in paths:
        msg = unknown_field(config, p.removesuffix(".*"))
        if msg:
            raise ConfigError(f"{what}: {msg}")

"""The values each config field may take, as tables that need no jax: `DOMAINS` (every int /
float field's `Domain`), `CHOICES` (the fixed-choice string fields) with the tuples of names
that other layers import (`PRECISIONS`, `KV_CACHE_PRECISIONS`, `ATTENTION_IMPLS`,
`ESS_SCOPES`, `TRAIN_MODES`, `LORA_BASE_PRECISIONS`, `LR_SCHEDULES`, `ADVANTAGE_MODES`, the
objective's), `FREE_STRINGS` (the string fields without a fixed set) and `LORA_TARGETS`.
schema.py checks a config against them.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any


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
    "model.lora.rank": _ints(0),  # 0: off
    "model.lora.alpha": _POS,
    "model.lora.dropout": _UNIT_OPEN_HI,
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
    "rollout.max_lag": _ints(0),
    "rollout.target_ess": _UNIT_OPEN_HI,  # 0: no ESS pacing
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
    "objective.vcpo_base_ess_ratio": _POS,
    "objective.vcpo_is_cap": _POS,
    "objective.dppo_mask_low": _NONNEG,
    "objective.dppo_mask_high": _NONNEG,
    "objective.dppo_kl_tau": _NONNEG,
    "objective.icepop_low": _NONNEG,
    "objective.icepop_high": _POS,
    "objective.seq_mis_low": _NONNEG,
    "objective.seq_mis_high": _POS,
    "objective.geo_rs_low": _NONNEG,
    "objective.geo_rs_high": _POS,
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
    "train.async_rollout_devices": _ints(0),  # 0: half of the devices
    "train.async_rollout_tensor": _ints(1),
    "train.sync_every": _ints(1),
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

# ModelConfig.attention_impl (meanings: ess_jax/model/config.py; "cudnn" also needs a CUDA backend,
# "splash" a TPU one, checked in experiment.validate).
ATTENTION_IMPLS = ("einsum", "xla", "cudnn", "splash")

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

# train.mode (meanings: ess_jax/rl/actor_learner.py).
TRAIN_MODES = ("sync", "async")

# model.dtype: the trainer's compute dtype (params stay float32 masters; model/config.py).
MODEL_DTYPES = ("float32", "bfloat16", "float16")

# optim.schedule (ess_jax/rl/optim.py): after the linear warmup, "constant" holds optim.lr and
# "cosine" decays it to lr * optim.final_lr_fraction at the run's last update.
LR_SCHEDULES = ("constant", "cosine")

# rollout.advantage_mode (meanings: ess_jax/rl/advantages.py).
ADVANTAGE_MODES = ("grpo", "drgrpo", "rloo")

# The objective's string knobs (meanings: ess_jax/objectives/config.py and kl.py, whose
# KL_ESTIMATORS implement every kl_estimator name but "full", the re-scored exact KL).
KL_ESTIMATOR_NAMES = ("k1", "k2", "k3", "k3_tangent", "k3_is", "forward", "full")
REF_KL_ESTIMATORS = ("k1", "k2", "k3", "k3_tangent")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")
DUAL_VERSIONS = ("two_kl", "mixture")
IS_LEVELS = ("token", "sequence")
M2PO_FORMS = ("mask", "areal", "authors")  # objectives/m2po_forms.py
VCPO_BASELINES = ("paper", "authors")  # objectives/vcpo.py

# String fields with a fixed set of values (a test keeps every string field of base_config either
# here or in FREE_STRINGS).
CHOICES: dict[str, tuple[str, ...]] = {
    "objective.ess_scope": ESS_SCOPES,
    "objective.kl_estimator": KL_ESTIMATOR_NAMES,
    "objective.ref_kl_estimator": REF_KL_ESTIMATORS,
    "objective.aggregation": AGGREGATIONS,
    "objective.dual_version": DUAL_VERSIONS,
    "objective.is_level": IS_LEVELS,
    "objective.m2po_form": M2PO_FORMS,
    "objective.vcpo_baseline": VCPO_BASELINES,
    "model.dtype": MODEL_DTYPES,
    "model.attention_impl": ATTENTION_IMPLS,
    "optim.schedule": LR_SCHEDULES,
    "rollout.advantage_mode": ADVANTAGE_MODES,
    "rollout.precision": PRECISIONS,
    "rollout.external_precision": PRECISIONS,
    "rollout.kv_cache_precision": KV_CACHE_PRECISIONS,
    "eval.precision": PRECISIONS,
    "eval.kv_cache_precision": KV_CACHE_PRECISIONS,
    "train.mode": TRAIN_MODES,
    "model.lora.base_precision": LORA_BASE_PRECISIONS,
}

# String fields without a fixed set of values, and what checks each. Names with a registry of
# their own are checked by that registry in experiment.validate.
FREE_STRINGS: dict[str, str] = {
    "model.source": "embedded | smollm2 | a Hugging Face directory or .gguf file (validate)",
    "model.lora.targets": "comma-separated LORA_TARGETS (schema.check)",
    "objective.name": "a key of objectives/registry.py's OBJECTIVES (validate)",
    "task.name": "a synthetic task or local dataset of rl/experiment.py (validate)",
    "task.reward": "a reward of ess_jax/rewards (validate)",
    "task.manual_dir": "a directory (validate, for the local datasets)",
    "task.cache_dir": "a directory ('': beside manual_dir)",
    "task.test_split": "a split of the task's files",
    "rollout.external_checkpoint": "as model.source (validate, with external_fraction > 0)",
}


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # model/lora.py's TARGETS

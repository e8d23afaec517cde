"""Field names: the paths of `defaults.base_config`, the mappings whose keys are free-form, and
the names researchers bring from other frameworks (TRL, verl, Hugging Face Trainer), which the
"did you mean" of `schema.unknown_field` maps to the field they mean here.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

from ess_jax.config.defaults import base_config

# Mappings whose keys a config chooses: the synthetic task's own dials ({"digits": 2}),
# checked by constructing the task in experiment.validate.
FREE_FORM = ("task.difficulty",)

# A name typed in place of a field -> that field. A "section.name" key applies in that section
# only; a bare name anywhere, and when the typed section has a field of the target's name
# (sft.learning_rate), that one is meant (sft.lr). batch_size has no bare entry: in RL it means
# prompts or sequences, per step or per update, depending on the framework.
ALIASES: dict[str, str] = {
    "learning_rate": "optim.lr",
    "lr_schedule": "optim.schedule",
    "lr_scheduler_type": "optim.schedule",
    "warmup": "optim.warmup_steps",
    "num_warmup_steps": "optim.warmup_steps",
    "grad_clip": "optim.max_grad_norm",
    "clip_grad_norm": "optim.max_grad_norm",
    "beta1": "optim.b1",
    "beta2": "optim.b2",
    "adam_beta1": "optim.b1",
    "adam_beta2": "optim.b2",
    "steps": "train.steps",
    "num_steps": "train.steps",
    "max_steps": "train.steps",
    "total_steps": "train.steps",
    "num_train_steps": "train.steps",
    "gradient_accumulation_steps": "train.num_microbatches",
    "save_steps": "train.checkpoint_every",
    "eval_steps": "eval.every",
    "data.batch_size": "data.prompts_per_step",
    "data.train_batch_size": "data.prompts_per_step",
    "num_generations": "rollout.group_size",
    "num_samples": "rollout.group_size",
    "rollout.n": "rollout.group_size",
    "max_completion_length": "rollout.max_new_tokens",
    "max_response_length": "rollout.max_new_tokens",
    "temperature": "rollout.temperature",
    "kl_coef": "objective.beta_kl",
    "beta": "objective.beta_kl",
    "entropy_coeff": "objective.beta_ent",
    "model_name_or_path": "model.source",
}


_MISSING = object()


@functools.cache
def known_paths() -> frozenset[str]:
    """Every field path of `base_config()` (an empty mapping, e.g. task.difficulty, is one)."""

    def walk(tree: Mapping, prefix: str):
        for key, value in tree.items():
            if isinstance(value, Mapping) and value:
                yield from walk(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}"

    return frozenset(walk(base_config().to_dict(), ""))


def is_known(path: str) -> bool:
    """`path` is a field of base_config or a key inside a FREE_FORM mapping."""
    return path in known_paths() or any(path.startswith(f + ".") for f in FREE_FORM)


def _get(tree: Mapping, parts: Sequence[str]):
    for part in parts:
        if not isinstance(tree, Mapping) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


def alias(tree: Mapping, path: str) -> str | None:
    """The field of `tree` (a config as a dict) that ALIASES says `path` means, or None."""
    parts = path.split(".")
    section, name = parts[:-1], parts[-1]
    target = ALIASES.get(path) or ALIASES.get(name)
    if target is None:
        return None
    leaf = target.rsplit(".", 1)[1]
    here = _get(tree, section)
    if section and isinstance(here, Mapping) and leaf in here:
        return ".".join([*section, leaf])
    return target if _get(tree, target.split(".")) is not _MISSING else None

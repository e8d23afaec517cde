"""Field names: the paths of `defaults.base_config` and the keys inside its free-form mappings
(fields.FREE_FORM: the synthetic task's dials), the names researchers bring from other
frameworks (TRL, verl, Hugging Face Trainer), and the one-line "did you mean" for a name that is
no field (`unknown_field`, `explain_flag_error`), which maps such a name to the field it means
here.
"""

from __future__ import annotations

import difflib
import functools
import os
from collections.abc import Iterable, Mapping
from typing import Any

from ess_jax.config.defaults import base_config
from ess_jax.config.fields import FREE_FORM

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
    "lora_r": "model.lora.rank",
    "lora_rank": "model.lora.rank",
    "lora_alpha": "model.lora.alpha",
    "lora_dropout": "model.lora.dropout",
    "target_modules": "model.lora.targets",
}


MISSING = object()  # `lookup`'s answer for a path the tree does not have


@functools.cache
def known_paths() -> frozenset[str]:
    """Every field path of `base_config()` (an empty mapping, e.g. task.difficulty, is one)."""
    return frozenset(path for path, _ in leaves(base_config().to_dict()))


def is_known(path: str) -> bool:
    """`path` is a field of base_config or a key inside a FREE_FORM mapping."""
    return path in known_paths() or any(path.startswith(f + ".") for f in FREE_FORM)


def lookup(tree: Mapping, path: str):
    """The value at the dotted `path` of `tree` (a config as a dict), or MISSING."""
    for part in path.split("."):
        if not isinstance(tree, Mapping) or part not in tree:
            return MISSING
        tree = tree[part]
    return tree


def assign(config, path: str, value) -> None:
    """Sets the field at the dotted `path` of `config` (a ConfigDict or nested dicts)."""
    *parents, leaf = path.split(".")
    node = config
    for part in parents:
        node = node[part]
    node[leaf] = value


def literal(text: str):
    """A command line's VALUE of FIELD=VALUE: a Python literal (True, 3, 0.5, 'a', (1, 2)),
    else the text itself as a string."""
    import ast

    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def alias(tree: Mapping, path: str) -> str | None:
    """The field of `tree` (a config as a dict) that ALIASES says `path` means, or None."""
    parts = path.split(".")
    section, name = parts[:-1], parts[-1]
    target = ALIASES.get(path) or ALIASES.get(name)
    if target is None:
        return None
    leaf = target.rsplit(".", 1)[1]
    here = lookup(tree, ".".join(section))
    if section and isinstance(here, Mapping) and leaf in here:
        return ".".join([*section, leaf])
    return target if lookup(tree, target) is not MISSING else None


def leaves(tree: Mapping, prefix: str = "") -> Iterable[tuple[str, Any]]:
    """(dotted path, value) of every leaf; an empty mapping is a leaf."""
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from leaves(value, path + ".")
        else:
            yield path, value


def as_dict(config) -> dict:
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def unknown_field(config, path: str) -> str | None:
    """None if `path` (e.g. "objective.name") is a field of `config`; else a one-line message
    naming it and the field it most likely means: the one ALIASES gives (learning_rate
    -> optim.lr), else the closest spelling in its section, else the closest path."""
    tree = as_dict(config)
    node, parts = tree, path.split(".")
    for i, part in enumerate(parts):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
            continue
        if not isinstance(node, Mapping):
            return f"config.{path}: no such field ({'.'.join(parts[:i])} is not a section)"
        guess = alias(tree, path)
        close = difflib.get_close_matches(part, [str(k) for k in node], n=1, cutoff=0.5)
        if guess is None and close:
            guess = ".".join([*parts[:i], close[0], *parts[i + 1 :]])
        elif guess is None:
            every = [p for p, _ in leaves(tree)]
            close = difflib.get_close_matches(path, every, n=1, cutoff=0.5)
            guess = close[0] if close else None
        hint = f"; did you mean {guess}?" if guess else ""
        return f"config.{path}: no such field{hint}"
    return None


def config_file(argv: list[str]) -> str | None:
    """The `--config` flag's value (FILE[:ARG]) on a command line, or None."""
    found = None
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            found = a.split("=", 1)[1]
        elif a == "--config" and i + 1 < len(argv):
            found = argv[i + 1]
    return found


def config_root(spec: str) -> str | None:
    """The nearest directory above the config file of `spec` (FILE[:ARG]) that holds a
    `configs` package: what `from configs.mini import common` in the file needs on sys.path,
    wherever the command runs from. None when no directory above it holds one."""
    here = os.path.dirname(os.path.abspath(spec.partition(":")[0]))
    while True:
        if os.path.isfile(os.path.join(here, "configs", "__init__.py")):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def explain_flag_error(argv: list[str], exc: Exception) -> str:
    """One line for a command line the flags parser refused: an unknown `--config.<field>`
    names the closest field; a config file that raised gives its exception's last line (a
    `configs` package it cannot import: where to keep the file or run from)."""
    text = str(exc)
    spec = config_file(argv)
    overrides = [a[len("--config.") :].split("=", 1)[0] for a in argv if a.startswith("--config.")]
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "configs":
        return (
            f"config file {spec}: {text}: it imports the repository's configs package, so keep "
            "it under the repository (beside configs/), or run from the repository's root"
        )
    if "Error whilst parsing config file" in text:
        last = [line for line in text.splitlines() if line.strip()][-1].strip()
        return f"config file {spec}: {last}"
    if spec and overrides and isinstance(exc, (AttributeError, KeyError)):
        from ml_collections.config_flags.config_flags import ConfigFileFlagParser

        try:
            config = ConfigFileFlagParser("config", lock_config=False).parse(spec)
        except Exception:  # reported below as the parser's own message
            config = None
        for path in overrides if config is not None else ():
            msg = unknown_field(config, path)
            if msg:
                return msg
    return " ".join(text.replace("\\n", " ").split())

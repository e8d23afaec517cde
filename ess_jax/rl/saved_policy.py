"""The policy a tool samples from, named by one path (tools/evaluate.py, tools/generate.py): a
Hugging Face directory, a .gguf file, or a run's workdir. A workdir gives its `hf/` export if
there is one, else the params of its newest orbax checkpoint, with the model the workdir's own
config.json (the experiment config) describes: the embedded model's sizes, or the config and
tokenizer of its `model.source`.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import ml_collections

from ess_jax.config.schema import UserError
from ess_jax.data import char_tokenizer
from ess_jax.io.checkpoint import Checkpointer
from ess_jax.model import decoder as model_lib
from ess_jax.model import lora
from ess_jax.rl import experiment, lora_policy

WHAT_TO_PASS = (
    "pass a Hugging Face directory (config.json with model_type), a .gguf file, or a run's "
    "workdir (config.json with hf/ or checkpoints/ beside it)"
)


class CheckpointPathError(UserError, ValueError):
    """A path that names no loadable policy."""


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            out = json.load(f)
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def _is_hf_config(d: dict | None) -> bool:
    return d is not None and ("model_type" in d or "architectures" in d)


def resolve(path: str) -> tuple[str, str]:
    """("hf", dir), ("gguf", file) or ("workdir", dir) for `path`; CheckpointPathError saying
    what to pass otherwise."""
    path = os.fspath(path)
    if path.endswith(".gguf") and os.path.isfile(path):
        return "gguf", path
    if os.path.isdir(path):
        own = _read_json(os.path.join(path, "config.json"))
        if _is_hf_config(own):
            return "hf", path
        hf = os.path.join(path, "hf")
        if _is_hf_config(_read_json(os.path.join(hf, "config.json"))):
            return "hf", hf
        if own is not None and "model" in own and os.path.isdir(os.path.join(path, "checkpoints")):
            return "workdir", path
    raise CheckpointPathError(f"{path}: not a checkpoint; {WHAT_TO_PASS}")


def _run_model(workdir: str, mcfg) -> tuple[model_lib.ModelConfig, Any]:
    """The ModelConfig and tokenizer of a run's `model` section, without the source's weights."""
    if mcfg.source == "embedded":
        tokenizer = char_tokenizer()
        return experiment.embedded_model_config(mcfg, tokenizer), tokenizer
    from ess_jax.io import weights

    source = mcfg.source
    try:
        source = weights.smollm2_gguf_path() if source == "smollm2" else source
        cfg, tokenizer = weights.checkpoint_config(source)
    except (OSError, ValueError) as e:
        raise CheckpointPathError(
            f"{workdir}: its checkpoints need the config and tokenizer of the run's model.source "
            f"{mcfg.source!r}, which do not load ({e}); pass its hf/ export instead (a run "
            "writes one with --config.train.export_hf=True)"
        ) from e
    if tokenizer is None:
        raise CheckpointPathError(f"{workdir}: the run's model.source {source!r} has no tokenizer")
    return cfg.replace(**experiment.trainer_settings(mcfg)), tokenizer


def _load_workdir(workdir: str, mesh) -> tuple[model_lib.ModelConfig, Any, Any, str]:
    with open(os.path.join(workdir, "config.json")) as f:
        run = ml_collections.ConfigDict(json.load(f))
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=None)
    step = ckpt.latest_step()
    if step is None:
        raise CheckpointPathError(
            f"{workdir}: no hf/ export and no committed checkpoint yet; {WHAT_TO_PASS}"
        )
    cfg, tokenizer = _run_model(workdir, run.model)
    rank = lora_policy.lora_settings(run.model)[0]
    cfg = lora_policy.lora_config(run.model, cfg)  # a LoRA run's checkpoints: adapters only
    abstract = model_lib.abstract_params(cfg)
    if mesh is not None:
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            abstract,
            model_lib.param_shardings(cfg, mesh),
        )
    if rank:
        abstract = lora.split(abstract)[1]
    _, tree, _ = ckpt.restore({"state": {"params": abstract}}, step, partial=True)
    params = tree["state"]["params"]
    if rank:  # merged onto the run's frozen base, model.source
        _, base, _ = experiment.load_policy(run.model, mesh, need_tokenizer=False)
        base = lora_policy.frozen_base(cfg, base, mesh)  # as the run trained on it (QLoRA)
        params, cfg = lora_policy.merged(cfg, base, params, "train"), lora.base_config(cfg)
    return cfg, params, tokenizer, str(ckpt.directory / str(step))


def _warn_if_stale(workdir: str, hf: str) -> None:
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=None)
    step = ckpt.latest_step()
    if step is not None:
        newest = ckpt.directory / str(step)
        if os.path.getmtime(newest) > os.path.getmtime(os.path.join(hf, "config.json")):
            logging.warning(
                f"{hf} is older than checkpoint step {step} ({newest}): the run went on without "
                "train.export_hf; resume it with --config.train.export_hf=True to export it"
            )


def load(path: str, mesh=None, settings: dict | None = None):
    """(cfg, params, tokenizer, source): the policy `path` names (see `resolve`), params in the
    train layout of `mesh` (or on one device), `settings` (experiment.trainer_settings: dtype,
    ...) applied to cfg; `source` is what was read (an hf/ directory, a checkpoint step)."""
    from ess_jax.io import weights

    kind, where = resolve(path)
    if kind == "workdir":
        cfg, params, tokenizer, where = _load_workdir(where, mesh)
    else:
        if kind == "hf" and os.path.abspath(where) != os.path.abspath(path):
            _warn_if_stale(path, where)
        cfg, params, tokenizer = weights.load_checkpoint(where, mesh=mesh)
    return (cfg.replace(**settings) if settings else cfg), params, tokenizer, where

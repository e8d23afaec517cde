"""From an ml_collections config to the run's parts: checks, model, tokenizer, data, reward.

`validate(config)` runs before anything is compiled, so a typo in a config fails in a second
with a message naming the field, not after minutes of XLA compilation.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from ess_jax import objectives as obj_lib
from ess_jax import rewards as rewards_lib
from ess_jax.config.schema import check, fail
from ess_jax.data import char_tokenizer, get_task, load_dataset
from ess_jax.model import decoder as model_lib
from ess_jax.parallel import sharding as sharding_lib

SYNTHETIC_TASKS = ("addition", "sort", "countdown")
LOCAL_DATASETS = ("gsm8k", "deepscaler", "math")
PRECISIONS = ("float32", "bfloat16", "fp8")


def _mesh_sizes(config) -> dict[str, int]:
    try:
        return sharding_lib.mesh_shape(dict(config.mesh), jax.device_count())
    except ValueError as e:
        fail("mesh", str(e))


def validate(config) -> None:
    """Every check that can be made without compiling; raises ConfigError (a ValueError)
    naming the field. Reads files (checkpoint paths) but never writes any."""
    check(config)  # required fields and numeric domains
    try:
        obj_lib.get_objective(config.objective.name)
    except (ValueError, KeyError) as e:
        fail("objective.name", str(e))
    try:
        obj_lib.objective_config(config.objective.to_dict())
    except ValueError as e:
        fail("objective", str(e))
    m = config.model
    if m.source == "embedded" and m.num_heads % m.num_kv_heads:
        fail("model.num_kv_heads", f"{m.num_kv_heads} does not divide num_heads={m.num_heads}")
    if m.get("attention_impl") == "cudnn":
        if jax.default_backend() != "gpu":
            fail(
                "model.attention_impl",
                f"'cudnn' runs on NVIDIA GPUs only; this run's backend is "
                f"{jax.default_backend()!r} (use 'einsum')",
            )
        if m.dtype != "bfloat16":
            fail("model.attention_impl", f"'cudnn' needs model.dtype 'bfloat16', got {m.dtype!r}")
    if config.task.name not in SYNTHETIC_TASKS + LOCAL_DATASETS:
        fail(
            "task.name",
            f"unknown task {config.task.name!r}; valid: "
            f"{', '.join(SYNTHETIC_TASKS + LOCAL_DATASETS)}",
        )
    if config.task.name in SYNTHETIC_TASKS:
        try:
            get_task(config.task.name, **dict(config.task.difficulty))
        except (TypeError, ValueError) as e:
            fail("task.difficulty", str(e))
    if config.task.name in LOCAL_DATASETS and not os.path.isdir(str(config.task.manual_dir)):
        fail(
            "task.manual_dir",
            f"{config.task.manual_dir!r} is not a directory holding the {config.task.name} files",
        )
    try:
        rewards_lib.get_reward(config.task.reward)
    except (ValueError, KeyError) as e:
        fail("task.reward", str(e))
    r = config.rollout
    for field in ("precision", "external_precision"):
        if r[field] not in PRECISIONS:
            fail(f"rollout.{field}", f"{r[field]!r} is not one of {PRECISIONS}")
    if r.group_size < 1:
        fail("rollout.group_size", "must be >= 1")
    if r.lag < 0:
        fail("rollout.lag", "must be >= 0")
    if r.max_resample_rounds and not r.dynamic_sampling:
        fail("rollout.max_resample_rounds", "resampling needs rollout.dynamic_sampling=True")
    if r.max_resample_rounds and r.group_size < 2:
        fail(
            "rollout.max_resample_rounds",
            f"every group of rollout.group_size={r.group_size} has a constant reward: "
            "resampling could never fill the batch",
        )
    if not 0.0 <= r.external_fraction < 1.0:
        fail("rollout.external_fraction", "must be in [0, 1)")
    if r.external_fraction > 0:
        if not r.external_checkpoint:
            fail("rollout.external_checkpoint", "needed when rollout.external_fraction > 0")
        if round(r.external_fraction * r.group_size) in (0, r.group_size):
            fail(
                "rollout.external_fraction",
                f"{r.external_fraction} of a group of {r.group_size} rounds to no or all samples",
            )
        _check_checkpoint("rollout.external_checkpoint", r.external_checkpoint)
    _check_checkpoint("model.source", config.model.source)
    sizes = _mesh_sizes(config)
    data_ranks = sizes["data"] * sizes["fsdp"]
    batch = config.data.prompts_per_step * r.group_size
    t = config.train
    if batch % t.updates_per_batch:
        fail(
            "train.updates_per_batch",
            f"rollout batch {batch} (data.prompts_per_step x "
            f"rollout.group_size) is not divisible by it",
        )
    if config.data.prompts_per_step % r.sample_microbatches:
        fail("rollout.sample_microbatches", "does not divide data.prompts_per_step")
    per_update = batch // t.updates_per_batch
    if per_update % t.num_microbatches:
        fail("train.num_microbatches", f"update batch {per_update} is not divisible by it")
    if (per_update // t.num_microbatches) % data_ranks:
        fail(
            "data.prompts_per_step",
            f"micro-batch of {per_update // t.num_microbatches} "
            f"sequences does not divide over {data_ranks} data ranks "
            f"of mesh {sizes}",
        )
    if config.sft.steps and config.sft.batch_size % data_ranks:
        fail("sft.batch_size", f"not divisible by {data_ranks} data ranks")
    if config.eval.every and (config.eval.batch_size * config.eval.k) % data_ranks:
        fail("eval.batch_size", f"eval batch x eval.k not divisible by {data_ranks} data ranks")


def _check_checkpoint(field: str, source: str) -> None:
    if source == "embedded":
        return
    if source == "smollm2":
        from ess_jax.io.gguf_llama import smollm2_gguf_path

        try:
            smollm2_gguf_path()
        except FileNotFoundError as e:
            fail(field, str(e))
        return
    if not os.path.exists(source):
        fail(field, f"checkpoint {source!r} does not exist")
    if os.path.isdir(source) and not os.path.exists(os.path.join(source, "config.json")):
        fail(field, f"{source!r} has no config.json (not a Hugging Face checkpoint)")


def load_policy(
    mcfg, mesh=None, need_tokenizer: bool = True
) -> tuple[model_lib.ModelConfig, Any, Any]:
    """(cfg, params, tokenizer) for `model.source`: embedded | smollm2 | HF dir | .gguf.

    An external behaviour model shares the policy's tokenizer: `need_tokenizer=False`."""
    from ess_jax.io import weights  # heavy imports (safetensors, gguf) only when needed

    source = mcfg.source
    if source == "embedded":
        tok = char_tokenizer()
        cfg = model_lib.ModelConfig(
            vocab_size=len(tok),
            hidden_size=mcfg.hidden_size,
            intermediate_size=mcfg.intermediate_size,
            num_layers=mcfg.num_layers,
            num_heads=mcfg.num_heads,
            num_kv_heads=mcfg.num_kv_heads,
            head_dim=mcfg.head_dim,
            tie_embeddings=mcfg.tie_embeddings,
            dtype=mcfg.dtype,
            rope_theta=mcfg.rope_theta,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            logits_chunk=mcfg.logits_chunk,
            remat=mcfg.remat,
            attention_impl=mcfg.get("attention_impl", "einsum"),
        )
        shardings = None if mesh is None else model_lib.param_shardings(cfg, mesh)
        return cfg, model_lib.init_params(cfg, int(mcfg.init_seed), shardings), tok
    path = weights.smollm2_gguf_path() if source == "smollm2" else source
    cfg, params, tok = weights.load_checkpoint(path, mesh=mesh)
    if tok is None and need_tokenizer:
        fail("model.source", f"{path!r} has no tokenizer files")
    cfg = cfg.replace(
        dtype=mcfg.dtype,
        logits_chunk=mcfg.logits_chunk,
        remat=mcfg.remat,
        attention_impl=mcfg.get("attention_impl", "einsum"),
    )
    return cfg, params, tok


def load_examples(tcfg) -> tuple[list[dict], list[dict]]:
    """(train, held-out) example lists for `task.name`."""
    if tcfg.name in SYNTHETIC_TASKS:
        task = get_task(tcfg.name, **dict(tcfg.difficulty))
        train = task.examples("train", tcfg.num_train or None)
        test = task.examples("test", tcfg.num_test or None)
    else:
        train = list(load_dataset(tcfg.name, tcfg.manual_dir, "train"))
        test = list(load_dataset(tcfg.name, tcfg.manual_dir, tcfg.test_split))
        train, test = train[: tcfg.num_train or None], test[: tcfg.num_test or None]
    if not train:
        fail("task", f"{tcfg.name}: the train split is empty")
    if not test:
        fail("task", f"{tcfg.name}: the held-out split is empty")
    return train, test


def stop_ids(config, tokenizer) -> tuple[int, ...]:
    ids = tuple(config.rollout.stop_ids)
    if ids:
        return ids
    eos = tokenizer.eos_token_id
    extra = [
        tokenizer.convert_tokens_to_ids(t)
        for t in ("<|im_end|>", "<|endoftext|>")
        if t in tokenizer.get_vocab()
    ]
    return tuple(sorted({eos, *extra} - {None}))

"""From an ml_collections config to the run's parts: checks, model, tokenizer, data, reward.

`validate(config)` runs before anything is compiled, so a typo in a config fails in a second
with a message naming the field, not after minutes of XLA compilation.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax

from ess_jax import objectives as obj_lib
from ess_jax import rewards as rewards_lib
from ess_jax.config.schema import check, fail
from ess_jax.data import (
    CacheDirError,
    PromptBatcher,
    PromptTooLongError,
    UnencodableError,
    char_tokenizer,
    get_task,
    load_dataset,
)
from ess_jax.model import decoder as model_lib
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.rl import device_split

SYNTHETIC_TASKS = ("addition", "sort", "countdown")
LOCAL_DATASETS = ("gsm8k", "deepscaler", "math")


def _mesh_sizes(config) -> dict[str, int]:
    """The train mesh's sizes: every device, less the rollout mesh's in train.mode "async"."""
    n = jax.device_count()
    try:
        return sharding_lib.mesh_shape(
            dict(config.mesh), n - device_split.rollout_device_count(config, n)
        )
    except ValueError as e:
        fail("mesh", str(e))


def validate(config) -> None:
    """Every check that can be made without compiling; raises ConfigError (a ValueError)
    naming the field. The rules that need no devices, files or task are the schema's
    (config/schema.py `check`); here: the objective's record, the backend, the task, the
    reward, the checkpoint paths and the mesh's data ranks. Reads files but never writes any."""
    check(config)
    try:
        obj_lib.objective_config(config.objective.to_dict())
    except ValueError as e:
        unknown_name = config.objective.name not in obj_lib.OBJECTIVES
        fail("objective.name" if unknown_name else "objective", str(e))
    if config.model.get("attention_impl") == "cudnn" and jax.default_backend() != "gpu":
        fail(
            "model.attention_impl",
            f"'cudnn' runs on NVIDIA GPUs only; this run's backend is "
            f"{jax.default_backend()!r} (use 'einsum')",
        )
    if config.model.get("attention_impl") == "splash" and jax.default_backend() != "tpu":
        fail(
            "model.attention_impl",
            f"'splash' runs on TPUs only; this run's backend is "
            f"{jax.default_backend()!r} (use 'einsum')",
        )
    if config.model.get("moe_impl") == "grouped" and jax.default_backend() != "tpu":
        fail(
            "model.moe_impl",
            f"'grouped' runs on TPUs only; this run's backend is "
            f"{jax.default_backend()!r} (use 'dense')",
        )
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
    if r.external_fraction > 0:
        _check_checkpoint("rollout.external_checkpoint", r.external_checkpoint)
    _check_checkpoint("model.source", config.model.source)
    _check_experts(config)
    device_split.check(config)  # one process, a device split that leaves both sides some
    sizes = _mesh_sizes(config)
    data_ranks = sharding_lib.batch_ranks(sizes)
    per_update = config.data.prompts_per_step * r.group_size // config.train.updates_per_batch
    micro_batch = per_update // config.train.num_microbatches
    if micro_batch % data_ranks:
        fail(
            "data.prompts_per_step",
            f"micro-batch of {micro_batch} sequences does not divide over {data_ranks} data "
            f"ranks of mesh {sizes}",
        )
    if config.sft.steps and config.sft.batch_size % data_ranks:
        fail("sft.batch_size", f"not divisible by {data_ranks} data ranks")
    if config.eval.every and (config.eval.batch_size * config.eval.k) % data_ranks:
        fail("eval.batch_size", f"eval batch x eval.k not divisible by {data_ranks} data ranks")


def num_experts(source: str) -> int:
    """The experts per sparse layer of the checkpoint `source`, as loading reads them from its
    config.json (io.weights.config_from_hf); 0 for a dense model or another source."""
    path = os.path.join(str(source), "config.json")
    if not os.path.isfile(path):
        return 0
    from ess_jax.io import weights  # heavy imports (safetensors, gguf) only when needed

    with open(path) as f:
        return weights.config_from_hf(json.load(f)).num_experts


def _check_experts(config) -> None:
    """A mixture-of-experts source takes no LoRA adapters; mesh.expert shards experts, so it
    needs an MoE model whose expert count it divides; routing replay and the router's
    auxiliary loss need a router. Checked before any weight is loaded."""
    source = config.model.source
    experts = int(config.model.get("num_experts", 0)) if source == "embedded" else 0
    experts = experts or num_experts(source)
    if experts and int(config.model.lora.rank):
        fail("model.lora.rank", f"LoRA adapters on a mixture-of-experts model ({experts} "
             "experts per sparse layer) are not supported; use rank 0")  # fmt: skip
    if not experts and config.model.get("routing_replay", "none") != "none":
        fail("model.routing_replay", f"{config.model.source!r} is a dense model (no experts "
             "to route); use none")  # fmt: skip
    if not experts and config.model.get("moe_impl", "dense") != "dense":
        fail("model.moe_impl", f"{config.model.source!r} is a dense model (no experts "
             "to group); use dense")  # fmt: skip
    aux = float(config.model.get("moe_aux_loss_coef", 0.0))
    if not experts and aux:
        fail("model.moe_aux_loss_coef", f"{config.model.source!r} is a dense model (no "
             "router to balance); use 0")  # fmt: skip
    if aux and config.objective.get("kl_estimator") == "full":
        fail("model.moe_aux_loss_coef", "the router's loss is not in objective.kl_estimator "
             "'full''s forward; use 0 or another estimator")  # fmt: skip
    n = int(config.mesh.get("expert", 1))
    if n > 1 and not experts:
        fail("mesh.expert", f"{n} expert ranks, but {config.model.source!r} is a dense model "
             "(no experts to shard); use 1")  # fmt: skip
    if n > 1 and experts % n:
        fail("mesh.expert", f"{n} expert ranks do not divide the model's {experts} experts")


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


def trainer_settings(mcfg) -> dict[str, Any]:
    """The ModelConfig fields the experiment config sets on every model, embedded or loaded:
    compute dtype, LM-head chunk, remat (and its order), TPU compiler flags, attention
    implementation, decode attention, and an MoE model's routing replay and router-loss weight."""
    return {
        "dtype": mcfg.dtype,
        "logits_chunk": int(mcfg.logits_chunk),
        "remat": bool(mcfg.get("remat", False)),
        "remat_ordered": bool(mcfg.get("remat_ordered", False)),
        "collective_matmul": mcfg.get("collective_matmul", "auto"),
        "scheduler_memory_percent": int(mcfg.get("scheduler_memory_percent", 0)),
        "attention_impl": mcfg.get("attention_impl", "einsum"),
        "decode_attention": mcfg.get("decode_attention", "dense"),
        "decode_block": int(mcfg.get("decode_block", 256)),
        "routing_replay": str(mcfg.get("routing_replay", "none")),
        "moe_aux_loss_coef": float(mcfg.get("moe_aux_loss_coef", 0.0)),
        "moe_impl": str(mcfg.get("moe_impl", "dense")),
    }


def embedded_model_config(mcfg, tokenizer) -> model_lib.ModelConfig:
    """The embedded model's ModelConfig: the config's `model.*` sizes, the tokenizer's ids.
    With `model.num_experts` > 0 it is a Qwen3-MoE model (family qwen3_moe, so its export is a
    Qwen3MoeForCausalLM: q/k RMSNorm, every layer a router with the top `num_experts_per_tok`
    of `num_experts` SwiGLU experts of width `moe_intermediate_size`)."""
    experts = int(mcfg.get("num_experts", 0))
    moe = {}
    if experts:
        moe = {
            "family": "qwen3_moe",
            "qk_norm": True,
            "num_experts": experts,
            "num_experts_per_tok": int(mcfg.num_experts_per_tok),
            "moe_intermediate_size": int(mcfg.moe_intermediate_size),
            "norm_topk_prob": bool(mcfg.norm_topk_prob),
        }
    return model_lib.ModelConfig(
        vocab_size=len(tokenizer),
        hidden_size=mcfg.hidden_size,
        intermediate_size=mcfg.intermediate_size,
        num_layers=mcfg.num_layers,
        num_heads=mcfg.num_heads,
        num_kv_heads=mcfg.num_kv_heads,
        head_dim=mcfg.head_dim,
        tie_embeddings=mcfg.tie_embeddings,
        rope_theta=mcfg.rope_theta,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **moe,
        **trainer_settings(mcfg),
    )


def with_source(mcfg, source: str):
    """A copy of the `model` section naming another checkpoint (the external behaviour model
    shares the policy's trainer settings)."""
    m = mcfg.copy_and_resolve_references()
    m.source = source
    return m


def load_policy(
    mcfg, mesh=None, need_tokenizer: bool = True
) -> tuple[model_lib.ModelConfig, Any, Any]:
    """(cfg, params, tokenizer) for `model.source`: embedded | smollm2 | HF dir | .gguf.

    An external behaviour model shares the policy's tokenizer: `need_tokenizer=False`."""
    from ess_jax.io import weights  # heavy imports (safetensors, gguf) only when needed

    source = mcfg.source
    if source == "embedded":
        tok = char_tokenizer()
        cfg = embedded_model_config(mcfg, tok)
        shardings = None if mesh is None else model_lib.param_shardings(cfg, mesh)
        return cfg, model_lib.init_params(cfg, int(mcfg.init_seed), shardings), tok
    path = weights.smollm2_gguf_path() if source == "smollm2" else source
    cfg, params, tok = weights.load_checkpoint(path, mesh=mesh)
    if tok is None and need_tokenizer:
        fail("model.source", f"{path!r} has no tokenizer files")
    return cfg.replace(**trainer_settings(mcfg)), params, tok


def load_examples(tcfg) -> tuple[list[dict], list[dict]]:
    """(train, held-out) example lists for `task.name`."""
    if tcfg.name in SYNTHETIC_TASKS:
        task = get_task(tcfg.name, **dict(tcfg.difficulty))
        train, test = (_task_examples(task, tcfg, s) for s in ("train", "test"))
    else:
        cache = tcfg.get("cache_dir") or None
        try:
            train = list(load_dataset(tcfg.name, tcfg.manual_dir, "train", data_dir=cache))
            test = list(load_dataset(tcfg.name, tcfg.manual_dir, tcfg.test_split, data_dir=cache))
        except CacheDirError as e:
            fail("task.cache_dir", str(e))
        train, test = train[: tcfg.num_train or None], test[: tcfg.num_test or None]
    if not train:
        fail("task", f"{tcfg.name}: the train split is empty")
    if not test:
        fail("task", f"{tcfg.name}: the held-out split is empty")
    return train, test


def _task_examples(task, tcfg, split: str) -> list[dict]:
    """A synthetic task's examples; an explicit count its problem space cannot supply (a
    ValueError naming it) is the config's error."""
    field = "num_train" if split == "train" else "num_test"
    try:
        return task.examples(split, tcfg[field] or None)
    except ValueError as e:
        fail(f"task.{field}", str(e))


def _fit_buckets(config, examples, tokenizer, split: str, batch_size: int, **kw) -> PromptBatcher:
    drop = bool(config.data.get("drop_long_prompts", False))
    try:
        b = PromptBatcher(
            examples, tokenizer, batch_size, tuple(config.data.buckets), drop_long=drop, **kw
        )
    except PromptTooLongError as e:
        how = "" if drop else ", or set data.drop_long_prompts=True to leave such prompts out"
        fail("data.buckets", f"{split} prompts: {e}; add a wider bucket{how}")
    except UnencodableError as e:  # the task's text against model.source's tokenizer
        chars = ", ".join(map(repr, e.chars)) or "(none alone, only in sequence)"
        fail(
            "task",
            f"{config.task.name}: {split} example {e.index} (prompt {e.text[:60]!r}) has "
            f"characters the tokenizer of model.source={config.model.source!r} cannot encode: "
            f"{chars}; use a model whose tokenizer covers the task's text",
        )
    except ValueError as e:
        fail("data.prompts_per_step", f"{split} prompts: {e}")
    if b.dropped:
        longest = max(config.data.buckets)
        logging.warning(
            f"data.drop_long_prompts: left out {len(b.dropped)} of {len(examples)} {split} "
            f"prompts longer than the largest bucket ({longest} tokens)"
        )
    return b


def train_batcher(config, examples, tokenizer) -> PromptBatcher:
    """The RL prompt stream. Every prompt is tokenized here, before any work: one longer than
    the largest `data.buckets` width is a ConfigError naming it, or with
    `data.drop_long_prompts` it is left out (a warning counts them)."""
    n = config.data.prompts_per_step
    return _fit_buckets(config, examples, tokenizer, "train", n, seed=config.seed)


def heldout_examples(config, examples, tokenizer) -> list[dict]:
    """The held-out examples, checked against `data.buckets` as `train_batcher` checks the
    train ones: those eval uses (the first `eval.num_examples`), or with
    `data.drop_long_prompts` every one, the long ones left out. No eval: unchecked."""
    if not config.eval.every:
        return examples
    if not config.data.get("drop_long_prompts", False):
        used = examples[: config.eval.num_examples or None]
        _fit_buckets(config, used, tokenizer, "held-out", 1, shuffle=False)
        return examples
    dropped = set(_fit_buckets(config, examples, tokenizer, "held-out", 1, shuffle=False).dropped)
    return [ex for i, ex in enumerate(examples) if i not in dropped]


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


def rollout_config(config, ids) -> Any:
    """config.rollout with the stop token ids (`stop_ids`) the sampler ends a response at."""
    r = config.rollout.copy_and_resolve_references()
    r.stop_ids = tuple(int(i) for i in ids)
    return r

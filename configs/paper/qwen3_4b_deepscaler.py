"""The paper's main setup (PAPER.md): Qwen3-4B-Thinking-2507 on DeepScaleR, P3O, 8 accelerators.

    python -m ess_jax.main --config=configs/paper/qwen3_4b_deepscaler.py \
        --config.model.source=/path/to/Qwen3-4B-Thinking-2507 \
        --config.task.manual_dir=/path/to/deepscaler --workdir=runs/p3o_qwen3_4b

The manual dir holds DeepScaleR as `train.json` (the public `deepscaler.json`, renamed) and a
held-out `test.jsonl` for the in-run eval: MATH-500 (fields problem / answer). DeepScaleR has no
test split, and evaluating on its own training prompts would measure memorisation.

One optimizer step per rollout batch (rho != 1 comes from train/inference mismatch), lr 1e-5,
n = 4 samples per prompt, 256 prompts per step, ~35 steps, binary math verifier, 4K tokens.
For TPU/GPU meshes; not runnable on a CPU. The paper's exact lr/batch per run and seeds are
not public (PAPER.md); these are its stated defaults.

`:tiny` is the same pipeline (DeepScaleR files, math verifier, P3O, bfloat16 sampler) with the
embedded char-level model, 2 steps of 4 prompts and 16 new tokens: a CPU smoke run.
"""

from ess_jax.defaults import base_config


def get_config(arg: str | None = None):
    if arg not in (None, "", "tiny"):
        raise ValueError(f"unknown arg {arg!r}; valid: tiny")
    c = base_config()
    c.mesh = {"data": 1, "fsdp": -1, "tensor": 1}
    c.model.source = "/path/to/Qwen3-4B-Thinking-2507"
    c.model.dtype = "bfloat16"  # BF16 training compute, float32 masters
    c.model.logits_chunk = 1024  # never hold [B, 4K+, 151936] float32 logits at once
    c.task.name = "deepscaler"
    c.task.reward = "math"
    c.task.manual_dir = "/path/to/deepscaler"
    c.task.test_split = "test"  # a held-out file (MATH-500) next to DeepScaleR's train.json
    c.data.prompts_per_step = 256
    c.data.buckets = (256, 512, 1024)
    c.rollout.group_size = 4
    c.rollout.max_new_tokens = 4096
    c.rollout.precision = "bfloat16"
    c.objective.name = "p3o"
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
    c.eval.temperature = 0.6
    c.eval.max_new_tokens = 4096
    if arg == "tiny":
        c.model.source = "embedded"
        c.model.dtype = "float32"
        c.model.logits_chunk = 0
        c.data.prompts_per_step = 4
        c.rollout.max_new_tokens = 16
        c.train.steps = 2
        c.train.num_microbatches = 1
        c.train.checkpoint_every = 1
        c.eval.every = 0
        c.eval.max_new_tokens = 16
    return c

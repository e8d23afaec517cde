"""E5 (docs/method.md): FP8 rollouts (float8_e4m3fn weights, per-channel scales), BF16 training, 16K
new tokens, Qwen3-4B on DeepScaleR; GRPO eps 0.2 vs P3O, plus the P3O ablations and TIS.

    .venv/bin/python -m ess_jax.main --config=configs/paper/e5_fp8.py:p3o \
        --config.model.source=/path/to/Qwen3-4B-Thinking-2507 \
        --config.task.manual_dir=/path/to/deepscaler --workdir=runs/paper/e5/p3o

(other arms: replace both `p3o`). Paper numbers: train reward GRPO 0.54 -> 0.02, P3O stays
~0.52; held-out pass@1 at iteration 30 (tools/evaluate.py on the step-30 checkpoint): GRPO ~0
everywhere, P3O AIME24 0.173, AIME25 0.254, AMC 0.529. p3o_cap_only, p3o_kl_only and grpo_tis
are not in the paper. Unknown: the paper's FP8 recipe (vLLM's; here weights only, activations
bf16), seeds, lr per run.
"""

from configs.paper import common

ARMS = ("grpo_eps0.2", "p3o", "p3o_cap_only", "p3o_kl_only", "grpo_tis")
# v5e-8: does not fit (tools/plan_memory.py); the RL step on v5e-16 compiles to 13.4 GB of its
# 14.4 usable, the whole run on v4-8 to 26.7 of 30.9 and on tpu7x-8 to 49.7 of 92.8 (its step
# 2.13x its plan at fsdp 8 with model.remat_ordered: docs/tpu.md). On v6e-8 the RL step
# compiles to 31.1 GB with libtpu's collective matmuls (1.53x its plan; v6e has 32 GB, a run
# may use 28.8) and to 21.0 without them (1.03x): that preset turns them off
# (model.collective_matmul; what that costs in time is not measured: docs/tpu.md), and the
# whole run then compiles to 22.2 GB of 28.8
PRESETS = common.FITS_4B


def get_config(arg: str | None = None):
    arm, preset = common.parse(arg, ARMS, PRESETS)
    c = common.with_objective(common.base(max_new_tokens=16384), arm)
    c.rollout.precision = "fp8"
    c.train.checkpoint_every = 5  # iteration 30 is evaluated afterwards
    c = common.finish(c, preset)
    if preset == "v6e-8":
        c.model.collective_matmul = "none"
    return c

"""E7, mixed-policy batches (docs/method.md): 2 of each group's 4 rollouts are sampled by another
model (Qwen3-8B) whose own log-probs are pi_b; Qwen3-4B on DeepScaleR; GRPO eps 0.2 vs P3O and
GRPO with truncated IS.

    .venv/bin/python -m ess_jax.main --config=configs/paper/e7_external.py:p3o \
        --config.model.source=/path/to/Qwen3-4B-Thinking-2507 \
        --config.rollout.external_checkpoint=/path/to/Qwen3-8B \
        --config.task.manual_dir=/path/to/deepscaler --workdir=runs/paper/e7/p3o

(other arms: replace both `p3o`). Paper numbers: none in docs/method.md (the result is qualitative).
grpo_tis is not in the paper. Unknown: the external model's sampling precision (bf16 here) and
temperature (the policy's here), seeds, lr.
"""

from configs.paper import common

ARMS = ("grpo_eps0.2", "p3o", "grpo_tis")
# the other presets do not fit (tools/plan_memory.py)
PRESETS = ("8xh100", "8xh200", "v5p-8", "tpu7x-8", "v5p-64")


def get_config(arg: str | None = None):
    arm, preset = common.parse(arg, ARMS, PRESETS)
    c = common.with_objective(common.base(), arm)
    c.rollout.external_fraction = 0.5
    c.rollout.external_checkpoint = common.QWEN3_8B
    c.rollout.external_precision = "bfloat16"
    # tensor 2: the 8B sampler's sample-layout weights (float32, no FSDP) fit an H100 halved
    return common.finish(c, preset, min_tensor=2)

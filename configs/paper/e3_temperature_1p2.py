"""E3, temperature shift (docs/method.md): rollouts at T=1.2, the trainer scores at T=1, Qwen3-4B on
DeepScaleR; GRPO eps 0.2 vs P3O, plus the P3O ablations and GRPO with truncated IS.

    .venv/bin/python -m ess_jax.main --config=configs/paper/e3_temperature_1p2.py:p3o \
        --config.model.source=/path/to/Qwen3-4B-Thinking-2507 \
        --config.task.manual_dir=/path/to/deepscaler --workdir=runs/paper/e3/p3o

(other arms: replace both `p3o`). Paper numbers (train reward): GRPO peaks ~0.70 and collapses
to ~0.09 by step 32; P3O stays ~0.60-0.66. grpo_eps0.6, p3o_cap_only, p3o_kl_only and grpo_tis
are not in the paper. Unknown: seeds, lr per run, whether the eval also samples at T=1.2 (the
in-run eval here uses 0.6).
"""

from configs.paper import common

ARMS = ("grpo_eps0.2", "grpo_eps0.6", "p3o", "p3o_cap_only", "p3o_kl_only", "grpo_tis")
PRESETS = common.FITS_4B  # v5e-8: does not fit (tools/plan_memory.py)


def get_config(arg: str | None = None):
    arm, preset = common.parse(arg, ARMS, PRESETS)
    c = common.with_objective(common.base(), arm)
    c.rollout.temperature = 1.2
    return common.finish(c, preset)

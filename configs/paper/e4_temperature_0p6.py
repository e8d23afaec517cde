"""E4 (docs/method.md): rollouts at T=0.6, the trainer scores at T=1, Qwen3-4B on DeepScaleR;
GRPO eps 0.2 vs P3O, plus the P3O ablations and GRPO with truncated IS.

    .venv/bin/python -m ess_jax.main --config=configs/paper/e4_temperature_0p6.py:p3o \
        --config.model.source=/path/to/Qwen3-4B-Thinking-2507 \
        --config.task.manual_dir=/path/to/deepscaler --workdir=runs/paper/e4/p3o

(other arms: replace both `p3o`). Paper numbers: none in the text; the authors' raw data shows
both GRPO and P3O collapsing. grpo_eps0.6, p3o_cap_only, p3o_kl_only and grpo_tis are not in
the paper. Unknown: seeds, lr per run, the step of collapse.
"""

from configs.paper import common

ARMS = ("grpo_eps0.2", "grpo_eps0.6", "p3o", "p3o_cap_only", "p3o_kl_only", "grpo_tis")
PRESETS = common.FITS_4B  # v5e-8: does not fit (tools/plan_memory.py)


def get_config(arg: str | None = None):
    arm, preset = common.parse(arg, ARMS, PRESETS)
    c = common.with_objective(common.base(), arm)
    c.rollout.temperature = 0.6
    return common.finish(c, preset)

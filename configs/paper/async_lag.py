"""Async staleness (not in the paper, natural for the method; docs/method.md): rollouts from the
policy k = 1 / 2 / 4 updates old (an actor-learner pipeline), Qwen3-4B on DeepScaleR; GRPO eps
0.2 vs P3O and GRPO with truncated IS.

    .venv/bin/python -m ess_jax.main --config=configs/paper/async_lag.py:lag2_p3o \
        --config.model.source=/path/to/Qwen3-4B-Thinking-2507 \
        --config.task.manual_dir=/path/to/deepscaler --workdir=runs/paper/async/lag2_p3o

(other arms: replace both `lag2_p3o`). No paper number: this run is new. The policy history
holds lag + 1 parameter copies in the sample layout (tools/plan_memory.py counts them).
"""

from configs.paper import common

ARMS = tuple(
    f"lag{k}_{objective}" for k in (1, 2, 4) for objective in ("grpo_eps0.2", "p3o", "grpo_tis")
)
# the other presets do not fit (tools/plan_memory.py)
PRESETS = ("8xh100", "8xh200", "v5p-8", "tpu7x-8", "v5p-64")


def get_config(arg: str | None = None):
    arm, preset = common.parse(arg, ARMS, PRESETS)
    lag, objective = arm.split("_", 1)
    c = common.with_objective(common.base(), objective)
    c.rollout.lag = int(lag[3:])
    return common.finish(c, preset)

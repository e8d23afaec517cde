"""Async staleness at CPU scale (not in the paper): rollouts from the policy k updates old
(k = 0 / 1 / 2 / 4 / 8), GRPO clip 0.2 vs P3O and GRPO with truncated IS.

    .venv/bin/python experiments/reproduce.py --experiments async_lag --seeds 0 1 2 --jobs 2

runs every arm and seed (warm starts included); one arm by hand, after its seed's warm start:

    .venv/bin/python -m ess_jax.main --config=configs/mini/async_lag.py:lag4_p3o --config.seed=0 \
        --config.model.source=runs/mini/warm/policy/seed0/hf \
        --workdir=runs/mini/async_lag/lag4_p3o/0
"""

from configs.mini import common

ARMS = tuple(
    f"lag{k}_{objective}"
    for k in (0, 1, 2, 4, 8)
    for objective in ("grpo_eps0.2", "p3o", "grpo_tis")
)


def get_config(arg: str | None = None):
    arm = common.pick(ARMS, arg)
    c = common.testbed()
    lag, objective = arm.split("_", 1)
    c.rollout.lag = int(lag[3:])
    return common.with_objective(c, objective)

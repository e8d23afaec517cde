"""E3b at CPU scale (not in the paper): rollouts at temperature 1.5, a stronger dial than E3,
the same arms as E3.

    .venv/bin/python experiments/reproduce.py --experiments e3b_temperature_1p5 \
        --seeds 0 1 2 --jobs 2

runs every arm and seed (warm starts included); one arm by hand, after its seed's warm start:

    .venv/bin/python -m ess_jax.main --config=configs/mini/e3b_temperature_1p5.py:p3o \
        --config.seed=0 --config.model.source=runs/mini/warm/policy/seed0/hf \
        --workdir=runs/mini/e3b_temperature_1p5/p3o/0
"""

from configs.mini import common

ARMS = ("grpo_eps0.2", "grpo_eps0.6", "p3o", "p3o_cap_only", "p3o_kl_only", "grpo_tis")


def get_config(arg: str | None = None):
    arm = common.pick(ARMS, arg)
    c = common.testbed()
    c.rollout.temperature = 1.5
    return common.with_objective(c, arm)

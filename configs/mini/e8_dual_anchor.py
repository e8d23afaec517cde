"""E8 at CPU scale: the dual anchor (two_kl and mixture) vs P3O with 4 optimizer updates per
rollout batch (of 32 sequences each), at temperature 1 and 1.2.

    .venv/bin/python experiments/reproduce.py --experiments e8_dual_anchor --seeds 0 1 2 --jobs 2

runs every arm and seed (warm starts included); one arm by hand, after its seed's warm start:

    .venv/bin/python -m ess_jax.main --config=configs/mini/e8_dual_anchor.py:t1.2_p3o \
        --config.seed=0 --config.model.source=runs/mini/warm/policy/seed0/hf \
        --workdir=runs/mini/e8_dual_anchor/t1.2_p3o/0
"""

from configs.mini import common

ARMS = (
    "t1.0_p3o",
    "t1.0_p3o_dual_two_kl",
    "t1.0_p3o_dual_mixture",
    "t1.2_p3o",
    "t1.2_p3o_dual_two_kl",
    "t1.2_p3o_dual_mixture",
)


def get_config(arg: str | None = None):
    arm = common.pick(ARMS, arg)
    c = common.testbed()
    temperature, objective = arm.split("_", 1)
    c.rollout.temperature = float(temperature[1:])
    c.train.updates_per_batch = 4
    return common.with_objective(c, objective)

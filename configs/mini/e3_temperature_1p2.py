"""E3 at CPU scale: rollouts at temperature 1.2 (the trainer scores at T=1), GRPO clip 0.2 / 0.6
vs P3O, P3O taken apart (cap only, KL only) and GRPO with truncated IS (beyond the paper).

    .venv/bin/python experiments/reproduce.py --experiments e3_temperature_1p2 \
        --seeds 0 1 2 --jobs 2

runs every arm and seed (warm starts included); one arm by hand, after its seed's warm start:

    .venv/bin/python -m ess_jax.main --config=configs/mini/e3_temperature_1p2.py:p3o \
        --config.seed=0 --config.model.source=runs/mini/warm/policy/seed0/hf \
        --workdir=runs/mini/e3_temperature_1p2/p3o/0
"""

from configs.mini import common

ARMS = ("grpo_eps0.2", "grpo_eps0.6", "p3o", "p3o_cap_only", "p3o_kl_only", "grpo_tis")


def get_config(arg: str | None = None):
    arm = common.pick(ARMS, arg)
    c = common.testbed()
    c.rollout.temperature = 1.2
    return common.with_objective(c, arm)

"""E7 at CPU scale: half of each group (4 of 8) is sampled by an external model (configs/mini/
warm_start.py:external, another init trained on clean demonstrations) whose own log-probs are
pi_b; GRPO clip 0.2 vs P3O and GRPO with truncated IS.

    .venv/bin/python experiments/reproduce.py --experiments e7_external --seeds 0 1 2 --jobs 2

runs every arm and seed (warm starts included); one arm by hand, after its seed's warm start:

    .venv/bin/python -m ess_jax.main --config=configs/mini/e7_external.py:p3o --config.seed=0 \
        --config.model.source=runs/mini/warm/policy/seed0/hf \
        --workdir=runs/mini/e7_external/p3o/0

With an external model also give
--config.rollout.external_checkpoint=runs/mini/warm/external/seed0/hf.
"""

from configs.mini import common

ARMS = ("grpo_eps0.2", "p3o", "grpo_tis")


def get_config(arg: str | None = None):
    arm = common.pick(ARMS, arg)
    c = common.testbed()
    c.rollout.external_fraction = 0.5
    c.rollout.external_checkpoint = common.placeholder(str)
    return common.with_objective(c, arm)

"""E5 at CPU scale: fp8 sampler (float8_e4m3fn weights, per-channel scales), float32 trainer;
GRPO clip 0.2 vs P3O, P3O taken apart, GRPO with truncated IS.

    .venv/bin/python experiments/reproduce.py --experiments e5_fp8 --seeds 0 1 2 --jobs 2

runs every arm and seed (warm starts included); one arm by hand, after its seed's warm start:

    .venv/bin/python -m ess_jax.main --config=configs/mini/e5_fp8.py:p3o --config.seed=0 \
        --config.model.source=runs/mini/warm/policy/seed0/hf \
        --workdir=runs/mini/e5_fp8/p3o/0
"""

from configs.mini import common

ARMS = ("grpo_eps0.2", "p3o", "p3o_cap_only", "p3o_kl_only", "grpo_tis")


def get_config(arg: str | None = None):
    arm = common.pick(ARMS, arg)
    c = common.testbed()
    c.rollout.precision = "fp8"
    return common.with_objective(c, arm)

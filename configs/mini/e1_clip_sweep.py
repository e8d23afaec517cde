"""E1 at CPU scale: GRPO clip 0.2 / 0.4 / 0.6, DAPO, CISPO, GSPO, P3O and P3O dual, all with
the bfloat16 sampler (the natural train/inference mismatch; the trainer is float32).

    .venv/bin/python experiments/reproduce.py --experiments e1_clip_sweep --seeds 0 1 2 --jobs 2

runs every arm and seed (warm starts included); one arm by hand, after its seed's warm start:

    .venv/bin/python -m ess_jax.main --config=configs/mini/e1_clip_sweep.py:p3o --config.seed=0 \
        --config.model.source=runs/mini/warm/policy/seed0/hf \
        --workdir=runs/mini/e1_clip_sweep/p3o/0
"""

from configs.mini import common

ARMS = ("grpo_eps0.2", "grpo_eps0.4", "grpo_eps0.6", "dapo", "cispo", "gspo", "p3o", "p3o_dual")


def get_config(arg: str | None = None):
    arm = common.pick(ARMS, arg)
    c = common.testbed()
    c.rollout.precision = "bfloat16"
    return common.with_objective(c, arm)

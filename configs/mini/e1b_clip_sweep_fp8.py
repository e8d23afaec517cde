"""E1b at CPU scale (a stronger dial than E1): the same eight arms as E1 with the fp8 sampler
instead of bf16. E1's bf16 sampler left the ESS at 0.9996 on this model (no mismatch to speak
of), so the clip sweep is repeated where fp8 gives a real one (E5: mean ESS ~0.99, min ~0.65).

    .venv/bin/python experiments/reproduce.py --experiments e1b_clip_sweep_fp8 \
        --seeds 0 1 2 --jobs 2

runs every arm and seed (warm starts included); one arm by hand, after its seed's warm start:

    .venv/bin/python -m ess_jax.main --config=configs/mini/e1b_clip_sweep_fp8.py:p3o \
        --config.seed=0 --config.model.source=runs/mini/warm/policy/seed0/hf \
        --workdir=runs/mini/e1b_clip_sweep_fp8/p3o/0
"""

from configs.mini import common, e1_clip_sweep

ARMS = e1_clip_sweep.ARMS


def get_config(arg: str | None = None):
    arm = common.pick(ARMS, arg)
    c = common.testbed()
    c.rollout.precision = "fp8"
    return common.with_objective(c, arm)

"""E1b with the calibrated mismatch: E1's eight arms with the sampler of common.CALIBRATED_*
(int4 per-channel weights, fp8 KV cache), the format whose token statistics on the mini model
come closest to SmolLM2-135M's fp8 sampler (docs/mismatch.md: exact KL 3.7e-2, 18.5% of ratios
outside [0.8, 1.2], where plain fp8 gives 1.1e-3 and 0.7% on this model).

    .venv/bin/python experiments/reproduce.py --experiments e1b_clip_sweep_calibrated \
        --seeds 0 1 2 --jobs 2

one arm by hand, after its seed's warm start:

    .venv/bin/python -m ess_jax.main --config=configs/mini/e1b_clip_sweep_calibrated.py:p3o \
        --config.seed=0 --config.model.source=runs/mini/warm/policy/seed0/hf \
        --workdir=runs/mini/e1b_clip_sweep_calibrated/p3o/0
"""

from configs.mini import common, e1_clip_sweep

ARMS = e1_clip_sweep.ARMS


def get_config(arg: str | None = None):
    arm = common.pick(ARMS, arg)
    return common.with_objective(common.calibrated(common.testbed()), arm)

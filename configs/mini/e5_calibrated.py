"""E5 with the calibrated mismatch: the arms of e5_fp8.py (GRPO clip 0.2, P3O, P3O taken apart,
GRPO with truncated IS) with the sampler of common.CALIBRATED_* (int4 per-channel weights, fp8
KV cache) instead of fp8 weights, whose mismatch on this model is ~35x smaller in KL than on
SmolLM2-135M (docs/mismatch.md). Its grpo_eps0.2 and p3o runs equal
e1b_clip_sweep_calibrated's (analyze.py counts them once).

    .venv/bin/python experiments/reproduce.py --experiments e5_calibrated --seeds 0 1 2 --jobs 2

one arm by hand, after its seed's warm start:

    .venv/bin/python -m ess_jax.main --config=configs/mini/e5_calibrated.py:p3o_cap_only \
        --config.seed=0 --config.model.source=runs/mini/warm/policy/seed0/hf \
        --workdir=runs/mini/e5_calibrated/p3o_cap_only/0
"""

from configs.mini import common, e5_fp8

ARMS = e5_fp8.ARMS


def get_config(arg: str | None = None):
    arm = common.pick(ARMS, arg)
    return common.with_objective(common.calibrated(common.testbed()), arm)

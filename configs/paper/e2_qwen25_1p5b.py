"""E2 (docs/method.md): E1's clip sweep on Qwen2.5-1.5B, DeepScaleR, bf16 sampler and training.

    .venv/bin/python -m ess_jax.main --config=configs/paper/e2_qwen25_1p5b.py:p3o \
        --config.model.source=/path/to/Qwen2.5-1.5B \
        --config.task.manual_dir=/path/to/deepscaler --workdir=runs/paper/e2/p3o

(other arms: replace both `p3o`). Paper numbers: none given in docs/method.md (the figure's
qualitative result is E1's: small clips collapse, P3O holds). Unknown: base or instruct
checkpoint (same dimensions), seeds, lr, the response length (4K here, as E1).
"""

from configs.paper import common

ARMS = ("grpo_eps0.2", "grpo_eps0.4", "grpo_eps0.6", "p3o")
PRESETS = common.FITS_ALL


def get_config(arg: str | None = None):
    arm, preset = common.parse(arg, ARMS, PRESETS)
    c = common.with_objective(common.base(source=common.QWEN25_1P5B), arm)
    return common.finish(c, preset)

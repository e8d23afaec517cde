"""Several optimizer updates per rollout batch (not in the paper, natural for the method;
docs/method.md): each batch of 256 x 4 rollouts is cut into 4 updates of 256 sequences, so later
updates are off-policy by staleness as well as by train/inference mismatch; Qwen3-4B on
DeepScaleR, T=1.

    .venv/bin/python -m ess_jax.main --config=configs/paper/multi_update.py:p3o \
        --config.model.source=/path/to/Qwen3-4B-Thinking-2507 \
        --config.task.manual_dir=/path/to/deepscaler --workdir=runs/paper/multi_update/p3o

(other arms: replace both `p3o`). No paper number: this run is new (E8 uses the same
4 updates for the dual anchor).
"""

from configs.paper import common

ARMS = ("grpo_eps0.2", "p3o", "p3o_dual_mixture", "grpo_tis")
PRESETS = common.FITS_4B  # v5e-8: does not fit (tools/plan_memory.py)


def get_config(arg: str | None = None):
    arm, preset = common.parse(arg, ARMS, PRESETS)
    c = common.with_objective(common.base(), arm)
    c.train.updates_per_batch = 4
    c.train.num_microbatches = 4
    return common.finish(c, preset)

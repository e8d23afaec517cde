"""E8 (docs/method.md): the dual anchor (P4O, versions two_kl and mixture) vs P3O at T=1 and T=1.2,
Qwen3-4B on DeepScaleR, 4 optimizer updates per rollout batch (the anchor is the policy
before the first of them; with one update it equals P3O).

    .venv/bin/python -m ess_jax.main \
        --config=configs/paper/e8_dual_anchor.py:t1.0_p3o_dual_mixture \
        --config.model.source=/path/to/Qwen3-4B-Thinking-2507 \
        --config.task.manual_dir=/path/to/deepscaler \
        --workdir=runs/paper/e8/t1.0_p3o_dual_mixture

(other arms: replace both `t1.0_p3o_dual_mixture`). Paper numbers: none in docs/method.md; the dual
anchor beats P3O at the default temperature and collapses at T=1.2. Unknown: the number of
updates per batch (4 here), which dual version the figure used, seeds, lr.
"""

from configs.paper import common

ARMS = tuple(
    f"t{t}_{objective}"
    for t in ("1.0", "1.2")
    for objective in ("p3o", "p3o_dual_two_kl", "p3o_dual_mixture")
)
PRESETS = common.FITS_4B  # v5e-8: does not fit (tools/plan_memory.py)


def get_config(arg: str | None = None):
    arm, preset = common.parse(arg, ARMS, PRESETS)
    temperature, objective = arm.split("_", 1)
    c = common.with_objective(common.base(), objective)
    c.rollout.temperature = float(temperature[1:])
    c.train.updates_per_batch = 4
    c.train.num_microbatches = 4
    return common.finish(c, preset)

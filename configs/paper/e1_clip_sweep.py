"""E1, clip sensitivity (docs/method.md): GRPO eps 0.2 / 0.4 / 0.6 vs one untuned P3O run,
Qwen3-4B on DeepScaleR, bfloat16 sampler and bfloat16 training compute (rho != 1 from that
mismatch only).

    .venv/bin/python -m ess_jax.main --config=configs/paper/e1_clip_sweep.py:grpo_eps0.2 \
        --config.model.source=/path/to/Qwen3-4B-Thinking-2507 \
        --config.task.manual_dir=/path/to/deepscaler --workdir=runs/paper/e1/grpo_eps0.2

(other arms: replace both `grpo_eps0.2`; another mesh: `:grpo_eps0.2,v5p-8`, see
docs/paper_scale.md).

Paper numbers to reproduce (train reward, ~35 steps): eps 0.2 collapses (~0.5 -> 0.13 by step
35), eps 0.6 holds ~0.5, P3O ~0.51. Held-out pass@1 at 4K tokens (tools/evaluate.py), GRPO
(mean over eps) vs P3O: AIME24 0.176 vs 0.165, AIME25 0.160 vs 0.183, AMC 0.381 vs 0.493.
dapo / cispo / gspo / p3o_dual are not in the paper's figure (its tabulated baselines); they
share the setup (dapo refills constant-reward groups by resampling and penalises overlong
responses: DAPO_RESAMPLE_ROUNDS and DAPO_OVERLONG_FRACTION in common.py). Unknown: seeds, the
exact lr per run, ESS scope (step here; common.py).
"""

from configs.paper import common

ARMS = ("grpo_eps0.2", "grpo_eps0.4", "grpo_eps0.6", "dapo", "cispo", "gspo", "p3o", "p3o_dual")
PRESETS = common.FITS_4B  # v5e-8: does not fit (tools/plan_memory.py)


def get_config(arg: str | None = None):
    arm, preset = common.parse(arg, ARMS, PRESETS)
    c = common.with_objective(common.base(), arm)
    return common.finish(c, preset)

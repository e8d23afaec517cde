"""E3 at CPU scale with LoRA policies: rank-8 adapters on q/k/v/o and the MLP projections of
the frozen warm start (model.lora, ess_jax/model/lora.py), rollout temperature 1.2, GRPO clip
0.2 vs P3O. Everything else is the configs/mini testbed, the same for both arms (lr 5e-4 as
for full fine-tuning: nothing tuned for adapters), so the arms compare as E3's do.

    .venv/bin/python experiments/reproduce.py --experiments e3_lora --seeds 0 1 2 --jobs 2

one arm by hand, after its seed's warm start:

    .venv/bin/python -m ess_jax.main --config=configs/mini/e3_lora.py:p3o --config.seed=0 \\
        --config.model.source=runs/mini/warm/policy/seed0/hf \\
        --workdir=runs/mini/e3_lora/p3o/0
"""

from configs.mini import common

ARMS = ("grpo_eps0.2", "p3o")
RANK = 8


def get_config(arg: str | None = None):
    arm = common.pick(ARMS, arg)
    c = common.testbed()
    c.rollout.temperature = 1.2
    c.model.lora.rank = RANK
    return common.with_objective(c, arm)

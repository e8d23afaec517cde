"""SFT warm start of the CPU-scale ablations: one per seed, shared by every arm of that seed.

    .venv/bin/python -m ess_jax.main --config=configs/mini/warm_start.py:policy --config.seed=0 \
        --workdir=runs/mini/warm/policy/seed0

`:policy` is the noisy-teacher SFT every RL arm starts from (model.source=<workdir>/hf).
`:external` is the E7 behaviour model: the same tokenizer and architecture, trained from another
init (init_seed = seed + 1000) on clean demonstrations, so its distribution differs from the
policy's. Both run no RL (train.steps=0) and export their params as a Hugging Face checkpoint.
"""

from configs.mini import common

ARMS = ("policy", "external")


def get_config(arg: str | None = "policy"):
    arm = common.pick(ARMS, arg or "policy")
    c = common.testbed()
    c.model.source = "embedded"
    c.sft.steps = 1500
    c.sft.batch_size = 64
    c.sft.demo_noise = 0.6 if arm == "policy" else 0.0
    c.model.init_seed = c.get_ref("seed") + (0 if arm == "policy" else 1000)
    c.train.steps = 0
    c.train.export_hf = True
    return c

"""SFT warm start of the CPU-scale ablations: one per seed, shared by every arm of that seed.

    .venv/bin/python -m ess_jax.main --config=configs/mini/warm_start.py:policy --config.seed=0 \
        --workdir=runs/mini/warm/policy/seed0

`:policy` is the noisy-teacher SFT every RL arm starts from (model.source=<workdir>/hf).
`:external` is the E7 behaviour model: the same tokenizer and architecture, trained from another
init (init_seed = seed + 1000) on clean demonstrations, so its distribution differs from the
policy's. `:moe` is the MoE testbed's warm start (configs/mini/moe_replay.py): `:policy`'s
noisy-teacher SFT on the embedded model made a mixture of experts (common.MOE_MODEL), with the
router's load-balancing loss, for common.MOE_SFT_STEPS steps. All run no RL (train.steps=0)
and export their params as a Hugging Face checkpoint (a Qwen3MoeForCausalLM one for `:moe`).
"""

from configs.mini import common

ARMS = ("policy", "external", "moe")


def get_config(arg: str | None = "policy"):
    arm = common.pick(ARMS, arg or "policy")
    c = common.testbed()
    c.model.source = "embedded"
    c.sft.steps = 1500
    c.sft.batch_size = 64
    c.sft.demo_noise = 0.0 if arm == "external" else 0.6
    c.model.init_seed = c.get_ref("seed") + (1000 if arm == "external" else 0)
    if arm == "moe":
        common.moe_model(c)
        c.model.moe_aux_loss_coef = common.MOE_WARM_AUX_LOSS
        c.sft.steps = common.MOE_SFT_STEPS
    c.train.steps = 0
    c.train.export_hf = True
    return c

"""Beyond the paper, at CPU scale: does routing replay change stability, ESS or reward under
the calibrated mismatch on a mixture-of-experts policy?

Testbed: the configs/mini one (common.testbed: 3-digit addition, 16 prompts x 8 samples per
step, lr 5e-4, the same eval) with the policy a mixture of experts (common.MOE_MODEL: the
embedded decoder with every MLP a Qwen3-MoE block, 4 experts, top 2), SFT-warm-started from
scratch per seed like the dense testbed (configs/mini/warm_start.py:moe: noisy-teacher SFT,
the router's load-balancing loss at 0.01), both shortened to fit the CPU: 1000 SFT steps
(common.MOE_SFT_STEPS; the dense testbed's 1500) and 60 RL steps (common.MOE_STEPS; the map's
150), held-out eval at steps 0, 30 and 60. Condition: the stability map's calibrated mismatch
(common.calibrated: int4 sampler weights, fp8 KV cache, T 1), where a rounding difference can
flip a token's top-k experts between sampler and trainer.

Arms: <condition>_<objective>, condition `calib` (the trainer routes every token itself,
model.routing_replay none) or `calib+replay` (the trainer takes the experts the sampler
recorded, model.routing_replay sampler); objectives p3o, p3o_cap_only, grpo_tis, vcpo
(common.OBJECTIVES, as the map runs them). Seeds 0-2. Nothing is tuned per arm: the map's
protocol and hyper-parameters for all eight.

    .venv/bin/python experiments/reproduce.py --experiments moe_replay --seeds 0 1 2
    .venv/bin/python experiments/moe_replay.py results  # results/moe_replay.md and its figure

one arm by hand, after its seed's warm start (reproduce.py runs it):

    .venv/bin/python -m ess_jax.main --config=configs/mini/moe_replay.py:calib+replay_p3o \\
        --config.seed=0 --config.model.source=runs/mini/warm/moe/seed0/hf \\
        --workdir=runs/mini/moe_replay/calib+replay_p3o/0

Every metrics row has `routing_flip`: the share of (response token, sparse layer) pairs whose
top-2 expert set under the trainer's own routing, with the params that sampled, differs from
the set the sampler recorded (the rollout's routing; the first update's batch, before any
update changes the params).

Declared before any run of this file. Collapse and learning as the map counts them
(experiments/run_stats.py, experiments/stability_map.py's docstring): a sustained collapse is
a run whose 10-step mean reward falls below half its running peak and stays there for 20
steps (or to the end); a stable run has no sustained collapse and its held-out pass@1 at the
last eval (step 60) not below step 0's; a run learns when that final pass@1 is above step
0's. Per objective, replay against no replay over the 3 seeds (each seed's two arms share a
warm start): sustained collapses, stable runs, final held-out pass@1 (paired by seed: mean
difference and 95% t-interval), mean token ESS, mean train reward of the last 10 steps.
The comparisons are exploratory: 3 seeds, no Holm family, no test declared; a difference
whose interval excludes 0 is reported as seen in these seeds, anything else as no difference
seen.
"""

from configs.mini import common, stability_map

CONDITIONS = ("calib", "calib+replay")
OBJECTIVES = ("p3o", "p3o_cap_only", "grpo_tis", "vcpo")
ARMS = stability_map.arms(CONDITIONS, OBJECTIVES)
# the warm start of configs/mini/warm_start.py every arm starts from (experiments/reproduce.py)
WARM = "moe"


def condition(c, name: str):
    """c under `name`: the map's condition of that name, with `+replay` the trainer replaying
    the sampler's recorded routing."""
    parts = name.split("+")
    replay = "replay" in parts
    c = stability_map.condition(c, "+".join(p for p in parts if p != "replay"))
    c.model.routing_replay = "sampler" if replay else "none"
    return c


def testbed():
    """The map's testbed (common.testbed) at the MoE testbed's length, its model the MoE
    (common.moe_model: what model.source=embedded builds; the warm start's checkpoint, which
    the runs load, has the same architecture in its config.json)."""
    c = common.testbed()
    common.moe_model(c)
    c.train.steps = common.MOE_STEPS
    c.eval.every = c.train.checkpoint_every = common.MOE_STEPS // 2
    return c


def get_config(arg: str | None = None):
    cond, objective = stability_map.split(common.pick(ARMS, arg))
    return common.with_objective(condition(testbed(), cond), objective)

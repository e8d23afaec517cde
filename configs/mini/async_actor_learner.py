"""The asynchronous actor-learner at CPU scale (issue 27, not in the paper): the sampler and
the trainer run at once on one device each (train.mode "async", ess_jax/rl/actor_learner.py),
staleness bounded by rollout.max_lag = 4; P3O, GRPO clip 0.2 and GRPO with truncated IS at
that fixed bound, and P3O paced by its ESS (rollout.target_ess = 0.97: the lag budget halves
while the running step ESS is under 0.97 and grows back by one step above it).

The lag each batch gets depends on the two sides' speeds, so unlike the other configs/mini
experiments these runs are not bit-reproducible: the rows log the measured lag (lag_mean,
lag_max, lag_budget) and queue depth per step. Two CPU devices per run, one core each:

    XLA_FLAGS="--xla_force_host_platform_device_count=2 --xla_cpu_multi_thread_eigen=false \
        intra_op_parallelism_threads=1" \
    .venv/bin/python -m ess_jax.main --config=configs/mini/async_actor_learner.py:p3o_paced \
        --config.seed=0 --config.model.source=runs/mini/warm/policy/seed0/hf \
        --workdir=runs/mini/async_actor_learner/p3o_paced/0

(the warm start as for the other experiments: configs/mini/warm_start.py; one run at a time on
a 2-core machine, the run uses both cores).
"""

from configs.mini import common

MAX_LAG = 4
TARGET_ESS = 0.97
ARMS = ("p3o", "grpo_eps0.2", "grpo_tis", "p3o_paced")


def get_config(arg: str | None = None):
    arm = common.pick(ARMS, arg)
    c = common.testbed()
    c.train.mode = "async"
    c.train.async_rollout_devices = 0  # half: one of the two CPU devices
    c.train.sync_every = 1
    c.rollout.max_lag = MAX_LAG
    if arm == "p3o_paced":
        c.rollout.target_ess = TARGET_ESS
        arm = "p3o"
    return common.with_objective(c, arm)

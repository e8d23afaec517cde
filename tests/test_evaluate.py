"""Held-out eval scores every example exactly k times, whatever num_examples % batch_size is.

Bug caught: fixed-shape batching that drops the last num_examples % batch_size examples (or
scores the repeats that top up the last batch), which biases pass@k toward the first examples.
"""

import jax
import ml_collections
import pytest
from test_train import tiny_config

from ess_jax.rl import experiment, heldout
from ess_jax.sampling.engine import JaxEngine


@pytest.fixture(scope="module")
def policy_and_examples():
    c = tiny_config()
    cfg, params, tokenizer = experiment.load_policy(c.model)
    _, held_out = experiment.load_examples(c.task)
    engine = JaxEngine(cfg)
    engine.update_params(0, params)
    return engine, held_out, tokenizer


@pytest.mark.parametrize("num_examples,batch_size", [(5, 4), (3, 4), (8, 4)])
def test_every_example_scored_k_times(policy_and_examples, num_examples, batch_size):
    policy, examples, tokenizer = policy_and_examples
    k = 2
    seen = []
    last = examples[num_examples - 1]["prompt"]

    def reward(text, example):  # only the last example counts as solved, whatever the text
        seen.append(example["prompt"])
        return float(example["prompt"] == last)

    ecfg = ml_collections.ConfigDict(
        {
            "num_examples": num_examples,
            "batch_size": batch_size,
            "k": k,
            "temperature": 1.0,
            "max_new_tokens": 3,
        }
    )
    out = heldout.evaluate(
        policy, examples, tokenizer, reward, ecfg, stop_ids=(), rng=jax.random.key(0)
    )
    want = [ex["prompt"] for ex in examples[:num_examples] for _ in range(k)]
    assert sorted(seen) == sorted(want)
    assert out["eval/pass@1"] == pytest.approx(1 / num_examples)
    assert out[f"eval/pass@{k}"] == pytest.approx(1 / num_examples)
    assert 0 < out["eval/response_len"] <= 3

"""Held-out pass@1 and pass@k: k samples per problem at a set temperature."""

from __future__ import annotations

import math

import jax
import numpy as np

from ess_jax.data import PromptBatcher, RowLayout
from ess_jax.rl import rollout as rollout_lib
from ess_jax.sampling import sampler as sampler_lib
from ess_jax.sampling.engine import RolloutEngine


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al., 2021)."""
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def evaluate(
    engine: RolloutEngine,
    examples: list[dict],
    tokenizer,
    reward_fn,
    ecfg,
    stop_ids,
    rng: jax.Array,
    buckets=(16, 32, 64),
) -> dict:
    """{'eval/pass@1', 'eval/pass@k' (k > 1), 'eval/response_len'} over the first
    `ecfg.num_examples` of `examples` (all if 0), drawn by `engine` (its params pushed).

    Every example is scored with `ecfg.k` samples at `ecfg.temperature`; pass@1 is the mean
    success over all samples, pass@k the unbiased estimator with n = k. The engine's formats
    are the eval's (`Run.evaluate` builds it in eval.precision and eval.kv_cache_precision).
    Batches have a fixed shape: the last one is topped up with repeats of the first examples,
    whose samples are dropped unscored, so every example counts once whatever
    num_examples % batch_size is.
    """
    n_ex = min(len(examples), int(ecfg.num_examples)) if ecfg.num_examples else len(examples)
    if n_ex == 0:
        raise ValueError("eval: no held-out examples")
    bs = int(ecfg.batch_size)
    n_batches = -(-n_ex // bs)
    padded = [examples[i % n_ex] for i in range(n_batches * bs)]
    batcher = PromptBatcher(padded, tokenizer, bs, buckets=buckets, shuffle=False)
    sampling = sampler_lib.SamplingConfig(
        temperature=float(ecfg.temperature),
        top_k=0,
        top_p=1.0,
        max_new_tokens=int(ecfg.max_new_tokens),
        num_samples=int(ecfg.k),
        stop_ids=tuple(stop_ids),
    )
    correct, lengths = [], []
    k = sampling.num_samples
    for i in range(n_batches):
        b = next(batcher)
        layout = RowLayout(min(bs, n_ex - i * bs), k)  # the prompts scored, k rows each
        gen = engine.generate(
            b["prompt_tokens"], b["prompt_mask"], sampling, jax.random.fold_in(rng, i)
        )
        mask = gen.response_mask[: layout.num_rows]
        texts = rollout_lib.completions_text(tokenizer, gen.tokens[: layout.num_rows], mask)
        exs = layout.repeat(b["examples"][: layout.num_prompts])
        correct.append(np.array([reward_fn(t, ex) >= 1.0 for t, ex in zip(texts, exs)]))
        lengths.append(mask.sum(-1))
    c = np.concatenate(correct).reshape(n_ex, k)
    out = {
        "eval/pass@1": float(c.mean()),
        "eval/response_len": float(np.concatenate(lengths).mean()),
    }
    if k > 1:
        out[f"eval/pass@{k}"] = float(np.mean([pass_at_k(k, int(n), k) for n in c.sum(-1)]))
    return out

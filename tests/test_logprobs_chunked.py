"""token_logprobs with the LM head and attention computed in time chunks (and blocks recomputed
in the backward pass) equals the one-shot version; so does the sampler's chunked prefill."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model_cfg

from ess_jax.model import decoder as model
from ess_jax.model import scoring

CFG = tiny_model_cfg()


@pytest.mark.parametrize("chunk,remat", [(3, False), (5, True), (16, False), (0, True)])
def test_chunked_logprobs_value_entropy_and_grad_match(chunk, remat):
    """Catches: a query chunk attending to the wrong keys (causal / padding mask shifted by the
    chunk offset), the padded last chunk leaking into real rows, remat changing gradients."""
    cfg = CFG
    params = model.init_params(cfg, 0)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 96, (3, 13)), jnp.int32)
    mask = jnp.ones((3, 13), bool).at[0, :4].set(False).at[2, 10:].set(False)
    chunked = cfg.replace(logits_chunk=chunk, remat=remat)

    lp, ent = scoring.token_logprobs(cfg, params, tokens, mask, return_entropy=True)
    lp_c, ent_c = jax.jit(lambda p: scoring.token_logprobs(chunked, p, tokens, mask, True))(params)
    np.testing.assert_allclose(lp_c, lp, rtol=1e-5, atol=1e-6)  # float32 rounding
    np.testing.assert_allclose(ent_c, ent, atol=1e-5)
    assert float(jnp.abs(lp).sum()) > 0  # not vacuous

    w = jnp.asarray(rng.normal(size=(3, 13)), jnp.float32)
    loss = lambda c: lambda p: jnp.sum(w * scoring.token_logprobs(c, p, tokens, mask))
    g = jax.grad(loss(cfg))(params)
    g_c = jax.jit(jax.grad(loss(chunked)))(params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_c)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


def test_sampler_prefill_with_chunked_attention_draws_the_same_tokens():
    """Catches: the prefill's query chunks writing a different KV cache than the one-shot
    prefill (the decode steps would then read wrong keys)."""
    from ess_jax.sampling import sampler

    cfg = CFG
    params = model.init_params(cfg, 1)
    rng = np.random.default_rng(1)
    prompts = rng.integers(3, 96, (2, 20)).astype(np.int32)
    mask = np.ones((2, 20), bool)
    mask[0, :6] = False
    sc = sampler.SamplingConfig(max_new_tokens=6, num_samples=2, stop_ids=())
    key = jax.random.key(0)
    a = sampler.sample(cfg, params, prompts, mask, sc, key)
    b = sampler.sample(cfg.replace(logits_chunk=8), params, prompts, mask, sc, key)
    np.testing.assert_array_equal(b.tokens, a.tokens)
    np.testing.assert_allclose(b.behaviour_logp, a.behaviour_logp, atol=1e-5)
    assert float(np.abs(np.asarray(a.behaviour_logp)).sum()) > 0


@pytest.mark.parametrize("start,chunk", [(1, 0), (5, 0), (5, 3), (12, 4)])
def test_scoring_from_start_matches_the_whole_sequence_sliced(start, chunk):
    """Catches an off-by-one in where the scored tokens begin (the hidden state of position
    start - 1 predicts token start: planted, 4 of 5 cases fail), chunking of the scored span
    misaligned with it, and the gradient of the sliced LM head differing from the whole one's:
    the RL step scores from the prompt width. (The whole-sequence path itself is checked
    against Hugging Face in test_model.)"""
    params = model.init_params(CFG, 2)
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, 96, (3, 13)), jnp.int32)
    mask = jnp.ones((3, 13), bool).at[0, :6].set(False).at[2, 11:].set(False)
    cfg = CFG.replace(logits_chunk=chunk)
    lp, ent = scoring.token_logprobs(CFG, params, tokens, mask, True)
    lp_s, ent_s = scoring.token_logprobs(cfg, params, tokens, mask, True, start=start)
    assert lp_s.shape == (3, 13 - start)
    np.testing.assert_allclose(lp_s, lp[:, start:], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ent_s, ent[:, start:], atol=1e-5)
    assert float(jnp.abs(lp_s).sum()) > 0

    w = jnp.asarray(rng.normal(size=(3, 13)), jnp.float32)
    whole = lambda p: jnp.sum(
        w[:, start:] * scoring.token_logprobs(CFG, p, tokens, mask)[:, start:]
    )
    part = lambda p: jnp.sum(
        w[:, start:] * scoring.token_logprobs(cfg, p, tokens, mask, start=start)
    )
    for a, b in zip(
        jax.tree.leaves(jax.grad(whole)(params)), jax.tree.leaves(jax.grad(part)(params))
    ):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)  # float32 sums


def test_scoring_from_start_skips_the_prompt_positions_lm_head():
    """Catches the LM head still running over every position (the logits sliced afterwards):
    XLA's FLOP count must fall by the vocabulary matmul of the unscored positions."""
    cfg = CFG.replace(vocab_size=4096)  # the LM head dominates the count
    params = model.init_params(cfg, 0)
    tokens = jnp.zeros((2, 32), jnp.int32)
    flops = {
        s: jax.jit(lambda p, s=s: scoring.token_logprobs(cfg, p, tokens, start=s))
        .lower(params)
        .compile()
        .cost_analysis()["flops"]
        for s in (0, 24)
    }
    lm_head = 2 * 2 * cfg.hidden_size * cfg.vocab_size  # per position, 2 rows
    saved = flops[0] - flops[24]
    assert 0.9 * 23 * lm_head < saved < 1.3 * 23 * lm_head, (flops, 23 * lm_head)
    with pytest.raises(ValueError, match="start 32"):
        scoring.token_logprobs(cfg, params, tokens, start=32)

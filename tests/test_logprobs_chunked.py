"""token_logprobs with the LM head computed in time chunks equals the one-shot version."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ess_jax import model


@pytest.mark.parametrize("chunk", [3, 5, 16])  # 5: the padded last chunk
def test_chunked_logprobs_value_entropy_and_grad_match(chunk):
    cfg = model.ModelConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    params = model.init_params(cfg, 0)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 96, (3, 13)), jnp.int32)
    mask = jnp.ones((3, 13), bool).at[0, :4].set(False).at[2, 10:].set(False)
    chunked = cfg.replace(logits_chunk=chunk)

    lp, ent = model.token_logprobs(cfg, params, tokens, mask, return_entropy=True)
    lp_c, ent_c = jax.jit(lambda p: model.token_logprobs(chunked, p, tokens, mask, True))(params)
    np.testing.assert_allclose(lp_c, lp, atol=1e-6)
    np.testing.assert_allclose(ent_c, ent, atol=1e-5)
    assert float(jnp.abs(lp).sum()) > 0  # not vacuous

    w = jnp.asarray(rng.normal(size=(3, 13)), jnp.float32)
    loss = lambda c: lambda p: jnp.sum(w * model.token_logprobs(c, p, tokens, mask))
    g = jax.grad(loss(cfg))(params)
    g_c = jax.jit(jax.grad(loss(chunked)))(params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_c)):
        np.testing.assert_allclose(b, a, atol=1e-5)

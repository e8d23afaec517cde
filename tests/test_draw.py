"""draw.categorical, the sampler's two-stage Gumbel-max draw (a vocabulary block, then a token
in it), against the exact softmax: chi-square on many draws over a vocabulary of several
blocks, with a truncated support, a block with nothing to draw and a partial last block.
(tests/test_sampler.py's models have V = 32, which takes the one-stage path.)"""

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats

from ess_jax.sampling import draw

V = 5 * draw.BLOCK + 37  # a partial last block: padding must never be drawn
N = 200_000


def _logits():
    rng = np.random.default_rng(0)
    x = rng.normal(0.0, 1.5, V)
    x[: draw.BLOCK] += 3.0  # most of the mass in the first block ...
    x[2 * draw.BLOCK : 3 * draw.BLOCK] = -np.inf  # ... none in the third (a truncated support)
    x[3 * draw.BLOCK : 3 * draw.BLOCK + 5] -= 6.0  # rare tokens
    x[-1] = -np.inf
    return x


def _draws(logits_V, n=N, seed=1):
    keys = jax.random.split(jax.random.key(seed), n // 1000)
    x = jnp.broadcast_to(jnp.asarray(logits_V, jnp.float32), (1000, V))
    tok, lse = jax.jit(jax.vmap(lambda k: draw.categorical(k, x)))(keys)
    return np.asarray(tok).reshape(-1), np.asarray(lse)


def test_two_stage_draw_is_the_softmax():
    """Catches a biased two-stage draw: stage one weighting blocks by anything but their
    log-sum-exp (planted: their max, fails), the within-block index offset wrong (planted: off
    by one, fails), or padding / -inf tokens drawn. Block masses are checked too: a block-level
    bias can hide in the per-token pooling. Not caught: both stages reusing one key (planted:
    passes; its bias falls on token k of block k only)."""
    x = _logits()
    tok, lse = _draws(x)
    p = np.exp(x - np.logaddexp.reduce(x[np.isfinite(x)]))
    assert tok.min() >= 0 and tok.max() < V
    counts = np.bincount(tok, minlength=V)
    assert counts[~np.isfinite(x)].sum() == 0
    expected = p * len(tok)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    assert scipy.stats.chisquare(obs, exp).pvalue > 1e-3
    blocks = np.arange(V) // draw.BLOCK
    obs_b = np.bincount(blocks, weights=counts)
    exp_b = np.bincount(blocks, weights=expected)
    live = exp_b > 0
    assert scipy.stats.chisquare(obs_b[live], exp_b[live]).pvalue > 1e-3
    want = np.logaddexp.reduce(x[np.isfinite(x)].astype(np.float64))
    np.testing.assert_allclose(lse, want, rtol=1e-6)


def test_two_stage_draw_is_per_row_and_deterministic():
    """Catches rows sharing one block choice (a broadcast key or block index) and a draw
    that is not a function of its key."""
    x = jnp.asarray(np.stack([_logits(), _logits()[::-1]]), jnp.float32)
    key = jax.random.key(3)
    a, _ = draw.categorical(key, x)
    b, _ = draw.categorical(key, x)
    np.testing.assert_array_equal(a, b)
    many = jax.vmap(lambda k: draw.categorical(k, x)[0])(jax.random.split(key, 400))
    many = np.asarray(many)
    assert np.isfinite(np.asarray(x)[0, many[:, 0]]).all()
    assert np.isfinite(np.asarray(x)[1, many[:, 1]]).all()
    # row 1 is row 0 reversed: its mass sits in the last block, row 0's in the first
    assert (many[:, 0] < draw.BLOCK).mean() > 0.5 and (many[:, 1] >= V - draw.BLOCK).mean() > 0.5

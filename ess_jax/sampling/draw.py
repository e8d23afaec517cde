"""One draw from the sampler's distribution, with the exact log-probs it records.

The drawing distribution: logits / temperature, then top-k, then top-p over the renormalised
top-k distribution; greedy (temperature 0) is a point mass on the argmax. rescore.py uses
`kept_support` to rebuild the same truncated distribution for the full-vocabulary KL.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def kept_support(scaled_BxV, top_k: int, top_p, use_top_p: bool):
    """Boolean mask of the tokens that may be drawn (by value, so ties are kept together)."""
    keep = jnp.ones(scaled_BxV.shape, bool)
    vals = None
    if 0 < top_k < scaled_BxV.shape[-1]:
        vals = jax.lax.top_k(scaled_BxV, top_k)[0]  # sorted descending
        keep = scaled_BxV >= vals[:, -1:]
    if use_top_p:
        if vals is None:
            vals = -jnp.sort(-scaled_BxV, axis=-1)
        probs = jax.nn.softmax(vals, axis=-1)
        # mass strictly before each token in descending order; keep while it is < top_p
        before = jnp.pad(jnp.cumsum(probs, axis=-1)[:, :-1], ((0, 0), (1, 0)))
        n_keep = jnp.sum(before < top_p, axis=-1, keepdims=True)  # >= 1
        thresh = jnp.take_along_axis(vals, n_keep - 1, axis=-1)
        keep = keep & (scaled_BxV >= thresh)
    return keep


BLOCK = 128  # vocabulary block of the two-stage draw


def categorical(key, logits_BxV):
    """(token [B] int32, logsumexp(logits) [B]): one exact draw from softmax(logits) per row.

    Gumbel-max in two stages: a block of BLOCK tokens with probability exp(lse_block - lse),
    then a token within it with probability exp(logit - lse_block). Exact, because the maximum
    of logit + Gumbel noise over a block is itself lse_block + Gumbel noise, independent of
    where in the block it falls. It draws V / BLOCK + BLOCK Gumbel variables per row instead of
    V: on the CPU one draw at [32, 8192] takes 0.4 ms, 5.9 ms in one stage (a greedy draw:
    0.7 ms).
    mode="high": the default Gumbel noise is biased for events with p < ~1e-7, and the recorded
    log-probs must describe the drawing distribution exactly. -inf logits (a truncated support)
    are never drawn; padding to whole blocks is -inf too.
    """
    b, v = logits_BxV.shape
    if v <= 2 * BLOCK:
        tok = jax.random.categorical(key, logits_BxV, axis=-1, mode="high")
        return tok.astype(jnp.int32), jax.nn.logsumexp(logits_BxV, axis=-1)
    nb = -(-v // BLOCK)
    x_BxNxK = jnp.pad(logits_BxV, ((0, 0), (0, nb * BLOCK - v)), constant_values=-jnp.inf)
    x_BxNxK = x_BxNxK.reshape(b, nb, BLOCK)
    lse_BxN = jax.nn.logsumexp(x_BxNxK, axis=-1)  # -inf for a block with nothing to draw
    k_block, k_token = jax.random.split(key)
    block = jax.random.categorical(k_block, lse_BxN, axis=-1, mode="high")
    inner_BxK = jnp.take_along_axis(x_BxNxK, block[:, None, None], axis=1)[:, 0]
    within = jax.random.categorical(k_token, inner_BxK, axis=-1, mode="high")
    tok = (block * BLOCK + within).astype(jnp.int32)
    return tok, jax.nn.logsumexp(lse_BxN, axis=-1)


def draw(logits_BxV, key, temperature, top_p, *, greedy: bool, top_k: int, use_top_p: bool):
    """token, behaviour_logp, raw_logp, log_kept_mass for one step (all float32)."""
    logits = logits_BxV.astype(jnp.float32)
    raw_lse = jax.nn.logsumexp(logits, axis=-1)

    def pick(x, tok):
        return jnp.take_along_axis(x, tok[:, None], axis=-1)[:, 0]

    if greedy:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        zero = jnp.zeros(tok.shape, jnp.float32)
        return tok, zero, pick(logits, tok) - raw_lse, zero
    scaled = logits / temperature
    truncated = (0 < top_k < logits.shape[-1]) or use_top_p
    if truncated:
        keep = kept_support(scaled, top_k, top_p, use_top_p)
        masked = jnp.where(keep, scaled, -jnp.inf)
    else:
        masked = scaled
    tok, kept_lse = categorical(key, masked)
    behaviour = pick(scaled, tok) - kept_lse
    if truncated:
        kept_mass = kept_lse - jax.nn.logsumexp(scaled, axis=-1)
    else:
        kept_mass = jnp.zeros(tok.shape, jnp.float32)
    return tok, behaviour, pick(logits, tok) - raw_lse, kept_mass

"""How far the trainer's policy is from another one: the normalised effective sample size of
the importance ratios, sampled-token KL estimators, exact full-vocabulary KL (also to a
truncated distribution); all in float32.

Axis alphabet: B batch, T time, V vocab. Sampled-token estimators take the log-prob of the
realised token under the current policy (`logp`) and under the other policy (`other_logp`)
and estimate KL(pi_theta || pi_other) per token (Schulman's k1/k2/k3).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

# docs/method.md / FeynRL's `compute_kl_distance`: the exponent of k3 is clamped to
# [-10, 10] so one wildly off token cannot overflow exp() and dominate the loss.
K3_EXP_CLAMP = 10.0


def kl_k1(logp: jax.Array, other_logp: jax.Array) -> jax.Array:
    """k1 = log(pi / pi_other): unbiased, high variance, can be negative."""
    return logp.astype(jnp.float32) - other_logp.astype(jnp.float32)


def kl_k2(logp: jax.Array, other_logp: jax.Array) -> jax.Array:
    """k2 = 0.5 * log(pi / pi_other)^2: biased, low variance, non-negative."""
    return 0.5 * jnp.square(kl_k1(logp, other_logp))


def kl_k3(logp: jax.Array, other_logp: jax.Array) -> jax.Array:
    """k3 = (logp - other) + exp(clip(other - logp, -10, 10)) - 1, exactly as the paper code."""
    logp = logp.astype(jnp.float32)
    other_logp = other_logp.astype(jnp.float32)
    expo = jnp.clip(other_logp - logp, -K3_EXP_CLAMP, K3_EXP_CLAMP)
    return (logp - other_logp) + jnp.exp(expo) - 1.0


KL_ESTIMATORS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}


def get_kl_estimator(name: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
    if name not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {name!r}; valid: {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[name]


def full_kl(logits_p_BxTxV: jax.Array, logits_q_BxTxV: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """Exact per-token KL(p || q) over the full vocabulary, 0 on masked tokens -> [B, T]."""
    logp_BxTxV = jax.nn.log_softmax(logits_p_BxTxV.astype(jnp.float32), axis=-1)
    logq_BxTxV = jax.nn.log_softmax(logits_q_BxTxV.astype(jnp.float32), axis=-1)
    # Where p(v) == 0 the term is 0 even if q(v) == 0: guard the 0 * -inf = nan case.
    p_BxTxV = jnp.exp(logp_BxTxV)
    terms = jnp.where(p_BxTxV > 0, p_BxTxV * (logp_BxTxV - logq_BxTxV), 0.0)
    return jnp.where(mask_BxT.astype(bool), terms.sum(-1), 0.0)


# Stands for -inf outside a support: exp() of it is exactly 0, yet it stays finite, so neither the
# value nor the gradient can meet 0 * inf = nan.
_OUTSIDE = -1e30


def kl_on_support(logits_p_BxTxV: jax.Array, logq_BxTxV: jax.Array, keep_BxTxV: jax.Array):
    """Per-token KL(p(.|S) || q) in float32 -> [B, T], where S = `keep` is q's support (log q is
    read on S only) and p(.|S) is p conditioned on S: softmax of the logits over S.

    With S the whole vocabulary this is the exact KL(p || q). With a truncated q (top-k / top-p)
    KL(p || q) itself is +inf (q is 0 where p is not); this is its finite counterpart, 0 iff p
    agrees with q on S, and p's logits outside S get no gradient."""
    logp_s = jax.nn.log_softmax(jnp.where(keep_BxTxV, logits_p_BxTxV.astype(jnp.float32), _OUTSIDE))
    logq = jnp.where(keep_BxTxV, logq_BxTxV.astype(jnp.float32), 0.0)
    return jnp.sum(jnp.where(keep_BxTxV, jnp.exp(logp_s) * (logp_s - logq), 0.0), axis=-1)


def entropy_from_logits(logits_BxTxV: jax.Array) -> jax.Array:
    """Per-token entropy H(softmax(logits)) in float32 -> [B, T]."""
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    p_BxTxV = jnp.exp(logp_BxTxV)
    return -jnp.where(p_BxTxV > 0, p_BxTxV * logp_BxTxV, 0.0).sum(-1)


# ----------------------------------------------------------------------------- ESS


class EssSums(NamedTuple):
    """Shift-aware partial sums of an ESS: sums of exp(lr - max) and exp(2 (lr - max))."""

    max: jax.Array  # largest valid log-ratio; -inf when there is none
    sum: jax.Array
    sumsq: jax.Array
    count: jax.Array  # valid tokens, float32


def ess_sums(log_ratio_BxT: jax.Array, mask_BxT: jax.Array) -> EssSums:
    """Partial sums over one shard / micro-batch; merge them with `combine_ess_sums`."""
    mask = mask_BxT.astype(bool)
    lr = jnp.where(mask, jax.lax.stop_gradient(log_ratio_BxT).astype(jnp.float32), -jnp.inf)
    top = jnp.max(lr)
    # Shifting by the max keeps ratios of exp(+-80) in float32 range; NaN / +inf survive the
    # shift on purpose so that ess_from_sums can fall back to 1.
    shifted = lr - jnp.where(top == -jnp.inf, 0.0, top)
    count = jnp.sum(mask, dtype=jnp.int32).astype(jnp.float32)
    return EssSums(top, jnp.sum(jnp.exp(shifted)), jnp.sum(jnp.exp(2.0 * shifted)), count)


def combine_ess_sums(a: EssSums, b: EssSums) -> EssSums:
    """Merge two partials with log-sum-exp style rescaling to the common max."""
    top = jnp.maximum(a.max, b.max)
    ref = jnp.where(top == -jnp.inf, 0.0, top)
    fa, fb = jnp.exp(a.max - ref), jnp.exp(b.max - ref)
    return EssSums(
        top, a.sum * fa + b.sum * fb, a.sumsq * fa**2 + b.sumsq * fb**2, a.count + b.count
    )


def ess_from_sums(s: EssSums) -> jax.Array:
    """(sum rho)^2 / (N sum rho^2); 1.0 for an empty batch or non-finite sums."""
    # The reference adds 1e-8 to sum rho^2, which makes its ESS scale-dependent (it falls to 0
    # when every ratio is tiny). After the max-shift sumsq >= 1, so no epsilon is needed.
    ess = jnp.square(s.sum) / (s.count * s.sumsq)
    ok = (s.count > 0) & jnp.isfinite(ess)
    # Cauchy-Schwarz gives ess <= 1; the min only removes float rounding above 1.
    return jnp.where(ok, jnp.minimum(ess, 1.0), 1.0)


def effective_sample_size(log_ratio_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """Normalised ESS of the ratios exp(log_ratio) over valid tokens, in [1/N, 1], stop-gradient."""
    return ess_from_sums(ess_sums(log_ratio_BxT, mask_BxT))

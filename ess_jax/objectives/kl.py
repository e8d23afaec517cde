"""How far the trainer's policy is from another one: the normalised effective sample size of
the importance ratios, sampled-token KL estimators, exact full-vocabulary KL (also to a
truncated distribution); all in float32.

Axis alphabet: B batch, T time, V vocab. Sampled-token estimators take the log-prob of the
realised token under the current policy (`logp`) and under the other policy (`other_logp`),
for tokens drawn from pi_b (Schulman's k1/k2/k3, `k3_tangent`: k3 continued past its clamp,
and the importance-weighted `k3_is` and `forward`); each docstring gives the estimator's mean
over y ~ pi_b when pi_other = pi_b.
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
    """k1 = log(pi / pi_other); over y ~ pi_b (pi_other = pi_b) its mean is -KL(pi_b || pi) <= 0
    (it is unbiased for KL(pi || pi_other) on pi's own samples); high variance."""
    return logp.astype(jnp.float32) - other_logp.astype(jnp.float32)


def kl_k2(logp: jax.Array, other_logp: jax.Array) -> jax.Array:
    """k2 = 0.5 * log(pi / pi_other)^2; over y ~ pi_b its mean is 0.5 E_b[log^2(pi/pi_b)] >= 0
    (either KL to second order): biased, low variance."""
    return 0.5 * jnp.square(kl_k1(logp, other_logp))


def kl_k3(logp: jax.Array, other_logp: jax.Array) -> jax.Array:
    """k3 = (logp - other) + exp(clip(other - logp, -10, 10)) - 1, exactly as the paper code.
    Over y ~ pi_b (pi_other = pi_b, unclamped) its mean is chi^2(pi_b || pi) - KL(pi_b || pi),
    not KL(pi || pi_b) (`kl_k3_is` is)."""
    logp = logp.astype(jnp.float32)
    other_logp = other_logp.astype(jnp.float32)
    expo = jnp.clip(other_logp - logp, -K3_EXP_CLAMP, K3_EXP_CLAMP)
    return (logp - other_logp) + jnp.exp(expo) - 1.0


def kl_k3_tangent(logp: jax.Array, other_logp: jax.Array) -> jax.Array:
    """k3 inside |log(pi / pi_other)| < 10 (K3_EXP_CLAMP), its tangent at +-10 beyond.

    Past the clamp k3's exponent is constant, so its gradient in logp is +1 on both sides: at
    log ratio x > 10 nearly the true 1 - e^-x, at x < -10 the opposite sign of the true
    1 - e^-x (-1.6e5 at x = -12): the term then pushes pi(y) further below pi_b(y) (docs/
    method.md, "KL estimators"). Here, with c = clip(x, -10, 10), the estimate beyond is
    g(c) + g'(c) (x - c), g(x) = x + e^-x - 1, g'(c) = 1 - e^-c (as `k3_is` and `forward` are
    continued past +-20): value and gradient continuous at +-10, the gradient beyond is
    1 - e^10 ~ -2.2e4 below -10 (the true sign, bounded) and 1 - e^-10 above, and no exp() can
    overflow. Inside it is `kl_k3` itself, value and gradient to the bit. Over y ~ pi_b it is
    k3's divergence while no token is beyond the clamp, biased low where one is."""
    log_r = kl_k1(logp, other_logp)
    c = jax.lax.stop_gradient(jnp.clip(log_r, -K3_EXP_CLAMP, K3_EXP_CLAMP))
    slope = 1.0 - jnp.exp(-c)
    tangent = (c + jnp.exp(-c) - 1.0) + slope * (log_r - c)
    return jnp.where(jnp.abs(log_r) < K3_EXP_CLAMP, kl_k3(logp, other_logp), tangent)


# The log of the importance weight pi / pi_other in `k3_is` and `forward` is clamped as every
# importance ratio (core.LOG_RATIO_CLAMP, verl's; core imports this module, so the value is here).
IS_LOG_CLAMP = 20.0


def _clamp(log_w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(c, d): c = clip(log_w, -IS_LOG_CLAMP, IS_LOG_CLAMP) and d = log_w - c, the distance
    beyond the clamp (0 inside, with a zero gradient there).

    `kl_k3_is` and `kl_forward` compute their g(log w) as g(c) + g'(c) d, the first-order
    extension past the clamp: g itself inside, its tangent at +-20 beyond. Value and gradient
    are continuous; both g are convex and increase away from 0, so beyond the clamp the
    extension grows from g(+-20) > 0 and the gradient keeps the exact one's sign."""
    c = jnp.clip(log_w, -IS_LOG_CLAMP, IS_LOG_CLAMP)
    return c, log_w - c


def kl_k3_is(logp: jax.Array, other_logp: jax.Array) -> jax.Array:
    """k3_is = w log w - (w - 1) with w = pi / pi_other: unbiased for KL(pi || pi_b) on tokens
    drawn from pi_b (pi_other = pi_b), and so is its gradient.

    Derivation. For samples of pi, k3 of KL(pi || q) is f = q/pi - 1 - log(q/pi) = 1/w - 1 +
    log w. Importance-weighted to samples of q = pi_b: w f = 1 - w + w log w, and
    E_b[w f] = sum_y pi_b (1 - w + w log w) = 1 - 1 + sum_y pi log(pi/pi_b) = KL(pi || pi_b).
    Per token w f >= 0 (x log x - x + 1 >= 0), 0 iff w = 1.

    Gradient. pi_b does not depend on theta, so grad E_b[h] = E_b[grad h] for any h: the
    estimate's gradient is unbiased exactly when the weight stays differentiable. Here
    d(w f)/dw = log w and grad w = w grad log pi, so grad(w f) = w log w grad log pi, and
    E_b[w log w grad log pi] = E_pi[log w grad log pi] = grad KL(pi || pi_b) (the "+1" term of
    grad KL, E_pi[grad log pi], is 0). With the weight stop-gradient, sg(w) grad f =
    (w - 1) grad log pi, whose expectation is -E_b[grad log pi] = grad KL(pi_b || pi): the
    other direction. (sg(w) f plus the score term sg(w f) grad log pi is the same gradient as
    the form used here.)

    Clamp: exact for |log w| <= 20 (IS_LOG_CLAMP, as core.ratio); beyond, the estimate
    continues along its tangent at c = +-20 (`_clamp`): value and gradient are
    continuous, the gradient is c e^c grad log pi (<= 20 e^20 ~ 9.7e9 in size), with the exact
    sign, and no exp() can overflow."""
    log_w = logp.astype(jnp.float32) - other_logp.astype(jnp.float32)
    c, beyond = _clamp(log_w)
    # 1 - w as -expm1: exact near w = 1, where the estimate is ~ (w - 1)^2 / 2.
    return (c * jnp.exp(c) - jnp.expm1(c)) + c * jnp.exp(c) * beyond


def kl_forward(logp: jax.Array, other_logp: jax.Array) -> jax.Array:
    """forward = rho - 1 - log rho with rho = pi / pi_other: unbiased for the forward KL
    KL(pi_b || pi) on tokens drawn from pi_b (pi_other = pi_b), and so is its gradient.

    E_b[rho] = sum_y pi = 1 and E_b[-log rho] = KL(pi_b || pi), so E_b[rho - 1 - log rho] =
    KL(pi_b || pi); per token >= 0, 0 iff rho = 1. Gradient (pi_b fixed, as for k3_is):
    (rho - 1) grad log pi, with E_b[(rho - 1) grad log pi] = -E_b[grad log pi] =
    grad KL(pi_b || pi). Its value is k3 with the arguments swapped; k3 itself,
    -log r + r - 1 with r = 1/rho, is the reverse-direction k3 without its weight.

    Clamp: exact for |log rho| <= 20 (IS_LOG_CLAMP); beyond, its tangent at c = +-20
    (`_clamp`): the gradient is (e^c - 1) grad log pi, bounded by e^20, with the
    exact sign (-1 below -20: as k3's linear term, it pulls pi(y) back up)."""
    log_rho = logp.astype(jnp.float32) - other_logp.astype(jnp.float32)
    c, beyond = _clamp(log_rho)
    return (jnp.expm1(c) - c) + jnp.expm1(c) * beyond


KL_ESTIMATORS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "k3_tangent": kl_k3_tangent,
    "k3_is": kl_k3_is,
    "forward": kl_forward,
}
# ObjectiveConfig.ref_kl_estimator (config/domains.py's REF_KL_ESTIMATORS): the frozen reference
# is not the policy the tokens come from (pi_b), so the weight pi / pi_ref of k3_is and forward
# corrects for the wrong sampler (and grows without bound as pi leaves pi_ref); the reference KL
# keeps the unweighted k1 / k2 / k3 / k3_tangent.


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

"""Sampled-token KL estimators on tokens drawn from pi_b: on a 5-outcome categorical (pi =
softmax(theta), pi_b fixed), the Monte Carlo mean over 200k pi_b samples of each estimator and
of its gradient in theta matches the exact divergence and gradient (float64 numpy) within 4
standard errors estimated from the samples; the new estimators run end to end in p3o and
p3o_dual."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import quickstart
from ess_jax import objectives as O
from ess_jax.objectives import core
from ess_jax.objectives import kl as K

N = 200_000
Z_OK = 4.0  # a correct estimator: every |MC mean - exact| within 4 standard errors
Z_WRONG = 10.0  # a wrong one: some component more than 10 standard errors off
Q = np.array([0.3, 0.25, 0.2, 0.15, 0.1])  # pi_b
THETA = np.log(np.array([0.15, 0.2, 0.2, 0.25, 0.2]))  # pi = softmax(THETA)


def _softmax(theta):
    e = np.exp(theta - theta.max())
    return e / e.sum()


def _kl_pi_b(theta):  # KL(pi || pi_b)
    p = _softmax(theta)
    return float(np.sum(p * np.log(p / Q)))


def _kl_b_pi(theta):  # KL(pi_b || pi)
    return float(np.sum(Q * np.log(Q / _softmax(theta))))


def _chi2_minus_kl(theta):  # chi^2(pi_b || pi) - KL(pi_b || pi): E_b[k3]
    return float(np.sum(Q**2 / _softmax(theta)) - 1.0) - _kl_b_pi(theta)


def _exact(fn):
    """fn(THETA) and its gradient in float64 (central differences, error ~1e-10)."""
    h = 1e-5
    eye = np.eye(len(THETA))
    grad = np.array([(fn(THETA + h * e) - fn(THETA - h * e)) / (2 * h) for e in eye])
    return fn(THETA), grad


@functools.cache
def _samples():
    y = np.random.default_rng(0).choice(len(Q), size=N, p=Q)
    return jnp.asarray(y), jnp.asarray(np.log(Q)[y], jnp.float32)


def _z_scores(estimator, exact_fn):
    """|MC mean - exact| / SE for the value and the 5 gradient components."""
    y, blogp = _samples()

    def per_token(theta):
        return estimator(jax.nn.log_softmax(theta)[y], blogp)

    theta = jnp.asarray(THETA, jnp.float32)
    values = np.asarray(per_token(theta), np.float64)
    one = jax.grad(lambda t, yi, bi: estimator(jax.nn.log_softmax(t)[yi], bi))
    grads = np.asarray(jax.vmap(one, (None, 0, 0))(theta, y, blogp), np.float64)  # [N, 5]
    # The gradient of the sample mean (what a loss backpropagates), taken over chunks of 1000
    # and averaged in float64: one float32 scatter-add of 200k terms would be off by ~0.3 SE.
    chunk_mean = lambda t, yc, bc: jnp.mean(estimator(jax.nn.log_softmax(t)[yc], bc))
    chunks = (y.reshape(-1, 1000), blogp.reshape(-1, 1000))
    mean_grad = np.asarray(jax.vmap(jax.grad(chunk_mean), (None, 0, 0))(theta, *chunks)).mean(0)
    value, grad = _exact(exact_fn)
    est = np.concatenate([[values.mean()], mean_grad])
    se = np.concatenate([[values.std()], grads.std(0)]) / np.sqrt(N)
    # float32 summation of 200k terms: far below the Monte Carlo error.
    assert np.all(np.abs(mean_grad - grads.mean(0)) < 0.05 * se[1:])
    return np.abs(est - np.concatenate([[value], grad])) / se


CORRECT = {  # estimator: the divergence its expectation over y ~ pi_b is
    "k3_is": _kl_pi_b,
    "forward": _kl_b_pi,
    "k3": _chi2_minus_kl,
    "k1": lambda t: -_kl_b_pi(t),
}


@pytest.mark.parametrize("name", sorted(CORRECT))
def test_mc_mean_and_gradient_match_the_exact_divergence(name):
    """Catches an estimator, or its gradient, whose expectation under pi_b is not the divergence
    its docstring names (a wrong sign, a dropped term, a mis-placed stop-gradient)."""
    z = _z_scores(K.get_kl_estimator(name), CORRECT[name])
    assert z.max() < Z_OK, z


def test_k3_is_not_kl_pi_pi_b_on_pi_b_samples():
    """Catches docs or code that take the unweighted k3 for an estimate of KL(pi || pi_b): on
    pi_b's tokens it matches chi^2 - KL(pi_b || pi) (above) and misses KL(pi || pi_b)."""
    assert abs(_chi2_minus_kl(THETA) - _kl_pi_b(THETA)) > 0.01
    assert _z_scores(K.kl_k3, _kl_pi_b).max() > Z_WRONG


def _weight_dropped(logp, other_logp):
    log_w = logp - other_logp
    return jnp.exp(-log_w) - 1.0 + log_w  # k3 of KL(pi || pi_b) for pi's samples, no weight


def _weight_stop_gradient(logp, other_logp):
    log_w = logp - other_logp
    w = jax.lax.stop_gradient(jnp.exp(log_w))
    return w * (jnp.exp(-log_w) - 1.0 + log_w)


def _value_kl_pi_b_gradient_kl_b_pi(theta):
    """KL(pi || pi_b) at THETA, with the gradient of KL(pi_b || pi): what sg(w) f estimates."""
    return _kl_pi_b(THETA) + _kl_b_pi(theta) - _kl_b_pi(THETA)


@pytest.mark.parametrize("wrong", [_weight_dropped, _weight_stop_gradient])
def test_wrong_weighting_is_detected(wrong):
    """Catches a check too weak to tell k3_is from a wrongly weighted variant: the weight dropped
    (biased value and gradient), or stop-gradiented (right value; its gradient's expectation is
    grad KL(pi_b || pi), the other direction)."""
    z = _z_scores(wrong, _kl_pi_b)
    assert z.max() > Z_WRONG, z
    if wrong is _weight_stop_gradient:  # the value alone is unbiased: only the gradient is off
        assert z[0] < Z_OK and z[1:].max() > Z_WRONG, z
        assert _z_scores(wrong, _value_kl_pi_b_gradient_kl_b_pi)[1:].max() < Z_OK


def test_clamp_and_by_hand():
    """Catches a clamp other than core.LOG_RATIO_CLAMP's, and one whose gradient beyond it
    vanishes or flips sign (a weight exp(clip(log w)) with a zero gradient does both) instead of
    following the tangent at +-20."""
    assert K.IS_LOG_CLAMP == core.LOG_RATIO_CLAMP
    lp, other = jnp.float32(0.0), jnp.float32(-np.log(2.0))  # w = 2
    assert float(K.kl_k3_is(lp, other)) == pytest.approx(2 * np.log(2) - 1, rel=1e-6)
    assert float(K.kl_forward(lp, other)) == pytest.approx(1 - np.log(2), rel=1e-6)
    assert float(K.kl_k3_is(lp, lp)) == 0.0 and float(K.kl_forward(lp, lp)) == 0.0
    zero = jnp.float32(0.0)
    tangent_slope = {  # d estimate / d log w beyond the clamp: g'(+-20)
        (K.kl_k3_is, 1): 20 * np.exp(20.0),
        (K.kl_k3_is, -1): -20 * np.exp(-20.0),
        (K.kl_forward, 1): np.expm1(20.0),
        (K.kl_forward, -1): np.expm1(-20.0),
    }
    for (fn, side), slope in tangent_slope.items():
        for lw in (20.0, 30.0):  # continuous at the clamp, constant beyond
            assert float(jax.grad(fn)(jnp.float32(side * lw), zero)) == pytest.approx(
                slope, rel=1e-5, abs=1e-8
            )
        at, far = (
            float(fn(jnp.float32(side * 20.0), zero)),
            float(fn(jnp.float32(side * 30.0), zero)),
        )
        assert far == pytest.approx(at + 10 * abs(slope), rel=1e-5) and at > 0
        assert np.isfinite(float(fn(jnp.float32(side * 1e4), zero)))


def _batch():
    rng = np.random.default_rng(1)
    blogp = np.log(rng.uniform(0.05, 1.0, (2, 6))).astype(np.float32)
    return (
        (blogp + rng.normal(0, 0.5, (2, 6))).astype(np.float32),
        {
            "behaviour_logp": blogp,
            "prox_logp": (blogp + rng.normal(0, 0.3, (2, 6))).astype(np.float32),
            "advantages": rng.normal(size=(2, 6)).astype(np.float32),
            "mask": np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], bool),
        },
    )


@pytest.mark.parametrize("name", ["k3_is", "forward"])
@pytest.mark.parametrize("objective", ["p3o", "p3o_dual:two_kl", "p3o_dual:mixture"])
def test_p3o_and_dual_accept_new_estimators(objective, name):
    """Catches a new estimator the config refuses, or one that breaks jit or yields a non-finite
    loss or gradient in p3o / p3o_dual (both anchors)."""
    obj, _, version = objective.partition(":")
    cfg = O.objective_config(
        {"name": obj, "kl_estimator": name, **({"dual_version": version} if version else {})}
    )
    logp, batch = _batch()
    fn = jax.jit(
        jax.value_and_grad(lambda lp: O.OBJECTIVES[obj].loss(lp, batch, cfg), has_aux=True)
    )
    (loss, _), grad = fn(jnp.asarray(logp))
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad)))
    # The trust-region term differs from k3's: the estimator is actually used.
    k3 = dataclasses.replace(cfg, kl_estimator="k3")
    assert float(loss) != pytest.approx(float(O.OBJECTIVES[obj].loss(logp, batch, k3)[0]))


def test_default_stays_k3_and_reference_kl_refuses_weighted():
    """Catches a changed default estimator (the quickstart and the reference code use k3) and a
    reference KL that accepts an importance weight pi / pi_ref for tokens drawn from pi_b."""
    assert O.ObjectiveConfig().kl_estimator == "k3"
    qs = O.objective_config(quickstart.get_config().objective)
    assert (qs.kl_estimator, qs.ref_kl_estimator) == ("k3", "k3")
    logp, batch = _batch()
    explicit = O.ObjectiveConfig(kl_estimator="k3")
    assert float(O.p3o(logp, batch, O.ObjectiveConfig())[0]) == float(
        O.p3o(logp, batch, explicit)[0]
    )
    for name in ("k3_is", "forward"):
        with pytest.raises(ValueError, match="ref_kl_estimator"):
            O.ObjectiveConfig(ref_kl_estimator=name)

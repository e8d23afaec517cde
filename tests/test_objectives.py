"""Objectives: hand-computed values, a float64 reference of P3O and its dual, gradient identities,
degenerate batches, and partition invariance of the step-scope accumulation."""

import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from ess_jax import objectives as O
from ess_jax.model.scoring import entropy_from_logits
from ess_jax.objectives import scopes as A
from ess_jax.objectives.kl import K3_EXP_CLAMP
from ess_jax.rl import update as U

LN3 = math.log(3.0)


@functools.cache
def _jitted(name, kw):
    cfg = O.ObjectiveConfig(name=name, **dict(kw))
    fn = lambda lp, batch: O.OBJECTIVES[name].loss(lp, batch, cfg)
    return jax.jit(jax.value_and_grad(fn, has_aux=True))


def _loss_and_grad(name, logp, batch, **kw):
    (loss, metrics), grad = _jitted(name, tuple(sorted(kw.items())))(logp, batch)
    return float(loss), np.asarray(grad), {k: float(v) for k, v in metrics.items()}


# Two valid tokens with log-ratios 0 and ln 3 (rho = 1, 3, so ESS = 4^2 / (2 * 10) = 0.8),
# then a pad holding garbage that must not leak into anything.
LOGP = np.array([[-1.0, -2.0, -np.inf]], np.float32)
HAND = {
    "behaviour_logp": np.array([[-1.0, -2.0 - LN3, np.nan]], np.float32),
    "advantages": np.array([[2.0, 1.0, np.nan]], np.float32),
    "mask": np.array([[True, True, False]]),
    "prox_logp": np.array([[-1.0, -2.0 - math.log(1.5), np.inf]], np.float32),
}
K3_T2 = LN3 + 1 / 3 - 1  # k3 of token 2 vs pi_b: log rho + 1/rho - 1


def test_config_from_dict_and_errors():
    cfg = O.objective_config({"name": "grpo", "clip_eps_high": 0.28})
    assert (cfg.name, cfg.clip_eps_high) == ("grpo", 0.28)
    cd = ml_collections.ConfigDict({"name": "p3o_dual", "dual_version": "two_kl"})
    assert O.objective_config(cd).dual_version == "two_kl"
    with pytest.raises(ValueError, match="clip_eps"):
        O.objective_config({"clip_eps": 0.2, "name": "grpo"})
    with pytest.raises(ValueError, match="aggregation"):
        O.ObjectiveConfig(aggregation="mean")
    with pytest.raises(ValueError, match="p3o_dual"):  # the message lists the valid names
        O.get_objective("ppo2")
    assert O.paper_config("dapo").clip_eps_high == 0.28
    assert O.paper_config("gspo").clip_eps_low == 3e-4
    with pytest.raises(ValueError, match="prox_logp"):
        _loss_and_grad("p3o_dual", LOGP, {k: v for k, v in HAND.items() if k != "prox_logp"})


def test_kl_estimators_by_hand():
    logp, other = jnp.float32(-1.0), jnp.float32(-2.0)
    assert float(O.kl_k1(logp, other)) == pytest.approx(1.0)
    assert float(O.kl_k2(logp, other)) == pytest.approx(0.5)
    assert float(O.kl_k3(logp, other)) == pytest.approx(math.exp(-1.0), rel=1e-6)
    # The exponent is clamped to [-10, 10], the linear part is not.
    assert float(O.kl_k3(jnp.float32(-20.0), jnp.float32(0.0))) == pytest.approx(
        -20.0 + math.exp(K3_EXP_CLAMP) - 1.0, rel=1e-6
    )
    assert float(O.kl_k3(jnp.float32(0.0), jnp.float32(-20.0))) == pytest.approx(
        20.0 + math.exp(-10.0) - 1.0, rel=1e-6
    )
    # Beyond the clamp k3 has the gradient of k1 (exp of a clipped argument is constant).
    assert float(jax.grad(O.kl_k3)(jnp.float32(-20.0), jnp.float32(0.0))) == 1.0


def test_full_kl_and_entropy_by_hand():
    p = np.log(np.array([[[0.5, 0.25, 0.25], [1.0, 1e-30, 1e-30]]], np.float32))
    q = np.log(np.array([[[0.25, 0.25, 0.5], [0.5, 0.25, 0.25]]], np.float32))
    kl = np.asarray(O.full_kl(p, q, np.array([[True, False]])))
    expected = 0.5 * math.log(2) + 0.25 * math.log(0.5)
    np.testing.assert_allclose(kl, [[expected, 0.0]], rtol=1e-6)
    ent = np.asarray(entropy_from_logits(p))
    np.testing.assert_allclose(ent[0, 0], 1.5 * math.log(2), rtol=1e-6)
    assert np.all(np.isfinite(ent))


def test_p3o_by_hand():
    loss, grad, m = _loss_and_grad("p3o", LOGP, HAND)
    # pg: -min(1, .8)(-1)(2) = 1.6 and -min(3, .8)(-2)(1) = 1.6; KL: 0 and K3_T2.
    assert loss == pytest.approx((3.2 + 0.2 * K3_T2) / 2, rel=1e-6)
    # dL/dlogp = (-min(rho, e) A + (1 - e)(1 - 1/rho)) / N
    np.testing.assert_allclose(grad, [[-0.8, (-0.8 + 0.2 * (2 / 3)) / 2, 0.0]], rtol=1e-6)
    assert m["ess"] == pytest.approx(0.8, rel=1e-6)
    assert m["capped_frac"] == pytest.approx(1.0)  # both rho exceed e = 0.8
    assert m["clip_frac"] == pytest.approx(0.5)  # only rho = 3 leaves [0.8, 1.2]
    assert (m["ratio_mean"], m["ratio_max"]) == (pytest.approx(2.0), pytest.approx(3.0))
    assert m["kl_behaviour"] == pytest.approx(K3_T2 / 2, rel=1e-6)
    assert m["entropy_proxy"] == pytest.approx(1.5)
    assert m["loss"] == pytest.approx(loss)


def test_p3o_dual_by_hand():
    e_p = 2.5**2 / (2 * (1 + 1.5**2))  # proximal ratios 1 and 1.5
    k3_prox = math.log(1.5) + 1 / 1.5 - 1
    loss, _, m = _loss_and_grad("p3o_dual", LOGP, HAND, dual_version="two_kl")
    assert loss == pytest.approx((3.2 + 0.2 * K3_T2 + (1 - e_p) * k3_prox) / 2, rel=1e-6)
    assert (m["ess_prox"], m["ess_mix"]) == (pytest.approx(e_p), pytest.approx(0.8))
    # mixture: pi_mix = (w_b pi_b + w_p pi_prox) / (w_b + w_p); at token 2 pi_mix / pi = q.
    w_b, w_p = 0.2, 1 - e_p
    q = (w_b / 3 + w_p / 1.5) / (w_b + w_p)
    loss, _, _ = _loss_and_grad("p3o_dual", LOGP, HAND, dual_version="mixture")
    assert loss == pytest.approx((3.2 + 0.2 * (-math.log(q) + q - 1)) / 2, rel=1e-6)


@pytest.mark.parametrize(
    "name, kw, want_loss, want_grad",
    [
        # -min(rho A, clip(rho) A): token 2 is clipped at 1.2 (or 1.28) and gets no gradient.
        ("grpo", {}, (-2.0 - 1.2) / 2, [-1.0, 0.0]),
        ("dapo", {"clip_eps_high": 0.28}, (-2.0 - 1.28) / 2, [-1.0, 0.0]),
        # -sg(clip(rho)) logp A
        ("cispo", {}, (2.0 + 2.4) / 2, [-1.0, -0.6]),
        # sequence ratio sqrt(3) < 2 (unclipped): every token's grad is -s mean(A) / len / N * N
        ("gspo", {"clip_eps_high": 1.0}, -1.5 * math.sqrt(3), [-0.75 * math.sqrt(3)] * 2),
        ("gspo_token", {"clip_eps_high": 1.0}, -1.5 * math.sqrt(3), [-math.sqrt(3), -0.5 * 3**0.5]),
        # r = pi / pi_prox = (1, 1.5), w = pi_prox / pi_b = (1, 2): -(1 * 2 + 2 * 1.2) / 2
        ("decoupled_ppo", {}, -2.2, [-1.0, 0.0]),
        ("decoupled_ppo", {"behaviour_weight_cap": 1.5}, -(2.0 + 1.5 * 1.2) / 2, [-1.0, 0.0]),
        ("reinforce", {}, 2.0, [-1.0, -0.5]),
    ],
)
def test_baselines_by_hand(name, kw, want_loss, want_grad):
    loss, grad, m = _loss_and_grad(name, LOGP, HAND, **kw)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    np.testing.assert_allclose(grad[0, :2], want_grad, rtol=1e-6, atol=1e-7)
    assert grad[0, 2] == 0.0
    assert set(O.METRIC_KEYS) <= set(m) and all(np.isfinite(v) for v in m.values())
    assert m["ess"] == pytest.approx(0.8, rel=1e-6)


def test_aggregations_by_hand():
    # reinforce with logp = -1: per-token loss = A. Row 0 has 1 token (A = 3), row 1 has 3 (A = 1).
    mask = np.array([[1, 0, 0], [1, 1, 1]], np.float32)
    batch = {
        "behaviour_logp": np.full((2, 3), -1.0, np.float32),
        "advantages": np.array([[3.0, 9.0, 9.0], [1.0, 1.0, 1.0]], np.float32),
        "mask": mask,
    }
    logp = np.full((2, 3), -1.0, np.float32)
    cases = {
        "token_mean": (3 + 3) / 4,
        "seq_mean_token_mean": (3 + 1) / 2,
        "seq_mean_token_sum": (3 + 3) / 2,
        "constant": (3 + 3) / (2 * 4.0),
    }
    cfgs = {
        a: O.ObjectiveConfig("reinforce", aggregation=a, constant_normalizer=4.0) for a in cases
    }
    out = jax.jit(lambda lp, b: {a: O.reinforce(lp, b, c) for a, c in cfgs.items()})(logp, batch)
    for agg, want in cases.items():
        loss, metrics = out[agg]
        assert float(loss) == pytest.approx(want, rel=1e-6), agg
        assert float(metrics["entropy_proxy"]) == pytest.approx(1.0)  # metrics: token means


def test_packed_sequences_match_unpacked_rows():
    rng = np.random.default_rng(0)
    lengths = [3, 2, 4]
    rows = {k: np.zeros((3, 4), np.float32) for k in ("behaviour_logp", "advantages", "mask")}
    logp_rows = np.zeros((3, 4), np.float32)
    for i, n in enumerate(lengths):
        rows["behaviour_logp"][i, :n] = -rng.random(n) * 2
        rows["advantages"][i, :n] = rng.normal()
        rows["mask"][i, :n] = 1
        logp_rows[i, :n] = -rng.random(n) * 2
    # Pack rows 0 and 1 into one row of length 5 (+ 3 pads), row 2 into another.
    pack = lambda x: np.stack([np.r_[x[0, :3], x[1, :2], 0, 0, 0], np.r_[x[2], 0, 0, 0, 0]])
    packed = {k: pack(v) for k, v in rows.items()}
    packed["seq_ids"] = np.array([[0, 0, 0, 1, 1, 0, 0, 0], [0] * 8], np.int32)
    cases = [("gspo", "seq_mean_token_mean"), ("gspo_token", "token_mean")]
    cfgs = [O.ObjectiveConfig(n, aggregation=a, clip_eps_high=0.5) for n, a in cases]
    cfgs.append(O.ObjectiveConfig("p3o", aggregation="seq_mean_token_sum"))

    @jax.jit
    def losses_and_grads(logp, batch):
        fns = [lambda lp, c=c: O.OBJECTIVES[c.name].loss(lp, batch, c)[0] for c in cfgs]
        return [jax.value_and_grad(fn)(logp) for fn in fns]

    unpacked = losses_and_grads(logp_rows, rows)
    for cfg, (loss, grad), (loss_r, grad_r) in zip(
        cfgs, losses_and_grads(pack(logp_rows), packed), unpacked, strict=True
    ):
        assert float(loss) == pytest.approx(float(loss_r), rel=1e-6, abs=1e-7), cfg
        np.testing.assert_allclose(grad, pack(np.asarray(grad_r)), rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------ float64 reference


def _random_batch(seed, b=6, t=9, spread=20.0):
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.0, 6.0, (b, t)).astype(np.float32)
    log_ratio = rng.uniform(-spread, spread, (b, t)).astype(np.float32)
    mask = rng.random((b, t)) < 0.75
    mask[0] = False  # an empty row
    adv = np.repeat(rng.normal(size=(b, 1)), t, axis=1).astype(np.float32)
    adv[1] = 0.0  # a group with identical rewards
    prox = (logp - rng.normal(0.0, 0.3, (b, t))).astype(np.float32)
    batch = {
        "behaviour_logp": (logp - log_ratio).astype(np.float32),
        "advantages": adv,
        "mask": mask,
        "prox_logp": prox,
    }
    return logp, batch


def _np_ess(lr, mask):
    rho = np.exp(lr[mask])
    return rho.sum() ** 2 / (rho.size * (rho**2).sum())


def _np_k3(logp, other):
    """k3 and its derivative in logp, float64."""
    d = other - logp
    return (logp - other) + np.exp(np.clip(d, -10, 10)) - 1, 1 - np.exp(d) * (np.abs(d) < 10)


def _np_p3o(logp, batch, dual=False):
    """Float64 P3O (or the mixture dual) loss and its analytic gradient in logp."""
    f64 = lambda x: np.asarray(x, np.float64)
    logp, blogp, adv, prox = map(
        f64, (logp, *(batch[k] for k in ("behaviour_logp", "advantages", "prox_logp")))
    )
    mask = batch["mask"]
    n = mask.sum()
    rho = np.exp(np.where(mask, logp - blogp, 0))
    e = _np_ess(logp - blogp, mask)
    anchor, coef = blogp, 1 - e
    if dual:
        e_p = _np_ess(logp - prox, mask)
        w_b, w_p = max(0, 1 - e), max(0, 1 - e_p)
        e = min(e, e_p)
        coef = 1 - e if 1 - e > 1e-6 else 0.0
        anchor = np.log((w_b * np.exp(blogp) + w_p * np.exp(prox)) / (w_b + w_p))
    kl, dkl = _np_k3(logp, anchor)
    cap = np.minimum(rho, e)
    loss = np.where(mask, -cap * logp * adv + coef * kl, 0).sum() / n
    grad = np.where(mask, -cap * adv + coef * dkl, 0) / n
    # Scale of the summed terms, to compare float32 against float64 on normalised values.
    scale = np.where(mask, np.abs(cap * logp * adv) + np.abs(coef * kl), 0).sum() / n
    return loss, grad, scale


@pytest.mark.parametrize("seed, spread", [(0, 20.0), (1, 20.0), (2, 20.0), (3, 0.5), (4, 3.0)])
@pytest.mark.parametrize("dual", [False, True])
def test_p3o_matches_float64_reference(seed, spread, dual):
    logp, batch = _random_batch(seed, spread=spread)
    name = "p3o_dual" if dual else "p3o"
    loss, grad, _ = _loss_and_grad(name, logp, batch)
    ref_loss, ref_grad, scale = _np_p3o(logp, batch, dual=dual)
    assert abs(loss - ref_loss) <= 1e-6 * max(1.0, scale)
    grad_scale = max(1.0, np.abs(ref_grad).max())
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-6, atol=1e-6 * grad_scale)


def test_dual_mixture_equals_p3o_with_fresh_anchor():
    # One optimizer step per rollout: pi_prox = pi_theta, e_prox = 1, pi_mix = pi_b.
    logp, batch = _random_batch(5, spread=1.0)
    batch = {**batch, "prox_logp": logp}
    for version in ("mixture", "two_kl"):
        loss_d, grad_d, _ = _loss_and_grad("p3o_dual", logp, batch, dual_version=version)
        loss, grad, _ = _loss_and_grad("p3o", logp, batch)
        assert loss_d == pytest.approx(loss, rel=1e-6)
        np.testing.assert_allclose(grad_d, grad, rtol=1e-6, atol=1e-8)
    # Fully on-policy: both weights are 0, the mixture is undefined and its KL term is gated off.
    on_policy = {**batch, "behaviour_logp": logp}
    loss_d, grad_d, m = _loss_and_grad("p3o_dual", logp, on_policy)
    loss, grad, _ = _loss_and_grad("reinforce", logp, on_policy)
    assert m["ess_mix"] == 1.0 and loss_d == pytest.approx(loss, rel=1e-6)
    np.testing.assert_allclose(grad_d, grad, rtol=1e-6, atol=1e-8)


# ------------------------------------------------ gradient identities on a tiny policy


def _policy(seed=0, b=4, t=5, d=3, v=6):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(b, t, d)).astype(np.float32)
    tokens = rng.integers(0, v, (b, t))

    def logp_fn(w, x=x, tokens=tokens):
        logp = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", x, w), axis=-1)
        return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]

    logp_fn.data = {"x": x, "tokens": tokens}

    w = rng.normal(size=(d, v)).astype(np.float32)
    mask = rng.random((b, t)) < 0.8
    adv = np.repeat(rng.normal(size=(b, 1)), t, axis=1).astype(np.float32)
    return logp_fn, w, mask, adv, rng


def test_p3o_gradient_is_capped_reinforce_plus_scaled_kl_gradient():
    logp_fn, w, mask, adv, rng = _policy()
    blogp = np.asarray(logp_fn(w)) + rng.normal(0, 0.7, mask.shape).astype(np.float32)
    batch = {"behaviour_logp": blogp, "advantages": adv, "mask": mask}
    cfg = O.ObjectiveConfig()
    grad = jax.jit(jax.grad(lambda w_: O.p3o(logp_fn(w_), batch, cfg)[0]))(w)

    @jax.jit
    def written_out(w):  # -mean(sg(min(rho, e)) A dlogp) + (1 - e) dmean(KL)
        logp = logp_fn(w)
        e = O.effective_sample_size(logp - blogp, mask)
        weight = jnp.minimum(jnp.exp(logp - blogp), e) * adv * mask / mask.sum()
        surrogate = lambda w_: -jnp.sum(weight * logp_fn(w_))
        mean_kl = lambda w_: jnp.sum(mask * O.kl_k3(logp_fn(w_), blogp)) / mask.sum()
        return e, jax.grad(surrogate)(w), (1 - e) * jax.grad(mean_kl)(w)

    e, pg_grad, kl_grad = written_out(w)
    assert 0.1 < float(e) < 0.9
    np.testing.assert_allclose(grad, pg_grad + kl_grad, rtol=1e-5, atol=1e-6)
    assert np.abs(kl_grad).max() > 1e-3  # the KL term matters here


def test_p3o_on_policy_is_plain_reinforce():
    logp_fn, w, mask, adv, _ = _policy(1)
    batch = {"behaviour_logp": np.asarray(logp_fn(w)), "advantages": adv, "mask": mask}
    cfg = O.ObjectiveConfig()
    p3o_grad = lambda w_: jax.value_and_grad(lambda v: O.p3o(logp_fn(v), batch, cfg), has_aux=True)(
        w_
    )
    (loss, metrics), grad = jax.jit(p3o_grad)(w)
    assert metrics["ess"] == pytest.approx(1.0, abs=1e-6)
    assert float(metrics["kl_behaviour"]) == pytest.approx(0.0, abs=1e-6)
    reinforce = jax.jit(jax.grad(lambda w_: O.reinforce(logp_fn(w_), batch, cfg)[0]))(w)
    np.testing.assert_allclose(grad, reinforce, rtol=1e-5, atol=1e-7)


def test_reference_kl_and_entropy_bonus_by_hand():
    batch = {**HAND, "ref_logp": LOGP - 1.0, "entropy": np.array([[0.5, 0.25, np.nan]])}
    kw = {"beta_kl": 0.1, "beta_ent": 0.05}
    # reinforce loss 2; k3 vs a reference one nat below = 1 + e^-1 - 1 on both tokens.
    loss, _, m = _loss_and_grad("reinforce", LOGP, batch, **kw)
    assert loss == pytest.approx(2.0 + 0.1 * math.exp(-1) - 0.05 * 0.375, rel=1e-6)
    assert m["kl_ref"] == pytest.approx(math.exp(-1), rel=1e-6)
    no_entropy = {k: v for k, v in batch.items() if k != "entropy"}
    loss, grad, _ = _loss_and_grad("reinforce", LOGP, no_entropy, **kw)  # proxy -logp: 1.5
    assert loss == pytest.approx(2.0 + 0.1 * math.exp(-1) - 0.05 * 1.5, rel=1e-6)
    # d/dlogp: (-A + 0.1 (1 - e^{ref - logp}) + 0.05) / N
    want = (-np.array([2.0, 1.0]) + 0.1 * (1 - math.exp(-1)) + 0.05) / 2
    np.testing.assert_allclose(grad[0, :2], want, rtol=1e-6)


def test_step_loss_passes_logp_fn_extras():
    logp_fn, w, mask, adv, rng = _policy(2, b=4)
    blogp = np.asarray(logp_fn(w)) + rng.normal(0, 0.3, mask.shape).astype(np.float32)
    entropy = rng.random(mask.shape).astype(np.float32)
    batch = {"behaviour_logp": blogp, "advantages": adv, "mask": mask, "ent": entropy}
    batch.update(logp_fn.data)
    fn = lambda w_, mb: (logp_fn(w_, mb["x"], mb["tokens"]), {"entropy": mb["ent"] * jnp.sum(w_)})
    cfg = O.ObjectiveConfig(beta_ent=0.3)
    loss, grads, metrics = jax.jit(lambda w_: U.step_loss_and_grad(fn, w_, batch, cfg, 2))(w)
    plain = jax.jit(lambda w_: O.p3o(logp_fn(w_), batch, O.ObjectiveConfig())[0])(w)
    bonus = 0.3 * np.sum(entropy * mask) * float(np.sum(w)) / mask.sum()
    assert float(loss) == pytest.approx(float(plain) - bonus, rel=1e-5)
    assert set(O.METRIC_KEYS) <= set(metrics)


def test_combine_metrics():
    """Micro-batch metrics combined the wrong way: ESS summed, ratio_max averaged, or token means
    averaged where every micro-batch divided by the step's token count (or summed where each
    divided by its own)."""
    stacked = {"ess": jnp.array([0.5, 0.5]), "ratio_max": jnp.array([2.0, 3.0])}
    stacked["ratio_mean"] = jnp.array([0.25, 0.75])
    step = A.combine_metrics(stacked, "step")
    assert (float(step["ess"]), float(step["ratio_max"]), float(step["ratio_mean"])) == (
        0.5,
        3.0,
        1.0,
    )
    # The reference scope divides by the step's token count too: its token means add up.
    assert float(A.combine_metrics(stacked, "microbatch")["ratio_mean"]) == 1.0
    assert float(A.combine_metrics(stacked, "microbatch_local")["ratio_mean"]) == 0.5


# ------------------------------------------------------------------ degenerate batches


@pytest.mark.parametrize("name", sorted(O.OBJECTIVES))
def test_degenerate_batches_are_finite(name):
    logp = np.array([[-1.0, -0.5, -np.inf], [-2.0, -3.0, 0.0]], np.float32)
    base = {
        "behaviour_logp": np.array([[-1.5, -0.5, np.nan], [-2.0, -1.0, -np.inf]], np.float32),
        "prox_logp": np.array([[-1.2, -0.4, 0.0], [-2.0, -2.0, np.nan]], np.float32),
        "ref_logp": np.array([[-1.0, -1.0, 0.0], [-2.0, -2.0, 0.0]], np.float32),
        "advantages": np.array([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], np.float32),
    }
    cfg = O.ObjectiveConfig(name=name, beta_kl=0.1, beta_ent=0.01)
    loss = O.OBJECTIVES[name].loss
    fn = jax.jit(jax.value_and_grad(lambda lp, b: loss(lp, b, cfg), has_aux=True))
    all_masked = {**base, "mask": np.zeros((2, 3), bool)}
    # Every token valid (so every input finite), every advantage zero.
    zero_adv = {k: np.nan_to_num(v, nan=-1.0, neginf=-5.0) for k, v in base.items()}
    zero_adv.update(mask=np.ones((2, 3), bool), advantages=np.zeros((2, 3), np.float32))
    one_token = {**base, "mask": np.array([[False, True, False], [False, False, False]])}
    for batch in (all_masked, zero_adv, one_token):
        lp = np.nan_to_num(logp, neginf=-4.0) if batch is zero_adv else logp
        (loss, metrics), grad = fn(lp, batch)
        assert np.isfinite(float(loss))
        assert np.all(np.isfinite(np.asarray(grad)))
        assert all(np.isfinite(float(v)) for v in metrics.values()), metrics
    (loss, metrics), grad = fn(logp, all_masked)
    assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0.0)
    assert float(metrics["ess"]) == 1.0
    (_, metrics), _ = fn(logp, one_token)
    assert float(metrics["ess"]) == 1.0  # a single token is its own ESS


def test_degenerate_batch_through_microbatch_accumulation():
    """An all-masked batch must give a zero loss and gradient in every scope (no 0/0 = nan)."""
    logp_fn, w, mask, adv, _ = _policy(3)
    batch = {"behaviour_logp": np.asarray(logp_fn(w)), "advantages": adv, "mask": mask * False}
    for scope in O.SCOPES:
        cfg = O.ObjectiveConfig(ess_scope=scope)
        step = lambda w_, c=cfg: U.step_loss_and_grad(lambda p, mb: logp_fn(p), w_, batch, c, 1)
        loss, grads, _ = jax.jit(step)(w)
        assert float(loss) == 0.0 and np.all(np.asarray(grads) == 0.0)

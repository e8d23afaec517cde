"""P3O taken apart (cap only / KL only) and GRPO with truncated / masked importance sampling
(TIS / MIS): hand-computed values and a float64 numpy reference of loss and gradient.

Bugs these catch: an ablation flag that is ignored or switches off the wrong term; a TIS weight
taken as pi / pi_b (the trainer's live policy) instead of pi_old / pi_b, or not stop-gradient;
a sequence-level weight that is a mean (not the product) of token weights; MIS that truncates
instead of masking, or masks on the wrong side of the band.
"""

import math

import jax
import numpy as np
import pytest

from ess_jax import objectives as O

LN3 = math.log(3.0)
# Two valid tokens and a pad with garbage. rho = pi / pi_b = (1, 3), ESS 0.8;
# pi / pi_old = (1, 1.5); behaviour weight w = pi_old / pi_b = (1, 2).
LOGP = np.array([[-1.0, -2.0, -np.inf]], np.float32)
HAND = {
    "behaviour_logp": np.array([[-1.0, -2.0 - LN3, np.nan]], np.float32),
    "advantages": np.array([[2.0, 1.0, np.nan]], np.float32),
    "mask": np.array([[True, True, False]]),
    "prox_logp": np.array([[-1.0, -2.0 - math.log(1.5), np.inf]], np.float32),
}
K3_T2 = LN3 + 1 / 3 - 1


def _run(logp, batch, **kw):
    cfg = O.ObjectiveConfig(**kw)
    fn = lambda lp: O.OBJECTIVES[cfg.name].loss(lp, batch, cfg)
    (loss, metrics), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(logp)
    return float(loss), np.asarray(grad), {k: float(v) for k, v in metrics.items()}


def test_p3o_ablations_by_hand():
    full, _, _ = _run(LOGP, HAND, name="p3o")
    cap_only, grad, m = _run(LOGP, HAND, name="p3o", p3o_drop_kl=True)
    assert full == pytest.approx((3.2 + 0.2 * K3_T2) / 2, rel=1e-6)
    assert cap_only == pytest.approx(3.2 / 2, rel=1e-6)  # the KL term is gone
    np.testing.assert_allclose(grad, [[-0.8, -0.4, 0.0]], rtol=1e-6)  # -min(rho, e) A / N
    assert m["capped_frac"] == pytest.approx(1.0)
    kl_only, grad, m = _run(LOGP, HAND, name="p3o", p3o_drop_cap=True)
    # weights sg(rho) = 1, 3: pg = 2 + 6; the (1 - e) KL term stays.
    assert kl_only == pytest.approx((8.0 + 0.2 * K3_T2) / 2, rel=1e-6)
    np.testing.assert_allclose(grad, [[-1.0, (-3.0 + 0.2 * (2 / 3)) / 2, 0.0]], rtol=1e-6)
    assert m["capped_frac"] == 0.0 and m["ess"] == pytest.approx(0.8)


@pytest.mark.parametrize(
    "kw, want_loss, want_grad, capped",
    [
        # token 2: -min(1.5 A, 1.2 A) = -1.2 (clipped, no gradient), weight min(2, C)
        ({"name": "grpo_tis"}, (-2.0 - 2.4) / 2, [-1.0, 0.0], 0.0),
        ({"name": "grpo_tis", "is_cap": 1.5}, (-2.0 - 1.8) / 2, [-1.0, 0.0], 0.5),
        ({"name": "grpo_mis", "is_cap": 1.5}, -2.0 / 2, [-1.0, 0.0], 0.5),  # token 2 dropped
        ({"name": "grpo_mis", "is_cap": 3.0, "is_cap_low": 1.5}, -2.4 / 2, [0.0, 0.0], 0.5),
        # sequence level: w = 1 * 2 for both tokens
        ({"name": "grpo_tis", "is_level": "sequence"}, (-4.0 - 2.4) / 2, [-2.0, 0.0], 0.0),
        ({"name": "grpo_mis", "is_level": "sequence", "is_cap": 1.5}, 0.0, [0.0, 0.0], 1.0),
    ],
)
def test_truncated_and_masked_is_by_hand(kw, want_loss, want_grad, capped):
    loss, grad, m = _run(LOGP, HAND, **kw)
    assert loss == pytest.approx(want_loss, rel=1e-6, abs=1e-7)
    np.testing.assert_allclose(grad[0, :2], want_grad, rtol=1e-6, atol=1e-7)
    assert grad[0, 2] == 0.0
    assert m["behaviour_capped_frac"] == pytest.approx(capped)


def _np_is(logp, batch, cfg):
    """Float64 TIS / MIS loss and gradient in logp (per-token GRPO clip against pi_old)."""
    f = lambda x: np.where(batch["mask"], np.asarray(x, np.float64), 0.0)
    logp, blogp, adv, old = (
        f(logp),
        *(f(batch[k]) for k in ("behaviour_logp", "advantages", "prox_logp")),
    )
    mask, n = batch["mask"], batch["mask"].sum()
    log_w = old - blogp
    if cfg.is_level == "sequence":
        log_w = np.broadcast_to(log_w.sum(-1, keepdims=True), log_w.shape)
    w = np.exp(log_w)
    if cfg.name == "grpo_tis":
        w = np.minimum(w, cfg.is_cap)
    else:
        w = np.where((w > cfg.is_cap) | (w < cfg.is_cap_low), 0.0, w)
    r = np.exp(logp - old)
    lo, hi = 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high
    unclipped, clipped = r * adv, np.clip(r, lo, hi) * adv
    loss_t = -w * np.minimum(unclipped, clipped)
    grad_t = np.where(unclipped <= clipped, -w * r * adv, 0.0)
    return np.where(mask, loss_t, 0).sum() / n, np.where(mask, grad_t, 0) / n


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "kw",
    [
        {"name": "grpo_tis"},
        {"name": "grpo_tis", "is_level": "sequence", "is_cap": 5.0},
        {"name": "grpo_mis", "is_cap": 2.0, "is_cap_low": 0.5},
        {"name": "grpo_mis", "is_level": "sequence", "is_cap": 4.0, "is_cap_low": 0.25},
    ],
)
def test_truncated_is_matches_float64_reference(seed, kw):
    rng = np.random.default_rng(seed)
    b, t = 6, 7
    logp = -rng.uniform(0.1, 4.0, (b, t)).astype(np.float32)
    old = (logp - rng.normal(0.0, 0.3, (b, t))).astype(np.float32)
    batch = {
        "behaviour_logp": (old - rng.normal(0.0, 0.6, (b, t))).astype(np.float32),
        "prox_logp": old,
        "advantages": np.repeat(rng.normal(size=(b, 1)), t, 1).astype(np.float32),
        "mask": rng.random((b, t)) < 0.8,
    }
    cfg = O.ObjectiveConfig(**kw)
    loss, grad, m = _run(logp, batch, **kw)
    ref_loss, ref_grad = _np_is(logp, batch, cfg)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)
    # the weight uses pi_old, never the live policy: moving logp leaves it unchanged
    _, _, m2 = _run(logp - 0.1, batch, **kw)
    assert m2["behaviour_weight_mean"] == pytest.approx(m["behaviour_weight_mean"], rel=1e-6)


def test_ablation_and_is_options_are_validated():
    with pytest.raises(ValueError, match="p3o only"):
        O.paper_config("grpo", p3o_drop_kl=True)
    with pytest.raises(ValueError, match="is_level"):
        O.ObjectiveConfig(name="grpo_tis", is_level="group")
    with pytest.raises(ValueError, match="is_cap"):
        O.ObjectiveConfig(name="grpo_mis", is_cap=1.0, is_cap_low=2.0)
    with pytest.raises(ValueError, match="prox_logp"):
        _run(LOGP, {k: v for k, v in HAND.items() if k != "prox_logp"}, name="grpo_tis")
    assert {"grpo_tis", "grpo_mis"} <= {n for n, o in O.OBJECTIVES.items() if o.needs_prox}

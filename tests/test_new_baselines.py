"""M2PO (`losses.m2po`): loss, gradient and second-moment mask against a float64 numpy reference
on hand-built arrays. The reference masks by a different route than the loss (a loop that drops
the largest (log rho)^2 one at a time), so a shared slip cannot pass both."""

import functools

import jax
import numpy as np
import pytest

from ess_jax import objectives as O
from ess_jax.objectives import losses


@functools.cache
def _jitted(kw):
    cfg = O.ObjectiveConfig(**dict(kw))
    fn = lambda lp, batch: O.OBJECTIVES[cfg.name].loss(lp, batch, cfg)
    return jax.jit(jax.value_and_grad(fn, has_aux=True))


def _loss_and_grad(logp, batch, **kw):
    (loss, metrics), grad = _jitted(tuple(sorted({"name": "m2po", **kw}.items())))(logp, batch)
    return float(loss), np.asarray(grad), {k: float(v) for k, v in metrics.items()}


def _reference_mask(log_ratio, mask, threshold):
    """float64: drop the largest (log rho)^2 of the valid tokens one at a time while their mean
    is >= threshold, keeping at least one token (AReaL's get_m2po_loss_mask, re-derived)."""
    m2 = np.square(np.asarray(log_ratio, np.float64))
    kept = [(m2[idx], idx) for idx in zip(*np.nonzero(mask))]
    kept.sort(key=lambda x: -x[0])
    while len(kept) > 1 and np.mean([v for v, _ in kept]) >= threshold:
        kept.pop(0)
    out = np.zeros(mask.shape, bool)
    for _, idx in kept:
        out[idx] = True
    return out


def _reference(logp, batch, threshold):
    """float64 M2PO: loss -sum_t M_t rho_t A_t / N (N all valid tokens) and its gradient in logp."""
    mask = batch["mask"].astype(bool)
    log_ratio = np.where(mask, logp.astype(np.float64) - batch["behaviour_logp"], 0.0)
    keep = _reference_mask(log_ratio, mask, threshold)
    rho, adv, n = np.exp(log_ratio), batch["advantages"].astype(np.float64), mask.sum()
    per_token = np.where(keep, -rho * adv, 0.0)
    return per_token.sum() / n, per_token / n, keep


def _per_token_mask(log_ratio, mask, threshold):
    """Planted wrong variant: each token against the threshold alone, not the batch's mean."""
    return mask & (np.square(log_ratio) <= threshold)


# Log-ratios 0.1 -0.5 0.3 | 0.05 0.8 -0.2 0 (one pad): (log rho)^2 sorted .64 .25 .09 .04 .01
# .0025 0; means with the largest 0, 1, 2 dropped: .1475, .0654, .0285 -> the 0.8 and -0.5
# tokens are masked; a per-token test at 0.04 would also mask 0.3.
LOG_RATIO = np.array([[0.1, -0.5, 0.3, 0.0], [0.05, 0.8, -0.2, 0.0]])
HAND = {
    "behaviour_logp": np.full((2, 4), -1.0, np.float32),
    "advantages": np.array([[1.0, -2.0, 0.5, np.nan], [-1.0, 1.5, 2.0, 3.0]], np.float32),
    "mask": np.array([[True, True, True, False], [True, True, True, True]]),
}
HAND_LOGP = (-1.0 + LOG_RATIO).astype(np.float32)


def test_m2po_mask_by_hand():
    """Catches a mask that tests each token against the threshold instead of the kept tokens'
    mean (it would also drop the 0.3 token), one that masks one token too many or too few, or
    one that lets the pad in."""
    keep = np.asarray(losses.m2po_mask(LOG_RATIO, HAND["mask"], 0.04))
    expected = np.array([[True, False, True, False], [True, False, True, True]])
    np.testing.assert_array_equal(keep, expected)
    np.testing.assert_array_equal(_reference_mask(LOG_RATIO, HAND["mask"], 0.04), expected)
    assert not np.array_equal(_per_token_mask(LOG_RATIO, HAND["mask"], 0.04), expected)


def test_m2po_loss_and_grad_by_hand():
    """Catches masked tokens dropped from N (AReaL's normaliser; here N = 7 valid tokens, as
    grpo_mis), a clip on rho (M2PO has none), a gradient through the mask's (log rho)^2, or a
    capped_frac that is not the masked share."""
    loss, grad, m = _loss_and_grad(HAND_LOGP, HAND)
    ref_loss, ref_grad, keep = _reference(HAND_LOGP, HAND, 0.04)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)
    rho = np.exp(LOG_RATIO)
    by_hand = -(rho[0, 0] * 1 + rho[0, 2] * 0.5 - rho[1, 0] + rho[1, 2] * 2 + 3) / 7
    assert loss == pytest.approx(by_hand, rel=1e-5)
    assert m["capped_frac"] == pytest.approx(2 / 7)
    assert m["m2"] == pytest.approx(np.square(LOG_RATIO).sum() / 7, rel=1e-5)
    assert keep.sum() == 5


def test_m2po_keeps_one_token_when_every_suffix_is_above():
    """Catches an all-masked batch (AReaL keeps the token with the smallest (log rho)^2) or a
    kept token other than the smallest."""
    log_ratio = np.array([[1.0, -2.0, 1.5]])
    batch = {
        "behaviour_logp": np.zeros((1, 3), np.float32),
        "advantages": np.array([[1.0, 1.0, 1.0]], np.float32),
        "mask": np.ones((1, 3), bool),
    }
    keep = np.asarray(losses.m2po_mask(log_ratio, batch["mask"], 0.04))
    np.testing.assert_array_equal(keep, [[True, False, False]])
    loss, grad, _ = _loss_and_grad(log_ratio.astype(np.float32), batch)
    assert loss == pytest.approx(-np.e / 3, rel=1e-6)
    np.testing.assert_allclose(grad, [[-np.e / 3, 0.0, 0.0]], rtol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_m2po_matches_the_float64_reference(seed):
    """Catches any slip of the sorted-suffix mask on random batches (ties, pads, a threshold
    that leaves many or few tokens): loss, gradient and mask against the float64 loop."""
    rng = np.random.default_rng(seed)
    b, t = 3, 6
    blogp = rng.uniform(-3, -0.1, (b, t))
    logp = blogp + rng.normal(0, 0.3, (b, t))
    batch = {
        "behaviour_logp": blogp.astype(np.float32),
        "advantages": rng.normal(size=(b, t)).astype(np.float32),
        "mask": rng.uniform(size=(b, t)) < 0.8,
    }
    threshold = float(rng.choice([0.01, 0.04, 0.1]))
    logp32 = logp.astype(np.float32)
    loss, grad, _ = _loss_and_grad(logp32, batch, m2_threshold=threshold)
    ref_loss, ref_grad, keep = _reference(logp32, batch, threshold)
    log_ratio = np.where(batch["mask"], logp32 - batch["behaviour_logp"], 0.0)
    np.testing.assert_array_equal(losses.m2po_mask(log_ratio, batch["mask"], threshold), keep)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_m2po_record_and_config():
    """Catches an m2po record that reads the ESS, needs the proximal snapshot in its default
    form, or does not declare m2_threshold and m2po_form; and a non-positive threshold
    accepted."""
    record = O.get_objective("m2po")
    assert (record.ess_in_loss, record.needs_prox) == (False, False)
    assert not O.needs_prox(O.ObjectiveConfig(name="m2po"))
    assert record.fields == ("m2_threshold", "m2po_form")
    with pytest.raises(ValueError, match="m2_threshold"):
        O.ObjectiveConfig(name="m2po", m2_threshold=0.0)

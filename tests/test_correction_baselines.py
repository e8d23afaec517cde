"""DPPO, IcePop, Seq-MIS and Geo-RS (`objectives/correction.py`): loss, gradient and masks against
float64 numpy references written from their sources' equations (docs/method.md's table), on
hand-built arrays that put a token or a sequence on each side of every edge, and on random ones.
The references compare ratios in ratio space and walk sequences in a Python loop, where the
losses compare in log space and broadcast with `core.seq_sum`, so one slip cannot pass both."""

import functools

import jax
import numpy as np
import pytest

from ess_jax import objectives as O

N_EPS = 0.2  # the PPO clip the three decoupled losses use (their records' paper clips)


@functools.cache
def _jitted(kw):
    cfg = O.paper_config(**dict(kw))
    fn = lambda lp, batch: O.OBJECTIVES[cfg.name].loss(lp, batch, cfg)
    return jax.jit(jax.value_and_grad(fn, has_aux=True))


def _run(logp, batch, **kw):
    (loss, metrics), grad = _jitted(tuple(sorted(kw.items())))(logp, batch)
    return float(loss), np.asarray(grad), {k: float(v) for k, v in metrics.items()}


def _arrays(logp, batch):
    """float64 copies, pads zeroed (a pad may hold NaN), and the loss mask as bool."""
    mask = np.asarray(batch["mask"], bool)
    get = lambda x: np.where(mask, np.nan_to_num(np.asarray(x, np.float64)), 0.0)
    prox = get(batch["prox_logp"]) if "prox_logp" in batch else None
    return mask, get(logp), get(batch["behaviour_logp"]), get(batch["advantages"]), prox


# ------------------------------------------------------------------ references


def _dppo_reference(logp, batch, low=0.2, high=0.2, tau=1e-3):
    """float64 DPPO-Binary-TV + penalty (prime-rl's default_loss_fn, re-derived): per token
    -(1 - M) A rho + tau (log rho)^2, M = [A > 0 and p - mu > high] or [A <= 0 and
    p - mu < -low]; sum / N. Returns loss, d loss / d logp and M."""
    mask, lp, blp, adv, _ = _arrays(logp, batch)
    n, loss, grad = mask.sum(), 0.0, np.zeros(mask.shape)
    masked = np.zeros(mask.shape, bool)
    for idx in zip(*np.nonzero(mask)):
        p, mu, a = np.exp(lp[idx]), np.exp(blp[idx]), adv[idx]
        log_rho = lp[idx] - blp[idx]
        masked[idx] = (p - mu > high) if a > 0 else (p - mu < -low)
        keep = 0.0 if masked[idx] else 1.0
        loss += -keep * a * np.exp(log_rho) + tau * log_rho**2
        grad[idx] = (-keep * a * np.exp(log_rho) + 2.0 * tau * log_rho) / n
    return loss / n, grad, masked


def _segments(mask, seq_ids):
    """The kept positions of each sequence: (row, segment id) -> list of (row, col)."""
    out = {}
    for i, j in zip(*np.nonzero(mask)):
        out.setdefault((i, 0 if seq_ids is None else int(seq_ids[i, j])), []).append((i, j))
    return out


def _banded_reference(logp, batch, kind, low, high):
    """float64 decoupled correction: per sequence (or token, icepop) the statistic of
    w_t = pi_old / pi_b (icepop: w_t; seq_mis: prod_t w_t; geo_rs: (prod_t w_t)^(1/|y|)), kept
    when low <= it <= high (ratio space), weight M = the statistic (icepop, seq_mis) or 1
    (geo_rs), 0 outside; loss sum_t -M min(r A, clip(r, 0.8, 1.2) A) / N, r = pi / pi_old.
    Returns loss, gradient, the rejected tokens and the weights."""
    mask, lp, blp, adv, old = _arrays(logp, batch)
    weight = np.zeros(mask.shape)
    for toks in _segments(mask, batch.get("seq_ids")).values():
        units = [[t] for t in toks] if kind == "icepop" else [toks]
        for unit in units:
            log_w = [old[t] - blp[t] for t in unit]
            stat = np.exp(np.mean(log_w) if kind == "geo_rs" else np.sum(log_w))
            m = (stat if kind != "geo_rs" else 1.0) if low <= stat <= high else 0.0
            for t in unit:
                weight[t] = m
    rejected = mask & (weight == 0.0)
    n, loss, grad = mask.sum(), 0.0, np.zeros(mask.shape)
    for idx in zip(*np.nonzero(mask)):
        r, a = np.exp(lp[idx] - old[idx]), adv[idx]
        unclipped, clipped = r * a, np.clip(r, 1 - N_EPS, 1 + N_EPS) * a
        loss += -weight[idx] * min(unclipped, clipped)
        grad[idx] = 0.0 if clipped < unclipped else -weight[idx] * a * r / n
    return loss / n, grad, rejected, weight


def _check(logp, batch, reference, **kw):
    """The loss against its reference: value, gradient, and the metrics that count the mask."""
    loss, grad, m = _run(logp, batch, **kw)
    ref = reference(logp, batch)
    assert loss == pytest.approx(ref[0], rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(grad, ref[1], rtol=1e-5, atol=1e-7)
    n = np.asarray(batch["mask"], bool).sum()
    frac = m["capped_frac"] if kw["name"] == "dppo" else m["behaviour_capped_frac"]
    assert frac == pytest.approx(ref[2].sum() / n, abs=1e-6)
    return m, ref


# ------------------------------------------------------------------ DPPO

# One token per case of the mask (p = exp(logp), mu = exp(blogp)); row 1 ends in a pad:
#   A > 0, p - mu = +0.3 (masked) | A > 0, -0.3 (kept: the trust region is one-sided)
#   A < 0, -0.3 (masked)          | A < 0, +0.3 (kept)
#   A = 0, -0.3 (masked: A <= 0 takes the low side, as prime-rl's torch.where)
#   A > 0, +0.1 (kept)            | A > 0, p = mu (kept, rho = 1)  | pad
DPPO_LOGP = np.log([[0.6, 0.3, 0.3, 0.6], [0.3, 0.5, 0.5, 0.5]]).astype(np.float32)
DPPO_HAND = {
    "behaviour_logp": np.log([[0.3, 0.6, 0.6, 0.3], [0.6, 0.4, 0.5, 0.5]]).astype(np.float32),
    "advantages": np.array([[1.0, 2.0, -1.0, -0.5], [0.0, 1.5, 1.5, np.nan]], np.float32),
    "mask": np.array([[True, True, True, True], [True, True, True, False]]),
}


def test_dppo_by_hand():
    """Catches a two-sided TV mask (|p - mu| > delta whatever the sign of A, which would also
    drop the kept +-0.3 tokens), a mask on the ratio instead of p - mu, the A = 0 token on the
    high side, a penalty only on the kept tokens, or masked tokens dropped from N (prime-rl
    divides by every loss token: 7 here)."""
    m, (ref_loss, _, masked) = _check(DPPO_LOGP, DPPO_HAND, _dppo_reference, name="dppo")
    np.testing.assert_array_equal(masked, [[True, False, True, False], [True, False, False, False]])
    rho = np.array([2.0, 0.5, 0.5, 2.0, 0.5, 1.25, 1.0])
    adv = np.array([1.0, 2.0, -1.0, -0.5, 0.0, 1.5, 1.5])
    keep = np.array([0, 1, 0, 1, 0, 1, 1])
    by_hand = (-(keep * adv * rho).sum() + 1e-3 * (np.log(rho) ** 2).sum()) / 7
    assert ref_loss == pytest.approx(by_hand, rel=1e-6)
    tv = np.abs([0.3, -0.3, -0.3, 0.3, -0.3, 0.1, 0.0]).sum() / 7
    assert m["tv_mean"] == pytest.approx(tv, rel=1e-5)
    # The two-sided variant masks 5 of 7; the one-sided mask 3.
    assert (np.abs(np.exp(DPPO_LOGP) - np.exp(DPPO_HAND["behaviour_logp"])) > 0.2).sum() == 5


@pytest.mark.parametrize("seed", range(3))
def test_dppo_matches_the_float64_reference(seed):
    """Catches any slip of the sign-conditioned TV mask, the rho A term or the (log rho)^2
    penalty on random batches with pads, thresholds and penalty away from the defaults."""
    rng = np.random.default_rng(seed)
    blogp = np.log(rng.uniform(0.05, 0.95, (3, 6)))
    logp = np.minimum(blogp + rng.normal(0, 0.5, (3, 6)), -1e-3).astype(np.float32)
    batch = {
        "behaviour_logp": blogp.astype(np.float32),
        "advantages": rng.choice([-1.5, -0.5, 0.0, 0.5, 1.5], (3, 6)).astype(np.float32),
        "mask": rng.uniform(size=(3, 6)) < 0.8,
    }
    kw = {"dppo_mask_low": 0.1, "dppo_mask_high": 0.15, "dppo_kl_tau": 0.05}
    ref = functools.partial(_dppo_reference, low=0.1, high=0.15, tau=0.05)
    _, (_, _, masked) = _check(logp, batch, ref, name="dppo", **kw)
    assert 0 < masked.sum() < batch["mask"].sum()  # both sides of the mask are exercised


# ------------------------------------------------------------------ IcePop, Seq-MIS, Geo-RS


def _decoupled_batch(log_w, log_r, adv, mask, seq_ids=None):
    """A batch with log(pi_old / pi_b) = log_w and log(pi / pi_old) = log_r on blogp = -1."""
    mask = np.asarray(mask, bool)
    blogp = np.full(mask.shape, -1.0)
    batch = {
        "behaviour_logp": blogp.astype(np.float32),
        "prox_logp": (blogp + log_w).astype(np.float32),
        "advantages": np.asarray(adv, np.float32),
        "mask": np.asarray(mask, bool),
    }
    if seq_ids is not None:
        batch["seq_ids"] = np.asarray(seq_ids, np.int32)
    return (blogp + log_w + log_r).astype(np.float32), batch


def test_icepop_by_hand():
    """Catches IcePop weighting the kept tokens by 1 instead of w (OpenRLHF and slime multiply
    by w), truncating w at 5 instead of masking (TIS), a band without its lower edge, or a
    mask by sequence."""
    w = np.array([[0.4, 0.6, 4.9, 5.5], [1.0, 0.3, 2.0, 1.0]])
    log_r = np.array([[0.05, -0.1, 0.3, 0.0], [0.0, 0.1, -0.3, 0.0]])  # two r outside the clip
    adv = np.array([[1.0, -1.0, 2.0, 1.0], [-0.5, 1.0, -1.0, 0.0]])
    mask = np.array([[1, 1, 1, 1], [1, 1, 1, 0]])
    logp, batch = _decoupled_batch(np.log(w), log_r, adv, mask)
    ref = functools.partial(_banded_reference, kind="icepop", low=0.5, high=5.0)
    m, (_, _, rejected, weight) = _check(logp, batch, ref, name="icepop")
    np.testing.assert_array_equal(rejected, [[1, 0, 0, 1], [0, 1, 0, 0]])
    np.testing.assert_allclose(weight[0], [0.0, 0.6, 4.9, 0.0], rtol=1e-6)
    assert m["behaviour_weight_mean"] == pytest.approx(weight.sum() / 7, rel=1e-5)
    assert m["capped_frac"] == pytest.approx(2 / 7)  # r = e^0.3, A > 0 and r = e^-0.3, A < 0
    # weight 1 inside the band would change the loss
    assert not np.allclose(weight[mask.astype(bool) & ~rejected], 1.0)


def test_seq_mis_rejects_by_the_sequence_product():
    """Catches a token-level mask (row 0's tokens are each inside [0.5, 2] but their product
    2.7 is not; row 1's 2.5 and 0.5 are not, their product 1.25 is), a sequence weight that
    is not the product (the kept row must weigh 1.25), and packed sequences mixed up (the two
    rows packed into one row as segments 0 and 1 must give the same loss: a product over the
    row would reject both)."""
    w = [[1.5, 1.2, 1.5, 1.0], [2.5, 0.5, 1.0, 1.0]]
    adv = [[1.0, -1.0, 0.5, 0.0], [-1.0, 2.0, 0.0, 0.0]]
    mask = [[1, 1, 1, 0], [1, 1, 0, 0]]
    log_r = np.full((2, 4), 0.05)
    logp, batch = _decoupled_batch(np.log(w), log_r, adv, mask)
    ref = functools.partial(_banded_reference, kind="seq_mis", low=0.5, high=2.0)
    loss, _, _ = _run(logp, batch, name="seq_mis")
    _, (_, _, rejected, weight) = _check(logp, batch, ref, name="seq_mis")
    np.testing.assert_array_equal(rejected, [[1, 1, 1, 0], [0, 0, 0, 0]])
    np.testing.assert_allclose(weight[1, :2], [1.25, 1.25], rtol=1e-6)
    # the same two sequences packed into one row (segments 0 and 1), same N and S
    packed_w = np.log([[1.5, 1.2, 1.5, 2.5, 0.5]])
    plogp, pbatch = _decoupled_batch(
        packed_w,
        np.full((1, 5), 0.05),
        [[1.0, -1.0, 0.5, -1.0, 2.0]],
        np.ones((1, 5)),
        [[0, 0, 0, 1, 1]],
    )
    _check(plogp, pbatch, ref, name="seq_mis")
    assert _run(plogp, pbatch, name="seq_mis")[0] == pytest.approx(loss, rel=1e-5)


def test_geo_rs_rejects_by_the_geometric_mean():
    """Catches Geo-RS on the product instead of the geometric mean (row 0: 4 tokens at
    w = 1.04 have mean 1.04 inside [0.95, 1.05] but product 1.17 outside), an IS weight on the
    kept sequences (geo_rs keeps them at weight 1), a mean over the row's pads (row 1's two
    tokens at 1.06 would become ~1.03 inside), and an exclusive lower edge (row 2: every w = 1,
    kept at the band [1, 1.05])."""
    w = [[1.04, 1.04, 1.04, 1.04], [1.06, 1.06, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    adv = [[1.0, -1.0, 0.5, 2.0], [-1.0, 2.0, 0.0, 0.0], [1.0, 1.0, -1.0, 0.0]]
    mask = [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]
    log_r = np.array([[0.0, 0.3, -0.3, 0.1]] * 3)
    logp, batch = _decoupled_batch(np.log(w), log_r, adv, mask)
    kw = {"name": "geo_rs", "geo_rs_low": 0.95, "geo_rs_high": 1.05}
    ref = functools.partial(_banded_reference, kind="geo_rs", low=0.95, high=1.05)
    _, (_, _, rejected, weight) = _check(logp, batch, ref, **kw)
    np.testing.assert_array_equal(rejected.sum(-1), [0, 2, 0])
    assert set(weight[np.asarray(mask, bool) & ~rejected]) == {1.0}
    kw_edge = {"name": "geo_rs", "geo_rs_low": 1.0, "geo_rs_high": 1.05}
    logp2, batch2 = _decoupled_batch(np.zeros((3, 4)), log_r, adv, mask)  # every g = 1
    ref_edge = functools.partial(_banded_reference, kind="geo_rs", low=1.0, high=1.05)
    _, (_, _, rejected2, _) = _check(logp2, batch2, ref_edge, **kw_edge)
    assert not rejected2.any()


CASES = {
    "icepop": ({}, (0.5, 5.0), 0.7),
    "seq_mis": ({}, (0.5, 2.0), 0.35),
    "geo_rs": ({"geo_rs_low": 0.9, "geo_rs_high": 1.1}, (0.9, 1.1), 0.25),
}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", sorted(CASES))
def test_decoupled_corrections_match_the_float64_reference(name, seed):
    """Catches any slip of the band, the per-token / per-sequence statistic, the weight or the
    clip against pi_old on random batches with pads, some units kept and some rejected."""
    kw, (low, high), scale = CASES[name]
    rng = np.random.default_rng(seed)
    mask = rng.uniform(size=(4, 5)) < 0.85
    mask[:, 0] = True
    log_w = rng.normal(0, scale, (4, 5))
    log_r = rng.normal(0, 0.15, (4, 5))
    logp, batch = _decoupled_batch(log_w, log_r, rng.normal(size=(4, 5)), mask)
    ref = functools.partial(_banded_reference, kind=name, low=low, high=high)
    _, (_, _, rejected, _) = _check(logp, batch, ref, name=name, **kw)
    assert 0 < rejected.sum() < mask.sum()  # both sides of the band are exercised


def test_icepop_and_seq_mis_equal_grpo_mis_at_their_bands():
    """Catches the two implementations of one estimator drifting apart: IcePop is grpo_mis at
    is_level token with the band [0.5, 5], Seq-MIS grpo_mis at is_level sequence with
    [0.5, 2] (loss, gradient and metrics)."""
    rng = np.random.default_rng(7)
    logp, batch = _decoupled_batch(
        rng.normal(0, 0.6, (3, 4)),
        rng.normal(0, 0.2, (3, 4)),
        rng.normal(size=(3, 4)),
        rng.uniform(size=(3, 4)) < 0.8,
    )
    for name, level, high in (("icepop", "token", 5.0), ("seq_mis", "sequence", 2.0)):
        loss, grad, m = _run(logp, batch, name=name)
        mis = _run(logp, batch, name="grpo_mis", is_level=level, is_cap_low=0.5, is_cap=high)
        assert loss == pytest.approx(mis[0], rel=1e-6)
        np.testing.assert_allclose(grad, mis[1], rtol=1e-6)
        assert m == pytest.approx(mis[2], rel=1e-6, abs=1e-7)


def test_records_and_config():
    """Catches a DPPO record that asks for the proximal snapshot (it reads pi_b only) or a
    decoupled one that does not (their weight is pi_old / pi_b), an undeclared field, the
    full-vocabulary KL accepted, and an empty or inverted band or a negative DPPO knob
    accepted."""
    assert O.get_objective("dppo").needs_prox is False
    for name in ("icepop", "seq_mis", "geo_rs"):
        record = O.get_objective(name)
        assert record.needs_prox and not record.ess_in_loss
        assert record.fields == ("clip_eps_low", "clip_eps_high", f"{name}_low", f"{name}_high")
    assert O.get_objective("dppo").fields == ("dppo_mask_low", "dppo_mask_high", "dppo_kl_tau")
    for name in ("dppo", "icepop", "seq_mis", "geo_rs"):
        with pytest.raises(ValueError, match="kl_estimator='full'"):
            O.paper_config(name, kl_estimator="full")
    # an inverted band breaks the rule between its edges; a negative edge, its own domain
    for bad, message in (
        ({"geo_rs_low": 1.1}, "need 0 <= geo_rs_low < geo_rs_high"),
        ({"icepop_low": -0.1}, "icepop_low=-0.1: must be a number >= 0"),
        ({"seq_mis_high": 0.5}, "need 0 <= seq_mis_low < seq_mis_high"),
    ):
        with pytest.raises(ValueError, match=message):
            O.ObjectiveConfig(**bad)
    with pytest.raises(ValueError, match="dppo_kl_tau"):
        O.ObjectiveConfig(dppo_kl_tau=-1.0)

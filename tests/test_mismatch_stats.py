"""ess_jax/mismatch/stats.py against a float64 reference written here token by token in plain
Python from the definitions of docs/mismatch.md, on hand-made log-prob arrays: every statistic
of the whole set and of each length and pi_b bucket."""

import math

import numpy as np
import pytest

from ess_jax.mismatch import stats

# 3 responses of lengths 2, 1 and 10 over T = 10 columns: buckets 1-8 and 9-16; pi_b(y) spans
# every probability bucket; one token's trainer log-prob is -inf (dropped, counted).
BLOGP = np.log(
    np.array(
        [
            [0.5, 0.95, 0, 0, 0, 0, 0, 0, 0, 0],
            [0.005, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            [0.3, 0.05, 0.7, 0.92, 0.2, 0.6, 0.008, 0.4, 0.99, 0.15],
        ]
    )
    + 1e-300
)
LR = np.array(
    [
        [0.1, -0.05, 0, 0, 0, 0, 0, 0, 0, 0],
        [1.5, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [-0.3, 0.25, 0.01, -0.002, 0.19, -0.21, -2.0, 0.0, 0.03, 0.4],
    ]
)
MASK = np.zeros((3, 10), bool)
MASK[0, :2] = MASK[1, :1] = MASK[2, :] = True
LOGP = BLOGP + LR
LOGP[2, 5] = -np.inf  # a non-finite trainer log-prob: left out
KL_F = np.arange(30, dtype=np.float64).reshape(3, 10) * 1e-3
KL_R = KL_F * 2 + 1e-4


def ref_ess(ws):
    return (sum(ws) ** 2) / (len(ws) * sum(w * w for w in ws)) if ws else 1.0


def ref_percentile(xs, q):
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ref_group(cells, rows=None):
    """cells: [(b, t)] of kept tokens; rows: the sequences (for ess_seq) or None."""
    lrs = [LOGP[b, t] - BLOGP[b, t] for b, t in cells]
    n = len(lrs)
    out = {"tokens": n, "sequences": None if rows is None else len(rows)}
    out["ess_seq"] = None
    if rows is not None:
        seq = [sum(LOGP[b, t] - BLOGP[b, t] for bb, t in cells if bb == b) for b in rows]
        out["ess_seq"] = ref_ess([math.exp(s) for s in seq])
    rho = [math.exp(x) for x in lrs]
    a = [abs(x) for x in lrs]
    out.update(
        ess_token=ref_ess(rho),
        abs_lr_mean=sum(a) / n,
        abs_lr_p50=ref_percentile(a, 50),
        abs_lr_p95=ref_percentile(a, 95),
        abs_lr_max=max(a),
        lr_rms=math.sqrt(sum(x * x for x in lrs) / n),
        lr_mean=sum(lrs) / n,
        k3=sum(x + math.exp(min(max(-x, -10), 10)) - 1 for x in lrs) / n,
        chi2=sum((r - 1) ** 2 for r in rho) / n,
        kl_exact=sum(KL_F[c] for c in cells) / n,
        kl_exact_rev=sum(KL_R[c] for c in cells) / n,
        frac_outside=sum(r > 1.2 or r < 0.8 for r in rho) / n,
    )
    out["frac_outside_0.1"] = sum(r > 1.1 or r < 0.9 for r in rho) / n
    return out


def check(got, want):
    assert set(got) - {"bucket"} == set(want)
    for k, v in want.items():
        if v is None or isinstance(v, int):
            assert got[k] == v, k
        else:
            assert got[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k


KEPT = [(b, t) for b in range(3) for t in range(10) if MASK[b, t] and (b, t) != (2, 5)]


@pytest.fixture(scope="module")
def summary():
    return stats.summarize(LOGP, BLOGP, MASK, KL_F, KL_R)


def test_whole_set(summary):
    """Every statistic of the whole set against the token-by-token reference; catches a wrong
    definition (chi^2 of rho instead of rho - 1, k3's sign or clamp, a percentile rule, ESS over
    sequences summing means instead of log-ratios) and the -inf token leaking into a sum."""
    check(summary["all"], ref_group(KEPT, rows=[0, 1, 2]))
    assert summary["nonfinite"] == 1
    # the reference can disagree: with the -inf token kept, nothing would be finite
    assert summary["all"]["tokens"] == 12


def test_length_buckets(summary):
    """Length buckets hold whole sequences (a response of 10 tokens is in 9-16 with all its
    tokens, pads never counted); catches bucketing by position instead of by response length."""
    got = {b["bucket"]: b for b in summary["by_length"]}
    assert list(got) == ["1-8", "9-16"]
    check(got["1-8"], ref_group([c for c in KEPT if c[0] < 2], rows=[0, 1]))
    check(got["9-16"], ref_group([c for c in KEPT if c[0] == 2], rows=[2]))


def test_pb_buckets(summary):
    """pi_b(y) buckets [0, 0.01), [0.01, 0.1), [0.1, 0.5), [0.5, 0.9), [0.9, 1]; catches a
    bucket on the trainer's probability instead of pi_b's, or a lost edge token (0.5, 0.9)."""
    edges = [(0, 0.01), (0.01, 0.1), (0.1, 0.5), (0.5, 0.9), (0.9, 1.0 + 1e-9)]
    pb = np.exp(BLOGP)
    got = summary["by_pb"]
    assert [b["bucket"] for b in got] == [
        "[0, 0.01)",
        "[0.01, 0.1)",
        "[0.1, 0.5)",
        "[0.5, 0.9)",
        "[0.9, 1]",
    ]
    for g, (lo, hi) in zip(got, edges):
        cells = [c for c in KEPT if lo <= pb[c] < hi]
        check(g, ref_group(cells))
    assert sum(g["tokens"] for g in got) == len(KEPT)


def test_ess_large_ratios():
    """ESS of log-ratios of +-80 (exp overflows float32 and ratios differ by e^160) stays
    finite and equals the shifted value; catches an unshifted exp."""
    assert stats.ess(np.array([80.0, 80.0, -80.0])) == pytest.approx(4 / 6, rel=1e-12)
    assert stats.ess(np.array([])) == 1.0

"""The per-step mismatch metrics (objectives/core.mismatch_metrics; rl/train.py reports them
from each batch's first update) against float64 numpy and hand-computed values. Their values
under every ESS scope and micro-batch split: tests/test_ess_scope.py's float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import first_rows, tiny_config

from ess_jax import objectives as O


def _reference(logp, batch):
    mask = batch["mask"].astype(bool)
    keep = mask & np.isfinite(logp) & np.isfinite(batch["behaviour_logp"])
    lr = np.where(keep, logp.astype(np.float64) - batch["behaviour_logp"], 0.0)
    rho = np.exp(lr)
    outside = keep & ((rho > 1.2) | (rho < 0.8))
    return {
        "logratio_p95": np.percentile(np.abs(lr[keep]), 95),
        "logratio_max": np.abs(lr[keep]).max(),
        "frac_outside_clip": outside.sum() / mask.sum(),
        "seq_logratio_mean": lr.sum() / mask.any(-1).sum(),
    }


def test_mismatch_metrics_match_float64_numpy():
    """Catches a p95 over the padded tokens too (pads are 0 and pull it down), another
    percentile rule than numpy's linear interpolation, a max or share that counts a dropped
    non-finite token, a share outside [0.8, 1.2] over the kept tokens instead of the loss
    mask's, and a sequence mean over rows that hold no token."""
    rng = np.random.default_rng(0)
    b, t = 6, 9
    lengths = np.array([9, 4, 0, 7, 1, 6])
    mask = np.arange(t)[None] < lengths[:, None]
    logp = rng.normal(size=(b, t)).astype(np.float32) - 2
    blogp = (logp + rng.normal(size=(b, t)) * 0.3).astype(np.float32)
    blogp[3, 2] = -np.inf  # a dropped token: in N, out of every sum
    batch = {"mask": mask.astype(np.float32), "behaviour_logp": np.where(mask, blogp, 0.0)}
    got = jax.jit(O.mismatch_metrics)(jnp.asarray(logp), batch)
    want = _reference(logp, batch)
    assert set(got) == set(O.MISMATCH_KEYS) == set(want)
    for k in want:
        assert float(got[k]) == pytest.approx(want[k], rel=1e-5), k
    assert 0 < want["frac_outside_clip"] < 1 and want["logratio_p95"] < want["logratio_max"]

    empty = {"mask": np.zeros((2, 3), np.float32), "behaviour_logp": np.zeros((2, 3), np.float32)}
    zeros = jax.jit(O.mismatch_metrics)(jnp.zeros((2, 3)), empty)
    assert all(float(v) == 0.0 for v in zeros.values())


def test_p95_interpolates_between_ranks_by_hand():
    """Five kept log-ratios 0.1 .. 0.5 (two pads of 9): rank 0.95 * 4 = 3.8, so p95 = 0.4 +
    0.8 * 0.1 = 0.48 by hand; the pads' 9 is in no statistic."""
    lr = np.array([[0.1, -0.2, 0.3, 9.0], [0.4, -0.5, 9.0, 9.0]], np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)
    got = O.mismatch_metrics(jnp.asarray(lr), {"mask": mask, "behaviour_logp": np.zeros_like(lr)})
    assert float(got["logratio_p95"]) == pytest.approx(0.48, rel=1e-6)
    assert float(got["logratio_max"]) == pytest.approx(0.5)
    assert float(got["seq_logratio_mean"]) == pytest.approx(0.1 / 2, abs=1e-7)  # 2 sequences
    assert float(got["frac_outside_clip"]) == pytest.approx(3 / 5)  # |lr| >= 0.3: outside


def test_rl_row_reports_the_first_update(tmp_path):
    """Catches the loop averaging the mismatch metrics over a batch's updates (or taking the
    last): with a float32 sampler and lag 0 the first update's ratios are 1 to float rounding
    (ESS 1 +- 1e-5, zero gap), while the second update, after an lr 1e-2 step, sees ratios
    away from 1, so any mixing of the second into the row shows."""
    c = tiny_config(**{"train.updates_per_batch": 2, "data.prompts_per_step": 4, "optim.lr": 1e-2})
    (row,) = first_rows(c, tmp_path)
    assert row["logratio_max"] < 1e-5 and row["frac_outside_clip"] == 0.0
    assert abs(row["seq_logratio_mean"]) < 1e-5 and row["logratio_p95"] <= row["logratio_max"]
    # not vacuous: the second update's policy had moved (its ratios enter the mean ratio_max)
    assert row["ratio_max"] > 1 + 1e-4 and row["ess_min"] < 1 - 1e-6

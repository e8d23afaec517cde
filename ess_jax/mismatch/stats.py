"""The mismatch statistics of one knob setting, in float64 numpy, from per-token arrays.

Axis alphabet: B rows (sampled responses), T response positions.

Inputs, for the response tokens the sampler drew (`mask`):
  logp   log pi_theta(y_t): the float32 trainer's teacher-forced log-prob (`scoring.token_logprobs`)
  blogp  log pi_b(y_t): the log-prob the sampler recorded for the token it drew (`draw.draw`)
  kl_fwd, kl_rev (optional)  the exact per-position KL(pi_b || pi_theta) and KL(pi_theta || pi_b)
         over the whole vocabulary (replay.py; with a truncated pi_b the second is on its support)

With lr_t = logp_t - blogp_t (the log importance ratio, docs/method.md) and rho_t = exp(lr_t):
  ess_token   (sum rho)^2 / (N sum rho^2) over the tokens: the objectives' e_B
              (`objectives/kl.py:effective_sample_size`)
  ess_seq     the same over sequences, each weighted by its whole-sequence ratio exp(sum_t lr_t)
  abs_lr_mean, abs_lr_p50, abs_lr_p95, abs_lr_max   of |lr_t| (percentiles: numpy's linear rule)
  lr_rms      sqrt(mean lr_t^2), the root-mean-square log-ratio
  lr_mean     mean lr_t = the sampled k1 (`kl_k1`); over y ~ pi_b it estimates -KL(pi_b || pi)
  k3          mean of `kl_k3`(logp, blogp) (its exponent clamped to +-10, as the objectives' k3)
  chi2        mean (rho_t - 1)^2: over y ~ pi_b it estimates chi^2(pi_theta || pi_b)
  kl_exact, kl_exact_rev   token means of kl_fwd / kl_rev
  frac_outside  share of tokens with rho_t outside [0.8, 1.2] (`core.NOMINAL_CLIP`, the
              objectives' `clip_frac`); frac_outside_0.1 the same for [0.9, 1.1]
Tokens whose logp or blogp is not finite are left out (counted in `nonfinite`), as the
objectives drop them. Each statistic is also given per response-length bucket (`LENGTH_EDGES`,
the bucket of a token is its sequence's) and per pi_b-probability bucket (`PROB_EDGES`: the
low-probability tail is where a format's rounding moves a log-prob most); ess_seq only for the
whole set and the length buckets.
"""

from __future__ import annotations

import numpy as np

CLIP = 0.2  # objectives/core.py NOMINAL_CLIP: the nominal band [0.8, 1.2]
K3_EXP_CLAMP = 10.0  # objectives/kl.py K3_EXP_CLAMP
# Response-length buckets (tokens): (lo, hi], the last open.
LENGTH_EDGES = (0, 8, 16, 32, 64, 128, 256)
# pi_b(y_t) buckets: [lo, hi).
PROB_EDGES = (0.0, 0.01, 0.1, 0.5, 0.9, 1.0 + 1e-9)
KEYS = (
    "tokens",
    "sequences",
    "ess_token",
    "ess_seq",
    "abs_lr_mean",
    "abs_lr_p50",
    "abs_lr_p95",
    "abs_lr_max",
    "lr_rms",
    "lr_mean",
    "k3",
    "chi2",
    "kl_exact",
    "kl_exact_rev",
    "frac_outside",
    "frac_outside_0.1",
)


def ess(log_w: np.ndarray) -> float:
    """(sum w)^2 / (n sum w^2) of w = exp(log_w), max-shifted; 1.0 for an empty set."""
    log_w = np.asarray(log_w, np.float64).ravel()
    if log_w.size == 0:
        return 1.0
    w = np.exp(log_w - log_w.max())
    return float(min(w.sum() ** 2 / (w.size * np.sum(w * w)), 1.0))


def _group(lr, k3, kl_fwd, kl_rev, seq_lr) -> dict:
    """The statistics of one set of tokens (1-D arrays) and, if given, of its sequences."""
    n = lr.size
    out: dict = {"tokens": int(n), "sequences": None if seq_lr is None else int(seq_lr.size)}
    out["ess_seq"] = None if seq_lr is None else ess(seq_lr)
    if n == 0:
        return {k: out.get(k) for k in KEYS}
    a = np.abs(lr)
    rho = np.exp(lr)
    out.update(
        ess_token=ess(lr),
        abs_lr_mean=float(a.mean()),
        abs_lr_p50=float(np.percentile(a, 50)),
        abs_lr_p95=float(np.percentile(a, 95)),
        abs_lr_max=float(a.max()),
        lr_rms=float(np.sqrt(np.mean(lr * lr))),
        lr_mean=float(lr.mean()),
        k3=float(k3.mean()),
        chi2=float(np.mean((rho - 1.0) ** 2)),
        kl_exact=None if kl_fwd is None else float(kl_fwd.mean()),
        kl_exact_rev=None if kl_rev is None else float(kl_rev.mean()),
        frac_outside=float(np.mean((rho > 1.0 + CLIP) | (rho < 1.0 - CLIP))),
    )
    out["frac_outside_0.1"] = float(np.mean((rho > 1.1) | (rho < 0.9)))
    return {k: out[k] for k in KEYS}


def summarize(logp_BxT, blogp_BxT, mask_BxT, kl_fwd_BxT=None, kl_rev_BxT=None) -> dict:
    """{"all": stats, "by_length": [stats + "bucket"], "by_pb": [...], "nonfinite": int} of
    the tokens in `mask` (see the module docstring); empty buckets are left out."""
    logp = np.asarray(logp_BxT, np.float64)
    blogp = np.asarray(blogp_BxT, np.float64)
    mask = np.asarray(mask_BxT, bool)
    if not (logp.shape == blogp.shape == mask.shape) or logp.ndim != 2:
        raise ValueError(f"logp {logp.shape}, blogp {blogp.shape}, mask {mask.shape}: need BxT")
    kl_f = None if kl_fwd_BxT is None else np.asarray(kl_fwd_BxT, np.float64)
    kl_r = None if kl_rev_BxT is None else np.asarray(kl_rev_BxT, np.float64)
    ok = mask & np.isfinite(logp) & np.isfinite(blogp)
    lr = np.where(ok, logp - blogp, 0.0)
    expo = np.clip(-lr, -K3_EXP_CLAMP, K3_EXP_CLAMP)
    k3 = lr + np.exp(expo) - 1.0
    length = mask.sum(1)  # the response's length: every drawn token, finite or not
    seq_lr = lr.sum(1)
    has = ok.any(1)

    def pick(sel_BxT, rows_B=None) -> dict:
        f = lambda x: None if x is None else x[sel_BxT]  # noqa: E731
        seqs = None if rows_B is None else seq_lr[rows_B & has]
        return _group(lr[sel_BxT], k3[sel_BxT], f(kl_f), f(kl_r), seqs)

    out = {"all": pick(ok, np.ones(len(ok), bool)), "by_length": [], "by_pb": []}
    edges = (*LENGTH_EDGES, np.inf)
    for lo, hi in zip(edges[:-1], edges[1:]):
        rows = (length > lo) & (length <= hi)
        if rows.any():
            g = pick(ok & rows[:, None], rows)
            name = f"{lo + 1}-{hi}" if np.isfinite(hi) else f">{lo}"
            out["by_length"].append({"bucket": name, **g})
    pb = np.exp(blogp)
    for lo, hi in zip(PROB_EDGES[:-1], PROB_EDGES[1:]):
        sel = ok & (pb >= lo) & (pb < hi)
        if sel.any():
            name = f"[{lo:g}, {min(hi, 1.0):g}" + ("]" if hi > 1 else ")")
            out["by_pb"].append({"bucket": name, **pick(sel)})
    out["nonfinite"] = int((mask & ~ok).sum())
    return out

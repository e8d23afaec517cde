"""One run's and one experiment's numbers, from their metrics.jsonl rows: the collapse
criteria, the per-run summary the tables and the stability map report, the fingerprint that
finds identical runs, the paired statistics (95% t-interval, t-test, Holm's correction) and
how the tables print an interval. experiments/analyze.py and experiments/stability_map.py write
their tables from these (imports flow analyze.py -> stability_map.py -> run_stats.py); the
criteria are defined in analyze.py's docstring, the tests in stability_map.py's.
"""

from __future__ import annotations

import json
import math
import os
from typing import NoReturn

import numpy as np

from ess_jax.config.schema import user_exit

WINDOW = 10
SUSTAIN = 20  # consecutive steps below half the running peak for a sustained collapse
# Per-step fields that measure time, not the run: they differ between two identical runs.
TIMING_KEYS = ("tokens_per_s", "sample_s", "step_s")
# Two-sided 95% quantiles of Student's t by degrees of freedom (1.96 beyond the table).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
COLLAPSE_NOTES = [
    "collapse (dip): the first step whose 10-step mean reward is below half its running peak.",
    f"collapse (sustained): the first step from which it stays there for {SUSTAIN} consecutive "
    'steps, or to the end of the run if fewer remain. Both per seed, "none" if never.',
    "held-out below step 0: runs whose held-out pass@1 at the last eval is below step 0's.",
]


def fail(msg: str) -> NoReturn:
    """Stop a tool of experiments/ as `python -m ess_jax.main` stops on a user's mistake (a bad
    config, workdir, argument or metrics.jsonl): `schema.user_exit`, one `error:` line on
    stderr, exit code 2."""
    user_exit(msg)


def read_rows(path: str) -> list[dict]:
    """A metrics.jsonl's rows, or a workdir's (ess_jax.rl.metrics.read_metrics, which imports no
    jax): a cut last line is left out with a warning; a bad line before it stops (`fail`) with
    the file and line."""
    from ess_jax.rl.metrics import MetricsError, read_metrics

    try:
        return read_metrics(path)
    except MetricsError as e:
        fail(str(e))


def load_run(path: str) -> dict:
    """{'train': [rows with reward_mean], 'eval': [rows with eval/pass@1]} of a metrics.jsonl."""
    rows = read_rows(path)
    train = sorted((r for r in rows if "reward_mean" in r), key=lambda r: r["step"])
    evals = sorted((r for r in rows if "eval/pass@1" in r), key=lambda r: r["step"])
    return {"train": train, "eval": evals}


def moving_mean(x: np.ndarray, w: int = WINDOW) -> np.ndarray:
    """Means of the full windows x[i - w + 1 : i + 1], for i = w - 1 ... len(x) - 1."""
    if len(x) < w:
        return np.array([])
    c = np.cumsum(np.concatenate([[0.0], x]))
    return (c[w:] - c[:-w]) / w


def below_half_peak(reward: np.ndarray) -> np.ndarray:
    """Per full window: is the 10-step mean reward below half its running peak."""
    mm = moving_mean(reward)
    peak = np.maximum.accumulate(mm) if len(mm) else mm
    return mm < 0.5 * peak


def collapse_step(steps: np.ndarray, reward: np.ndarray) -> int | None:
    """Collapse (dip): first step whose 10-step mean reward is below half its running peak, or
    None."""
    below = np.nonzero(below_half_peak(reward))[0]
    return int(steps[below[0] + WINDOW - 1]) if len(below) else None


def sustained_collapse_step(
    steps: np.ndarray, reward: np.ndarray, sustain: int = SUSTAIN
) -> int | None:
    """Collapse (sustained): first step from which the 10-step mean reward stays below half its
    running peak for `sustain` consecutive steps, or to the end of the run if fewer remain; or
    None."""
    below = below_half_peak(reward)
    for i in np.nonzero(below)[0]:
        if np.all(below[i : i + sustain]):
            return int(steps[i + WINDOW - 1])
    return None


def run_summary(run: dict) -> dict:
    tr = run["train"]
    steps = np.array([r["step"] for r in tr])
    col = lambda k: np.array([r.get(k, np.nan) for r in tr], np.float64)
    reward = col("reward_mean")
    ent = col("entropy_proxy")
    return {
        "steps": int(len(tr)),
        "final": float(np.mean(reward[-WINDOW:])),
        "peak": float(np.max(moving_mean(reward))) if len(tr) >= WINDOW else float("nan"),
        "collapse": collapse_step(steps, reward),
        "sustained": sustained_collapse_step(steps, reward),
        "pass1": float(run["eval"][-1]["eval/pass@1"]) if run["eval"] else float("nan"),
        "below_step0": heldout_below_step0(run["eval"]),
        "ess": float(np.mean(col("ess"))),
        "ess_min": float(np.min(col("ess_min") if "ess_min" in tr[0] else col("ess"))),
        "capped": float(np.mean(col("capped_frac"))),
        "ent_first": float(np.mean(ent[:WINDOW])),
        "ent_last": float(np.mean(ent[-WINDOW:])),
    }


def heldout_below_step0(evals: list[dict]) -> bool:
    """Held-out pass@1 of the last eval below that of the eval at step 0 (False without both)."""
    first = [r["eval/pass@1"] for r in evals if r["step"] == 0]
    if not first or evals[-1]["step"] == 0:
        return False
    return bool(evals[-1]["eval/pass@1"] < first[0])


def fingerprint(run: dict) -> str:
    """The run's metrics rows, timing fields aside, as one string: equal for identical runs."""
    rows = [
        {k: v for k, v in r.items() if k not in TIMING_KEYS} for r in run["train"] + run["eval"]
    ]
    return json.dumps(rows, sort_keys=True)


def load_experiment(path: str) -> dict[str, dict[int, dict]]:
    """{arm: {seed: run}} of an experiment directory."""
    out: dict[str, dict[int, dict]] = {}
    for arm in sorted(os.listdir(path)):
        arm_dir = os.path.join(path, arm)
        if not os.path.isdir(arm_dir):
            continue
        for seed in sorted(os.listdir(arm_dir)):
            f = os.path.join(arm_dir, seed, "metrics.jsonl")
            if seed.isdigit() and os.path.exists(f):
                out.setdefault(arm, {})[int(seed)] = load_run(f)
    return out


def fmt(values, digits: int = 3) -> str:
    v = np.asarray(values, np.float64)
    if len(v) == 0 or np.all(np.isnan(v)):
        return "-"
    if len(v) == 1:
        return f"{v[0]:.{digits}f}"
    return f"{np.mean(v):.{digits}f} ± {np.std(v, ddof=1):.{digits}f}"


def paired_interval(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """(mean of a - b, its 95% t-interval low, high), paired by seed; nan bounds for n < 2."""
    d = np.asarray(a) - np.asarray(b)
    if len(d) < 2:
        return float(np.mean(d)), float("nan"), float("nan")
    half = T975.get(len(d) - 1, 1.96) * np.std(d, ddof=1) / math.sqrt(len(d))
    return float(np.mean(d)), float(np.mean(d) - half), float(np.mean(d) + half)


def fmt_interval(m: tuple[float, float, float]) -> str:
    """A paired_interval as the tables print it, "+0.120 [+0.050, +0.190]"; the mean alone when
    it has no interval (n < 2)."""
    if math.isnan(m[1]):
        return f"{m[0]:+.3f}"
    return f"{m[0]:+.3f} [{m[1]:+.3f}, {m[2]:+.3f}]"


def paired_t(a: list[float], b: list[float]) -> tuple[float, float, float, float]:
    """(mean of a - b, 95% interval low, high, two-sided paired t-test p-value; nan for n < 2)."""
    from scipy.special import stdtr  # Student's t CDF (scipy comes with jax)

    mean, lo, hi = paired_interval(a, b)
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    if len(d) < 2:
        return mean, lo, hi, float("nan")
    sd = float(np.std(d, ddof=1))
    if sd == 0.0:
        return mean, lo, hi, 1.0 if mean == 0.0 else 0.0
    stat = abs(float(np.mean(d))) / (sd / math.sqrt(len(d)))
    return mean, lo, hi, float(2.0 * stdtr(len(d) - 1, -stat))


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order; nan stays nan, outside the family."""
    family = sorted((p, i) for i, p in enumerate(pvalues) if not math.isnan(p))
    out = [float("nan")] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(family):
        running = max(running, min(1.0, (len(family) - rank) * p))
        out[i] = running
    return out

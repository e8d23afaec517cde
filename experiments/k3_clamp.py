"""The share of response tokens beyond k3's exponent clamp, per step, before and during a
collapse, for each run directory (or metrics.jsonl) given.

    .venv/bin/python experiments/k3_clamp.py runs/mini/stability_map/t2.0_p3o/0 [more runs]

k3's exponent is clamped at +-10 (FeynRL's, `ess_jax/objectives/kl.py:K3_EXP_CLAMP`); where the
log ratio log(pi / pi_b) of a token is below -10 the KL term's gradient has the wrong sign
(docs/method.md, "KL estimators"). Each step's row of metrics.jsonl holds the share of the N
response tokens below -10 (`lr_beyond_clamp_low`) and above +10 (`lr_beyond_clamp_high`), as a
token mean over the step's updates, and the largest |log ratio| of the step's first update
(`logratio_max`; rows written before the shares existed have only this one).

Collapse: experiments/run_stats.py's, as analyze.py and stability_map.py count it. The dip is
the first step whose 10-step mean reward is below half its running peak; its window is the 10
steps that end there. Per run the report gives the dip and the sustained collapse, then one
row per step from `--context` steps before the dip's window to `--context` steps after it
(every step when there is no dip), each marked `before`, `during` (the dip's window) or
`after`, and per phase the mean of each share, the largest logratio_max and the number of
steps whose logratio_max exceeds the clamp.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from experiments.run_stats import (  # noqa: E402
    WINDOW,
    collapse_step,
    fail,
    load_run,
    sustained_collapse_step,
)

CLAMP = 10.0  # ess_jax/objectives/kl.py:K3_EXP_CLAMP (this tool imports no jax)
SHARES = ("lr_beyond_clamp_low", "lr_beyond_clamp_high")


def _col(rows: list[dict], key: str) -> np.ndarray:
    return np.array([r.get(key, np.nan) for r in rows], np.float64)


def clamp_report(rows: list[dict], context: int = WINDOW) -> dict:
    """A run's train rows -> {collapse, sustained, rows, before, during, after}.

    rows: [{step, phase, reward_mean, lr_beyond_clamp_low, lr_beyond_clamp_high,
    logratio_max}] from `context` steps before the dip's window to `context` steps after it
    (phase "before" / "during" / "after"); every row, phase "", when there is no dip. before /
    during / after (empty without a dip): per phase, the mean of each share over its steps
    (None where no row has it), the largest logratio_max and the number of steps whose
    logratio_max exceeds the clamp."""
    steps = np.array([r["step"] for r in rows])
    reward = _col(rows, "reward_mean")
    dip = collapse_step(steps, reward)
    report = {"collapse": dip, "sustained": sustained_collapse_step(steps, reward)}
    keys = ("reward_mean", *SHARES, "logratio_max")
    if dip is None:
        spans = {"": (0, len(rows))}
    else:
        end = int(np.nonzero(steps == dip)[0][0]) + 1  # one past the dip's window
        lo = end - WINDOW  # first row of the dip's window
        spans = {
            "before": (max(lo - context, 0), lo),
            "during": (lo, end),
            "after": (end, min(end + context, len(rows))),
        }
    report["rows"] = [
        {"step": int(steps[i]), "phase": phase, **{k: rows[i].get(k) for k in keys}}
        for phase, (a, b) in spans.items()
        for i in range(a, b)
    ]
    for phase in ("before", "during", "after"):
        a, b = spans.get(phase, (0, 0))
        lr_max = _col(rows[a:b], "logratio_max")
        report[phase] = (
            {}
            if phase not in spans
            else {
                **{k: _mean(_col(rows[a:b], k)) for k in SHARES},
                "logratio_max": float(np.nanmax(lr_max)) if np.isfinite(lr_max).any() else None,
                "steps_beyond": int(np.sum(lr_max > CLAMP)),
            }
        )
    return report


def _mean(x: np.ndarray) -> float | None:
    x = x[np.isfinite(x)]
    return float(np.mean(x)) if len(x) else None


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def render(name: str, report: dict) -> list[str]:
    """Markdown lines of one run's report."""
    lines = [
        f"## {name}",
        "",
        f"collapse (dip): {_fmt(report['collapse'])}; sustained: {_fmt(report['sustained'])}",
    ]
    if report["rows"] and all(r[SHARES[0]] is None for r in report["rows"]):
        lines.append(
            f"no {SHARES[0]} / {SHARES[1]} in its rows (a run written before them): "
            f"logratio_max > {CLAMP:g} marks a step with a token beyond the clamp"
        )
    for phase in ("before", "during", "after"):
        if report[phase]:
            means = ", ".join(f"{k} {_fmt(v)}" for k, v in report[phase].items())
            lines.append(f"mean {phase}: {means}")
    lines += [
        "",
        "| step | phase | reward_mean | below -10 | above +10 | logratio_max |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        cells = (
            r["step"],
            r["phase"],
            r["reward_mean"],
            *(r[k] for k in SHARES),
            r["logratio_max"],
        )
        lines.append("| " + " | ".join(_fmt(v) for v in cells) + " |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="run directories or metrics.jsonl files")
    ap.add_argument(
        "--context",
        type=int,
        default=WINDOW,
        help=f"steps listed before and after the dip's window (default {WINDOW})",
    )
    args = ap.parse_args(argv)
    for path in args.runs:
        rows = load_run(path)["train"]
        if not rows:
            fail(f"{path}: no train rows (no metrics.jsonl there, or no row with reward_mean)")
        print("\n".join(render(path, clamp_report(rows, args.context))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Turn finished runs into a table (markdown) and an overlay plot of reward and ESS.

    .venv/bin/python experiments/compare.py runs/p3o runs/grpo_eps0.2 --out runs/compare

Per run: final train reward (mean of the last 5 steps), first and last held-out pass@1,
mean and minimum ESS, mean clip fraction, skipped (non-finite) updates. Each metrics.jsonl is
read once: a cut last line warns once; a bad line before it, a path that does not exist, a
directory without a metrics.jsonl or a run without training rows stops with one `error:` line
naming it (exit code 2, as `python -m ess_jax.main`).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from experiments.run_stats import fail, read_rows  # noqa: E402


def read_run(workdir: str) -> list[dict]:
    """The metrics rows of a workdir or a metrics.jsonl; `fail` if there is none."""
    if not os.path.exists(workdir):
        fail(f"{workdir}: no such file or directory")
    if os.path.isdir(workdir) and not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
        fail(f"{workdir}: no metrics.jsonl in it (not a run's workdir, or a run that wrote no row)")
    return read_rows(workdir)


def summarize(workdir: str, rows: list[dict] | None = None) -> dict:
    """The table's row of one run; `rows` are its metrics rows when already read. A run
    without training rows (eval rows only, or none) is a `fail` naming it."""
    rows = read_run(workdir) if rows is None else rows
    train = [r for r in rows if r.get("reward_mean") is not None]
    evals = [r for r in rows if r.get("eval/pass@1") is not None]
    if not train:
        fail(f"{workdir}: no training rows (no row with reward_mean)")
    col = lambda k: np.array([r[k] for r in train if r.get(k) is not None], float)
    return {
        "run": os.path.basename(os.path.normpath(workdir)),
        "steps": len(train),
        "reward_last5": float(col("reward_mean")[-5:].mean()),
        "pass@1_first": evals[0]["eval/pass@1"] if evals else float("nan"),
        "pass@1_last": evals[-1]["eval/pass@1"] if evals else float("nan"),
        "ess_mean": float(col("ess").mean()),
        "ess_min": float(col("ess").min()),
        "clip_frac": float(col("clip_frac").mean()),
        "skipped": int(col("skipped").sum()) if len(col("skipped")) else 0,
    }


def markdown_table(summaries: list[dict]) -> str:
    keys = list(summaries[0])
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(s[k]) for k in keys) + " |" for s in summaries]
    return "\n".join(lines)


def overlay_plot(runs: dict[str, list[dict]], out_png: str) -> None:
    """Reward and ESS against step, one line per {workdir: its metrics rows}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for wd, rows in runs.items():
        rows = [r for r in rows if r.get("reward_mean") is not None]
        steps = [r["step"] for r in rows]
        name = os.path.basename(os.path.normpath(wd))
        axes[0].plot(steps, [r["reward_mean"] for r in rows], label=name)
        axes[1].plot(steps, [r["ess"] for r in rows], label=name)
    for ax, title in zip(axes, ("train reward", "ESS")):
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def write(workdirs: list[str], out: str, notes: str = "") -> str:
    """Writes <out>.md (the table, then `notes`) and <out>.png (none without workdirs); returns
    the markdown. Reads each metrics.jsonl once."""
    runs = {w: read_run(w) for w in workdirs}
    parts = [markdown_table([summarize(w, rows) for w, rows in runs.items()])] if runs else []
    text = "\n\n".join(parts + ([notes] if notes else []))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".md", "w") as f:
        f.write(text + "\n")
    if runs:
        overlay_plot(runs, out + ".png")
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdirs", nargs="+")
    ap.add_argument("--out", default="compare", help="output prefix (.md and .png)")
    args = ap.parse_args(argv)
    print(write(args.workdirs, args.out))
    print(f"wrote {args.out}.md and {args.out}.png")


if __name__ == "__main__":
    main()

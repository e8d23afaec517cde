"""Run outputs: metrics.jsonl, TensorBoard events, the progress line and the PNG curves."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np


def _py(v: Any) -> Any:
    """JSON-safe scalar (numpy / jax scalars -> float/int; NaN kept as null)."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsWriter:
    """Appends one JSON object per row to <workdir>/metrics.jsonl and mirrors to TensorBoard.

    `active=False` writes nothing: the other processes of a multi-host run, whose process 0
    alone writes the shared workdir's files (their rows are the same)."""

    def __init__(
        self,
        workdir: str,
        resume_step: int | None = None,
        tensorboard: bool = True,
        active: bool = True,
    ):
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.active = active
        self._tb = None
        if not active:
            return
        os.makedirs(workdir, exist_ok=True)
        if resume_step is not None:
            self.truncate_from(resume_step)
        if tensorboard:
            from tensorboardX import SummaryWriter  # tensorboard events without TensorFlow

            self._tb = SummaryWriter(os.path.join(workdir, "tb"))

    def truncate_from(self, step: int) -> None:
        """Drop rows of step >= `step` (a resumed run rewrites them identically)."""
        rows = [r for r in read_metrics(self.path) if r.get("step", -1) < step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.path)

    def write(self, row: Mapping[str, Any]) -> None:
        if not self.active:
            return
        row = {k: _py(v) for k, v in row.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, row["step"])
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str) -> list[dict]:
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def progress_postfix(row: Mapping[str, Any]) -> str:
    keys = ("reward_mean", "ess", "kl_behaviour", "loss")
    return " ".join(f"{k.split('_')[0]}={row[k]:.3f}" for k in keys if row.get(k) is not None)


def eval_summary(row: Mapping[str, Any]) -> str:
    """The console line of an eval row: `eval @ step 50: pass@1 0.904  pass@4 0.984 ...`."""
    keys = [k for k, v in row.items() if k.startswith("eval/") and isinstance(v, (int, float))]
    keys.sort(key=lambda k: not k.startswith("eval/pass@"))  # pass@1, pass@k first
    return f"eval @ step {row['step']}: " + "  ".join(f"{k[5:]} {row[k]:.3f}" for k in keys)


def plot_run(workdir: str, out: str | None = None) -> str:
    """PNG of reward, held-out pass@1 and ESS against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(workdir)
    panels = [("reward_mean", "train reward"), ("eval/pass@1", "held-out pass@1"), ("ess", "ESS")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (key, title) in zip(axes, panels):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            xs, ys = np.array(pts).T
            ax.plot(xs, ys, marker="o" if key.startswith("eval") else None, ms=3)
        if key != "reward_mean":  # both live in [0, 1]; a fixed scale hides float noise
            ax.set_ylim(-0.02, 1.05)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = out or os.path.join(workdir, "curves.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

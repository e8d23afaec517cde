"""Run outputs: metrics.jsonl, TensorBoard events, the progress line and the PNG curves.

A run stopped mid-row (killed, disk full) leaves metrics.jsonl's last line cut: readers leave it
out with a warning, and a resume moves its bytes to metrics.jsonl.torn before it writes on. A
line before the last that does not parse is damage: MetricsError names the file and the line.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ess_jax.config.schema import UserError

TORN_SUFFIX = ".torn"  # where a resume keeps a cut last line's bytes


class MetricsError(UserError, ValueError):
    """A metrics.jsonl line before the last that is not a JSON row."""


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
        """Drop rows of step >= `step` (a resumed run rewrites them identically); a cut last
        line goes to metrics.jsonl.torn (appended), never lost."""
        rows, torn = _parse(self.path)
        if torn is not None:
            with open(self.path + TORN_SUFFIX, "ab") as f:
                f.write(torn + b"\n")
            logging.warning(
                "%s: its last line is cut (%d bytes: a run stopped mid-row); moved to %s",
                self.path,
                len(torn),
                self.path + TORN_SUFFIX,
            )
        rows = [r for r in rows if r.get("step", -1) < step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.path)

    def write(self, row: Mapping[str, Any]) -> None:
        if not self.active:
            return
        row = {k: _py(v) for k, v in row.items()}
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as e:  # a failed write() names no file
            raise OSError(e.errno, e.strerror, e.filename or self.path) from e
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, row["step"])
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str) -> list[dict]:
    """The rows of a metrics.jsonl, or of a workdir's; a cut last line is left out (a warning)."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    rows, torn = _parse(path)
    if torn is not None:
        logging.warning("%s: its last line is cut (a run stopped mid-row); left out", path)
    return rows


def _parse(path: str) -> tuple[list[dict], bytes | None]:
    """(rows, the cut last line's bytes or None). MetricsError for a bad line before the last."""
    if not os.path.exists(path):
        return [], None
    with open(path, "rb") as f:
        lines = [(i, line) for i, line in enumerate(f.read().split(b"\n"), 1) if line.strip()]
    rows = []
    for n, (i, line) in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except ValueError as e:
            if n == len(lines):
                return rows, line
            why = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else e
            raise MetricsError(
                f"{path} line {i} is not a JSON row ({why}); only a cut last line is an "
                "interrupted write: fix or remove that line"
            ) from e
    return rows, None


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

"""Run outputs: metrics.jsonl, TensorBoard events, the progress line and the PNG curves.

A run stopped mid-row (killed, disk full) leaves metrics.jsonl's last line cut: readers leave it
out with a warning, and a resume moves its bytes to metrics.jsonl.torn before it writes on. A
line before the last that does not parse is damage: MetricsError names the file and the line.

A resume drops the rows of the steps it redoes (those from its checkpoint on) from both
metrics.jsonl and the TensorBoard events in tb/ (`purge_tensorboard`), so each (tag, step) has
one value there, the one metrics.jsonl holds.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import socket
import struct
import time
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


@functools.cache
def _tensorboardx():
    """tensorboardX, imported without PyTorch: its package `__init__` imports torch where it is
    installed (1.1 s of a run's 3.6 s of imports with compiled bytecode), only to accept torch
    tensors in SummaryWriter's methods, and ess_jax hands it Python floats. While it imports,
    torch reads as absent (a None entry in sys.modules makes `import torch` raise ImportError,
    which tensorboardX catches); the entry goes afterwards, so torch imports as usual later. A
    process that has imported torch already keeps it."""
    import importlib
    import sys

    hidden = "torch" not in sys.modules
    if hidden:
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        for name in ("event_file_writer", "proto.event_pb2", "summary"):
            importlib.import_module(f"tensorboardX.{name}")
    finally:
        if hidden and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return sys.modules["tensorboardX"]


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
            # tensorboardX's EventsWriter, not its SummaryWriter: the SummaryWriter hands events
            # to a thread through a queue and its flush() does not drain that queue, so a kill -9
            # right after a row could keep the row in metrics.jsonl and lose its events. Here
            # each row's events are on disk (flushed to the OS) when write() returns.
            EventsWriter = _tensorboardx().event_file_writer.EventsWriter
            tb = os.path.join(workdir, "tb")
            if resume_step is not None:
                purge_tensorboard(tb, resume_step)
            os.makedirs(tb, exist_ok=True)
            self._tb = EventsWriter(os.path.join(tb, "events"))

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
            tbx = _tensorboardx()
            Event, scalar = tbx.proto.event_pb2.Event, tbx.summary.scalar
            now = time.time()
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    event = Event(wall_time=now, step=int(row["step"]), summary=scalar(k, v))
                    self._tb.write_event(event)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _records(path: str) -> list[bytes]:
    """An event file's TFRecords, each whole (length, its CRC, the event, its CRC), as written;
    a cut last record (a run killed mid-write) is left out."""
    with open(path, "rb") as f:
        buf = f.read()
    out, i = [], 0
    while i + 12 <= len(buf):
        end = i + 12 + struct.unpack_from("<Q", buf, i)[0] + 4
        if end > len(buf):
            break
        out.append(buf[i:end])
        i = end
    return out


def purge_tensorboard(tb_dir: str, step: int) -> None:
    """Drop the events of step >= `step` from the event files in `tb_dir` (a resume from
    checkpoint `step` writes them again), and duplicates of a (tags, step) left by older runs
    (the last one kept).

    The files are rewritten, not marked: tensorboardX's `purge_step` (a SessionLog.START event)
    hides the old events from TensorBoard alone, while other readers (tbparse, pandas exports,
    `summary_iterator`) would see both. The kept records are copied byte for byte (their wall
    times, their CRCs: no pure-Python CRC) into one file named a second before now, so that it
    sorts before the one the resumed writer opens (TensorBoard reads a directory's files in name
    order and takes a step that goes back for a restart), and the old files go only once it is
    in place: a crash between leaves duplicates the next resume drops."""
    if not os.path.isdir(tb_dir):
        return
    from google.protobuf.message import DecodeError

    Event = _tensorboardx().proto.event_pb2.Event

    names = sorted(f for f in os.listdir(tb_dir) if ".tfevents." in f)
    kept: dict = {}  # key -> record, in the order of each key's last occurrence
    for name in names:
        for rec in _records(os.path.join(tb_dir, name)):
            try:
                e = Event.FromString(rec[12:-4])
            except DecodeError:
                break  # not an event: the rest of this file is unreadable
            what = e.WhichOneof("what")
            if what == "file_version":
                kept.setdefault("file_version", rec)
                continue
            if e.step >= step:
                continue
            key = (e.step, *sorted(v.tag for v in e.summary.value)) if what == "summary" else rec
            kept.pop(key, None)
            kept[key] = rec
    target = None
    if len(kept) > ("file_version" in kept):  # more than a header
        target = f"events.out.tfevents.{int(time.time()) - 1:010d}.{socket.gethostname()}"
        tmp = os.path.join(tb_dir, ".purge.tmp")
        with open(tmp, "wb") as f:
            f.write(b"".join(kept.values()))
        os.replace(tmp, os.path.join(tb_dir, target))
    for name in names:
        if name != target:
            os.remove(os.path.join(tb_dir, name))


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

"""A workdir a run cannot simply go on in: metrics.jsonl cut mid-row, a checkpoint past
train.steps, a workdir that is a file, read-only or on a full disk. Each is one line (or a
warning and the run goes on), never a traceback.

Disk full and read-only are simulated where the OS error starts (the write or the open raises
what the kernel or tensorstore raises); everything above it is the real error handling.
"""

import errno
import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import quickstart
from ess_jax.io import workdir as workdir_lib
from ess_jax.io.checkpoint import Checkpointer
from ess_jax.io.workdir import WorkdirError
from ess_jax.rl import metrics, train
from ess_jax.rl.metrics import MetricsError, MetricsWriter, read_metrics
from experiments import run_stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {
    "sft.steps": 0,
    "eval.every": 0,
    "data.prompts_per_step": 2,
    "rollout.group_size": 4,
    "rollout.max_new_tokens": 4,
}
CUT = b'{"step": 3, "reward_mean": 0.5, "ess": 0.9'  # a row cut mid-write: no brace, no newline


def config(**overrides):
    c = quickstart.get_config("tiny")
    c.update_from_flattened_dict({**TINY, **overrides})
    return c


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "experiments", name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write_rows(path, steps, tail=b""):
    rows = [{"step": s, "reward_mean": 0.1 * s, "ess": 1.0, "clip_frac": 0.0} for s in steps]
    with open(path, "wb") as f:
        f.write(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + tail)
    return rows


def snapshot(workdir):
    out = {}
    for d, _, files in os.walk(workdir):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, workdir)] = hashlib.sha1(fh.read()).hexdigest()
    return out


# ------------------------------------------------------------------------------ metrics.jsonl


def test_cut_last_metrics_line_is_set_aside_and_every_reader_goes_on(tmp_path, caplog):
    """Catches a metrics.jsonl whose last row was cut mid-write (a kill, a full disk) blocking
    the resume with a JSONDecodeError that names no file, and crashing experiments/compare.py
    and analyze.py: readers must leave the line out with a warning, and the resume must move
    its bytes to metrics.jsonl.torn (never lose them) and keep the rows before its step."""
    path = tmp_path / "metrics.jsonl"
    rows = _write_rows(path, range(3), tail=CUT)
    with caplog.at_level(logging.WARNING):
        assert read_metrics(str(tmp_path)) == rows
    assert f"{path}: its last line is cut" in caplog.text
    assert _load("compare.py").summarize(str(tmp_path))["steps"] == 3
    assert run_stats.load_run(str(path))["train"] == rows

    MetricsWriter(str(tmp_path), resume_step=2, tensorboard=False)  # what a resume does
    assert read_metrics(str(path)) == rows[:2]
    assert (tmp_path / "metrics.jsonl.torn").read_bytes() == CUT + b"\n"


def test_bad_metrics_line_before_the_last_names_the_file_and_line(tmp_path):
    """Catches damage in the middle of metrics.jsonl being dropped as if it were a cut last line
    (rows silently lost) or raised as a bare JSONDecodeError: it must stop with the file and the
    line number."""
    path = tmp_path / "metrics.jsonl"
    _write_rows(path, range(2), tail=CUT + b"\n" + b'{"step": 3}\n')
    with pytest.raises(MetricsError) as e:
        MetricsWriter(str(tmp_path), resume_step=2, tensorboard=False)
    assert str(e.value).startswith(f"{path} line 3 is not a JSON row (Expecting ")
    assert not (tmp_path / "metrics.jsonl.torn").exists()
    with pytest.raises(SystemExit, match=f"{path} line 3 is not a JSON row"):
        run_stats.read_rows(str(path))


def tensorboard_scalars(tb_dir) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every scalar event under `tb_dir`, its files read in name order
    (as TensorBoard does), as any raw reader sees them: each TFRecord parsed here, no purge."""
    from tensorboardX.proto.event_pb2 import Event

    out = []
    for name in sorted(os.listdir(tb_dir)):
        with open(os.path.join(tb_dir, name), "rb") as f:
            data = f.read()
        i = 0
        while i + 12 <= len(data):
            n = int.from_bytes(data[i : i + 8], "little")
            if i + 16 + n > len(data):
                break  # a cut last record
            e = Event.FromString(data[i + 12 : i + 12 + n])
            out += [(v.tag, e.step, v.simple_value) for v in e.summary.value]
            i += 16 + n
    return out


def test_tensorboard_events_are_written_without_importing_torch(tmp_path):
    """Catches the run's TensorBoard writer importing PyTorch again (tensorboardX's `__init__`
    imports it where installed: 1.1 s of every run's start, for tensor types ess_jax never
    passes) and the way around it breaking torch for the rest of the process: in a fresh
    process, a row's events are written with torch not imported, then torch imports."""
    code = (
        "import sys\n"
        "from ess_jax.rl.metrics import MetricsWriter\n"
        f"w = MetricsWriter({str(tmp_path)!r}, tensorboard=True)\n"
        "w.write({'step': 0, 'loss': 0.5}); w.close()\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "import torch\n"
        "print(torch.ones(2).sum().item())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["2.0"]
    assert tensorboard_scalars(tmp_path / "tb") == [("loss", 0, 0.5)]


def assert_tensorboard_holds_the_rows(workdir):
    """Each (tag, step) once in `workdir`'s TensorBoard events, in rising steps per tag across
    the files in name order, with the value of metrics.jsonl's row (float32: TensorBoard's)."""
    scalars = tensorboard_scalars(os.path.join(workdir, "tb"))
    expected = sorted(
        (k, r["step"], float(np.float32(v)))
        for r in read_metrics(str(workdir))
        for k, v in r.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    )
    assert sorted(scalars) == expected
    for tag in {t for t, _, _ in scalars}:
        steps = [s for t, s, _ in scalars if t == tag]
        assert steps == sorted(set(steps)), (tag, steps)  # no step goes back: no restart seen


def test_resume_purges_the_tensorboard_events_of_the_steps_it_redoes(tmp_path):
    """Catches a resume that leaves TensorBoard two events for the steps it redoes (those from
    its checkpoint on: a kill -9 after the last checkpoint) while metrics.jsonl keeps one, the
    kept events lost when the resumed writer opens a file of the same name (runs started within
    one second), a cut last event record (a kill mid-write) blocking the resume, or the kept
    events in a file that sorts after the resumed writer's (TensorBoard reads the later steps
    first, then takes the earlier ones for a restart and drops the later)."""
    rows = lambda steps, r: [{"step": s, "reward_mean": r + 0.1 * s, "ess": 0.5} for s in steps]
    writer = MetricsWriter(str(tmp_path), resume_step=0)
    for row in rows(range(5), 0.0):
        writer.write(row)
    writer.close()
    (events,) = os.listdir(tmp_path / "tb")
    with open(tmp_path / "tb" / events, "ab") as f:
        f.write(bytes(12) + b"\x09\x00\x00")  # a record cut in its event (a kill mid-write)
    for resume, r in ((3, 1.0), (4, 2.0)):  # the checkpoint at 3, then at 4
        writer = MetricsWriter(str(tmp_path), resume_step=resume)
        for row in rows(range(resume, 6), r):
            writer.write(row)
        writer.close()
    assert read_metrics(str(tmp_path)) == rows(range(3), 0.0) + rows([3], 1.0) + rows([4, 5], 2.0)
    assert_tensorboard_holds_the_rows(tmp_path)


# ------------------------------------------------------------------------------ train.steps


def test_resume_past_train_steps_is_refused_and_changes_nothing(tmp_path):
    """Catches a resume with train.steps below the checkpoint's step saving the step-4 state as
    checkpoint 2 (exit 0, a checkpoint that lies): it must be refused in one line, with no file
    changed."""
    run = train.Run(config(**{"train.steps": 4}), str(tmp_path))
    try:
        run.trainer.history.push(0, run.trainer.state.params)
        run.save(4, force=True)
    finally:
        run.close()
    before = snapshot(tmp_path)
    with pytest.raises(WorkdirError) as e:
        train.run(config(**{"train.steps": 2}), str(tmp_path))
    assert str(e.value) == (
        f"workdir {tmp_path}: its checkpoint is at step 4, past train.steps=2; nothing to do. "
        "Set --config.train.steps above 4 to go on, or use another --workdir"
    )
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------------ write errors


def test_workdir_that_is_a_file_is_one_line(tmp_path):
    """Catches a --workdir naming a file ending in a 28-line FileExistsError traceback: main
    must print one line naming the path and the cause, and exit 2."""
    path = tmp_path / "afile"
    path.write_text("not a workdir")
    env = {k: v for k, v in os.environ.items() if k not in ("ESS_JAX_VERBOSE", "XLA_FLAGS")}
    cmd = [sys.executable, "-m", "ess_jax.main", "--config=configs/quickstart.py:tiny"]
    p = subprocess.run(
        [*cmd, f"--workdir={path}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"error: workdir {path}: {path}: File exists [errno 17]; that path is a file, not a "
        "directory: use another --workdir"
    ], p.stderr
    assert path.read_text() == "not a workdir"


def test_read_only_workdir_is_one_error_naming_the_path(tmp_path, monkeypatch):
    """Catches a read-only workdir ending in an OSError traceback: the run must stop with one
    WorkdirError naming the file it could not write and the cause (the open of the lock file
    raises EROFS as on a read-only mount; chmod cannot show it to root)."""
    real_open = os.open

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(WorkdirError) as e:
        train.Run(config(), str(tmp_path))
    assert str(e.value) == (
        f"workdir {tmp_path}: {tmp_path}/lock: Read-only file system [errno 30]; use a "
        "--workdir on a writable file system"
    )


# tensorstore's error for a checkpoint array written to a full disk (seen on a 1 MB tmpfs)
TENSORSTORE_ENOSPC = (
    'RESOURCE_EXHAUSTED: Error writing "state.params.embed/0.0" in OCDBT database at local file '
    '"{d}/0.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_0/": Failed writing: '
    '"{d}/0.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_0/d/18155feee925": '
    "Failed to write 46346 bytes to file 21: No space left on device [os_error_code='28']"
)


def test_disk_full_during_a_checkpoint_save_is_one_line(tmp_path, monkeypatch):
    """Catches a checkpoint save on a full disk ending in hundreds of lines of orbax and asyncio
    tracebacks: the run must stop with one WorkdirError naming the step's directory and the
    cause, and release the workdir."""
    d = tmp_path / "checkpoints"

    def full_disk(self, step, *args, **kwargs):
        raise ValueError(TENSORSTORE_ENOSPC.format(d=d))

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
    with pytest.raises(WorkdirError) as e:
        train.run(config(), str(tmp_path))  # its first save: step 0, before any RL step
    assert str(e.value) == (
        f"workdir {tmp_path}: {d}/0: No space left on device [errno 28]; free space on that disk "
        "(or use another --workdir), then rerun the same command: it resumes from the last "
        "checkpoint"
    )
    assert not (tmp_path / "lock").exists()
    assert Checkpointer(str(d)).all_steps() == []


def test_disk_full_writing_a_metrics_row_names_the_file(tmp_path, monkeypatch):
    """Catches a metrics row lost to a full disk as an OSError that names no file (a failed
    write() carries none): the error must name metrics.jsonl and the cause."""
    writer = MetricsWriter(str(tmp_path), tensorboard=False)

    class FullDisk:
        def __init__(self, *args):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(metrics, "open", FullDisk, raising=False)
    with pytest.raises(WorkdirError) as e, workdir_lib.write_errors(str(tmp_path)):
        writer.write({"step": 0, "loss": 1.0})
    assert str(e.value).startswith(
        f"workdir {tmp_path}: {tmp_path}/metrics.jsonl: No space left on device [errno 28]; "
    )


def test_each_rows_tensorboard_events_are_on_disk_when_write_returns(tmp_path):
    """Catches TensorBoard events written through a queue and a thread (tensorboardX's
    SummaryWriter, whose flush() does not drain its queue and whose thread flushes at most
    every 120 s): a kill -9 right after a row then kept the row in metrics.jsonl and lost its
    events, and a resume cannot rewrite a row before its checkpoint (test_preemption's kill -9
    of a LoRA run failed that way, now and then)."""
    writer = MetricsWriter(str(tmp_path), resume_step=0)
    for step in range(3):
        writer.write({"step": step, "reward_mean": 0.25 * step, "ess": 0.5})
        assert_tensorboard_holds_the_rows(tmp_path)  # before any close
    writer.close()

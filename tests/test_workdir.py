"""Runs that refuse what they cannot do safely: the resume config check, the workdir
lock, the checkpoint fallback, the effective config file and the console eval rows.

One finished tiny run (module fixture, ~30 s) is copied into each test that damages it.
"""

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from configs import quickstart
from ess_jax.io.checkpoint import Checkpointer, CheckpointError
from ess_jax.io.workdir import WorkdirError, WorkdirLock
from ess_jax.rl import train
from ess_jax.rl.metrics import eval_summary, read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {  # 1 RL step; checkpoints and evals at 0 and 1; eval shapes = rollout shapes
    "sft.steps": 0,
    "train.steps": 1,
    "train.checkpoint_every": 1,
    "eval.every": 1,
    "eval.num_examples": 8,
    "eval.batch_size": 2,
    "eval.k": 4,
    "eval.max_new_tokens": 4,
    "data.prompts_per_step": 2,
    "rollout.group_size": 4,
    "rollout.max_new_tokens": 4,
}


def config(**overrides):
    c = quickstart.get_config("tiny")
    c.update_from_flattened_dict({**TINY, **overrides})
    return c


def main_cmd(workdir, **overrides):
    args = [f"--config.{k}={v}" for k, v in {**TINY, **overrides}.items()]
    return [sys.executable, "-m", "ess_jax.main", "--config=configs/quickstart.py:tiny"] + [
        f"--workdir={workdir}",
        *args,
    ]


ENV = {k: v for k, v in os.environ.items() if k not in ("ESS_JAX_VERBOSE", "XLA_FLAGS")}


def snapshot(workdir):
    """Every file under `workdir`: size, mtime and content hash."""
    out = {}
    for d, _, files in os.walk(workdir):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                digest = hashlib.sha1(fh.read()).hexdigest()
            out[os.path.relpath(p, workdir)] = (os.path.getsize(p), os.stat(p).st_mtime_ns, digest)
    return out


def truncate_array_files(step_dir, largest_only=True):
    """Cut array data files of a checkpoint step in half: the largest one (for the tiny model,
    its params), or every one (a tiny test tree's arrays may sit in any of them)."""
    files = [
        os.path.join(d, f)
        for d, _, fs in os.walk(step_dir / "state")
        for f in fs
        if os.path.basename(d) == "d"
    ]
    for path in [max(files, key=os.path.getsize)] if largest_only else files:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished tiny run: (workdir, what it printed on stdout)."""
    workdir = tmp_path_factory.mktemp("finished") / "run"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.run(config(), str(workdir))
    return workdir, out.getvalue()


@pytest.fixture
def copied(finished, tmp_path):
    shutil.copytree(finished[0], tmp_path / "run")
    return tmp_path / "run"


def test_eval_rows_are_printed_to_the_console(finished):
    """Catches held-out pass@1 / pass@k landing only in metrics.jsonl and TensorBoard: every eval
    row must also be printed on the console."""
    workdir, stdout = finished
    evals = [r for r in read_metrics(workdir) if "eval/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 1]
    printed = [line for line in stdout.splitlines() if line.startswith("eval @ step")]
    assert printed == [eval_summary(r) for r in evals]
    assert re.match(r"eval @ step 0: pass@1 \d\.\d{3}  pass@4 \d\.\d{3}  ", printed[0])


def test_effective_config_is_written_and_the_lock_is_gone(finished):
    """Catches a run's effective config kept nowhere but inside orbax metadata (config.json must
    hold it, written atomically), and a clean exit that leaves a lock the next run would have
    to take over."""
    workdir, _ = finished
    with open(workdir / "config.json") as f:
        assert json.load(f) == json.loads(json.dumps(config().to_dict()))
    assert not (workdir / "lock").exists()
    assert not [f for f in os.listdir(workdir) if ".tmp" in f]  # written atomically


def test_resume_with_another_config_is_refused_and_changes_nothing(copied):
    """Catches a P3O workdir resumed silently with objective.name=grpo rollout.temperature=1.2
    (metrics of both runs mixed, keep-2 deleting the P3O checkpoints): the resume must be
    refused naming the changed fields, change nothing, and go ahead only for allowed or safe
    changes."""
    before = snapshot(copied)
    other = config(**{"objective.name": "grpo", "rollout.temperature": 1.2, "train.steps": 3})
    with pytest.raises(WorkdirError) as e:
        train.run(other, str(copied))
    assert str(e.value) == (
        f"the config differs from the checkpoint's (step 1 in {copied}/checkpoints) in 2 "
        "field(s): objective.name ('p3o' -> 'grpo'), rollout.temperature (1.0 -> 1.2). Resume "
        "with the same config, use another --workdir, or allow these changes: "
        "--allow_config_change=objective.name,rollout.temperature"
    )  # train.steps is safe to change: not listed
    assert snapshot(copied) == before
    # allowed explicitly (a field and a whole section), or only safe fields changed: accepted
    train.Run(other, str(copied), allow_config_change=["objective.name", "rollout.*"]).close()
    train.Run(config(**{"train.steps": 5, "eval.every": 0}), str(copied)).close()
    assert snapshot(copied) == before  # building a run writes nothing; a clean close no lock


def test_two_runs_on_one_workdir(tmp_path, caplog):
    """Catches two runs started on one workdir both writing (rows duplicated): the second must
    refuse at once naming the first's pid and host; once the holder is killed -9 its lock is
    taken over with a warning."""
    workdir = tmp_path / "run"
    cmd = main_cmd(workdir, **{"train.steps": 100000})
    procs = [
        subprocess.Popen(
            cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        deadline = time.time() + 240
        while all(p.poll() is None for p in procs) and time.time() < deadline:
            time.sleep(0.2)
        loser = next(p for p in procs if p.poll() is not None)
        winner = next(p for p in procs if p is not loser)
        err = [line for line in loser.communicate()[1].splitlines() if line.strip()]
        assert winner.poll() is None, "the first run must keep running"
        assert loser.returncode == 2
        assert len(err) == 1, err
        assert re.fullmatch(
            rf"error: workdir {re.escape(str(workdir))} is in use by pid {winner.pid} on host "
            rf"{re.escape(socket.gethostname())} since [0-9: -]+ \(lock file "
            rf"{re.escape(str(workdir))}/lock\); wait for that run to end or use another "
            r"--workdir",
            err[0],
        ), err[0]
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stderr.close()
    assert json.loads((workdir / "lock").read_text())["pid"] == winner.pid  # left by kill -9
    with caplog.at_level(logging.WARNING):
        lock = WorkdirLock(str(workdir)).acquire()
    assert f"taking over the lock left by pid {winner.pid} on host" in caplog.text
    with pytest.raises(WorkdirError, match=r"in use by pid \d+ .*\(this process"):
        WorkdirLock(str(workdir)).acquire()  # held, here in this process
    lock.release()
    assert not (workdir / "lock").exists()


def test_truncated_newest_checkpoint_falls_back_to_the_newest_intact_one(copied, caplog):
    """Catches a truncated array file of the newest step ending the run (pages of tracebacks, no
    fallback): by default the run must warn, restore the previous step, move the bad step
    aside (never delete it), and write that step again at the next save."""
    truncate_array_files(copied / "checkpoints" / "1")
    run = train.Run(config(), str(copied))
    try:
        with caplog.at_level(logging.WARNING):
            assert run.try_restore() == 0
        assert re.search(r"checkpoint step 1 in \S+ is truncated or corrupted", caplog.text)
        assert (copied / "checkpoints" / "1.unreadable" / "state").is_dir()
        assert run.ckpt.all_steps() == [0]
        run.save(1)  # not skipped as "already saved"
        assert run.ckpt.all_steps() == [0, 1]
    finally:
        run.close()


def test_truncated_checkpoint_without_fallback_is_one_error_and_changes_nothing(copied):
    """Catches a truncated checkpoint with restore_fallback=False reported as pages of tracebacks
    that bury the CheckpointError: the error must be one line, and the workdir left as it
    was."""
    truncate_array_files(copied / "checkpoints" / "1")
    before = snapshot(copied)
    cmd = main_cmd(copied, **{"train.restore_fallback": False})
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    # the changed safe field is logged as a warning (W...), the error is one line
    err = [line for line in p.stderr.splitlines() if line.strip() and not line.startswith("W")]
    assert p.returncode == 2 and len(err) == 1, p.stderr
    assert re.fullmatch(
        rf"error: checkpoint step 1 in {re.escape(str(copied))}/checkpoints is truncated or "
        r"corrupted: ValueError: OUT_OF_RANGE: Error reading \"\S+\" in OCDBT "
        r".+; not falling back to older steps \[0\] \(train.restore_fallback=False\)",
        err[0],
    ), err[0]
    assert snapshot(copied) == before


def test_truncated_metadata_json_names_the_file_and_the_step(copied, caplog):
    """Catches a truncated checkpoint metadata JSON raising a bare JSONDecodeError: the error must
    name the file and the step (and the default run falls back to the older step)."""
    meta = copied / "checkpoints" / "1" / "metadata" / "metadata"
    with open(meta, "r+b") as f:
        f.truncate(20)
    before = snapshot(copied)
    with pytest.raises(CheckpointError) as e:
        train.Run(config(**{"train.restore_fallback": False}), str(copied))
    assert str(e.value).startswith(
        f"checkpoint step 1 in {copied}/checkpoints: its metadata file {meta} is truncated or "
        "corrupted (JSONDecodeError: "
    )
    assert snapshot(copied) == before
    run = train.Run(config(), str(copied))  # default: warn, resume from step 0
    try:
        with caplog.at_level(logging.WARNING):
            assert run.try_restore() == 0
        assert f"metadata file {meta} is truncated" in caplog.text
    finally:
        run.close()


def _small(s=0):
    return {"w": jnp.full((4, 2), float(s)), "step": jnp.int32(s)}


def test_keep_n_never_deletes_an_intact_step_while_newer_ones_are_unverified(tmp_path):
    """Catches keep-N counting any newer step (orbax's rule), which deletes the intact step a run
    restored past an unreadable newer one. Steps must count only once verified: saved and read
    back, or restored, by this process."""
    ckpt = Checkpointer(str(tmp_path), keep=2)
    for s in (1, 2, 3):
        ckpt.save(s, _small(s), {"s": s})
    assert ckpt.all_steps() == [2, 3]  # verified by this process: keep-2 as before
    ckpt.close()
    truncate_array_files(tmp_path / "3", largest_only=False)
    ckpt = Checkpointer(str(tmp_path), keep=2)  # another process: 2 and 3 are unverified
    ckpt.save(4, _small(4), {"s": 4})
    assert ckpt.all_steps() == [2, 3, 4]  # orbax's rule would have deleted 2
    ckpt.save(5, _small(5), {"s": 5})
    assert ckpt.all_steps() == [4, 5]
    ckpt.close()

    ckpt = Checkpointer(str(tmp_path), keep=1)
    truncate_array_files(tmp_path / "5", largest_only=False)
    step, state, meta = ckpt.restore_newest_intact(lambda meta: jax.eval_shape(_small))
    assert (step, meta) == (4, {"s": 4}) and float(state["w"][0, 0]) == 4.0
    ckpt.save(5, _small(5), {"s": 5})  # verified: now 4 may go
    assert ckpt.all_steps() == [5] and (tmp_path / "5.unreadable").is_dir()


def test_refused_run_names_a_holder_that_has_not_written_its_record_yet(tmp_path):
    """Catches the refusal naming "another process" when it lands between the holder's flock
    and the write of its pid / host (as when test_two_runs_on_one_workdir's two runs start
    together): the refused process must wait for the record (planted: no wait, fails)."""
    import fcntl
    import threading

    workdir = tmp_path / "run"
    workdir.mkdir()
    fd = os.open(workdir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, record not written yet
    record = {"pid": 4242, "host": "elsewhere", "since": time.time()}
    writer = threading.Timer(0.3, lambda: os.pwrite(fd, json.dumps(record).encode(), 0))
    writer.start()
    try:
        with pytest.raises(WorkdirError, match="is in use by pid 4242 on host elsewhere since"):
            WorkdirLock(str(workdir)).acquire()
    finally:
        writer.join()
        os.close(fd)

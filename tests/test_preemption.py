"""SIGTERM, what a TPU VM or SLURM sends before preemption: a checkpoint, then exit 143, and a
resume that reproduces the uninterrupted run (`ess_jax/rl/preemption.py`).

The end-to-end test runs `python -m ess_jax.main` in subprocesses sharing one persistent
compilation cache: the first compiles, the others load.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from conftest import xla_flags
from test_damaged_workdir import assert_tensorboard_holds_the_rows

from ess_jax.io.checkpoint import Checkpointer
from ess_jax.rl import preemption

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the brief's command: the quickstart's tiny config, no eval, a checkpoint every 2 steps
RUN = {
    "sft.steps": 0,
    "eval.every": 0,
    "train.checkpoint_every": 2,
    "data.prompts_per_step": 2,
    "rollout.group_size": 4,
    "rollout.max_new_tokens": 4,
    "train.steps": 16,
}
TIMING = ("tokens_per_s", "sample_s", "step_s")


def _env(cache, extra=None):
    env = {k: v for k, v in os.environ.items() if k != "ESS_JAX_VERBOSE"}
    env["XLA_FLAGS"] = xla_flags()  # one device
    env.update(extra or {})
    env.update(
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
    )
    return env


# python -m ess_jax.main whose sampling takes 0.3 s more per step, so that a SIGTERM sent once
# a few rows are written lands mid-run, not after its end
SLOW_MAIN = """
import time
from absl import app
from ess_jax import main
from ess_jax.rl import rollout
collect = rollout.collect
rollout.collect = lambda *a, **k: (time.sleep(0.3), collect(*a, **k))[1]
app.run(main.main, flags_parser=main._parse_flags)
"""


def _start(workdir, cache, slow=False, env=None, **extra):
    """The run on `workdir` (RUN's overrides, then `extra`'s, dots as "__"; `env`: more
    environment), its stderr (progress bars, warnings, the last line) in `<workdir>.err`."""
    overrides = {**RUN, **{k.replace("__", "."): v for k, v in extra.items()}}
    args = [f"--config.{k}={v}" for k, v in overrides.items()]
    entry = ["-c", SLOW_MAIN] if slow else ["-m", "ess_jax.main"]
    with open(f"{workdir}.err", "a") as err:
        return subprocess.Popen(
            [sys.executable, *entry, "--config=configs/quickstart.py:tiny", *args]
            + [f"--workdir={workdir}"],
            cwd=ROOT,
            env=_env(cache, env),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def _err(workdir, start: int = 0) -> str:
    """The run's stderr from byte `start` on, progress bars left out."""
    with open(f"{workdir}.err", "rb") as f:
        lines = f.read()[start:].decode().replace("\r", "\n").splitlines()
    return "\n".join(ln for ln in lines if ln.strip() and not ln.startswith("rl:"))


def _rows(workdir):
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines(keepends=True)
    return [json.loads(line) for line in lines if line.endswith("\n")]


def _strip(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _signal_mid_run(workdir, cache, rows: int, sig, wait_s: float, **start):
    """Starts the slowed run on `workdir`, sends `sig` once `rows` rows are written, and
    returns its exit code (negative: killed by that signal)."""
    p = _start(workdir, cache, slow=True, **start)
    try:
        deadline = time.monotonic() + 300
        while len(_rows(workdir)) < rows:
            assert p.poll() is None and time.monotonic() < deadline, _err(workdir)
            time.sleep(0.05)
        p.send_signal(sig)
        p.wait(timeout=wait_s)
    finally:
        p.kill()
    return p.returncode


def _run_to_end(workdir, cache, **start) -> None:
    """Runs (or resumes) the run on `workdir` to its end; it must exit 0."""
    p = _start(workdir, cache, **start)
    try:
        assert p.wait(timeout=300) == 0, _err(workdir)
    finally:
        p.kill()


def _small(s):
    return {"w": jnp.full((4, 2), float(s)), "step": jnp.int32(s)}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl_c"])
def test_signal_is_held_through_a_checkpoint_save_and_raised_at_the_step_end(
    tmp_path, monkeypatch, sig
):
    """Catches a SIGTERM or Ctrl-C that stops a checkpoint save halfway (the step never commits;
    here the signal lands as orbax's save starts; a Ctrl-C did so before it had a handler, with
    an orbax thread's traceback): outside `interruptible()` it must be held, the save complete,
    and `check()` raise Preempted with 128 + the signal as exit code; inside `interruptible()`
    it raises at once. Ctrl-C must also give SIGINT its default action back (a second Ctrl-C
    ends the process at once), and the previous handlers be back afterwards."""
    ckpt = Checkpointer(str(tmp_path), keep=None)
    real_save = ocp.CheckpointManager.save

    def save_hit_by_a_signal(*args, **kwargs):
        os.kill(os.getpid(), sig)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save_hit_by_a_signal)
    before = signal.getsignal(sig)
    try:  # a KeyboardInterrupt escaping a test would stop the whole session
        with preemption.on_stop_signals():
            try:
                assert ckpt.save(1, _small(1), {"s": 1})
            except KeyboardInterrupt:
                pytest.fail("the signal stopped the save")
            assert ckpt.all_steps() == [1]  # committed, despite the signal
            if sig == signal.SIGINT:
                assert signal.getsignal(sig) is signal.SIG_DFL
            with pytest.raises(KeyboardInterrupt) as e:
                preemption.check()
            assert isinstance(e.value, preemption.Preempted) and e.value.exit_code == 128 + sig
            preemption.check()  # raised once
        with preemption.on_stop_signals():
            with pytest.raises(KeyboardInterrupt) as e, preemption.interruptible():
                os.kill(os.getpid(), sig)
                time.sleep(5)  # not reached: the handler raises first
            assert isinstance(e.value, preemption.Preempted) and e.value.exit_code == 128 + sig
    except KeyboardInterrupt as e:
        pytest.fail(f"a KeyboardInterrupt escaped: {e!r}")
    assert signal.getsignal(sig) is before
    ckpt.close()


# format reward: the untrained tiny model earns it on some groups, so the adapters get gradients
# (addition earns nothing without SFT, and a zero gradient never exercises the optimizer state)
# dropout 0.1: its masks come from the seed and the update count, so a resume redraws them
LORA_LAG = {
    "model__lora__rank": 4,
    "model__lora__dropout": 0.1,
    "rollout__lag": 2,
    "optim__lr": 5e-3,
    "train__steps": 10,
    "task__reward": "format",
}


def _stopped_by(workdir, cache, rows: int, sig, **start) -> int:
    """Stops the run on `workdir` with `sig` once `rows` rows are written; checks it exits with
    128 + sig, one `stopped:` line last and no traceback, its checkpoint at the rows written
    (no step lost or repeated) and no lock left. Returns the checkpoint's step."""
    before = os.path.getsize(f"{workdir}.err") if os.path.exists(f"{workdir}.err") else 0
    rc = _signal_mid_run(workdir, cache, rows, sig, 120, **start)
    err = _err(workdir, before)
    name = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}[sig]
    assert rc == 128 + sig, (rc, err)
    assert "Traceback" not in err and [ln for ln in err.splitlines() if "stopped:" in ln] == [
        f"stopped: {name}: the checkpoint is written; rerun the same command to resume"
    ], err
    assert err.strip().splitlines()[-1].startswith("stopped: "), err
    saved = Checkpointer(str(workdir / "checkpoints")).latest_step()
    assert saved == len(_rows(workdir)) and rows <= saved, (saved, len(_rows(workdir)))
    assert not (workdir / "lock").exists()
    return saved


def test_sigterm_ctrl_c_then_kill_9_of_a_lora_lag_2_run_each_resume_exactly(tmp_path):
    """One LoRA run with lag 2, stopped three times and resumed three times (what its resume
    needs: the adapters' optimizer state and the lag-2 history of adapter snapshots). Catches:
    - SIGTERM or Ctrl-C killing the run at once (rc 143 or 130 with no checkpoint past the last
      periodic one, as before their handlers; Ctrl-C ended in a KeyboardInterrupt traceback), a
      checkpoint that loses or repeats a step (the saved step must equal the rows written), an
      exit that is not one `stopped:` line with 143 / 130 and no traceback, a lock left behind;
    - a kill -9 of the resumed run (no handler runs) that leaves it unresumable: the lock must
      be taken over and rows written after the last checkpoint not kept twice, in
      metrics.jsonl or in TensorBoard's events (killed at an odd row count, the row of the last
      checkpoint's step is written again by the resume);
    - a resume that loses the optimizer state or the history, or draws other LoRA dropout
      masks: the final rows must equal an uninterrupted run's, timing aside."""
    cache, cut, full = tmp_path / "jax_cache", tmp_path / "cut", tmp_path / "full"
    _run_to_end(full, cache, **LORA_LAG)  # compiles into the cache the others load from
    saved = _stopped_by(cut, cache, 3, signal.SIGTERM, **LORA_LAG)
    saved = _stopped_by(cut, cache, saved + 2, signal.SIGINT, **LORA_LAG)
    assert saved < 8, saved

    # the resume, killed once an odd number of rows is written: the checkpoint before its last
    # row is (the periodic ones are at even steps), the one after it not yet
    rows = saved + 1 if saved % 2 == 0 else saved + 2
    assert _signal_mid_run(cut, cache, rows, signal.SIGKILL, 60, **LORA_LAG) == -signal.SIGKILL
    saved = Checkpointer(str(cut / "checkpoints")).latest_step()
    assert saved is not None and rows - 1 <= saved < 10, saved
    assert (cut / "lock").exists()  # kill -9 leaves the lock: the resume must take it over

    _run_to_end(cut, cache, **LORA_LAG)
    assert len(_rows(full)) == 10 and _rows(full)[-1]["policy_lag"] == 2
    assert _strip(_rows(cut)) == _strip(_rows(full))
    assert_tensorboard_holds_the_rows(cut)


ASYNC = {"train__mode": "async", "rollout__max_lag": 2, "train__steps": 10}


def test_kill_9_of_an_async_run_resumes_with_each_step_once(tmp_path):
    """Catches an async run that a kill -9 (sampler mid-draw, trainer mid-step or mid-push of
    params, sync_every 1: a push every step) leaves unresumable, or whose resume loses or
    repeats a step: the rerun must finish with rows for steps 0-9, each once, in order, every
    batch within the lag bound, and TensorBoard's events those rows, each once. (Async lags
    depend on timing, so rows are not compared with an uninterrupted run's; the prompts each
    step takes are checked in tests/test_actor_learner.py.)"""
    cache, cut = tmp_path / "jax_cache", tmp_path / "cut"
    devices = {"XLA_FLAGS": xla_flags(2)}
    # after 5 rows: step 4's checkpoint is written, steps past it maybe
    rc = _signal_mid_run(cut, cache, 5, signal.SIGKILL, 60, env=devices, **ASYNC)
    assert rc == -signal.SIGKILL
    saved = Checkpointer(str(cut / "checkpoints")).latest_step()
    assert saved is not None and 2 <= saved < 10, saved

    _run_to_end(cut, cache, env=devices, **ASYNC)
    rows = [r for r in _rows(cut) if "reward_mean" in r]
    assert [r["step"] for r in rows] == list(range(10))
    assert all(0 <= r["lag_max"] <= 2 for r in rows), [r["lag_max"] for r in rows]
    assert_tensorboard_holds_the_rows(cut)

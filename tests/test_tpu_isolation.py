"""ess_jax/memory/tpu.py's compile_isolated: the compiler's own crash (a signal that kills the
compiling process, as libtpu's stack overflow on E3's sampler prefill for tpu7x-8 does) is a
row of the record, the other programs' rows kept.

A stand-in worker (a few lines of Python that speak compile_run's progress protocol) dies of
SIGSEGV on one program, on its way out, of SIGKILL, or of a Python error; the real worker,
tools/compile_tpu.py --worker, is what test_compile_tpu.py's v5e record compiles through.
"""

import sys

import pytest

from ess_jax.memory import tpu

WORKER = r"""
import json, os, signal, sys

state = json.load(open(sys.argv[-1].split("=", 1)[1]))
names = ["rl_step", "sampler_copy", "sample/prefill", "sample/decode8", "eval/prefill"]
todo = state["only"] or names
if state["only"]:  # a restart compiles the inputs of what it is given: the copy again
    todo = todo + ["sampler_copy"]
mode, crash_on = os.environ["MODE"], os.environ.get("CRASH_ON")
with open(os.environ["RUNS"], "a") as f:
    f.write(json.dumps(state["only"]) + "\n")

def report(event):
    with open(state["progress"], "a") as f:
        f.write(json.dumps(event) + "\n")

report({"programs": [n for n in names if n in todo]})
for name in (n for n in names if n in todo):
    if name in state["skip"]:
        report({"row": name, "compiler_bytes": None, "planner_bytes": 1.0, "beside_bytes": 0.0,
                "loop_trips": 1, "compile_seconds": 0.0, "error": state["skip"][name]})
        continue
    report({"start": name})
    if name == crash_on and mode == "segv":
        print("*** SIGSEGV STACK OVERFLOW received by PID 7 (TID 9); stack trace: ***\n"
              "PC: @ 0x7fc649593c5b (unknown) xla::TransferSizeUtil::UpdateLeafLayout()\n"
              "    @ 0x7fc64d00cfd3 1888 FailureSignalHandler()\n"
              "  @ 0x7fc63fe1aebd 1472 xla::SpatialMajorConvolution::CalculateClassicWindowCost()\n"
              "E1207 coredump_hook.cc:349] RAW: Skipping coredump", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    if name == crash_on and mode == "kill":  # the host's out-of-memory killer
        os.kill(os.getpid(), signal.SIGKILL)
    if name == crash_on and mode == "raise":
        raise RuntimeError("memory_analysis failed")
    value = 99.0 if state["only"] and name == "sampler_copy" else 10.0 + names.index(name)
    report({"row": name, "compiler_bytes": value, "planner_bytes": 11.0, "beside_bytes": 0.0,
            "loop_trips": 1, "compile_seconds": 0.5, "memory": {"argument": value}})
if mode == "segv_at_exit":  # every row reported, then a crash on the way out
    os.kill(os.getpid(), signal.SIGSEGV)
"""


@pytest.fixture
def worker(tmp_path, monkeypatch):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    monkeypatch.setenv("RUNS", str(tmp_path / "runs.jsonl"))
    return [sys.executable, str(path)], tmp_path / "runs.jsonl"


def test_a_compiler_crash_is_a_row_and_the_rest_compile(worker, monkeypatch):
    """Catches a crash of the compiler that loses every row (the record never written), a
    crashed program that is not named with its signal and where the compiler crashed (the
    failure handler's report, not the coredump lines libtpu prints after it), a restart that
    compiles the crashed program again (a loop of crashes), compiles what already compiled
    other than its inputs, or lets an input's second compile replace its first row, and rows
    out of the run's order."""
    command, runs = worker
    monkeypatch.setenv("MODE", "segv")
    monkeypatch.setenv("CRASH_ON", "sample/prefill")
    logged = []
    rows = tpu.compile_isolated(command, log=logged.append)
    names = ["rl_step", "sampler_copy", "sample/prefill", "sample/decode8", "eval/prefill"]
    assert list(rows) == names
    crash = rows["sample/prefill"]
    assert crash.compiler_bytes is None and "died of SIGSEGV" in crash.error
    # the report's line and its named frames, innermost first, not the last stderr lines
    assert crash.error.endswith(
        "*** SIGSEGV STACK OVERFLOW received by PID 7 (TID 9); stack trace: *** at "
        "xla::TransferSizeUtil::UpdateLeafLayout() < "
        "xla::SpatialMajorConvolution::CalculateClassicWindowCost()"
    )
    # the copy's first row stands (its restart compile reported 99)
    assert [rows[n].compiler_bytes for n in names if n != "sample/prefill"] == [
        10.0, 11.0, 13.0, 14.0,
    ]  # fmt: skip
    assert rows["rl_step"].memory == {"argument": 10.0}
    # the second child compiles what is left, the crashed one a row it is handed
    assert runs.read_text().splitlines() == [
        "null",
        '["sample/prefill", "sample/decode8", "eval/prefill"]',
    ]
    assert len(logged) == 1 and logged[0].startswith("sample/prefill: the compiler crashed")
    assert tpu.peak_bytes(rows) == 14.0


def test_a_crash_on_the_way_out_loses_no_row(worker, monkeypatch):
    """Catches a child that reports every row and then dies (a fault in libtpu's teardown)
    read as a failure that discards the rows."""
    command, runs = worker
    monkeypatch.setenv("MODE", "segv_at_exit")
    rows = tpu.compile_isolated(command, log=lambda _: None)
    assert [r.compiler_bytes for r in rows.values()] == [10.0, 11.0, 12.0, 13.0, 14.0]
    assert runs.read_text().splitlines() == ["null"]


@pytest.mark.parametrize(
    "mode, words",
    [
        ("kill", "exited with SIGKILL"),
        ("raise", "status 1: .*RuntimeError: memory_analysis failed"),
    ],
)
def test_a_death_that_is_not_the_compilers_is_an_error_not_a_row(worker, monkeypatch, mode, words):
    """Catches the host's out-of-memory kill (SIGKILL) or a Python error after a compile
    (reading its memory analysis) recorded as the compiler's verdict on that program (a
    row, the record then committed as a result) instead of an error."""
    command, _ = worker
    monkeypatch.setenv("MODE", mode)
    monkeypatch.setenv("CRASH_ON", "sample/prefill")
    with pytest.raises(tpu.WorkerError, match=words):
        tpu.compile_isolated(command, log=lambda _: None)


def test_a_crash_outside_a_compile_is_an_error_not_a_row():
    """Catches a child that dies before compiling anything (a broken install, a bad config)
    read as a compiler crash of some program, or retried forever."""
    command = [sys.executable, "-c", "import sys; print('no libtpu here', file=sys.stderr); "
               "sys.exit(3)"]  # fmt: skip
    with pytest.raises(tpu.WorkerError, match="status 3: no libtpu here") as e:
        tpu.compile_isolated(command, log=lambda _: None)
    assert e.value.returncode == 3 and e.value.last_line == "no libtpu here"


def test_a_program_whose_input_did_not_compile_says_so():
    """Catches a decode segment whose prefill crashed (skipped) failing with a bare KeyError
    ('sample/prefill') in place of a row that names the program it needed."""
    from ess_jax.config.defaults import base_config

    c = base_config()
    c.model.num_layers, c.data.buckets, c.rollout.max_new_tokens = 1, (16,), 4
    c.data.prompts_per_step, c.rollout.group_size = 4, 2
    skip = {"sample/prefill": "the compiler crashed"}
    rows = tpu.compile_run(c, tpu.topology_devices("v5e:2x2"), log=lambda _: None,
                           only=["sample/decode4"], skip=skip)  # fmt: skip
    assert rows["sample/prefill"].error == "the compiler crashed"
    assert rows["sample/decode4"].error == (
        "not compiled: it takes sample/prefill's output, which did not compile"
    )

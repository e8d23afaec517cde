"""A run's programs compiled for a TPU slice on any host: the TPU compiler's memory and cost.

With libtpu installed (`bash tools/install.sh --tpu`), `jax.experimental.topologies` describes
a TPU slice on a CPU host (`topology_devices`); a mesh over those abstract devices and inputs
carrying NamedShardings on it let `jax.jit(f).lower(...).compile()` run the TPU compiler, which
lays out each program's buffers (`compiled.memory_analysis()`: argument, output, temporary
and alias bytes per device) and estimates its cost (`compiled.cost_analysis()`: flops, bytes
accessed, and `optimal_seconds`, the compiler's own time estimate: an estimate, never a
measurement; it can be negative or meaningless, so `compile_run` passes it on as given).

Traps the numbers carry (measured with libtpu 0.0.42.1):
  - a loop body (`lax.scan`, `while_loop`) is counted once in cost_analysis, not per trip:
    each row says its `loop_trips` (programs.Program);
  - Pallas kernels are custom calls that cost_analysis does not count;
  - libtpu takes a lock file (/tmp/libtpu_lockfile) so that one process owns a real TPU; a
    second compiling process fails with "multi-process lockfile". Compiling ahead of time uses
    no TPU, so `topology_devices` sets ALLOW_MULTIPLE_LIBTPU_LOAD=1 (two test workers, or a
    compile beside a run, would otherwise refuse each other);
  - a program whose buffers exceed the device's HBM is refused by the compiler
    (RESOURCE_EXHAUSTED: "... exceeds available HBM (15.75G)" on v5e): a row with that message.

`compile_run(config, devices)` compiles every `programs.run_programs` program and returns one
row per program; a program the compiler refuses is a row with its message, not a traceback.
`compile_isolated` runs it in child processes, so that a compiler that crashes the process
(libtpu's SIGSEGV on E3's sampler prefill for tpu7x-8) leaves a row too.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import signal
import subprocess
import tempfile
import time

import numpy as np

from ess_jax.memory import programs as programs_lib
from ess_jax.parallel import sharding as sharding_lib


class TopologyError(ValueError):
    """libtpu is missing or does not know the topology name."""


def topology_devices(name: str) -> list:
    """The abstract TPU devices of topology `name` (e.g. "v5p:2x2x1", "v5e:4x4"), one per
    device a TPU VM shows: on v4, one per megacore chip (libtpu's chip config "megacore"; its
    default describes each of a v4 chip's two TensorCores as a device: 8 for v4:2x2x1)."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no TPU is used (above)
    from jax.experimental import topologies

    extra = {"chip_config_name": "megacore"} if name.split(":")[0] == "v4" else {}
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=name, **extra)
        return list(desc.devices)
    except Exception as e:  # libtpu's errors are RuntimeError / XlaRuntimeError
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "libtpu" in text.lower() or "Unknown backend" in text or "tpu" not in text.lower():
            text += " (is libtpu installed? bash tools/install.sh --tpu)"
        raise TopologyError(f"topology {name!r}: {text}") from e


@dataclasses.dataclass
class Row:
    """One compiled program: per-device bytes as the planner counts them (arguments + outputs +
    temporaries - aliases), the compiler's cost, or the compiler's refusal."""

    compiler_bytes: float | None
    planner_bytes: float | None
    beside_bytes: float
    flops: float | None
    bytes_accessed: float | None
    optimal_seconds: float | None
    loop_trips: int
    compile_seconds: float
    error: str | None = None
    memory: dict | None = None  # argument / output / temp / alias bytes
    collectives: dict | None = None  # `collective_bytes`: kind -> bytes per device
    loop_collectives: dict | None = None  # the part of them inside loop bodies (per trip)

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, fields: dict) -> Row:
        """The Row that `to_json` wrote (its None fields left out)."""
        return cls(**{f.name: fields.get(f.name) for f in dataclasses.fields(cls)})


def memory_bytes(compiled) -> tuple[float, dict]:
    m = compiled.memory_analysis()
    parts = {
        "argument": m.argument_size_in_bytes,
        "output": m.output_size_in_bytes,
        "temp": m.temp_size_in_bytes,
        "alias": m.alias_size_in_bytes,
    }
    return float(parts["argument"] + parts["output"] + parts["temp"] - parts["alias"]), parts


# Collective ops of XLA's optimized HLO; TPU's fused all-reduce + scatter counts as reduce-scatter.
_COLLECTIVES = {"all-gather": "all-gather", "reduce-scatter": "reduce-scatter",
                "all-reduce-scatter": "reduce-scatter", "all-reduce": "all-reduce",
                "all-to-all": "all-to-all", "collective-permute": "collective-permute"}  # fmt: skip
_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(?P<shape>.*?)\s(?P<op>" + "|".join(
        sorted(_COLLECTIVES, key=len, reverse=True)) + r")(?P<start>-start)?\("
)  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5,
          "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8,
          "s64": 8, "u64": 8}  # fmt: skip


_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s")
_CALLEE = re.compile(  # calls=, body=, condition=, to_apply=, branch_computations={...}
    r"\b(?:calls|body|condition|to_apply|\w+_computations?)=\{?([^}\s,]+(?:,\s*%[\w.\-]+)*)"
)
_BODY = re.compile(r"\bbody=%([\w.\-]+)")


def _loop_computations(hlo_text: str) -> set[str]:
    """The computations of a module that run inside a while loop's body: each body and
    everything it calls, transitively."""
    callees: dict[str, set[str]] = collections.defaultdict(set)
    bodies, name = set(), None
    for line in hlo_text.splitlines():
        head = _HEADER.match(line)
        if head:
            name = head.group(1)
            continue
        for group in _CALLEE.findall(line):
            callees[name].update(c.strip().lstrip("%") for c in group.split(","))
        bodies.update(_BODY.findall(line))
    inside, todo = set(), list(bodies)
    while todo:
        c = todo.pop()
        if c not in inside:
            inside.add(c)
            todo.extend(callees.get(c, ()))
    return inside


def collective_bytes(hlo_text: str, in_loops: bool | None = None) -> dict[str, float]:
    """Bytes per device each kind of collective produces in an optimized (SPMD-partitioned,
    per-device) HLO module: the result arrays of every collective instruction, each
    computation counted once (a loop body once, not per trip: Row.loop_trips), an async
    `-start` by its last result array (its output; the first is its operand). `in_loops`
    True: only the collectives inside while-loop bodies (each runs once per trip); False:
    only those outside; None: all."""
    loops = _loop_computations(hlo_text) if in_loops is not None else set()
    out: collections.Counter = collections.Counter()
    name = None
    for line in hlo_text.splitlines():
        head = _HEADER.match(line)
        if head:
            name = head.group(1)
            continue
        m = _OP.match(line)
        if not m or (in_loops is not None and (name in loops) != in_loops):
            continue
        arrays = _ARRAY.findall(m["shape"])
        if m["start"]:
            arrays = arrays[-1:]
        for dtype, dims in arrays:
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            out[_COLLECTIVES[m["op"]]] += n * _BYTES.get(dtype, 4)
    return dict(out)


def _cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older jax: one dict per partition
        cost = cost[0] if cost else {}
    return cost or {}


def compile_run(config, devices, log=print, only=None, skip=None, progress=None) -> dict[str, Row]:
    """name -> Row for every program of `config` on `devices` with the config's mesh (or for
    those named in `only`, with the programs their inputs need, e.g. a decode segment's
    prefill). `skip`: name -> message of programs not to compile, each a row with that
    message (the compiler crashed on it in an earlier process: `compile_isolated`).
    `progress`: a file that gets one JSON line with every program's name, then one before
    each compile and one with each row after it (what `compile_isolated` reads when the
    process dies)."""
    mesh = sharding_lib.make_mesh(dict(config.mesh), devices)
    compiled: dict = {}
    rows: dict[str, Row] = {}
    skip = skip or {}
    progs = programs_lib.run_programs(config, mesh)
    if only is not None:
        unknown = set(only) - {p.name for p in progs}
        if unknown:
            raise ValueError(f"no program {sorted(unknown)}; this run's: {[p.name for p in progs]}")
        needed = set(only) | {n.split("/")[0] + "/prefill" for n in only if "/decode" in n}
        needed |= {p.name for p in progs if p.name.startswith(("sampler_copy", "lora_merge"))
                   and any(n.startswith(("sample/", "eval/")) for n in needed)}  # fmt: skip
        needed |= {p.name for p in progs if p.name.startswith("external/sampler_copy")
                   and any(n.startswith(("external/prefill", "external/decode"))
                           for n in needed)}  # fmt: skip
        progs = [p for p in progs if p.name in needed]
    _report(progress, {"programs": [p.name for p in progs]})

    def record(name: str, row: Row) -> None:  # the row, also in `progress`
        rows[name] = row
        _report(progress, {"row": name, **row.to_json()})

    for program in progs:
        t0 = time.perf_counter()
        if program.name in skip:
            record(program.name, _error_row(program, 0.0, skip[program.name]))
            log(f"{program.name}: not compiled: {skip[program.name][:200]}")
            continue
        _report(progress, {"start": program.name})
        try:
            c = program.lower(compiled).compile()
        except Exception as e:  # the compiler's refusal is a result, not a crash
            msg = " ".join(str(e).split())[:2000] or type(e).__name__
            missing = e.args[0] if isinstance(e, KeyError) and e.args else None
            if isinstance(missing, str) and missing in rows and missing not in compiled:
                msg = f"not compiled: it takes {e.args[0]}'s output, which did not compile"
            record(program.name, _error_row(program, time.perf_counter() - t0, msg))
            log(f"{program.name}: compile error: {msg[:200]}")
            continue
        compiled[program.name] = c
        total, parts = memory_bytes(c)
        cost, hlo = _cost(c), c.as_text()
        record(program.name, Row(
            total, program.planner_bytes, program.beside_bytes, cost.get("flops"),
            cost.get("bytes accessed"), cost.get("optimal_seconds"), program.loop_trips,
            time.perf_counter() - t0, memory=parts, collectives=collective_bytes(hlo),
            loop_collectives=collective_bytes(hlo, in_loops=True),
        ))  # fmt: skip
        log(f"{program.name}: {total / 1e9:.3f} GB per device, compiled in "
            f"{rows[program.name].compile_seconds:.1f} s")  # fmt: skip
    return rows


def _error_row(program, seconds: float, message: str) -> Row:
    return Row(
        None, program.planner_bytes, program.beside_bytes, None, None, None,
        program.loop_trips, seconds, message,
    )  # fmt: skip


def _report(path: str | None, event: dict) -> None:
    if path is not None:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


class WorkerError(RuntimeError):
    """A compiling process failed outside any program's compile: its exit status and the
    last line of its stderr (a tool's one-line `error: ...` on a mistake)."""

    def __init__(self, returncode: int, last_line: str, tail: str):
        super().__init__(f"the compiling process exited with {_exit(returncode)}: {tail}")
        self.returncode, self.last_line = returncode, last_line


# Signals by which the compiler itself ends its process (a fault, a failed check's abort);
# a SIGKILL (the host's out-of-memory killer), SIGTERM or SIGINT is not the compiler's verdict
# on a program, so it ends compile_isolated instead of becoming a row.
CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGFPE, signal.SIGILL)


def compile_isolated(command: list[str], log=print, only=None) -> dict[str, Row]:
    """The rows of `compile_run`, compiled in child processes so that a crash of the compiler
    itself (libtpu 0.0.42.1 overflows its stack compiling E3's sampler prefill for tpu7x-8 and
    the process dies of SIGSEGV) is a row, not the loss of every row. `command` runs
    `compile_run` with `--worker=STATE` appended, STATE a JSON file of its `only`, `skip` and
    `progress` arguments (tools/compile_tpu.py). When a child dies of one of CRASH_SIGNALS
    inside a compile, the program it was compiling becomes a row with the signal and the
    crash report of the child's stderr (`crash_report`; else its last lines), and a new child
    compiles the programs left (with those their inputs need, whose first rows stand), that
    one skipped. Any other failure raises WorkerError."""
    rows: dict[str, Row] = {}
    skip: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        state, progress = os.path.join(tmp, "state.json"), os.path.join(tmp, "progress.jsonl")
        err_path = os.path.join(tmp, "stderr")
        names = None
        while True:
            with open(state, "w") as f:
                json.dump({"only": only, "skip": skip, "progress": progress}, f)
            open(progress, "w").close()
            with open(err_path, "w") as err:
                rc = subprocess.run([*command, f"--worker={state}"], stderr=err).returncode
            listed, started = _read_progress(progress, rows)
            names = names or listed
            done = names is not None and all(n in rows for n in names)
            if rc == 0 or done:  # every row reported (a crash on the way out loses none)
                if not done:
                    raise WorkerError(rc, "", "it reported no rows of its programs")
                return {n: rows[n] for n in names}
            tail = _tail(err_path)
            if started is None or -rc not in CRASH_SIGNALS:  # not the compiler's crash
                raise WorkerError(rc, _tail(err_path, lines=1), tail)
            skip[started] = (
                f"the compiler crashed: the compiling process died of {_exit(rc)} compiling "
                f"this program: {crash_report(err_path) or 'its last stderr lines: ' + tail}"
            )
            log(f"{started}: {skip[started][:200]}")
            only = [n for n in names if n not in rows or n in skip]


def _read_progress(path: str, rows: dict[str, Row]) -> tuple[list | None, str | None]:
    """(the programs a child listed, the one it started and did not finish) from its progress
    file, each reported row added to `rows` unless one stands there already (a restarted
    child compiles its inputs again); a last line cut short by the child's death is skipped."""
    names = started = None
    with open(path) as f:
        for line in f:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                break
            names = event.get("programs", names)
            started = event.get("start", started)
            if "row" in event:
                name = event.pop("row")
                if name not in rows:
                    rows[name] = Row.from_json(event)
                started = None if name == started else started
    return names, started


def _exit(rc: int) -> str:
    """A child's return code in words: a signal's name or the exit status."""
    if rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"
    return f"status {rc}"


_FATAL = re.compile(r"^\*\*\* SIG|Check fail")  # a crash report's first line
_FRAME = re.compile(r"^(?:PC:\s*)?@\s+0x[0-9a-f]+\s+\S+\s+(?P<symbol>\S.*)$")


def crash_report(path: str, frames: int = 14) -> str | None:
    """The crash in a dead process's stderr (`path`), in one line: the failure signal
    handler's report line ("*** SIGSEGV STACK OVERFLOW ... received by PID ...") and the
    innermost `frames` named frames of its stack trace; None where stderr holds no report."""
    text = _lines(path)
    starts = [i for i, line in enumerate(text) if _FATAL.search(line)]
    if not starts:
        return None
    symbols = []
    for line in text[starts[-1] + 1 :]:
        m = _FRAME.match(line)
        if m and "(unknown)" not in m["symbol"] and "SignalHandler" not in m["symbol"]:
            symbols.append(m["symbol"])
    return f"{text[starts[-1]]} at {' < '.join(symbols[:frames])}"


def _lines(path: str) -> list[str]:
    """A stderr file's non-blank lines, stripped."""
    with open(path, errors="replace") as f:
        return [line.strip() for line in f if line.strip()]


def _tail(path: str, lines: int = 6, chars: int = 1500) -> str:
    return " | ".join(_lines(path)[-lines:])[-chars:] or "(none)"


def peak_bytes(rows: dict[str, Row]) -> float:
    """The run's per-device peak: the largest compiled program plus what the run holds beside
    it (programs.Program.beside_bytes); NaN-free, refused programs left out."""
    ok = [r.compiler_bytes + r.beside_bytes for r in rows.values() if r.compiler_bytes is not None]
    return float(max(ok)) if ok else float("nan")


def device_count(devices) -> tuple[int, int]:
    """(devices, hosts) of a device list."""
    return len(devices), len({d.process_index for d in devices})


def planner_error(row: Row) -> float | None:
    """(planner - compiler) / compiler, or None where either is missing."""
    if row.compiler_bytes is None or row.planner_bytes is None or not row.compiler_bytes:
        return None
    return float(np.float64(row.planner_bytes - row.compiler_bytes) / row.compiler_bytes)

"""Compiles a run's programs for a TPU slice on this (CPU) host: the TPU compiler's per-device
bytes and cost beside the memory planner's, without a TPU.

    bash tools/install.sh --tpu          # libtpu, the TPU compiler
    .venv/bin/python tools/compile_tpu.py --config=configs/paper/e3_temperature_1p2.py:p3o,v5p-8 \\
        --json=results/tpu/e3_p3o_v5p-8.json
    .venv/bin/python tools/compile_tpu.py --config=configs/quickstart.py --topology=v5e:2x2
    .venv/bin/python tools/compile_tpu.py --markdown --write=docs/tpu.md   # table from results/tpu

Builds every program a run of the config executes (ess_jax/memory/programs.py: the RL step,
the scoring pass, the SFT step, the train -> sample reshard, the sampler copy or LoRA merge,
the sampler's prefill and each decode segment, eval's), with abstract inputs (no weights
loaded: the model's shapes from KNOWN_MODELS or a config.json) on the devices of the preset's
topology (`presets.PRESETS[...].topology`) or of --topology, on the config's mesh, and
compiles each with the TPU compiler (ess_jax/memory/tpu.py). A program the compiler refuses
is a row with its message. The compiles run in a child process of this tool (--worker,
tpu.compile_isolated), so that a crash of the compiler itself (libtpu's SIGSEGV on E3's
sampler prefill for tpu7x-8) is a row too, with the signal and the compiler's crash report
(its last stderr lines where it printed none), and a new child compiles the programs left;
--in-process compiles in this process (a child's start saved, a crash then loses every row).
--json writes
`{"topology", "hbm_bytes", "fits", "programs": {name: {"compiler_bytes", "planner_bytes",
"flops", "bytes_accessed", "optimal_seconds", ...}}}`: compiler_bytes are arguments + outputs +
temporaries - aliases per device, as the planner counts; `fits` is whether every program
compiled and the largest, with what the run holds beside it (`beside_bytes`), stays within
presets.MEM_FRACTION of the device's HBM. Times are the compiler's estimates, never
measurements; flops and bytes count a loop body once (`loop_trips` says how often it runs).
Large programs take minutes each on two cores (a Qwen3-4B RL step: 5-10). --layers=N compiles
(and plans) the model's first N layers only, for a program too large to compile whole on a
host (Qwen3-30B-A3B's 48-layer RL step takes about 41 GB of host memory while compiling).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu compiles; nothing runs on a TPU
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # config files import configs.*
    sys.path.insert(0, ROOT)

from tpu_table import BEGIN, END, markdown_table, read_records  # noqa: E402  (tools/)

from ess_jax.config import presets  # noqa: E402
from ess_jax.config.schema import EXIT_USER_ERROR, UserError, user_exit  # noqa: E402


def preset_of(spec: str) -> presets.Preset | None:
    """The preset named after the arm of FILE:ARM,PRESET, if any."""
    name = spec.partition(":")[2].split(",")[-1]
    return presets.PRESETS.get(name)


def sliced(config, layers: int):
    """`config` with its model cut to its first `layers` layers: model.source becomes a
    directory holding only that slice's config.json (the checkpoint's, or KNOWN_MODELS' by the
    directory's name, with num_hidden_layers = `layers`), for a program too large to compile
    whole on the host at hand. The planner plans the same slice."""
    source = str(config.model.source).rstrip("/")
    name = os.path.basename(source)
    path = os.path.join(source, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            hf = json.load(f)
    elif name in presets.KNOWN_MODELS:
        hf = dict(presets.KNOWN_MODELS[name])
    else:
        raise UserError(f"--layers: {source!r} has no config.json and is not a known model")
    hf["num_hidden_layers"] = layers
    folder = os.path.join(tempfile.gettempdir(), f"compile_tpu_{layers}_layers", name)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f)
    config.model.source = folder
    return config


def overridden(config, settings):
    """`config` with each "dotted.field=value" of `settings` set (the value a Python literal,
    else a string), checked as the run checks its config (`schema.check_rules`)."""
    from ess_jax.config import names, schema

    for item in settings or ():
        field, eq, text = item.partition("=")
        if not eq:
            raise ValueError(f"--set {item!r}: not dotted.field=value")
        if names.lookup(names.as_dict(config), field) is names.MISSING:
            raise ValueError(f"--set {item!r}: config has no field {field!r}")
        names.assign(config, field, names.literal(text))
    schema.check_rules(config)
    return config


def load(spec: str, topology: str | None, layers=None, settings=()):
    """(config, refused_by_config, topology, devices) of --config=`spec` on `topology`
    (default: its preset's), with `layers` (`sliced`) and `settings` (`overridden`)."""
    import plan_memory  # tools/plan_memory.py: config loading as the planner does it

    from ess_jax.memory import tpu
    from ess_jax.parallel import sharding

    config, refused = plan_memory.load_planned(spec)
    config = overridden(config, settings)
    if layers:
        config = sliced(config, layers)
    preset = preset_of(spec)
    topology = topology or (preset.topology if preset else None)
    if topology is None:
        raise UserError(f"--config={spec}: no TPU preset after the arm; pass --topology=NAME")
    devices = tpu.topology_devices(topology)
    n, _ = tpu.device_count(devices)
    if preset is not None and preset.topology == topology and n != preset.num_devices:
        raise UserError(
            f"topology {topology}: libtpu describes {n} devices, the preset has "
            f"{preset.num_devices}"
        )
    sharding.make_mesh(dict(config.mesh), devices)  # its size checked before a child starts
    return config, refused, topology, devices


def compile_spec(
    spec: str, topology: str | None, log=print, only=None, layers=None, settings=(),
    in_process=False,
) -> dict:  # fmt: skip
    """The JSON record of --config=`spec` compiled for `topology` (default: its preset's);
    `only`: the names of the programs to compile (default: all); `layers`: the model's first
    that many layers only (`sliced`; default: all); `settings`: "dotted.field=value" overrides
    of the config (`overridden`). Compiles in child processes of this tool (`--worker`;
    tpu.compile_isolated: a compiler crash is a row), or in this one with `in_process`."""
    from ess_jax.memory import tpu

    config, refused, topology, devices = load(spec, topology, layers, settings)
    n, hosts = tpu.device_count(devices)
    kind = devices[0].device_kind
    device = _device_key(kind)
    if in_process:
        rows = tpu.compile_run(config, devices, log=log, only=only)
    else:
        command = [sys.executable, os.path.abspath(__file__), f"--config={spec}",
                   f"--topology={topology}", *[f"--set={x}" for x in settings or ()]]  # fmt: skip
        command += [f"--layers={layers}"] if layers else []
        rows = tpu.compile_isolated(command, log=log, only=list(only) if only else None)
    usable = presets.HBM[device] * presets.memory_fraction(device, environ={})
    peak = tpu.peak_bytes(rows)
    return {
        "per_device": _per_device(device),
        "config": spec,
        "refused_by_config": refused,
        "topology": topology,
        "device_kind": kind,
        "devices": n,
        "hosts": hosts,
        "mesh": dict(config.mesh),
        "hbm_bytes": presets.HBM[device],
        "usable_bytes": usable,
        "peak_bytes": peak,
        # None with --only: the programs left out may be the largest
        "only": list(only) if only else None,
        "layers": layers,  # None: the whole model
        "set": list(settings) or None,  # --set overrides of the config
        # the compiler's own flags, where set (the record compiles the same only with them)
        **({"libtpu_init_args": flags} if (flags := os.environ.get("LIBTPU_INIT_ARGS")) else {}),
        "fits": None if only else all(r.error is None for r in rows.values()) and peak <= usable,
        "programs": {name: row.to_json() for name, row in rows.items()},
    }


def replan(record: dict) -> dict:
    """`record` with its planner-side fields (each program's planner_bytes, beside_bytes and
    loop_trips, the peak and `fits`, the per-device chip figures) recomputed by the planner and
    programs.py, the compiler's figures kept: a planner change re-reads the committed compiles
    without recompiling them (minutes each). Builds the programs on the record's topology,
    compiles nothing."""
    import plan_memory

    from ess_jax.memory import programs as programs_lib
    from ess_jax.memory import tpu
    from ess_jax.parallel import sharding

    config, _ = plan_memory.load_planned(record["config"])
    config = overridden(config, record.get("set"))
    if record.get("layers"):
        config = sliced(config, record["layers"])
    mesh = sharding.make_mesh(dict(config.mesh), tpu.topology_devices(record["topology"]))
    built = {p.name: p for p in programs_lib.run_programs(config, mesh)}
    out = json.loads(json.dumps(record))
    out["per_device"] = _per_device(_device_key(record["device_kind"]))
    peak = []
    for name, row in out["programs"].items():
        p = built[name]
        row.pop("planner_bytes", None)
        if p.planner_bytes is not None:
            row["planner_bytes"] = p.planner_bytes
        row["beside_bytes"] = p.beside_bytes
        row["loop_trips"] = p.loop_trips
        if "error" not in row:
            peak.append(row["compiler_bytes"] + p.beside_bytes)
    out["peak_bytes"] = float(max(peak)) if peak else float("nan")
    if set(out["programs"]) < set(built) and not out.get("only"):  # compiled with --only
        out["only"] = sorted(out["programs"])
    ok = all("error" not in r for r in out["programs"].values())
    out["fits"] = None if out.get("only") else ok and out["peak_bytes"] <= out["usable_bytes"]
    return out


def _per_device(device: str) -> dict:
    """The vendor's per-chip figures (presets.CHIPS) over the chip's devices."""
    chip = presets.CHIPS[device]
    per = chip.devices_per_chip
    return {
        "bf16_flops": chip.bf16_flops / per,
        "hbm_bandwidth": chip.hbm_bandwidth / per,
        "ici_bandwidth": None if chip.ici_bandwidth is None else chip.ici_bandwidth / per,
    }


def _device_key(kind: str) -> str:
    """presets.HBM's key of a libtpu device kind ("TPU v5 lite" -> "v5e")."""
    if kind not in presets.TPU_KINDS:
        raise UserError(f"device kind {kind!r} has no HBM entry (ess_jax/config/presets.py)")
    return presets.TPU_KINDS[kind]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="FILE[:ARM[,PRESET]]")
    p.add_argument("--topology", help="libtpu topology name, e.g. v5p:2x2x1 (default: preset's)")
    p.add_argument("--json", help="write the record here")
    p.add_argument("--only", help="comma-separated program names (default: every program)")
    p.add_argument("--layers", type=int, help="the model's first N layers only (default: all)")
    p.add_argument(
        "--role", choices=("fit", "held-out"), default="fit",
        help="whether tools/fit_tpu_terms.py fits its RL step to this record",
    )  # fmt: skip
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a config field, e.g. train.pack_rows=True (repeatable)",
    )
    p.add_argument("--markdown", action="store_true", help="the table of results/tpu/*.json")
    p.add_argument(
        "--replan", nargs="+", metavar="JSON",
        help="recompute these records' planner-side fields with the planner (no compile)",
    )  # fmt: skip
    p.add_argument("--write", help="with --markdown: replace the table in this file")
    p.add_argument(
        "--in-process", action="store_true",
        help="compile in this process (starts faster; a compiler crash then loses every row)",
    )  # fmt: skip
    p.add_argument("--worker", help=argparse.SUPPRESS)  # tpu.compile_isolated's child
    args = p.parse_args(argv)
    try:
        if args.worker:
            return _work(args)
        if args.replan:
            for path in args.replan:
                with open(path) as f:
                    record = replan(json.load(f))
                _write(path, record)
            return 0
        if args.markdown:
            import plan_memory

            table = markdown_table(read_records())
            print(table)
            if args.write:
                changed = plan_memory.write_table(args.write, table, BEGIN, END)
                print(f"{args.write}: {'updated' if changed else 'already up to date'}")
            return 0
        if not args.config:
            p.error("--config (or --markdown) is required")
        from ess_jax.memory.tpu import TopologyError, WorkerError
        from ess_jax.parallel.sharding import MeshSizeError

        try:
            only = tuple(args.only.split(",")) if args.only else None
            record = compile_spec(
                args.config, args.topology, only=only, layers=args.layers, settings=args.set,
                in_process=args.in_process,
            )  # fmt: skip
            if args.role != "fit":  # tools/fit_tpu_terms.py: a check of its fit, never fitted
                record["role"] = args.role
        except WorkerError as e:  # the child's own one-line mistake, else its exit and tail
            mistake = e.returncode == EXIT_USER_ERROR and e.last_line.startswith("error: ")
            raise UserError(e.last_line.removeprefix("error: ") if mistake else str(e)) from e
        except (TopologyError, ValueError) as e:  # a topology, arm or program name
            hint = ""
            if args.topology and isinstance(e, MeshSizeError):  # the preset's mesh, another size
                hint = " (--topology: give the mesh its device count, e.g. --set mesh.data=-1)"
            raise UserError(f"{e}{hint}") from e
    except UserError as e:
        user_exit(e)
    print(markdown_table([record]))
    if args.json:
        _write(args.json, record)
    return 0


def _work(args) -> int:
    """A child of tpu.compile_isolated: compile_run with the `only`, `skip` and `progress` of
    the --worker state file, its rows reported in `progress` only."""
    from ess_jax.memory import tpu

    with open(args.worker) as f:
        state = json.load(f)
    config, _, _, devices = load(args.config, args.topology, args.layers, args.set)
    try:
        tpu.compile_run(
            config, devices, log=lambda line: print(line, flush=True), only=state["only"],
            skip=state["skip"], progress=state["progress"],
        )  # fmt: skip
    except ValueError as e:  # a program name of --only
        raise UserError(str(e)) from e
    return 0


def _write(path: str, record: dict) -> None:
    """The record as JSON at `path`, atomically (a reader never sees half of one)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())

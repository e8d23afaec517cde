"""Per-device memory of a run before launching it, and whether it fits the device.

    .venv/bin/python tools/plan_memory.py --config=configs/paper/e1_clip_sweep.py:p3o,v5p-8
    .venv/bin/python tools/plan_memory.py --config=configs/quickstart.py --device=h100 \
        --num_devices=1
    .venv/bin/python tools/plan_memory.py --config=configs/paper/e5_fp8.py:p3o \
        --mesh=fsdp=4,tensor=2
    .venv/bin/python tools/plan_memory.py --markdown --write=docs/paper_scale.md

Prints the resident buffers (params, AdamW state, policy history, external model), each phase's
transients (train step, sampling, eval, history push) and, on the last line, the peak and
whether it fits. The device and device count come from the preset named after the arm
(`8xh100`, `8xh200`, `v5p-8`, `v5e-16`; the paper configs default to 8xh100) or from
--device / --num_devices. A preset the config file refuses (it does not fit) is planned
anyway: the plan, then by how much it misses. Runs on the CPU, allocates nothing: shapes only
(ess_jax/memory/planner.py).

--markdown prints the table of docs/paper_scale.md: every configs/paper/ experiment's peak per
device on every preset (the worst of its arms); with --write=FILE it replaces the table between
the markers in FILE (tests/test_plan_memory_table.py checks the docs against it).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # config files import configs.*
    sys.path.insert(0, ROOT)

from ess_jax.config import presets  # noqa: E402
from ess_jax.config.presets import GB  # noqa: E402
from ess_jax.config.schema import UserError, user_exit  # noqa: E402
from ess_jax.memory import planner as memory  # noqa: E402
from ess_jax.parallel import sharding  # noqa: E402

# configs/paper/ experiment files in the order of docs/paper_scale.md's tables
PAPER_EXPERIMENTS = (
    ("E1 clip sweep", "e1_clip_sweep"),
    ("E2 Qwen2.5-1.5B", "e2_qwen25_1p5b"),
    ("E3 T=1.2", "e3_temperature_1p2"),
    ("E4 T=0.6", "e4_temperature_0p6"),
    ("E5 FP8 rollouts, 16K", "e5_fp8"),
    ("E7 50% external (Qwen3-8B)", "e7_external"),
    ("E8 dual anchor", "e8_dual_anchor"),
    ("async lag", "async_lag"),
    ("4 updates per batch", "multi_update"),
    ("MoE Qwen3-30B-A3B", "moe_qwen3_30b_a3b"),
)
BEGIN = "<!-- tools/plan_memory.py --markdown: begin -->"
END = "<!-- tools/plan_memory.py --markdown: end -->"


def _module(path: str):
    module_spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(mod)
    return mod


def load_config(spec: str):
    """--config=FILE[:ARG] as ess_jax.main reads it (ARG goes to get_config); UserError for a
    file that does not exist or an ARG the file refuses (its ValueError: an unknown arm or
    preset), a preset it does not fit aside (presets.PresetRefused, see load_planned)."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise UserError(f"--config {spec}: no such file {path}")
    try:
        return _module(path).get_config(arg or None)
    except presets.PresetRefused:
        raise
    except ValueError as e:
        raise UserError(f"config file {spec}: {e}") from e


def load_planned(spec: str):
    """(config, refusal): the config, and the file's refusal message when it refuses the preset
    (the config is then built anyway, inside presets.planning())."""
    try:
        return load_config(spec), None
    except presets.PresetRefused as e:
        with presets.planning():
            return load_config(spec), str(e)


@dataclasses.dataclass
class Cell:
    """One experiment file on one preset: the worst arm's peak (what its verdict weighs,
    Plan.judged: on v6e and tpu7x the RL step at their compiled ratio where that is larger), and
    the mesh if not the preset's."""

    peak: float
    usable: float
    arm: str  # the worst arm, or "every arm" when they all plan the same peak
    mesh: dict

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable


def paper_cells(name: str) -> dict[str, Cell]:
    """Preset -> the highest-peak arm of configs/paper/<name>.py on that preset."""
    mod = _module(os.path.join(ROOT, "configs", "paper", f"{name}.py"))
    out = {}
    for preset_name, preset in presets.PRESETS.items():
        plans = {}
        for arm in mod.ARMS:
            with presets.planning():
                config = mod.get_config(f"{arm},{preset_name}")
            plans[arm] = memory.plan(config, preset.num_devices, preset.device)
        arm = max(plans, key=lambda a: plans[a].judged)
        tie = len({round(p.judged / GB, 2) for p in plans.values()}) == 1
        worst = plans[arm]
        usable = presets.HBM[preset.device] * presets.memory_fraction(preset.device, environ={})
        out[preset_name] = Cell(worst.judged, usable, "every arm" if tie else arm, worst.mesh)
    return out


def _cell_text(cell: Cell, preset: presets.Preset) -> str:
    text = f"{cell.peak / GB:.1f}" if cell.fits else f"does not fit ({cell.peak / GB:.1f})"
    if cell.mesh != sharding.mesh_shape(preset.mesh, preset.num_devices):  # axes left out: 1
        text += " (" + ", ".join(f"{a} {n}" for a, n in cell.mesh.items() if n != 1) + ")"
    return text


def markdown_table(cells: dict[str, dict[str, Cell]] | None = None) -> str:
    """The planner's table of docs/paper_scale.md (GB per device); `cells`: paper_cells of every
    PAPER_EXPERIMENTS file (computed when None)."""
    cells = cells or {name: paper_cells(name) for _, name in PAPER_EXPERIMENTS}
    names = list(presets.PRESETS)
    fraction = {presets.memory_fraction(p.device, environ={}) for p in presets.PRESETS.values()}
    usable = [
        f"{presets.HBM[p.device] * presets.memory_fraction(p.device, environ={}) / GB:.1f}"
        for p in presets.PRESETS.values()
    ]
    lines = [
        "| experiment | worst arm (on " + names[0] + ") | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
        f"| usable ({'/'.join(f'{f:.0%}' for f in sorted(fraction))} of HBM) | | "
        + " | ".join(usable)
        + " |",
    ]
    for title, name in PAPER_EXPERIMENTS:
        row = cells[name]
        texts = [_cell_text(row[n], presets.PRESETS[n]) for n in names]
        arm = row[names[0]].arm
        arm = arm if arm == "every arm" else f"`{arm}`"
        lines.append(f"| {title} | {arm} | " + " | ".join(texts) + " |")
    return "\n".join(lines)


def write_table(path: str, table: str, begin: str = BEGIN, end: str = END) -> bool:
    """Replaces the text between `begin` and `end` in `path` by `table`; True if it changed."""
    with open(path) as f:
        text = f.read()
    head, found_begin, rest = text.partition(begin)
    old, found_end, tail = rest.partition(end)
    if not found_begin or not found_end:
        raise SystemExit(f"{path}: no {begin} ... {end} block")
    new = f"{head}{begin}\n{table}\n{end}{tail}"
    if new != text:
        with open(path, "w") as f:
            f.write(new)
    return new != text


def table_in(path: str, begin: str = BEGIN, end: str = END) -> str:
    """The table between `begin` and `end` in `path`."""
    with open(path) as f:
        return f.read().partition(begin)[2].partition(end)[0].strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="FILE[:ARM[,PRESET]]")
    p.add_argument("--mesh", help="mesh override, e.g. fsdp=4,tensor=2 (default: the config's)")
    p.add_argument("--device", help=f"device kind: {', '.join(presets.HBM)}")
    p.add_argument("--num_devices", type=int, help="devices in the mesh")
    p.add_argument(
        "--peer_devices",
        type=int,
        help="train.async_role runs: the other group's devices (default: as many)",
    )
    p.add_argument("--markdown", action="store_true", help="the paper experiments' table")
    p.add_argument("--write", help="with --markdown: replace the table in this file")
    args = p.parse_args(argv)
    if args.markdown:
        table = markdown_table()
        print(table)
        if args.write:
            changed = write_table(args.write, table)
            print(f"{args.write}: {'updated' if changed else 'already up to date'}")
        return 0
    if not args.config:
        p.error("--config (or --markdown) is required")
    try:
        presets.user_memory_fraction()  # the user's share of GPU memory, checked before planning
        config, refused = load_planned(args.config)
    except UserError as e:
        user_exit(e)  # one line, exit 2: as ess_jax.main
    preset = args.config.partition(":")[2].split(",")[-1]
    preset = presets.PRESETS.get(preset) or (
        presets.PRESETS[presets.DEFAULT] if "configs/paper/" in args.config else None
    )
    device = args.device or (preset.device if preset else None)
    num_devices = args.num_devices or (preset.num_devices if preset else None)
    if device is None or num_devices is None:
        p.error("name a preset after the arm (FILE:ARM,PRESET) or give --device and --num_devices")
    if device not in presets.HBM:
        user_exit(f"--device {device}: unknown device; valid: {', '.join(presets.HBM)}")
    if num_devices < 1:
        user_exit(f"--num_devices {num_devices}: must be >= 1")
    try:
        mesh = presets.parse_mesh(args.mesh) if args.mesh else None
    except UserError as e:
        user_exit(e)
    try:  # the axes and sizes against the devices, as the planner (and a run) lays them out
        sharding.mesh_shape(dict(mesh or config.mesh), num_devices)
    except ValueError as e:
        given = f"--mesh {args.mesh}" if mesh else "config.mesh"
        user_exit(f"{given} on {num_devices} devices: {e}")
    if args.peer_devices is not None and args.peer_devices < 1:
        user_exit(f"--peer_devices {args.peer_devices}: must be >= 1")
    plan = memory.plan(config, num_devices, device, mesh, peer_devices=args.peer_devices)
    if refused:
        print(f"planned although the config file refuses it: {refused}")
    print("\n".join(plan.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

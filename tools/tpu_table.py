"""docs/tpu.md's table of compiled TPU programs (results/tpu/*.json, tools/compile_tpu.py's
records): per program the compiler's bytes against the planner's, the compiler's cost of one
loop body, and the estimates drawn from it (MFU, HBM floor, ICI time). Every time is the
compiler's estimate or a bandwidth floor, never a measurement.

    .venv/bin/python tools/compile_tpu.py --markdown --write=docs/tpu.md
"""

from __future__ import annotations

import glob
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "results", "tpu")
BEGIN = "<!-- tools/compile_tpu.py --markdown: begin -->"
END = "<!-- tools/compile_tpu.py --markdown: end -->"


def _gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.3g}"


def _collective(p: dict) -> float | None:
    """Collective bytes of one call of a program row: those outside loops once, those inside
    loop bodies (`loop_collectives`) once per loop trip; None for a record made without them
    (a record without the loop split counts everything once)."""
    if "collectives" not in p:
        return None
    total = float(sum(p["collectives"].values()))
    looped = float(sum(p.get("loop_collectives", {}).values()))
    return total + looped * (p["loop_trips"] - 1)


def _estimates(p: dict, per_device: dict) -> tuple[str, str, str]:
    """(MFU, HBM floor, ICI time) of one program row, from the compiler's one-loop-body
    figures: MFU = flops / optimal_seconds / peak flop/s (the trip count cancels); the HBM
    floor reads the program's arguments once at the device's bandwidth (a decode step: the
    weights and the KV cache); ICI time = one call's collective bytes (`_collective`) / the
    bidirectional ICI bandwidth."""
    t, flops = p.get("optimal_seconds"), p.get("flops")
    mfu = f"{flops / t / per_device['bf16_flops']:.0%}" if flops and t and t > 0 else "-"
    floor = f"{p['memory']['argument'] / per_device['hbm_bandwidth']:.3g}"
    coll, ici = _collective(p), per_device.get("ici_bandwidth")
    ici_s = "-" if coll is None or not ici else f"{coll / ici:.3g}"
    return mfu, floor, ici_s


def _config_cell(rec: dict) -> str:
    """The record's --config, its --set overrides, the layers compiled when not all, and the
    compiler flags (LIBTPU_INIT_ARGS) where set."""
    layers, settings, flags = rec.get("layers"), rec.get("set"), rec.get("libtpu_init_args")
    cell = f"`{rec['config']}`" + "".join(f" `{s}`" for s in settings or ())
    cell += f" (first {layers} layers)" if layers else ""
    return cell + (f" `LIBTPU_INIT_ARGS={flags}`" if flags else "")


def markdown_table(records: list[dict]) -> str:
    """One row per compiled program of each record: compiler vs planner bytes, the compiler's
    cost (one loop body) and the estimates drawn from it. Every time is the compiler's
    estimate or a bandwidth floor, never a measurement."""
    lines = [
        "| config | topology | program | compiler GB | planner GB | planner error | "
        "GFLOP | loop trips | compiler's time (s) | est. MFU | HBM floor (s) | "
        "collectives GB per call | ICI time per call (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rec in records:
        for name, p in rec["programs"].items():
            head = f"| {_config_cell(rec)} | {rec['topology']} | {name} |"
            if "error" in p:  # the compiler's refusal, its crash, or an input that did not compile
                told = p["error"].startswith(("the compiler crashed", "not compiled"))
                cell = p["error"][:120] if told else f"refused: {p['error'][:120]}"
                lines.append(f"{head} {cell} |" + " |" * 9)
                continue
            comp, plan = p.get("compiler_bytes"), p.get("planner_bytes")
            err = f"{(plan - comp) / comp:+.0%}" if comp and plan is not None else "-"
            flops, t = p.get("flops"), p.get("optimal_seconds")
            mfu, floor, ici_s = _estimates(p, rec["per_device"])
            coll = _collective(p)
            lines.append(
                f"{head} {_gb(comp)} | {_gb(plan)} | {err} | "
                f"{'-' if flops is None else f'{flops / 1e9:.3g}'} | {p['loop_trips']} | "
                f"{'-' if t is None else f'{t:.3g}'} | {mfu} | {floor} | {_gb(coll)} | {ici_s} |"
            )
        verdict = {True: "fits", False: "does not fit"}.get(
            rec["fits"], "compiled programs only (--only)"
        )
        if rec["fits"] is False and rec["peak_bytes"] <= rec["usable_bytes"]:
            verdict = "a program did not compile; those that did fit"
        lines.append(
            f"| {_config_cell(rec)} | {rec['topology']} | **peak** | {_gb(rec['peak_bytes'])} of "
            f"{_gb(rec['usable_bytes'])} usable: {verdict} |" + " |" * 9
        )
    return "\n".join(lines)


def read_records(folder: str = RESULTS) -> list[dict]:
    records = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            records.append(json.load(f))
    return records

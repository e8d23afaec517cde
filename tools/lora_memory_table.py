"""docs/memory.md's LoRA / QLoRA tables: the memory planner's peak per device for the paper's E3
arm (configs/paper/e3_temperature_1p2.py:p3o) set for a small slice, with full fine-tuning,
LoRA and QLoRA (int8 / int4 base) on v5e-8, v4-8 and one 80 GB GPU.

    .venv/bin/python tools/lora_memory_table.py                       # print both tables
    .venv/bin/python tools/lora_memory_table.py --write=docs/memory.md

The small-slice settings: one sequence per device per micro-batch, rollout.sample_microbatches
64, eval.batch_size 2, rank 16, alpha 32. The second table is the rows whose adapter cells
change with eval.precision=bfloat16. --write replaces each table between its markers in the
file (tests/test_plan_memory_table.py checks the docs against this). Shapes only: no weights,
nothing allocated (ess_jax/memory/planner.py).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # config files import configs.*
    sys.path.insert(0, ROOT)

from configs.paper import e3_temperature_1p2 as e3  # noqa: E402
from ess_jax.config import presets  # noqa: E402
from ess_jax.config.presets import GB  # noqa: E402
from ess_jax.memory import planner as memory  # noqa: E402

MODELS = (("Qwen3-4B", "Qwen3-4B-Thinking-2507"), ("Qwen3-8B", "Qwen3-8B"))
HARDWARE = (  # (label, device preset, device count, mesh)
    ("v5e-8 (fsdp 2, tensor 4)", "v5e", 8, {"data": 1, "fsdp": 2, "tensor": 4}),
    ("v4-8 (tensor 4)", "v4", 4, {"data": 1, "fsdp": 1, "tensor": 4}),
    ("one 80 GB GPU", "h100", 1, {"data": 1, "fsdp": 1, "tensor": 1}),
)
ARMS = (  # (column, rank, base precision)
    ("full fine-tuning", 0, "compute"),
    ("LoRA r16", 16, "compute"),
    ("QLoRA r16, int8 base", 16, "int8"),
    ("QLoRA r16, int4 base", 16, "int4"),
)
TABLES = ("float32", "bfloat16")  # eval.precision of each table


def plan(model: str, device: str, n: int, mesh: dict, rank: int, base: str, eval_precision: str):
    with presets.planning():
        c = e3.get_config("p3o")
    c.model.source = model
    c.model.lora.rank, c.model.lora.alpha = rank, 32.0
    c.model.lora.base_precision = base
    c.rollout.sample_microbatches = 64
    c.eval.batch_size = 2
    c.eval.precision = eval_precision
    c.mesh = mesh
    seqs = c.data.prompts_per_step * c.rollout.group_size // c.train.updates_per_batch
    c.train.num_microbatches = seqs // (mesh["data"] * mesh["fsdp"])
    return memory.plan(c, n, device, mesh)


def cell(p) -> str:
    return f"{p.peak / GB:.1f} ({p.peak_phase}), {'fits' if p.fits else 'no'}"


def cells(eval_precision: str) -> dict[tuple[str, str], list[str]]:
    """{(model label, hardware label): a cell per arm}."""
    return {
        (label, hw): [cell(plan(model, dev, n, mesh, r, b, eval_precision)) for _, r, b in ARMS]
        for label, model in MODELS
        for hw, dev, n, mesh in HARDWARE
    }


def markdown(eval_precision: str, base: dict | None = None) -> str:
    """The table for `eval.precision`; with `base` (the float32 table's cells) only the rows
    whose adapter cells differ from it, without the full fine-tuning column."""
    rows = cells(eval_precision)
    arms = [a for a, _, _ in ARMS]
    if base is not None:
        arms = arms[1:]
        rows = {k: v[1:] for k, v in rows.items() if v[1:] != base[k][1:]}
    head = ["| model | hardware (mesh) | " + " | ".join(arms) + " |"]
    head.append("|" + "---|" * (len(arms) + 2))
    return "\n".join(
        head + [f"| {m} | {hw} | " + " | ".join(v) + " |" for (m, hw), v in rows.items()]
    )


def tables() -> dict[str, str]:
    first = cells("float32")
    return {"float32": markdown("float32"), "bfloat16": markdown("bfloat16", base=first)}


def markers(eval_precision: str) -> tuple[str, str]:
    tag = f"tools/lora_memory_table.py eval.precision={eval_precision}"
    return f"<!-- {tag}: begin -->", f"<!-- {tag}: end -->"


def table_in(path: str, eval_precision: str) -> str:
    """The table between the markers of `eval_precision` in `path`."""
    begin, end = markers(eval_precision)
    text = open(path).read()
    found = re.search(re.escape(begin) + r"\n(.*?)\n" + re.escape(end), text, re.S)
    if found is None:
        raise SystemExit(f"{path}: no {begin} ... {end} markers")
    return found.group(1)


def write(path: str, generated: dict[str, str]) -> None:
    text = open(path).read()
    for precision, table in generated.items():
        begin, end = markers(precision)
        table_in(path, precision)  # markers present
        block = f"{begin}\n{table}\n{end}"
        pattern = re.escape(begin) + r"\n.*?\n" + re.escape(end)
        text = re.sub(pattern, lambda _, block=block: block, text, flags=re.S)
    with open(path, "w") as f:
        f.write(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", help="replace the tables between their markers in this file")
    args = ap.parse_args()
    generated = tables()
    if args.write:
        write(args.write, generated)
        print(f"wrote both tables into {args.write}")
    else:
        for precision, table in generated.items():
            print(f"eval.precision={precision}\n{table}\n")


if __name__ == "__main__":
    main()

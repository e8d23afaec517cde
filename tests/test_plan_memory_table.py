"""The planner's paper table and refused presets (tools/plan_memory.py): the table in
docs/paper_scale.md is what the planner computes for every configs/paper/ experiment, arm and
preset (all 204 plans, ~10 s: shapes only); each file refuses exactly the presets it does not
fit; a refused preset is planned anyway, ending with by how much it misses."""

import importlib
import os
import sys

import pytest

from ess_jax.config import presets
from ess_jax.config.presets import GB

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import plan_memory  # noqa: E402  (tools/plan_memory.py)

DOC = os.path.join(ROOT, "docs", "paper_scale.md")


@pytest.fixture(scope="module")
def cells():
    return {name: plan_memory.paper_cells(name) for _, name in plan_memory.PAPER_EXPERIMENTS}


def test_docs_table_is_the_planners(cells):
    """Catches a hand-edited or stale table (a config, the planner or a preset changed since it
    was written): regenerate it with `tools/plan_memory.py --markdown --write=docs/paper_scale.md`;
    and an experiment file left out of the table."""
    files = {
        f[:-3] for f in os.listdir(os.path.join(ROOT, "configs", "paper")) if f.endswith(".py")
    }
    assert files - {"__init__", "common"} == {name for _, name in plan_memory.PAPER_EXPERIMENTS}
    assert plan_memory.table_in(DOC) == plan_memory.markdown_table(cells)


def test_each_file_refuses_exactly_the_presets_it_does_not_fit(cells):
    """Catches a file's PRESETS that refuses a preset its runs fit, or accepts one they do not
    (a run that would stop out of memory)."""
    for _, name in plan_memory.PAPER_EXPERIMENTS:
        mod = importlib.import_module(f"configs.paper.{name}")
        fitting = tuple(p for p, cell in cells[name].items() if cell.fits)
        assert tuple(mod.PRESETS) == fitting, name


def test_refused_preset_prints_the_plan_then_the_miss(capsys):
    """Catches the config file's refusal escaping as a traceback (no plan printed), and a
    verdict that does not say by how much the plan misses."""
    path = os.path.join(ROOT, "configs", "paper", "e5_fp8.py")
    assert plan_memory.main([f"--config={path}:p3o,v5e-8"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("planned although the config file refuses it: preset 'v5e-8'")
    assert out[1].startswith("mesh {'data': 1, 'fsdp': 2, 'tensor': 4, 'expert': 1}, device v5e")
    with presets.planning():
        plan = plan_memory.memory.plan(plan_memory.load_config(f"{path}:p3o,v5e-8"), 8, "v5e")
    over = (plan.peak - plan.usable) / GB
    assert over > 1
    assert out[-1].endswith(f"of 14.4 GB usable (90% of 16 GB): DOES NOT FIT: {over:.2f} GB over")


def test_lora_tables_are_the_planners():
    """Catches docs/memory.md's LoRA / QLoRA tables left stale by a planner change (regenerate
    them with `tools/lora_memory_table.py --write=docs/memory.md`): a change to the TPU sampler
    terms (the embedding-table lookup) moves six of their rows. 48 plans, ~11 s."""
    import lora_memory_table  # tools/lora_memory_table.py

    path = os.path.join(ROOT, "docs", "memory.md")
    for precision, table in lora_memory_table.tables().items():
        assert lora_memory_table.table_in(path, precision) == table, precision

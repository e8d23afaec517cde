"""experiments/smollm2_table.py: the SmolLM2 experiments' per-arm table and its two declared
readings (collapse, learning), from metrics.jsonl rows written here by hand."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from experiments import smollm2_table  # noqa: E402


def _run(folder, arm, seed, rewards, pass1, loss=0.0):
    d = folder / arm / str(seed)
    d.mkdir(parents=True)
    rows = [
        {"step": i, "reward_mean": r, "ess": 0.9 + 0.01 * (i % 2), "kl_behaviour": 0.02,
         "response_len": 40.0, "loss": loss, "grad_norm": 1.0}
        for i, r in enumerate(rewards)
    ]  # fmt: skip
    rows += [{"step": s, "eval/pass@1": p} for s, p in pass1.items()]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_table_rows_and_declared_readings(tmp_path):
    """Catches a collapse reading that compares the wrong windows (the last 10 steps against
    half the first 10), a learning reading with the wrong threshold or eval order, a
    non-finite loss not counted as a collapse, and means over the wrong rows."""
    _run(tmp_path, "p3o", 0, [0.4] * 10 + [0.3] * 10 + [0.1] * 10, {0: 0.1, 30: 0.15})
    _run(tmp_path, "vcpo", 0, [0.2] * 30, {30: 0.35, 0: 0.1})
    _run(tmp_path, "vcpo", 1, [0.2] * 30, {0: 0.1, 30: 0.2}, loss=float("nan"))
    lines = smollm2_table.table(str(tmp_path)).splitlines()
    assert len(lines) == 5
    p3o, v0, v1 = lines[2:]
    assert p3o.startswith("| p3o | 0 | 0.400 | 0.100 | 0.100 / 0.150 (steps 0, 30) | 0.905 (0.900)")
    assert p3o.endswith("| yes | no |")  # 0.1 < 0.4 / 2: collapsed; +0.05 pass@1: not learned
    assert v0.endswith("| no | yes |")  # +0.25 pass@1 at the last eval: learned
    assert v1.endswith("| yes | no |")  # a NaN loss is a collapse; +0.1 is not above 0.1


def test_write_between_markers_and_refuse_a_page_without_them(tmp_path):
    """Catches a --write that drops the page's text around the table or appends a second
    table on a rerun, and a page without markers overwritten instead of refused."""
    _run(tmp_path / "res", "p3o", 0, [0.2] * 12, {0: 0.0, 10: 0.05})
    page = tmp_path / "page.md"
    page.write_text(f"head\n{smollm2_table.BEGIN}\nold\n{smollm2_table.END}\ntail\n")
    for _ in range(2):
        assert smollm2_table.main([str(tmp_path / "res"), "--write", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("head\n") and text.endswith("tail\n") and "old" not in text
    assert text.count("| p3o | 0 |") == 1
    bare = tmp_path / "bare.md"
    bare.write_text("no markers\n")
    with pytest.raises(SystemExit):
        smollm2_table.main([str(tmp_path / "res"), "--write", str(bare)])
    assert bare.read_text() == "no markers\n"

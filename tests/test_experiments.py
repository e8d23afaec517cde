"""experiments/compare.py turns run directories into a table and an overlay plot."""

import importlib.util
import json
import os

import pytest

HERE = os.path.dirname(__file__)


def _compare():
    path = os.path.join(HERE, "..", "experiments", "compare.py")
    spec = importlib.util.spec_from_file_location("compare", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write_run(d, rewards, ess, evals):
    os.makedirs(d)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        for step, (r, e) in enumerate(zip(rewards, ess)):
            row = {"step": step, "reward_mean": r, "ess": e, "clip_frac": 0.1, "skipped": 0}
            f.write(json.dumps(row) + "\n")
        for step, p in evals:
            f.write(json.dumps({"step": step, "eval/pass@1": p}) + "\n")


def test_summary_table_and_plot(tmp_path):
    compare = _compare()
    a, b = str(tmp_path / "p3o"), str(tmp_path / "grpo")
    _write_run(a, [0.1 * i for i in range(10)], [1.0] * 9 + [0.5], [(0, 0.2), (10, 0.7)])
    _write_run(b, [0.5] * 10, [0.9] * 10, [(0, 0.2), (10, 0.3)])
    s = compare.summarize(a)
    assert s["run"] == "p3o" and s["steps"] == 10
    assert s["reward_last5"] == pytest.approx(0.7)  # mean of 0.5 .. 0.9
    assert (s["pass@1_first"], s["pass@1_last"]) == (0.2, 0.7)
    assert s["ess_min"] == 0.5 and s["ess_mean"] == pytest.approx(0.95)
    table = compare.markdown_table([s, compare.summarize(b)])
    assert table.splitlines()[0].startswith("| run | steps |") and "| grpo | 10 |" in table
    png = str(tmp_path / "cmp.png")
    compare.overlay_plot([a, b], png)
    assert os.path.getsize(png) > 1000


def test_run_without_training_rows_is_an_error(tmp_path):
    d = str(tmp_path / "empty")
    _write_run(d, [], [], [(0, 0.5)])
    with pytest.raises(ValueError, match="no training rows"):
        _compare().summarize(d)

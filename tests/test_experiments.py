"""experiments/compare.py turns run directories into a table and an overlay plot, and stops on
a damaged metrics.jsonl (as analyze.py does) with one line; experiments/sweep.py runs every
variant, a failing one included, then compares them."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from experiments import sweep

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(os.path.abspath(HERE))
ROW = '{"step": %d, "reward_mean": 0.5, "ess": 1.0, "clip_frac": 0.0}\n'


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
    compare.overlay_plot({a: compare.read_rows(a), b: compare.read_rows(b)}, png)
    assert os.path.getsize(png) > 1000


def _tool(name, *args):
    """experiments/<name> run as a user runs it: (exit code, stderr lines)."""
    cmd = [sys.executable, os.path.join(ROOT, "experiments", name), *map(str, args)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stderr.strip().splitlines()


def test_compare_and_analyze_stop_on_a_bad_line_with_one_line_and_exit_2(tmp_path):
    """Catches compare.py ending in a MetricsError traceback, and analyze.py exiting 1 with a
    bare message, on a garbage line in the middle of metrics.jsonl: each must print one
    `error:` line naming the file and the line and exit 2, as `python -m ess_jax.main` does on
    a mistake the user can fix."""
    run = tmp_path / "results" / "e1" / "p3o" / "0"
    run.mkdir(parents=True)
    path = run / "metrics.jsonl"
    path.write_text(ROW % 0 + ROW % 1 + "garbage\n" + ROW % 3)
    line = f"error: {path} line 3 is not a JSON row (Expecting value at column 1); only a cut"
    rc, err = _tool("compare.py", run, "--out", tmp_path / "cmp")
    assert rc == 2 and len(err) == 1 and err[0].startswith(line), err
    rc, err = _tool("analyze.py", tmp_path / "results")
    assert rc == 2 and len(err) == 1 and err[0].startswith(line), err


def test_compare_warns_once_about_a_cut_last_line(tmp_path):
    """Catches compare.py reading each metrics.jsonl twice (the table, then the plot), which
    warned twice about the same cut last line."""
    (tmp_path / "metrics.jsonl").write_text(ROW % 0 + ROW % 1 + '{"step": 2, "reward_m')
    rc, err = _tool("compare.py", tmp_path, "--out", tmp_path / "cmp")
    assert rc == 0 and sum("its last line is cut" in e for e in err) == 1, err


def test_run_without_training_rows_is_an_error(tmp_path):
    """Catches a run with eval rows only summarised as NaNs (or an IndexError) instead of an
    error naming the workdir."""
    d = str(tmp_path / "empty")
    _write_run(d, [], [], [(0, 0.5)])
    with pytest.raises(ValueError, match="no training rows"):
        _compare().summarize(d)


# A stand-in for `python -m ess_jax.main` (no training): writes 3 metrics rows into its workdir,
# or fails as main fails on a bad config when given --config.objective.name=nope.
FAKE_MAIN = """
import json, os, sys
flags = dict(a[2:].split("=", 1) for a in sys.argv[1:])
if flags.get("config.objective.name") == "nope":
    print("error: config.objective.name: unknown objective 'nope'", file=sys.stderr)
    sys.exit(2)
os.makedirs(flags["workdir"])
with open(os.path.join(flags["workdir"], "metrics.jsonl"), "w") as f:
    for s in range(3):
        f.write(json.dumps({"step": s, "reward_mean": 0.5, "ess": 1.0, "clip_frac": 0.0}) + "\\n")
print("done")
"""


def test_a_failing_variant_does_not_stop_the_sweep(tmp_path, monkeypatch, capsys):
    """Catches sweep.py stopping at the first failing variant (CalledProcessError, the later
    variants never run, no comparison), a failure missing from compare.md (the variant, its exit
    code, its log), a log without the variant's output, and a sweep that exits 0 anyway."""
    fake = tmp_path / "fake_main.py"
    fake.write_text(FAKE_MAIN)
    monkeypatch.setattr(sweep, "MAIN", (sys.executable, str(fake)))
    root = str(tmp_path / "sweep")
    argv = ["--config=configs/quickstart.py", f"--root={root}"]
    argv += ["--variant", "bad", "objective.name=nope", "--variant", "good", "seed=1"]
    assert sweep.main(argv) == 1
    log = os.path.join(root, "logs", "bad.log")
    md = open(os.path.join(root, "compare.md")).read()
    assert "| good | 3 | 0.500 |" in md  # the variant after the failure ran and was compared
    assert f"| bad | 2 | {log} |" in md
    assert "| bad |" not in md.split("failed variant")[0]
    text = open(log).read()
    assert text.startswith("+ ") and "--config.objective.name=nope" in text.splitlines()[0]
    assert "error: config.objective.name: unknown objective 'nope'" in text
    assert "done" in open(os.path.join(root, "logs", "good.log")).read()
    assert "done" in capsys.readouterr().out  # the variants' output also reaches the console
    assert os.path.getsize(os.path.join(root, "compare.png")) > 1000

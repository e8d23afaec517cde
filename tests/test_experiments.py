"""experiments/compare.py turns run directories into a table and an overlay plot, and stops on
a damaged metrics.jsonl (as analyze.py does) with one line; experiments/sweep.py runs every
variant, a failing one included, then compares them. A user's mistake in their arguments (a path
without runs, a malformed --variant) is one `error:` line and exit 2, as `ess_jax.main`."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import one_line_exit

from experiments import analyze, stability_map, sweep

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


def test_compare_refuses_a_path_without_training_rows_in_one_line(tmp_path, capsys):
    """Catches compare.py ending in a ValueError traceback for a path that does not exist, a
    directory without a metrics.jsonl (both read as a run of no rows) or a run with eval rows
    only (summarised as NaNs before): one `error:` line naming the path and what it lacks,
    exit 2, and nothing written."""
    main = _compare().main
    out = str(tmp_path / "cmp")
    missing, empty, evals = tmp_path / "nope", tmp_path / "empty", tmp_path / "evals"
    line = one_line_exit(capsys, lambda: main([str(missing), "--out", out]))
    assert line == f"error: {missing}: no such file or directory"
    empty.mkdir()
    line = one_line_exit(capsys, lambda: main([str(empty), "--out", out]))
    assert line == (
        f"error: {empty}: no metrics.jsonl in it (not a run's workdir, or a run that wrote no row)"
    )
    _write_run(str(evals), [], [], [(0, 0.5)])
    line = one_line_exit(capsys, lambda: main([str(evals), "--out", out]))
    assert line == f"error: {evals}: no training rows (no row with reward_mean)"
    assert not os.path.exists(out + ".md")


def test_analyze_and_stability_map_refuse_a_directory_without_runs_in_one_line(tmp_path, capsys):
    """Catches analyze.py and stability_map.py exiting 1 with a bare message for a directory with
    no runs under it, and analyze.py's FileNotFoundError traceback for one that does not exist:
    one `error:` line naming the directory, exit 2, as `ess_jax.main` on a user's mistake."""
    missing = tmp_path / "nope"
    line = one_line_exit(capsys, lambda: analyze.main([str(missing)]))
    want = "not a directory (give the one experiments/reproduce.py writes)"
    assert line == f"error: {missing}: {want}"
    (tmp_path / "e1" / "p3o" / "0").mkdir(parents=True)  # no metrics.jsonl
    line = one_line_exit(capsys, lambda: analyze.main([str(tmp_path)]))
    assert line == f"error: {tmp_path}: no <experiment>/<arm>/<seed>/metrics.jsonl under it"
    line = one_line_exit(capsys, lambda: stability_map.main([str(tmp_path)]))
    assert line == f"error: {tmp_path}: no stability_map/<arm>/<seed>/metrics.jsonl under it"


@pytest.mark.parametrize(
    "variants, line",
    [
        ([], "no --variant given: --variant NAME KEY=VALUE ... (one or more)"),
        (["--variant", "a", "seed"], "--variant a: override 'seed' is not KEY=VALUE"),
        (["--variant", "a", "seed=1", "--variant", "a", "seed=2"], "--variant a: given twice"),
        (
            ["--variant", "objective.name=grpo"],
            "--variant objective.name=grpo: not a variant name (a workdir under --root); give "
            "--variant NAME KEY=VALUE ...",
        ),
    ],
)
def test_sweep_refuses_malformed_variants_in_one_line_before_any_run(
    variants, line, tmp_path, monkeypatch, capsys
):
    """Catches sweep.py ending in a ValueError traceback for a malformed --variant group (none,
    an override without "=", a name twice), and an override where the name goes running as a
    variant whose workdir is named after the override."""
    monkeypatch.setattr(sweep, "run_logged", lambda cmd, log: pytest.fail("a variant ran"))
    argv = ["--config=configs/quickstart.py", f"--root={tmp_path / 'sweep'}", *variants]
    assert one_line_exit(capsys, lambda: sweep.main(argv)) == "error: " + line
    assert not (tmp_path / "sweep").exists()


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

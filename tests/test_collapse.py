"""experiments/analyze.py's collapse criteria (dip, sustained, held-out below step 0) and its
counting of runs shared by two experiments. Cheap: synthetic series and tiny results trees."""

import importlib.util
import json
import os
import sys

import numpy as np

from experiments import run_stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(ROOT, "experiments", f"{name}.py")
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


analyze = _load("analyze")
HIGH = 1.0  # exact sums: a window of 5 zeros is at half the peak, not below


def _series(*parts):
    """(steps, reward) from (value, length) parts; steps start at 0."""
    reward = np.concatenate([[v] * n for v, n in parts]).astype(np.float64)
    return np.arange(len(reward)), reward


def test_a_dip_that_recovers_is_no_sustained_collapse():
    """Catches a sustained detector that fires on any dip, as the dip criterion does: 10 zero
    steps put the 10-step mean below half its peak for 9 steps (35 ... 43), then it recovers."""
    steps, reward = _series((HIGH, 30), (0.0, 10), (HIGH, 40))
    assert run_stats.collapse_step(steps, reward) == 35
    assert run_stats.sustained_collapse_step(steps, reward) is None


def test_a_fall_of_20_steps_collapses_at_its_first_step_and_19_does_not():
    """Catches an off-by-one in the 20-step length and a sustained step reported at the end of
    the fall (or at an earlier dip) rather than at its first step. z zero steps keep the 10-step
    mean below half the peak for z - 1 steps, from the 6th zero on."""
    steps, reward = _series((HIGH, 30), (0.0, 20), (HIGH, 40))  # 19 steps below
    assert run_stats.sustained_collapse_step(steps, reward) is None
    steps, reward = _series((HIGH, 30), (0.0, 21), (HIGH, 40))  # 20 steps below
    assert run_stats.sustained_collapse_step(steps, reward) == 35
    # a recovered dip first, then a fall of 40 steps: dip at 35, sustained at the fall (85)
    steps, reward = _series((HIGH, 30), (0.0, 10), (HIGH, 40), (0.0, 40), (HIGH, 30))
    assert run_stats.collapse_step(steps, reward) == 35
    assert run_stats.sustained_collapse_step(steps, reward) == 85
    # step numbers come from the run, not the index
    assert run_stats.sustained_collapse_step(steps + 100, reward) == 185


def test_a_fall_that_lasts_to_the_end_of_the_run_collapses():
    """Catches a sustained detector that asks for 20 steps the run does not have: a fall in the
    last 15 steps that never recovers is below half the peak for its last 10 steps (90 ... 99)."""
    steps, reward = _series((HIGH, 85), (0.0, 15))
    assert run_stats.sustained_collapse_step(steps, reward) == 90
    # the same fall, recovering before the end, is no sustained collapse
    steps, reward = _series((HIGH, 85), (0.0, 15), (HIGH, 10))
    assert run_stats.sustained_collapse_step(steps, reward) is None


def test_heldout_below_step0():
    """Catches a comparison with the wrong eval (the first after step 0, or the best) or a run
    with only its step-0 eval counted as below."""
    ev = lambda *pairs: [{"step": s, "eval/pass@1": p} for s, p in pairs]
    assert run_stats.heldout_below_step0(ev((0, 0.3), (50, 0.1), (150, 0.25)))
    assert not run_stats.heldout_below_step0(ev((0, 0.3), (50, 0.1), (150, 0.3)))
    assert not run_stats.heldout_below_step0(ev((0, 0.3)))
    assert not run_stats.heldout_below_step0([])


def _write_run(path, rewards, pass1, step_s):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, "eval/pass@1": 0.3}) + "\n")
        for i, r in enumerate(rewards):
            row = {"step": i, "reward_mean": r, "ess": 1.0, "ess_min": 1.0, "capped_frac": 0.0}
            row |= {"entropy_proxy": 1.0, "kl_behaviour": 0.0, "step_s": step_s}
            f.write(json.dumps(row) + "\n")
        f.write(json.dumps({"step": len(rewards), "eval/pass@1": pass1}) + "\n")


def test_runs_shared_by_two_experiments_are_listed_and_counted_once(tmp_path):
    """Catches a summary.md that lists a comparison of shared runs twice (once per experiment)
    or counts shared runs in both experiments' collapse counts; and a run that differs in a
    metric (not only in timing) taken for a shared one."""
    root = tmp_path / "results"
    for seed in range(2):
        falling = [0.5 + 0.1 * seed] * 30 + [0.0] * 30
        for exp, step_s in (("e1b_clip_sweep_fp8", 0.1), ("e5_fp8", 0.2)):  # timing differs
            _write_run(root / exp / "p3o" / str(seed), [0.5 + 0.1 * seed] * 60, 0.5, step_s)
            _write_run(root / exp / "grpo_eps0.2" / str(seed), falling, 0.1, step_s)
        _write_run(root / "e1b_clip_sweep_fp8" / "gspo" / str(seed), [0.4] * 60, 0.4, 0.1)
        _write_run(root / "e5_fp8" / "grpo_tis" / str(seed), [0.45] * 60, 0.4, 0.1)
    # e5's p3o_cap_only seed 0 differs from e1b's gspo seed 0 in one reward: not shared
    _write_run(root / "e5_fp8" / "p3o_cap_only" / "0", [0.4] * 59 + [0.41], 0.4, 0.1)
    _write_run(root / "e5_fp8" / "p3o_cap_only" / "1", [0.4] * 60, 0.4, 0.1)  # = gspo seed 1
    analyze.analyze(str(root))
    summary = (root / "summary.md").read_text()
    assert summary.count("| p3o - grpo_eps0.2 | 2 |") == 1
    assert "| e1b_clip_sweep_fp8 | p3o - grpo_eps0.2 | 2 |" in summary
    assert "- e5_fp8 p3o - grpo_eps0.2: the same runs as e1b_clip_sweep_fp8's" in summary
    assert "| e5_fp8 | p3o - grpo_tis | 2 |" in summary  # a shared P3O, an own baseline
    # collapse counts: e1b's falling GRPO counted, e5's marked and not counted
    assert "| e1b_clip_sweep_fp8 | grpo_eps0.2 | 2 | 2 | 2 | 2 |" in summary
    shared = "0 (2 shared, counted under e1b_clip_sweep_fp8)"
    assert f"| e5_fp8 | grpo_eps0.2 | {shared} | 0 | 0 | 0 |" in summary
    assert "| e5_fp8 | p3o_cap_only | 1 (1 shared, counted under e1b_clip_sweep_fp8) |" in summary
    assert "| all | all | 9 | 2 | 2 | 2 |" in summary  # 14 runs, 5 of them shared
    e5 = (root / "e5_fp8" / "table.md").read_text()
    assert "Shared: `grpo_eps0.2` seeds 0, 1 are row for row" in e5
    assert "Shared: `p3o_cap_only` seeds 1 are row for row" in e5
    assert "Shared:" not in (root / "e1b_clip_sweep_fp8" / "table.md").read_text()

"""The CPU-scale reproduction pipeline: experiments/reproduce.py (sweep, resume, command.txt,
--check) and experiments/analyze.py (tables, collapse step, paired intervals, byte-for-byte).

Bugs these catch: a command.txt that does not reproduce the committed metrics (a missing
override, the wrong warm start, a thread setting that changes the numbers); a sweep that reruns
finished runs or forgets the warm start; a collapse step off by the window; an interval that
pairs the wrong seeds or uses a z instead of a t quantile; tables or figures that change when
regenerated from the same files.
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import run_stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(ROOT, "experiments", f"{name}.py")
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


analyze = _load("analyze")
reproduce = _load("reproduce")


def _write_run(path, rewards, ess=1.0, pass1=0.5):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, "eval/pass@1": 0.1}) + "\n")
        for i, r in enumerate(rewards):
            row = {"step": i, "reward_mean": r, "ess": ess, "ess_min": ess, "capped_frac": 0.0}
            f.write(
                json.dumps({**row, "entropy_proxy": 1.0, "kl_behaviour": 0.0, "step_s": 0.1}) + "\n"
            )
        f.write(json.dumps({"step": len(rewards), "eval/pass@1": pass1}) + "\n")


def test_collapse_step_and_moving_mean_by_hand():
    reward = np.array([0.2] * 10 + [0.8] * 10 + [0.1] * 20)
    steps = np.arange(len(reward))
    mm = run_stats.moving_mean(reward)
    assert len(mm) == len(reward) - 9 and mm[0] == pytest.approx(0.2)
    # peak 0.8 (window 10..19); window 15..24 (five 0.8, five 0.1) -> 0.45; window 16..25
    # -> 0.38: the first 10-step mean below half the peak ends at step 25
    assert run_stats.collapse_step(steps, reward) == 25
    assert run_stats.collapse_step(steps, np.linspace(0.2, 0.9, 40)) is None


def test_paired_interval_by_hand():
    mean, lo, hi = run_stats.paired_interval([0.5, 0.6, 0.7], [0.4, 0.4, 0.4])
    d = np.array([0.1, 0.2, 0.3])
    half = 4.303 * d.std(ddof=1) / np.sqrt(3)  # t(0.975, 2 df), not 1.96
    assert (mean, lo, hi) == pytest.approx((0.2, 0.2 - half, 0.2 + half))


def test_analyze_tables_and_regeneration_is_byte_identical(tmp_path):
    root = tmp_path / "results"
    for seed, shift in enumerate((0.0, 0.1, 0.2)):
        _write_run(
            root / "e1_clip_sweep" / "p3o" / str(seed), [0.5 + shift] * 30, pass1=0.6 + shift
        )
        falling = [0.5 + shift] * 15 + [0.02] * 15
        _write_run(root / "e1_clip_sweep" / "grpo_eps0.2" / str(seed), falling, ess=0.9, pass1=0.2)
    first = analyze.analyze(str(root))
    blobs = {p: open(p, "rb").read() for p in first}
    assert analyze.analyze(str(root)) == first
    assert all(open(p, "rb").read() == blobs[p] for p in first)
    table = (root / "e1_clip_sweep" / "table.md").read_text()
    # ARMS order of configs/mini/e1_clip_sweep.py: grpo_eps0.2 before p3o
    assert table.index("| grpo_eps0.2 |") < table.index("| p3o |")
    assert "| p3o | 3 | 0.600 ± 0.100 | 0.700 ± 0.100 |" in table
    # the falling arm: 6 of 10 steps at 0.02 bring the mean below half its peak (step 14 + 6)
    assert "| 20, 20, 20 |" in table
    assert "| none, none, none |" in table
    # P3O minus GRPO final reward: 0.48 + s = 0.48, 0.58, 0.68; half-width 4.303 * 0.1 / sqrt 3
    assert "| p3o | grpo_eps0.2 | 3 | +0.580 [+0.332, +0.828]" in table
    assert (root / "e1_clip_sweep" / "figure.png").read_bytes()[:4] == b"\x89PNG"
    assert "e1_clip_sweep | p3o - grpo_eps0.2 | 3" in (root / "summary.md").read_text()


def test_analyze_refuses_an_empty_results_dir(tmp_path):
    with pytest.raises(SystemExit, match="no <experiment>"):
        analyze.analyze(str(tmp_path))


def test_arm_names_split_into_setting_and_objective():
    assert analyze.split_arm("lag4_p3o") == ("lag4_", "p3o")
    assert analyze.split_arm("t1.2_p3o_dual_mixture") == ("t1.2_", "p3o_dual_mixture")
    assert analyze.split_arm("grpo_eps0.2") == ("", "grpo_eps0.2")
    assert analyze.split_arm("p3o_cap_only") == ("", "p3o_cap_only")


def test_every_mini_arm_builds_a_valid_config():
    """Each arm of every configs/mini experiment loads and validates (warm start path faked:
    the embedded model with the shape of the experiment's warm start, an MoE for WARM moe)."""
    from configs.mini import common, warm_start
    from ess_jax.rl import experiment

    for exp in reproduce.EXPERIMENTS:
        for arm in reproduce.arms_of(exp):
            mod = importlib.import_module(f"configs.mini.{exp}")
            c = mod.get_config(arm)
            c.model.source = "embedded"
            warm = warm_start.get_config(getattr(mod, "WARM", "policy")).model
            for key in common.MOE_MODEL:
                c.model[key] = warm[key]
            if c.rollout.external_fraction:
                c.rollout.external_checkpoint = "embedded"
            experiment.validate(c)
    with pytest.raises(ValueError, match="unknown arm"):
        importlib.import_module("configs.mini.e1_clip_sweep").get_config("grpo_eps0.3")


TINY = (
    "warm:sft.steps=3",
    "warm:task.num_train=64",
    "warm:eval.every=0",
    "train.steps=3",
    "train.checkpoint_every=2",
    "task.num_train=64",
    "data.prompts_per_step=4",
    "rollout.group_size=2",
    "eval.every=2",
    "eval.num_examples=32",
    "eval.k=1",
)


def test_sweep_runs_skips_finished_and_command_txt_reproduces(tmp_path):
    runs, results = tmp_path / "runs", tmp_path / "results"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "experiments", "reproduce.py"),
        "--experiments", "e1_clip_sweep",
        "--arms", "p3o",
        "--seeds", "0",
        "--runs", str(runs),
        "--results", str(results),
        "--set", *TINY,
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 warm starts and 1 runs to go" in out.stdout
    res = results / "e1_clip_sweep" / "p3o" / "0"
    rows = [json.loads(x) for x in (res / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == [0, 1, 2]
    command = (res / "command.txt").read_text()
    assert "configs/mini/warm_start.py:policy --config.seed=0 --config.sft.steps=3" in command
    assert "--config.model.source={workdir}/warm/policy/seed0/hf" in command
    assert "intra_op_parallelism_threads=1" in command
    # the CPUs the run had, which XLA:CPU's numbers depend on, and the rerun pinned to as many
    n = reproduce.cpus()
    pin = "0" if n == 1 else f"0-{n - 1}"
    assert f"# CPUs: {n} " in command and f"taskset -c {pin} " in command
    # a second sweep finds nothing to do
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert "0 warm starts and 0 runs to go" in again.stdout, again.stdout + again.stderr
    # the committed command reproduces the committed metrics from scratch
    assert reproduce.check(str(res)) == 0


def test_a_multi_device_experiment_gets_its_devices():
    """Catches XLA_FLAGS that name the device count after the bare `intra_op_parallelism_threads=1`
    token, where XLA stops reading flags: the async actor-learner's runs then saw one CPU device
    and every one of them failed at start."""
    env = {**os.environ, "XLA_FLAGS": reproduce.xla_flags("async_actor_learner")}
    code = "import jax; print(jax.device_count())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == str(reproduce.DEVICES["async_actor_learner"]), out.stderr
    assert reproduce.xla_flags("e1_clip_sweep") == reproduce.XLA_FLAGS  # one device: unchanged

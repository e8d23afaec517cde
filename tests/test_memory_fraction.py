"""The memory planner and the launch agree on the share of GPU memory a run may fill:
`python -m ess_jax.main` sets XLA_PYTHON_CLIENT_MEM_FRACTION (jax preallocates 75% without it)
to presets.MEM_FRACTION before jax starts, unless the user set it, and the planner checks plans
against the same share (the user's on GPUs when set)."""

import importlib
import os
import subprocess
import sys

import pytest

from ess_jax.config import presets

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# main as `python -m ess_jax.main` runs it, with the run replaced by a line naming what jax saw
PROBE = """
import os, sys
from absl import app
from ess_jax import main
from ess_jax.rl import train
def run(config, workdir, allow_config_change=()):
    import jax
    print("fraction", os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"), jax.default_backend())
    sys.exit(0)
train.run = run
app.run(main.main, flags_parser=main._parse_flags)
"""


def _launch(tmp_path, **env) -> str:
    base = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, "--config=configs/quickstart.py:tiny",
         f"--workdir={tmp_path}"],
        cwd=REPO, env={**base, **env}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return next(ln for ln in out.stdout.splitlines() if ln.startswith("fraction"))


def test_main_gives_jax_the_planners_share(tmp_path):
    """Catches a launch that leaves jax's 75% default under a planner that allows 90% (a plan
    that fits runs out of memory), and one that overrides the user's own setting."""
    assert _launch(tmp_path).split()[1] == str(presets.MEM_FRACTION) == "0.9"
    assert _launch(tmp_path, XLA_PYTHON_CLIENT_MEM_FRACTION="0.5").split()[1] == "0.5"


def test_planner_uses_the_same_share():
    """Catches a planner whose usable memory is not what the launch gives jax."""
    from configs.paper import e2_qwen25_1p5b
    from ess_jax.memory import planner

    config = e2_qwen25_1p5b.get_config("p3o,8xh100")
    plan = planner.plan(config, 8, "h100")
    assert plan.usable == pytest.approx(presets.HBM["h100"] * presets.MEM_FRACTION)
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    assert presets.memory_fraction("h100", env) == 0.5
    assert presets.memory_fraction("v5p", env) == presets.MEM_FRACTION  # TPUs ignore it
    environ = {}
    presets.set_memory_fraction(environ)
    assert environ == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}


OLD, NEW = "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION"


@pytest.mark.parametrize("text", ["abc", "1.5", "0", "-0.5", "nan", "inf"])
@pytest.mark.parametrize("name", [OLD, NEW])
def test_a_fraction_outside_0_1_is_one_line_naming_the_variable(name, text):
    """Catches `=abc` as a float() traceback in the planner and the launch, and `=1.5` planned
    as 150% of HBM (or `=0`, `=nan`) instead of refused."""
    with pytest.raises(presets.UserError) as e:
        presets.memory_fraction("h100", {name: text})
    assert str(e.value).startswith(f"{name}={text!r}: must be a number in (0, 1]")
    assert "\n" not in str(e.value)
    with pytest.raises(presets.UserError):
        presets.set_memory_fraction({name: text})


def test_either_name_is_honoured_and_two_different_values_refused():
    """Catches the planner ignoring jaxlib's XLA_CLIENT_MEM_FRACTION (planning 90% under a launch
    that gives jax the user's 50%), and two names that disagree planned with one of them."""
    assert presets.memory_fraction("h100", {NEW: "0.5"}) == 0.5
    assert presets.memory_fraction("h200", {OLD: "1"}) == 1.0
    assert presets.memory_fraction("h100", {NEW: "0.5", OLD: "0.50"}) == 0.5
    assert presets.memory_fraction("h100", {NEW: "", OLD: ""}) == presets.MEM_FRACTION
    with pytest.raises(presets.UserError, match=rf"^{NEW}=0.5 and {OLD}=0.6 disagree"):
        presets.memory_fraction("h100", {NEW: "0.5", OLD: "0.6"})


@pytest.mark.parametrize(
    "given,left",
    [
        ({}, {OLD: "0.9"}),
        ({OLD: ""}, {OLD: "0.9"}),  # empty is unset for jaxlib: 75%, not the planner's 90%
        ({OLD: "0.5"}, {OLD: "0.5"}),
        ({NEW: "0.5"}, {NEW: "0.5"}),
        ({NEW: "0.5", OLD: "0.5"}, {NEW: "0.5"}),
    ],
)
def test_the_launch_never_leaves_jax_both_names(given, left):
    """Catches the launch setting XLA_PYTHON_CLIENT_MEM_FRACTION on top of the user's
    XLA_CLIENT_MEM_FRACTION (jaxlib refuses the two "specified together" when its GPU backend
    starts), leaving the user's two equal settings both in place, or taking an empty value for
    the user's (jax then preallocates 75% under a plan for 90%)."""
    environ = dict(given)
    presets.set_memory_fraction(environ)
    assert environ == left


@pytest.mark.parametrize("tool", ["plan_memory", "generate", "evaluate"])
def test_the_tools_refuse_a_bad_fraction_in_one_line(tool, tmp_path, monkeypatch, capsys):
    """Catches tools/plan_memory.py, generate.py or evaluate.py ending in a traceback for
    XLA_PYTHON_CLIENT_MEM_FRACTION=abc, or with another exit status than ess_jax.main's 2."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    module = importlib.import_module(tool)
    argv = {
        "plan_memory": [f"--config={REPO}/configs/quickstart.py:tiny", "--device=h100",
                        "--num_devices=1"],
        "generate": ["--prompt=hi"],
        "evaluate": ["--checkpoint=none", f"--data=aime24={tmp_path}"],
    }[tool]  # fmt: skip
    monkeypatch.setenv(OLD, "abc")
    monkeypatch.delenv(NEW, raising=False)
    try:
        rc = module.main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert (rc, err) == (2, [f"error: {OLD}='abc': must be a number in (0, 1], the share of "
                             "each GPU's memory jax may take"])  # fmt: skip


def test_main_refuses_two_different_fractions_before_jax(tmp_path):
    """Catches `python -m ess_jax.main` passing two disagreeing names on to jaxlib (its
    "specified together" ValueError at the first GPU computation, after the config and workdir
    checks) instead of one line with the config mistakes' exit status 2, before the workdir."""
    env = {k: v for k, v in os.environ.items() if k not in (OLD, NEW, "ESS_JAX_VERBOSE")}
    out = subprocess.run(
        [sys.executable, "-m", "ess_jax.main", "--config=configs/quickstart.py:tiny",
         f"--workdir={tmp_path / 'run'}"],
        cwd=REPO, env={**env, NEW: "0.5", OLD: "0.6"}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    err = [line for line in out.stderr.splitlines() if line.strip()]
    assert (out.returncode, err) == (2, [f"error: {NEW}=0.5 and {OLD}=0.6 disagree: set one of "
                                         f"them ({NEW}: jaxlib's name)"])  # fmt: skip
    assert not (tmp_path / "run").exists()

"""The memory planner and the launch agree on the share of GPU memory a run may fill:
`python -m ess_jax.main` sets XLA_PYTHON_CLIENT_MEM_FRACTION (jax preallocates 75% without it)
to presets.MEM_FRACTION before jax starts, unless the user set it, and the planner checks plans
against the same share (the user's on GPUs when set)."""

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

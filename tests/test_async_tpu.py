"""tools/async_tpu.py: the two-slice async prediction from a compiled record, on a hand-made
record whose times are round numbers (no compile, milliseconds)."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import async_tpu  # noqa: E402  (tools/async_tpu.py)

from ess_jax.config.defaults import base_config  # noqa: E402


def _record(step_trips: int) -> dict:
    row = lambda t, trips=1, **kw: {"optimal_seconds": t, "loop_trips": trips, **kw}  # noqa: E731
    return {
        "config": "configs/quickstart.py",
        "topology": "v5p:2x2x1",
        "devices": 4,
        "hosts": 1,
        "per_device": {"hbm_bandwidth": 2e12},
        "programs": {
            "rl_step": row(2.0, step_trips),
            "sample/prefill": row(0.5),
            "sample/decode4": row(0.1, 3),
            "sample/decode8": row(0.2, 4),
            "eval/decode8": row(9.0, 4),  # eval is left out
            "sampler_copy/bfloat16": row(0.05),
            "reshard": row(0.01, memory={"argument": 4e9}),
        },
    }


def _config(remat: bool):
    c = base_config()
    c.train.num_microbatches, c.train.updates_per_batch = 4, 2
    c.rollout.sample_microbatches, c.rollout.precision = 2, "bfloat16"
    c.model.remat = remat
    return c


def test_terms_rebuild_loops_from_their_bodies():
    """Catches a step time taken as optimal_seconds x loop_trips when the statistics pass's
    forward loop and the kept last micro-batch are in the program (E3's step: (M - 1) f + M g
    over f + 2 g), the remat ratio g = 4 f ignored, eval's programs counted as the sampler's,
    a decode segment counted once instead of per token, and the pull sized by anything but a
    host's train-layout params over its link."""
    t = async_tpu.terms(_record(3), _config(True), 1, 1, 2.0)
    assert t["train_s"] == pytest.approx(2 * 2.0 * (3 + 4 * 4) / (1 + 2 * 4))  # 8.444
    assert async_tpu.terms(_record(3), _config(False), 1, 1, 2.0)["train_s"] == pytest.approx(
        2 * 2.0 * (3 + 4 * 3) / (1 + 2 * 3)
    )
    assert async_tpu.terms(_record(4), _config(True), 1, 1, 2.0)["train_s"] == 2 * 2.0 * 4
    assert t["sample_s"] == pytest.approx(2 * (0.5 + 0.1 * 3 + 0.2 * 4) + 0.05)  # 3.25
    assert t["pull_s"] == pytest.approx(4e9 * 4 / 2e9)  # a host's 4 devices over one link
    assert t["push_s"] == pytest.approx(4e-3)
    assert t["sync_both_s"] == pytest.approx((3.25 + 4 * 19 / 9) / 2)


def test_unusable_records_are_one_line_exit_2(tmp_path, capsys):
    """Catches a prediction built on a negative or refused compiler time (the compiler's
    estimate can be meaningless, docs/tpu.md), on a record compiled with --only (no sampler
    programs), or on a step whose loop_trips fits neither loop structure."""
    bad = _record(3)
    bad["programs"]["sample/decode8"]["optimal_seconds"] = -3.0
    only = {**_record(3), "programs": {"rl_step": _record(3)["programs"]["rl_step"]}}
    odd = _record(7)
    for rec, words in ((bad, "negative"), (only, "--only"), (odd, "neither M nor M - 1")):
        path = tmp_path / "r.json"
        path.write_text(json.dumps(rec))
        assert async_tpu.main([str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and words in err and "\n" not in err

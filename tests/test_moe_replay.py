"""configs/mini/moe_replay.py and its report (experiments/moe_replay.py): every arm builds the
map's calibrated condition with replay on or off and nothing else apart; the embedded MoE
warm start's config builds the Qwen3-MoE model; the report on a fake results directory counts
collapses and pairs seeds as declared, and is written byte for byte the same twice."""

import json

import numpy as np

from configs.mini import common, moe_replay, warm_start
from ess_jax.config import schema
from ess_jax.config.defaults import base_config
from ess_jax.rl import experiment
from experiments import moe_replay as report


def test_arms_differ_in_replay_only():
    """The report's arm grid is the config's; each objective's two arms differ in
    model.routing_replay alone and carry the calibrated sampler."""
    assert report.CONDITIONS == moe_replay.CONDITIONS
    assert report.OBJECTIVES == moe_replay.OBJECTIVES
    for obj in moe_replay.OBJECTIVES:
        a = moe_replay.get_config(f"calib_{obj}").to_dict()
        b = moe_replay.get_config(f"calib+replay_{obj}").to_dict()
        assert a["model"].pop("routing_replay") == "none"
        assert b["model"].pop("routing_replay") == "sampler"
        assert a == b and a["rollout"]["precision"] == common.CALIBRATED_PRECISION
        assert a["rollout"]["kv_cache_precision"] == common.CALIBRATED_KV_CACHE
        assert a["train"]["steps"] == common.MOE_STEPS


def test_embedded_moe_builds():
    """warm_start.py:moe validates and its model is a Qwen3-MoE with every layer sparse; an
    embedded top-k above the expert count fails in one line naming the field."""
    c = warm_start.get_config("moe")
    schema.check_rules(c)
    m = c.model
    cfg = experiment.embedded_model_config(m, experiment.char_tokenizer())
    assert cfg.family == "qwen3_moe" and cfg.num_experts == common.MOE_MODEL["num_experts"]
    assert all(cfg.is_sparse(i) for i in range(cfg.num_layers))
    bad = base_config()
    bad.model.num_experts, bad.model.num_experts_per_tok = 2, 3
    try:
        schema.check_rules(bad)
    except schema.UserError as e:
        assert "model.num_experts_per_tok" in str(e)
    else:
        raise AssertionError("top-k 3 of 2 experts passed")


def _run(path, rewards, pass1, flip):
    path.mkdir(parents=True)
    rows = [{"step": 0, "eval/pass@1": pass1[0]}]
    for i, r in enumerate(rewards):
        rows.append({"step": i, "reward_mean": r, "ess": 0.9, "routing_flip": flip,
                     "kl_behaviour": 0.01})  # fmt: skip
    rows.append({"step": len(rewards), "eval/pass@1": pass1[1]})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report(tmp_path):
    """Seed 0 of the no-replay p3o arm collapses (reward 0.5 then 0 for 30 steps): counted once,
    at step 35 (where the first 10-step window with a mean below half the peak, 0.25, ends);
    replay p3o learns in both seeds; the paired pass@1 difference is replay minus none. Written
    twice, the same bytes."""
    exp = tmp_path / "moe_replay"
    _run(exp / "calib_p3o" / "0", [0.5] * 30 + [0.0] * 30, (0.2, 0.1), 0.05)
    _run(exp / "calib_p3o" / "1", [0.5] * 60, (0.2, 0.3), 0.05)
    _run(exp / "calib+replay_p3o" / "0", [0.5] * 60, (0.2, 0.4), 0.05)
    _run(exp / "calib+replay_p3o" / "1", [0.5] * 60, (0.2, 0.5), 0.05)
    md, png = report.write(str(tmp_path))
    text = open(md).read()
    assert "| p3o | no | 2 (seeds 0, 1) | 1 (35, none) | 1 |" in text, text
    assert "| p3o | yes | 2 (seeds 0, 1) | 0 (none, none) | 2 |" in text
    d = np.mean([0.4 - 0.1, 0.5 - 0.3])
    assert f"| p3o | 2 | {d:+.3f} [" in text
    assert "| vcpo | 0 | - | - | - | no paired seeds yet |" in text
    assert "## Notes" not in text  # no warm start below DEAD_START
    first = open(md, "rb").read(), open(png, "rb").read()
    report.write(str(tmp_path))
    assert (open(md, "rb").read(), open(png, "rb").read()) == first

"""The RL loop end to end on the tiny quickstart config (8 fake CPU devices)."""

import json
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import quickstart
from ess_jax import objectives as O
from ess_jax.io import weights
from ess_jax.model import decoder as model
from ess_jax.parallel import sharding
from ess_jax.rl import actor_learner, rollout, train
from ess_jax.rl import update as U
from ess_jax.rl.metrics import read_metrics


def tiny_config(**overrides):
    c = quickstart.get_config("tiny")
    c.sft.steps = 0
    c.eval.every = 0
    c.data.prompts_per_step = 2
    c.rollout.group_size = 4  # 8 sequences: one per fake device
    c.rollout.max_new_tokens = 4
    for key, value in overrides.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


def coin_reward(text, example):
    """A reward a random policy earns half the time (a stable hash of its text), so the first
    updates have nonzero advantages and really move the policy."""
    return float(zlib.crc32(text.encode()) % 2)


def first_rows(config, workdir, steps=1):
    run = train.Run(config, str(workdir))
    run.reward_fn = coin_reward
    run.sft()
    run.trainer.history.push(0, sharding.reshard(run.trainer.state.params, run.sample_sh))
    return [run.rl_step(s) for s in range(steps)]


def test_full_loop_writes_metrics_checkpoint_png_and_resumes_exactly(tmp_path):
    c = quickstart.get_config("tiny")
    c.rollout.lag = 1  # the stale-policy history must be checkpointed and restored too
    full = tmp_path / "full"
    png = train.run(c, str(full))
    assert os.path.exists(png) and os.path.getsize(png) > 1000
    rows = read_metrics(full)
    steps = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval/pass@1" in r]
    assert [r["step"] for r in steps] == list(range(c.train.steps))
    assert evals[0]["step"] == 0 and evals[-1]["step"] == c.train.steps
    for key in (
        "reward_mean",
        "ess",
        "kl_behaviour",
        "capped_frac",
        "clip_frac",
        "loss",
        "grad_norm",
        "tokens_per_s",
        *O.MISMATCH_KEYS,  # the first update's train/sampler mismatch, in every row
    ):
        assert all(np.isfinite(r[key]) for r in steps), key
    assert os.listdir(full / "checkpoints")
    assert any(f.startswith("events") for f in os.listdir(full / "tb"))

    # Interrupt after 2 steps (a checkpoint is written at step 2), then resume to the end.
    part = tmp_path / "part"
    c_short = quickstart.get_config("tiny")
    c_short.rollout.lag = 1
    c_short.train.steps = 2
    train.run(c_short, str(part))
    train.run(c, str(part))
    resumed = read_metrics(part)
    volatile = ("tokens_per_s", "sample_s", "step_s")
    strip = lambda rs: [{k: v for k, v in r.items() if k not in volatile} for r in rs]
    assert strip(resumed) == strip(rows)


def test_on_policy_ess_is_one(tmp_path):
    (row,) = first_rows(tiny_config(), tmp_path)
    assert abs(row["ess"] - 1.0) < 1e-5
    assert abs(row["ratio_mean"] - 1.0) < 1e-5 and abs(row["ratio_max"] - 1.0) < 1e-5
    assert row["kl_behaviour"] < 1e-5
    # not vacuous: real tokens were drawn from a spread-out distribution and trained on
    assert row["response_len"] > 0 and row["entropy_proxy"] > 0.5


@pytest.mark.parametrize(
    "knob,value,step",
    [
        ("rollout.temperature", 1.5, 0),
        ("rollout.top_p", 0.7, 0),
        ("rollout.top_k", 4, 0),
        ("rollout.precision", "bfloat16", 0),
        ("rollout.precision", "fp8", 0),
        ("train.updates_per_batch", 2, 0),
        ("rollout.lag", 1, 1),
    ],
)
def test_each_off_policy_knob_lowers_ess(tmp_path, knob, value, step):
    overrides = {knob: value, "optim.lr": 1e-2}
    if knob == "train.updates_per_batch":
        overrides["data.prompts_per_step"] = 4  # two updates of 8 sequences
    if knob in ("rollout.top_p", "rollout.top_k"):
        # A random init is near-uniform over the vocab: every row then keeps ~70% of the mass,
        # all ratios are ~0.70 and the ESS is 1. A short warm start gives a peaked policy.
        overrides["sft.steps"] = 30
    rows = first_rows(tiny_config(**overrides), tmp_path, steps=step + 1)
    assert rows[step]["ess"] < 1.0 - 1e-4, rows[step]
    if knob == "rollout.lag":
        assert rows[0]["ess"] > 1.0 - 1e-5  # nothing to lag behind yet at step 0
        assert rows[1]["policy_lag"] == 1


def test_external_behaviour_model_lowers_ess(tmp_path):
    base = tiny_config()
    run = train.Run(base, str(tmp_path / "probe"))
    other = model.init_params(run.model_cfg, 123)
    ext_dir = tmp_path / "external"
    weights.save_hf(run.model_cfg, jax.device_get(other), str(ext_dir))
    c = tiny_config(
        **{"rollout.external_fraction": 0.5, "rollout.external_checkpoint": str(ext_dir)}
    )
    (row,) = first_rows(c, tmp_path / "ext")
    assert row["ess"] < 0.99


@pytest.mark.parametrize(
    "key,value,field",
    [
        ("objective.name", "ppo_typo", "objective.name"),
        ("task.name", "nosuchtask", "task.name"),
        ("task.reward", "nosuchreward", "task.reward"),
        ("data.prompts_per_step", 3, "data.prompts_per_step"),
        ("model.source", "/no/such/checkpoint", "model.source"),
        ("rollout.precision", "fp4", "rollout.precision"),
    ],
)
def test_bad_config_fails_before_compiling(tmp_path, key, value, field):
    c = tiny_config(**{key: value})
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        train.Run(c, str(tmp_path))
    assert not os.path.exists(tmp_path / "checkpoints")


def test_relative_workdir_and_metrics_rows_are_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # README's command uses a relative --workdir
    c = tiny_config(**{"train.steps": 1})
    train.run(c, "runs/rel")
    assert train.Checkpointer("runs/rel/checkpoints").latest_step() == 1
    with open(tmp_path / "runs/rel/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert rows and all("step" in r for r in rows)


def test_nonfinite_updates_are_skipped_then_stop_the_run(tmp_path, monkeypatch):
    real = U.step_loss_and_grad

    def poisoned(*args, **kwargs):
        loss, grads, metrics = real(*args, **kwargs)
        return loss * jnp.nan, jax.tree.map(lambda g: g * jnp.nan, grads), metrics

    monkeypatch.setattr(U, "step_loss_and_grad", poisoned)
    run = train.Run(tiny_config(), str(tmp_path))
    before = jax.device_get(run.trainer.state.params)
    run.trainer.history.push(0, sharding.reshard(run.trainer.state.params, run.sample_sh))
    rows = [run.rl_step(0), run.rl_step(1)]
    assert [r["skipped"] for r in rows] == [1, 1]
    with pytest.raises(train.NonFiniteError, match="3 updates in a row"):
        run.rl_step(2)
    after = jax.device_get(run.trainer.state.params)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)  # never overwritten with NaNs
    assert int(run.trainer.state.step) == 0


def test_ctrl_c_saves_a_checkpoint_and_the_run_resumes(tmp_path, monkeypatch):
    c = tiny_config(**{"train.steps": 3, "train.checkpoint_every": 100})
    real = actor_learner.SyncLoop.step

    def interrupted(self, step):
        if step == 2:
            raise KeyboardInterrupt
        return real(self, step)

    monkeypatch.setattr(actor_learner.SyncLoop, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train.run(c, str(tmp_path))
    assert train.Checkpointer(str(tmp_path / "checkpoints")).latest_step() == 2
    monkeypatch.setattr(actor_learner.SyncLoop, "step", real)
    train.run(c, str(tmp_path))
    steps = [r["step"] for r in read_metrics(tmp_path) if "reward_mean" in r]
    assert steps == [0, 1, 2]


def test_ctrl_c_between_update_and_history_push_still_saves(tmp_path, monkeypatch):
    # lag 0 on one layout: the history shares buffers with the params the update donated
    c = tiny_config(**{"train.steps": 3, "train.checkpoint_every": 100})
    real_push = rollout.ParamHistory.push

    raised = []

    def push(self, version, params):
        if version == 2 and not raised:  # once: the interrupt handler pushes version 2 too
            raised.append(1)
            raise KeyboardInterrupt
        return real_push(self, version, params)

    monkeypatch.setattr(rollout.ParamHistory, "push", push)
    with pytest.raises(KeyboardInterrupt):
        train.run(c, str(tmp_path))
    monkeypatch.setattr(rollout.ParamHistory, "push", real_push)
    # step 1's update was applied: its state is saved as step 2 (no deleted buffer touched)
    assert train.Checkpointer(str(tmp_path / "checkpoints")).latest_step() == 2
    train.run(c, str(tmp_path))
    assert [r["step"] for r in read_metrics(tmp_path) if "reward_mean" in r] == [0, 2]


def test_ctrl_c_while_sampling_resumes_exactly(tmp_path, monkeypatch):
    c = tiny_config(**{"train.steps": 3, "train.checkpoint_every": 100})
    train.run(c, str(tmp_path / "full"))
    real_collect = rollout.collect
    calls = []

    def collect(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # step 1, after the data iterator has moved on
            raise KeyboardInterrupt
        return real_collect(*args, **kwargs)

    monkeypatch.setattr(rollout, "collect", collect)
    with pytest.raises(KeyboardInterrupt):
        train.run(c, str(tmp_path / "cut"))
    monkeypatch.setattr(rollout, "collect", real_collect)
    assert train.Checkpointer(str(tmp_path / "cut" / "checkpoints")).latest_step() == 1
    train.run(c, str(tmp_path / "cut"))
    volatile = ("tokens_per_s", "sample_s", "step_s")
    strip = lambda rs: [{k: v for k, v in r.items() if k not in volatile} for r in rs]
    assert strip(read_metrics(tmp_path / "cut")) == strip(read_metrics(tmp_path / "full"))

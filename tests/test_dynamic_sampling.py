"""DAPO dynamic sampling with resampling (ess_jax/rl/dynamic_sampling.py).

A reward we control decides which prompts give a constant group: "mixed" prompts reward the
first sample of their group (1, 0, 0, 0: GRPO advantages 1.5, -0.5, -0.5, -0.5 by hand), the
others reward nothing. `rollout.collect` scores a batch's rows in order, groups of G
consecutive calls, so a counter knows which sample of its group a call is.
"""

import logging

import jax
import ml_collections
import numpy as np
import pytest
from test_memory_knobs import CFG
from test_train import coin_reward, tiny_config

from ess_jax import rewards
from ess_jax.config.schema import ConfigError
from ess_jax.data import PromptBatcher, char_tokenizer
from ess_jax.model import decoder as model
from ess_jax.model import scoring
from ess_jax.parallel import sharding
from ess_jax.rl import dynamic_sampling, experiment, rollout, train
from ess_jax.rl.metrics import read_metrics

G = 4
FIELDS = ("tokens", "attn_mask", "loss_mask", "behaviour_logp", "advantages", "rewards")
_tf_logp = jax.jit(scoring.token_logprobs, static_argnums=0)
DS_KEYS = ("ds_rounds", "ds_groups_kept", "ds_groups_masked", "ds_frac_constant")


def first_of_group_reward(mixed_prompts):
    calls = []

    def reward(text, example):
        calls.append(1)
        first = (len(calls) - 1) % G == 0
        return float(first and example["prompt"] in mixed_prompts)

    return reward


def group(r, i, name):
    return np.asarray(getattr(r, name))[i * G : (i + 1) * G]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One tiny run (2 prompts x 4 samples per step) shared by the cases: they only change
    the reward, the cap and the data position, none of which recompiles anything."""
    c = tiny_config(**{"rollout.dynamic_sampling": True, "rollout.max_resample_rounds": 2})
    r = train.Run(c, str(tmp_path_factory.mktemp("ds")))
    r.trainer.history.push(0, sharding.reshard(r.trainer.state.params, r.sample_sh))
    yield r
    r.close()


def one_step(run, monkeypatch, step, mixed, max_rounds):
    """rl_step with `mixed` prompts (as indices into the next rounds' prompt batches: (round,
    slot)) rewarding; returns (row, batch trained on, [(prompt batch, key, rollout)] per
    collect call, the rounds' prompt batches from a preview of the data stream)."""
    preview = PromptBatcher(
        run.train_examples, run.tokenizer, 2, buckets=tuple(run.config.data.buckets)
    )
    preview.restore(run.trainer.batcher.state())
    rounds = [next(preview) for _ in range(max(max_rounds, *(i for i, _ in mixed)) + 1)]
    run.reward_fn = first_of_group_reward({rounds[i]["examples"][j]["prompt"] for i, j in mixed})
    run.rollout_cfg.max_resample_rounds = max_rounds
    calls, batches = [], []
    real_collect, real_batch = rollout.collect, dynamic_sampling.collect_batch

    def collect(policy, prompt_batch, tok, reward_fn, rcfg, key, external=None):
        out = real_collect(policy, prompt_batch, tok, reward_fn, rcfg, key, external=external)
        calls.append((prompt_batch, key, out[0]))
        return out

    def collect_batch(*args, **kwargs):
        out = real_batch(*args, **kwargs)
        batches.append(out[0])
        return out

    start = run.trainer.batcher.state()
    with monkeypatch.context() as m:
        m.setattr(rollout, "collect", collect)
        m.setattr(dynamic_sampling, "collect_batch", collect_batch)
        row = run.rl_step(step)
    step_key = jax.random.fold_in(jax.random.fold_in(run.rng, 1), step)
    return row, batches[0], calls, rounds, start, step_key


def assert_same_group(a, i, b, j):
    for name in FIELDS:
        np.testing.assert_array_equal(group(a, i, name), group(b, j, name), err_msg=name)


def assert_mixed_advantages(r, i):
    """The hand-computed GRPO advantages of rewards (1, 0, 0, 0) on every response token."""
    adv, mask = group(r, i, "advantages"), group(r, i, "loss_mask") > 0
    assert mask.any(axis=1).all()
    expected = np.array([1.5, -0.5, -0.5, -0.5])[:, None] * mask
    np.testing.assert_allclose(adv, expected, rtol=1e-6)


def test_extra_rounds_refill_constant_groups_in_order(run, monkeypatch):
    """Catches: a refilled slot taking the wrong group of its round (or the first round's
    constant group left in), extra rounds drawn with the first round's key or not from the
    data stream (the position would not cover them), a round too many after the batch is full,
    metrics counting the wrong groups, a reward_mean of the filtered batch."""
    # round 0: slot 0 constant, slot 1 mixed; round 1: both constant; round 2: both mixed
    row, batch, calls, rounds, start, step_key = one_step(
        run, monkeypatch, 0, mixed={(0, 1), (2, 0), (2, 1)}, max_rounds=2
    )
    assert len(calls) == 3
    for (prompts, _, _), expected in zip(calls, rounds):
        np.testing.assert_array_equal(prompts["indices"], expected["indices"])
    keys = [jax.random.key_data(k).tolist() for _, k, _ in calls]
    assert keys[0] == jax.random.key_data(step_key).tolist()  # round 0 as without resampling
    assert len({str(k) for k in keys}) == 3
    # slot 0: round 2's first group (its second is dropped); slot 1: round 0's own group
    r0, r2 = calls[0][2], calls[2][2]
    assert_same_group(batch, 0, r2, 0)
    assert_same_group(batch, 1, r0, 1)
    for i in (0, 1):
        assert_mixed_advantages(batch, i)
    np.testing.assert_array_equal(batch.rewards, [1, 0, 0, 0] * 2)
    assert {k: row[k] for k in DS_KEYS} == {
        "ds_rounds": 3, "ds_groups_kept": 2, "ds_groups_masked": 0, "ds_frac_constant": 0.5,
    }  # fmt: skip
    assert row["reward_mean"] == pytest.approx(float(np.mean(r0.rewards)))  # 1 / 8
    assert run.trainer.batcher.state()["position"] - start["position"] == 3 * 2
    assert run.trainer.batcher.state()["epoch"] == start["epoch"]

    # round 0 has no constant group: no extra round, the batch is round 0's
    row, batch, calls, *_ = one_step(run, monkeypatch, 1, mixed={(0, 0), (0, 1)}, max_rounds=2)
    assert len(calls) == 1 and batch is calls[0][2]
    assert (row["ds_rounds"], row["ds_groups_kept"], row["ds_frac_constant"]) == (1, 2, 0.0)


def test_cap_on_rounds_masks_what_is_left_with_a_warning(run, monkeypatch, caplog):
    """Catches: a cap off by one (a round more than rollout.max_resample_rounds), an unfilled
    slot left out of the batch or trained on (its loss mask must be zero), no warning."""
    start_position = run.trainer.batcher.state()["position"]
    with caplog.at_level(logging.WARNING):
        row, batch, calls, *_ = one_step(
            run, monkeypatch, 2, mixed={(0, 1), (2, 0), (2, 1)}, max_rounds=1
        )
    assert len(calls) == 2  # rounds 0 and 1; round 2 (which would fill it) is never drawn
    assert run.trainer.batcher.state()["position"] - start_position == 2 * 2
    r0 = calls[0][2]
    for i in (0, 1):
        assert_same_group(batch, i, r0, i)
    assert not group(batch, 0, "loss_mask").any()
    assert_mixed_advantages(batch, 1)
    assert {k: row[k] for k in DS_KEYS} == {
        "ds_rounds": 2, "ds_groups_kept": 1, "ds_groups_masked": 1, "ds_frac_constant": 0.75,
    }  # fmt: skip
    assert any("max_resample_rounds" in r.getMessage() for r in caplog.records)


def test_groups_of_a_narrower_bucket_keep_their_exact_behaviour_logp():
    """Catches: a group from a round with shorter prompts merged without left pads in front
    (or with pads the attention sees), so its recorded pi_b does not match the sequence the
    trainer scores: the teacher-forced log-probs of the merged batch must equal pi_b."""
    params = model.init_params(CFG, 0)
    rng = np.random.default_rng(0)

    def prompts(width, names):
        toks = rng.integers(3, 48, (2, width)).astype(np.int32)
        return {
            "prompt_tokens": toks,
            "prompt_mask": np.ones((2, width), bool),
            "examples": [{"prompt": n} for n in names],
        }

    stream = iter([prompts(7, ("a", "b")), prompts(10, ("c", "d"))])  # round 0 narrower
    rcfg = ml_collections.ConfigDict(
        dict(
            group_size=G, max_new_tokens=5, temperature=1.0, top_k=0, top_p=1.0,
            precision="float32", external_fraction=0.0, external_precision="float32",
            stop_ids=(), advantage_mode="grpo", dynamic_sampling=True, overlong_buffer=0,
            sample_microbatches=1, max_resample_rounds=1,
        )
    )  # fmt: skip
    tok = char_tokenizer()
    engine = rollout.policy_engine(CFG, rcfg)
    engine.update_params(0, params)
    reward = first_of_group_reward({"b", "c", "d"})
    key = jax.random.key(0)
    out, metrics = dynamic_sampling.collect_batch(engine, stream, tok, reward, rcfg, key)
    assert out.prompt_len == 10 and out.tokens.shape == (8, 15)
    assert metrics["ds_rounds"] == 2 and metrics["ds_groups_masked"] == 0
    # slot 1 is round 0's group (7-token prompts): 3 pad columns in front, never attended
    assert (out.tokens[4:, :3] == tok.pad_token_id).all() and not out.attn_mask[4:, :3].any()
    logp = np.asarray(_tf_logp(CFG, params, out.tokens, out.attn_mask))[:, 10:]
    np.testing.assert_allclose(out.behaviour_logp, logp * out.loss_mask, atol=1e-5)
    assert np.abs(out.behaviour_logp[4:]).sum() > 0
    seen = out.attn_mask.copy()
    seen[4:, :3] = True  # the pads attended: pi_b would not match
    wrong = np.asarray(_tf_logp(CFG, params, out.tokens, seen))[4:, 10:]
    assert np.abs((wrong - logp[4:]) * out.loss_mask[4:]).max() > 1e-3


def test_resample_rounds_need_dynamic_sampling_and_groups(tmp_path):
    """Catches: a resampling config that silently does nothing (dynamic_sampling off) or can
    never fill a batch (groups of one sample), or a negative cap, accepted."""
    for overrides, words in (
        ({"rollout.max_resample_rounds": 2}, "needs rollout.dynamic_sampling"),
        (
            {"rollout.dynamic_sampling": True, "rollout.max_resample_rounds": 2,
             "rollout.group_size": 1, "train.updates_per_batch": 1},
            "group_size=1",
        ),
        ({"rollout.dynamic_sampling": True, "rollout.max_resample_rounds": -1}, ">= 0"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=f"config.rollout.max_resample_rounds.*{words}"):
            experiment.validate(tiny_config(**overrides))


def test_run_killed_while_resampling_resumes_exactly(tmp_path, monkeypatch):
    """Catches: a data position that does not cover the extra rounds (in the checkpoint, or in
    the rewind of a run interrupted while sampling), or round keys that are not a function of
    (seed, step, round): the resumed run's metrics rows would differ from the uninterrupted."""

    def reward(text, example):  # half the prompts constant, the others a coin per sample
        return coin_reward(text, example) * (int(example["answer"]) % 2)

    monkeypatch.setattr(rewards, "get_reward", lambda name: reward)
    c = tiny_config(
        **{
            "rollout.dynamic_sampling": True,
            "rollout.max_resample_rounds": 2,
            "train.steps": 2,
            "train.checkpoint_every": 100,
        }
    )
    train.run(c, str(tmp_path / "full"))
    full = read_metrics(tmp_path / "full")
    assert full[1]["ds_rounds"] >= 2, "the case needs an extra round at step 1"

    real_collect = rollout.collect
    calls = []

    def collect(*args, **kwargs):
        calls.append(1)
        if len(calls) == full[0]["ds_rounds"] + 2:  # step 1's second round
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
    assert strip(read_metrics(tmp_path / "cut")) == strip(full)

"""The rollout-engine seam (sampling/engine.py) and the row layout (data/layout.py): a toy
external engine the sync loop and the actor-learner draw through, one with a planted row-layout
bug the loop refuses, and the in-JAX engine's recorded pi_b against its own teacher-forced
score."""

import math

import jax
import numpy as np
import pytest
from conftest import tiny_model_cfg
from test_actor_learner import ASYNC
from test_train import coin_reward, tiny_config

from ess_jax.data import RowLayout, char_tokenizer
from ess_jax.model import decoder as model
from ess_jax.rl import dynamic_sampling, rollout, train
from ess_jax.rl.metrics import read_metrics
from ess_jax.sampling import engine as engine_lib
from ess_jax.sampling.sampler import SamplingConfig


class UniformEngine:
    """A toy external engine: every response token uniform over the vocabulary, so whatever the
    temperature, top-k (the tied logits are kept together) or top-p, log pi_b = -log V exactly;
    no stop token. `planted`: rows sample-major (row j * P + i), not in the row layout."""

    def __init__(self, vocab: int, planted: bool = False):
        self.vocab, self.planted = vocab, planted
        self.version, self.pushes, self.releases = None, [], 0

    def update_params(self, version, params):
        self.version = version
        self.pushes.append(version)

    def release(self):
        self.releases += 1

    def generate(self, prompts, pmask, sampling, rng):
        layout = RowLayout(len(prompts), sampling.num_samples)
        b, t = layout.num_rows, sampling.max_new_tokens
        seed = int(jax.random.randint(rng, (), 0, 2**31 - 1))
        tokens = np.random.default_rng(seed).integers(0, self.vocab, (b, t)).astype(np.int32)
        seq = np.concatenate([layout.repeat(prompts), tokens], 1)
        seq_mask = np.concatenate([layout.repeat(pmask), np.ones((b, t), bool)], 1)
        if self.planted:  # prompt-major rows reordered sample-major
            order = layout.grouped(np.arange(b)).T.reshape(-1)
            seq, seq_mask = seq[order], seq_mask[order]
            tokens = tokens[order]
        return engine_lib.Generation(
            tokens=tokens,
            response_mask=np.ones((b, t), bool),
            behaviour_logp=np.full((b, t), -math.log(self.vocab), np.float32),
            sequences=seq,
            sequence_mask=seq_mask,
            version=np.full((b,), self.version, np.int32),
            layout=layout,
        )

    def score(self, sequences, sequence_mask, prompt_len, sampling):
        resp = np.asarray(sequence_mask)[:, prompt_len:]
        return np.where(resp, -math.log(self.vocab), 0.0).astype(np.float32)


def _prompts(n=2, width=16):
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 40, (n, width)).astype(np.int32)
    mask = np.ones((n, width), bool)
    mask[0, :5] = False
    tokens[0, :5] = 0
    return tokens, mask


def test_row_layout_groups_repeats_and_refuses_partial_groups():
    """Catches a row layout whose grouping and repeat disagree (a repeat that tiles prompts
    [a, b, a, b] instead of [a, a, b, b], a reshape sample-major) or accepts rows that are
    not whole groups."""
    layout = RowLayout(3, 2)
    rows = np.arange(6)
    np.testing.assert_array_equal(layout.grouped(rows), [[0, 1], [2, 3], [4, 5]])
    np.testing.assert_array_equal(layout.flat(layout.grouped(rows)), rows)
    np.testing.assert_array_equal(layout.repeat(np.array([7, 8, 9])), [7, 7, 8, 8, 9, 9])
    assert layout.repeat(["a", "b", "c"]) == ["a", "a", "b", "b", "c", "c"]
    np.testing.assert_array_equal(layout.group_of(rows), [0, 0, 1, 1, 2, 2])
    assert rows[layout.rows_of(1)].tolist() == [2, 3]
    assert RowLayout.of_rows(6, 2) == layout
    with pytest.raises(ValueError, match="groups of 4"):
        RowLayout.of_rows(6, 4)
    with pytest.raises(ValueError, match="3 prompts x 2"):
        layout.grouped(np.arange(4))


def test_rows_out_of_the_row_layout_are_refused():
    """Catches a loop that takes an engine's rows without checking their layout: an engine
    returning its rows sample-major would pair each row with another prompt's reward and
    group. The planted engine is refused with a message naming the row layout; the same engine
    in layout is accepted."""
    tok = char_tokenizer()
    prompts, pmask = _prompts()
    batch = {"prompt_tokens": prompts, "prompt_mask": pmask, "examples": [{}, {}]}
    rcfg = tiny_config().rollout
    rcfg.stop_ids = ()
    bad = UniformEngine(tok.vocab_size, planted=True)
    bad.update_params(3, None)
    with pytest.raises(ValueError, match="row layout"):
        rollout.collect(bad, batch, tok, lambda t, ex: 0.0, rcfg, jax.random.key(0))
    good = UniformEngine(tok.vocab_size)
    good.update_params(3, None)
    r, _ = rollout.collect(good, batch, tok, lambda t, ex: 0.0, rcfg, jax.random.key(0))
    assert r.layout == RowLayout(2, rcfg.group_size)
    np.testing.assert_array_equal(r.tokens[:, :16], r.layout.repeat(prompts))
    assert (r.policy_version == 3).all()


def test_the_sync_loop_draws_through_a_given_engine(tmp_path, monkeypatch):
    """Catches a sync loop that bypasses `Run.engine` (the in-JAX sampler hard-wired), pushes
    the wrong version, keeps the version after the batch (no release) or drops the engine's
    pi_b: with the toy engine, step 0's rollout holds its exact -log V on every trained token
    and version 0 on every row, one push and one release."""
    c = tiny_config()
    engine = UniformEngine(char_tokenizer().vocab_size)
    run = train.Run(c, str(tmp_path), engine=engine)
    seen, real = [], dynamic_sampling.collect_batch

    def collect_batch(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out[0])
        return out

    monkeypatch.setattr(dynamic_sampling, "collect_batch", collect_batch)
    try:
        run.reward_fn = coin_reward
        run.trainer.history.push(0, run.trainer.state.params)
        row = run.rl_step(0)
    finally:
        run.close()
    (r,) = seen
    assert engine.pushes == [0] and engine.releases == 1
    trained = r.loss_mask > 0
    assert trained.any()
    np.testing.assert_allclose(r.behaviour_logp[trained], -math.log(engine.vocab), rtol=1e-6)
    assert (r.policy_version == 0).all() and row["policy_lag"] == 0
    assert 0 < row["ess"] < 1  # the trainer's policy is not uniform


def test_the_actor_learner_draws_through_a_given_engine(tmp_path):
    """Catches an actor-learner that ignores `Run.engine` (its own in-JAX sampler) or never
    pushes the params it publishes: a 2-step async run with the toy engine draws every batch
    through it, each after a push of the newest published version, one release per batch, and
    trains on its rows."""
    c = tiny_config(**{**ASYNC, "train.steps": 2})
    engine = UniformEngine(char_tokenizer().vocab_size)
    run = train.Run(c, str(tmp_path), engine=engine)
    run.reward_fn = coin_reward
    run.run()
    # version 0 at the start, version 1 pushed at step 1 (train.sync_every 1) for later batches
    assert engine.pushes[0] == 0 and engine.pushes == sorted(engine.pushes)
    assert len(engine.pushes) >= 2 and set(engine.pushes) <= {0, 1}
    assert engine.releases == len(engine.pushes)
    rows = [r for r in read_metrics(tmp_path) if "ess" in r]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(0 < r["ess"] < 1 for r in rows)


def test_the_in_jax_engine_records_what_it_scores():
    """Catches an engine whose recorded pi_b is not its drawing distribution (temperature or
    the top-k / top-p renormalisation left out of `generate` or `score`), rows without the
    pushed version, and an engine that keeps drawing after `release`: the in-JAX engine in
    float32 at T = 1.3, top-k 8, top-p 0.9 scores its own rows within 1e-5; the toy engine's
    gap is 0."""
    cfg = tiny_model_cfg()
    engine = engine_lib.JaxEngine(cfg)
    assert isinstance(engine, engine_lib.RolloutEngine)
    engine.update_params(5, model.init_params(cfg, 0))
    prompts, pmask = _prompts(width=8)
    sc = SamplingConfig(temperature=1.3, top_k=8, top_p=0.9, max_new_tokens=6, num_samples=3)
    gen = engine.generate(prompts, pmask, sc, jax.random.key(1))
    engine_lib.check_rows(gen, prompts, pmask, sc)
    assert (gen.version == 5).all() and gen.response_mask.any()
    assert engine_lib.logprob_gap(engine, gen, prompts.shape[1], sc) <= 1e-5
    toy = UniformEngine(cfg.vocab_size)
    toy.update_params(0, None)
    toy_rows = toy.generate(prompts, pmask, sc, jax.random.key(1))
    assert engine_lib.logprob_gap(toy, toy_rows, prompts.shape[1], sc) == 0
    engine.release()
    with pytest.raises(ValueError, match="update_params first"):
        engine.generate(prompts, pmask, sc, jax.random.key(1))

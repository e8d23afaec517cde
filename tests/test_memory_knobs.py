"""The memory knobs paper-scale configs rely on change no numbers.

- rollout.sample_microbatches: the rollout batch sampled in several sampler calls keeps each
  prompt's group together and its recorded pi_b equal to the teacher-forced log-probs.
- The proximal / reference scoring pass in row chunks equals one teacher-forced pass.
(model.logits_chunk's chunked attention and model.remat: tests/test_logprobs_chunked.py.)
"""

import jax
import ml_collections
import numpy as np
import pytest
from conftest import tiny_model_cfg

from ess_jax.data import char_tokenizer
from ess_jax.model import decoder as model
from ess_jax.model import scoring
from ess_jax.parallel import sharding
from ess_jax.rl import rollout, steps

CFG = tiny_model_cfg(vocab_size=48, pad_token_id=0, eos_token_id=2)


def _rcfg(calls):
    return ml_collections.ConfigDict(
        dict(
            group_size=4, max_new_tokens=5, temperature=1.0, top_k=0, top_p=1.0,
            precision="float32", external_fraction=0.0, external_precision="float32",
            stop_ids=(), advantage_mode="grpo", dynamic_sampling=False, overlong_buffer=0,
            sample_microbatches=calls,
        )
    )  # fmt: skip


def test_sampling_in_several_calls_keeps_groups_and_exact_behaviour_logp():
    """Catches: chunked sampling that interleaves rows of different prompts into one group (the
    group advantages would compare unrelated prompts) or records pi_b of the wrong rows."""
    params = model.init_params(CFG, 0)
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, 48, (4, 7)).astype(np.int32)
    batch = {"prompt_tokens": prompts, "prompt_mask": np.ones((4, 7), bool), "examples": [{}] * 4}
    tok = char_tokenizer()

    def engine(calls):
        e = rollout.policy_engine(CFG, _rcfg(calls))
        e.update_params(0, params)
        return e

    r, _ = rollout.collect(engine(2), batch, tok, lambda t, ex: 0.0, _rcfg(2), jax.random.key(0))
    assert r.tokens.shape == (16, 12)
    np.testing.assert_array_equal(r.tokens[:, :7], np.repeat(prompts, 4, axis=0))
    logp = np.asarray(scoring.token_logprobs(CFG, params, r.tokens, r.attn_mask))[:, 7:]
    np.testing.assert_allclose(r.behaviour_logp, logp * r.loss_mask, atol=1e-5)
    assert np.abs(r.behaviour_logp).sum() > 0
    with pytest.raises(ValueError, match="sample_microbatches"):
        rollout.collect(engine(3), batch, tok, lambda t, ex: 0.0, _rcfg(3), jax.random.key(0))


def test_chunked_scoring_pass_equals_one_pass():
    """Catches: the strided row chunks of the prox / reference scoring pass merged back in the
    wrong order (each sequence would get another sequence's pi_prox)."""
    mesh = sharding.make_mesh({"fsdp": 8})
    params = model.init_params(CFG, 1, model.param_shardings(CFG, mesh))
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, 48, (32, 12)).astype(np.int32)
    mask = np.ones((32, 12), bool)
    mask[::3, :2] = False
    batch = sharding.shard_batch({"tokens": tokens, "attn_mask": mask}, mesh)
    chunked = steps.score_fn(CFG, 4, mesh, 4)(params, batch)
    whole = np.asarray(scoring.token_logprobs(CFG, params, tokens, mask))[:, 4:]
    np.testing.assert_allclose(np.asarray(chunked), whole, atol=1e-5)

"""train.mode "async" (ess_jax/rl/actor_learner.py) combined with the rollout's other row
sources, on 8 fake CPU devices split 4 + 4: an external behaviour model
(rollout.external_fraction), DAPO's dynamic sampling with resampling rounds, and LoRA
(model.lora: a push copies the adapters alone). Each run is test_actor_learner's ASYNC (5
steps, sharing its compiled RL steps) with a trainer slower than the sampler
(`test_actor_learner.stale_async_run`), and each row's recorded pi_b is checked against a
float32 re-score (one device) with the params of the model that drew it.
"""

import zlib

import jax
import numpy as np
from test_actor_learner import ASYNC, max_rescore_error, stale_async_run
from test_dynamic_sampling import first_of_group_reward
from test_train import tiny_config

from ess_jax.io import weights
from ess_jax.model import decoder as model
from ess_jax.model import lora
from ess_jax.rl import actor_learner, experiment


def test_async_with_an_external_behaviour_model_records_each_rows_own_pi_b(tmp_path):
    """Catches the sampler thread drawing the external model's rows with the policy (or the
    reverse), the external copy on the rollout mesh holding other params than the checkpoint,
    and external rows (version -1) counted in the lag: every row's recorded pi_b must equal a
    re-score with the params of the model its version names (the external checkpoint's for -1,
    the trainer's of that version else) to 1e-5, and not with the other model's (> 1e-4)."""
    cfg, _, _ = experiment.load_policy(tiny_config().model)
    other = jax.device_get(model.init_params(cfg, 123))
    weights.save_hf(cfg, other, str(tmp_path))
    external = {"rollout.external_fraction": 0.5, "rollout.external_checkpoint": str(tmp_path)}
    c = tiny_config(**{**ASYNC, **external})
    cfg, params, batches, rows = stale_async_run(c, tmp_path / "run", steps_of=tiny_config(**ASYNC))
    assert [s for s, _, _ in batches] == list(range(5))
    for (step, version, rollout), row in zip(batches, rows):
        versions = np.asarray(rollout.policy_version)
        ext = versions == -1
        assert ext.sum() == len(versions) // 2 and set(versions[~ext].tolist()) == {version}
        assert max_rescore_error(cfg, other, rollout, ext) < 1e-5, step
        assert max_rescore_error(cfg, params[version], rollout, ~ext) < 1e-5, step
        assert max_rescore_error(cfg, params[version], rollout, ext) > 1e-4, step
        assert max_rescore_error(cfg, other, rollout, ~ext) > 1e-4, step
        assert row["lag_max"] == step - version == row["policy_lag"]
    assert max(r["lag_max"] for r in rows) >= 1  # the sampler really ran ahead


class OddHashPrompts:
    """The prompts whose crc32 is odd (about half): `first_of_group_reward` rewards the first
    sample of their groups, and nothing in the others' groups, which are constant and are
    refilled by DAPO's resampling rounds (in tiny_config's data stream, in every step)."""

    def __contains__(self, prompt: str) -> bool:
        return zlib.crc32(prompt.encode()) % 2 == 1


def test_async_with_dapo_resampling_records_the_pi_b_of_the_batchs_version(tmp_path):
    """Catches the sampler's resampling rounds drawing with other params than the batch's
    recorded version (e.g. a push arriving between two rounds of one batch) or misaligning
    the rows it assembles from several rounds: every row's recorded pi_b must equal a re-score
    with that version's params (1e-5) and not the version before's (> 1e-4), in batches that
    took more than one round."""
    overrides = {"rollout.dynamic_sampling": True, "rollout.max_resample_rounds": 2}
    c = tiny_config(**{**ASYNC, **overrides})
    cfg, params, batches, rows = stale_async_run(
        c, tmp_path, first_of_group_reward(OddHashPrompts()), tiny_config(**ASYNC)
    )
    assert [s for s, _, _ in batches] == list(range(5))
    for step, version, rollout in batches:
        assert set(np.asarray(rollout.policy_version).tolist()) == {version}
        assert max_rescore_error(cfg, params[version], rollout) < 1e-5, step
        if version >= 1:
            assert max_rescore_error(cfg, params[version - 1], rollout) > 1e-4, step
    assert [r["ds_rounds"] for r in rows] == [3, 2, 3, 3, 3]  # rows from several rounds
    assert max(r["lag_max"] for r in rows) >= 1


def test_async_with_lora_pushes_the_adapters_and_records_exact_pi_b(tmp_path, monkeypatch):
    """Catches a LoRA push of whole params (base and adapters, or merged) instead of the
    adapters alone, one that leaves the sampler on the base (B = 0: every version would draw
    as version 0), a rollout-mesh copy of the frozen base other than the loaded model, and a
    version tag off by one: each push (steps 1-4) is a tree of the adapters' structure, and
    every row's recorded pi_b must equal a re-score with its version's adapters (rank 4)
    merged into the loaded base (one device, float32, 1e-5), and not with the previous
    version's (> 1e-4)."""
    pushed, publish = [], actor_learner.Sampler.publish

    def spy(sampler, version, params):
        pushed.append(jax.tree.structure(params))
        return publish(sampler, version, params)

    monkeypatch.setattr(actor_learner.Sampler, "publish", spy)
    c = tiny_config(**{**ASYNC, "model.lora.rank": 4, "optim.lr": 2e-2})
    _, base, _ = experiment.load_policy(c.model)
    cfg, adapters, batches, rows = stale_async_run(c, tmp_path)
    assert len(pushed) == 4 and set(pushed) == {jax.tree.structure(adapters[0])}  # steps 1-4
    plain = lora.base_config(cfg)
    assert [s for s, _, _ in batches] == list(range(5))
    for step, version, rollout in batches:
        assert set(np.asarray(rollout.policy_version).tolist()) == {version}
        merged = lora.merge(cfg, base, adapters[version])
        assert max_rescore_error(plain, merged, rollout) < 1e-5, step
        if version >= 1:
            before = lora.merge(cfg, base, adapters[version - 1])
            assert max_rescore_error(plain, before, rollout) > 1e-4, step
    assert max(r["lag_max"] for r in rows) >= 1

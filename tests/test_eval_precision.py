"""eval.precision and eval.kv_cache_precision: held-out eval samples in a chosen sampler format
(with model.lora through the merge straight into that format) and KV-cache precision, and the
memory planner's eval phase counts both."""

import re

import jax
import jax.numpy as jnp
import ml_collections
import pytest
from test_train import coin_reward, tiny_config

from configs import quickstart
from ess_jax.config import schema as config_checks
from ess_jax.config.schema import ConfigError
from ess_jax.memory import planner as memory
from ess_jax.model import lora
from ess_jax.rl import experiment, heldout, lora_policy, train
from ess_jax.sampling import sampler
from ess_jax.sampling.engine import JaxEngine

ONE = {"data": 1, "fsdp": 1, "tensor": 1}


def _eval_config(rank: int):
    return tiny_config(**{"model.lora.rank": rank, "eval.num_examples": 8, "eval.k": 2})


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """The quickstart tiny config with LoRA rank 4, its B random (as after training: the
    merged policy is not the base's)."""
    run = train.Run(_eval_config(4), str(tmp_path_factory.mktemp("eval_precision")))
    run.reward_fn = coin_reward
    key = jax.random.key(3)
    params = jax.tree.map(
        lambda x: x if x.any() else x + 0.3 * jax.random.normal(key, x.shape),
        run.trainer.state.params,
    )
    run.trainer.state = run.trainer.state.replace(params=params)
    yield run
    run.close()


def _spy(monkeypatch):
    """Records (precision, the dtypes of the matrices) of every sampler call's copy, and counts
    the sampler's own prepares (sampler.prepare)."""
    calls, prepares = [], []
    real, real_prepare = sampler.sample_prepared, sampler.prepare

    def spy(sp, *args, **kwargs):
        calls.append((sp.precision, {x.dtype for x in jax.tree.leaves(sp.params) if x.ndim == 2}))
        return real(sp, *args, **kwargs)

    def prepare(*args, **kwargs):
        prepares.append(1)
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(sampler, "sample_prepared", spy)
    monkeypatch.setattr(sampler, "prepare", prepare)
    return calls, prepares


def test_float32_eval_rows_are_those_of_a_config_without_the_field(lora_run):
    """Catches eval.precision="float32" changing the eval numbers: Run.evaluate's row must be
    bit for bit heldout.evaluate's with an eval section that has no precision field, drawn
    from the float32 merge by a plain float32 engine (the path before the field)."""
    run = lora_run
    run.config.eval.precision = "float32"
    got = run.evaluate(1)
    ecfg = ml_collections.ConfigDict({k: v for k, v in run.config.eval.items() if k != "precision"})
    full = lora_policy.merged(run.model_cfg, run.trainer.state.frozen, run.trainer.state.params)
    engine = JaxEngine(lora.base_config(run.model_cfg))
    engine.update_params(1, full)
    rng = jax.random.fold_in(jax.random.fold_in(run.rng, 2), 1)
    buckets = tuple(run.config.data.buckets)
    ref = heldout.evaluate(
        engine, run.test_examples, run.tokenizer, run.reward_fn, ecfg, run.stop_ids, rng, buckets
    )
    assert got == ref
    assert 0.0 <= got["eval/pass@1"] <= 1.0 and got["eval/response_len"] > 0


def test_lora_eval_in_bfloat16_samples_the_merged_bfloat16_copy(lora_run, monkeypatch):
    """Catches eval.precision ignored with LoRA (the sampler fed the float32 merge, or a
    bfloat16 copy prepared a second time): every eval sampler call gets the merge's bfloat16
    copy, in precision bfloat16, the sampler's own prepare never runs, and pass@1 is a number
    in [0, 1]."""
    run = lora_run
    calls, prepares = _spy(monkeypatch)
    run.config.eval.precision = "bfloat16"
    try:
        row = run.evaluate(1)
    finally:
        run.config.eval.precision = "float32"
    assert calls and all(c == ("bfloat16", {jnp.dtype(jnp.bfloat16)}) for c in calls)
    assert not prepares
    assert 0.0 <= row["eval/pass@1"] <= 1.0
    assert 0 < row["eval/response_len"] <= run.config.eval.max_new_tokens


def test_full_fine_tuning_eval_in_bfloat16_lets_the_sampler_prepare(tmp_path, monkeypatch):
    """Catches eval.precision ignored without LoRA: the float32 params are prepared once by
    the sampler's own prepare (as in a rollout), and every eval sampler call gets that bfloat16
    copy in precision bfloat16."""
    c = _eval_config(0)
    c.eval.precision = "bfloat16"
    run = train.Run(c, str(tmp_path))
    try:
        run.reward_fn = coin_reward
        calls, prepares = _spy(monkeypatch)
        row = run.evaluate(0)
    finally:
        run.close()
    assert calls and all(c == ("bfloat16", {jnp.dtype(jnp.bfloat16)}) for c in calls)
    assert len(prepares) == 1
    assert 0.0 <= row["eval/pass@1"] <= 1.0


# The quickstart's embedded model by hand: vocab 56 (tied), d 64, ffn 192, 4 heads and 2 kv
# heads of 16, 2 layers. Matrices: the embedding and per layer q, k, v, o, gate, up, down.
_D, _F, _H, _N, _K, _L, _V = 64, 192, 4, 2, 16, 2, 56
_MATRIX = _V * _D + _L * (2 * _D * _H * _K + 2 * _D * _N * _K + 3 * _D * _F)
_VECTOR = (2 * _L + 1) * _D  # two RMSNorm scales per layer, the final one


def _eval_phase(rank: int, precision: str) -> dict:
    c = quickstart.get_config()
    c.model.lora.rank, c.eval.precision = rank, precision
    return memory.plan(c, 1, "h100", ONE).phases["eval"]


@pytest.mark.parametrize("rank", [8, 0])
def test_eval_phase_in_bfloat16_saves_the_hand_counted_bytes(rank):
    """Catches a planner whose eval phase ignores eval.precision: on one device the bfloat16
    eval holds the matrices in 2 bytes (LoRA: instead of the float32 merged copy; full
    fine-tuning: a copy beside the params, which float32 samples from directly) and a KV
    cache of 2-byte elements, half the float32 one (rows 32 x k 4, 512 + 6 positions)."""
    f32, bf16 = _eval_phase(rank, "float32"), _eval_phase(rank, "bfloat16")
    kv_f32 = 32 * 4 * (512 + 6) * 2 * _L * _N * _K * 4
    assert f32["kv_cache"] == kv_f32 and bf16["kv_cache"] == kv_f32 // 2
    assert bf16["sampler_tmp"] <= f32["sampler_tmp"]
    copy = 2 * _MATRIX + 4 * _VECTOR
    if rank:
        assert f32["merged sampler copy (float32)"] == 4 * (_MATRIX + _VECTOR)
        assert bf16["merged sampler copy (bfloat16)"] == copy
        saved = 2 * _MATRIX + kv_f32 // 2
    else:
        assert f32["sample-layout params (f32)"] == 0 and f32["sampler copy (float32)"] == 0
        assert bf16["sample-layout params (f32)"] == 0 and bf16["sampler copy (bfloat16)"] == copy
        saved = kv_f32 // 2 - copy
    tmp_saved = f32["sampler_tmp"] - bf16["sampler_tmp"]
    assert sum(f32.values()) - sum(bf16.values()) == saved + tmp_saved


def test_eval_kv_cache_precision_reaches_the_sampler_apart_from_the_rollouts(lora_run, monkeypatch):
    """Catches eval.kv_cache_precision ignored (eval's cache always in the compute dtype) or
    eval reading rollout.kv_cache_precision instead: with eval's set to bfloat16 and the
    rollout's to fp8, every eval sampler call gets kv_cache bfloat16."""
    run = lora_run
    seen, real = [], sampler.sample_prepared

    def spy(*args, **kwargs):
        seen.append(kwargs.get("kv_cache"))
        return real(*args, **kwargs)

    monkeypatch.setattr(sampler, "sample_prepared", spy)
    run.config.eval.kv_cache_precision = "bfloat16"
    run.config.rollout.kv_cache_precision = "fp8"
    try:
        row = run.evaluate(1)
    finally:
        run.config.eval.kv_cache_precision = "compute"
        run.config.rollout.kv_cache_precision = "compute"
    assert seen and set(seen) == {"bfloat16"}
    assert 0.0 <= row["eval/pass@1"] <= 1.0


def test_eval_phase_counts_eval_kv_cache_precision():
    """Catches a planner whose eval phase ignores eval.kv_cache_precision, or reads the
    rollout's: a bfloat16 eval cache is half the float32 one (rows 32 x k 4, 512 + 6
    positions), whatever rollout.kv_cache_precision says."""
    c = quickstart.get_config()
    c.rollout.kv_cache_precision = "fp8"
    kv_f32 = 32 * 4 * (512 + 6) * 2 * _L * _N * _K * 4
    assert memory.plan(c, 1, "h100", ONE).phases["eval"]["kv_cache"] == kv_f32
    c.eval.kv_cache_precision = "bfloat16"
    assert memory.plan(c, 1, "h100", ONE).phases["eval"]["kv_cache"] == kv_f32 // 2


@pytest.mark.parametrize("value", ["bf16", "float64", ""])
def test_a_bad_eval_precision_is_a_one_line_config_error(value):
    """Catches eval.precision unchecked (a typo would fail deep inside the first eval, after
    training steps): one line naming the field and the valid formats."""
    c = tiny_config(**{"eval.precision": value})
    valid = "'float32', .*'fp8_act'"
    msg = rf"^config\.eval\.precision: must be one of {valid}, got {re.escape(repr(value))}$"
    with pytest.raises(ConfigError, match=msg):
        config_checks.check(c)
    c.eval.precision = "bfloat16"
    config_checks.check(c)
    experiment.validate(c)

"""QLoRA (model.lora.base_precision int8 / int4, model/quant.py): the frozen base's block matrices
stored as integer codes with per-output-channel scales, dequantized inside the forward, against a
float64 numpy reference; adapters-only training on it, the sampler on the same dequantized base
(on-policy ESS 1), exact resume with the base re-derived from model.source."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model_cfg
from test_lora import _config
from test_train import coin_reward

from configs import quickstart
from ess_jax.config.schema import ConfigError, check
from ess_jax.memory import planner as memory
from ess_jax.model import decoder as model
from ess_jax.model import lora, quant
from ess_jax.rl import train

RANK, ALPHA = 4, 8.0
QMAX = {"int8": 127.0, "int4": 7.0}
# contraction axes of each block matrix (the rest are output channels), as model/decoder.py lays
# them out: q/k/v [D, H, K], o [H, K, D], gate/up [D, F], down [F, D]
INPUT_AXES = {"q": (0,), "k": (0,), "v": (0,), "o": (0, 1), "gate": (0,), "up": (0,), "down": (0,)}
_logits = jax.jit(model.apply, static_argnums=0)


@pytest.fixture(scope="module")
def tiny():
    """precision -> (QLoRA cfg, float base, quantized base, adapters with B random, tokens)."""
    base_cfg = tiny_model_cfg()
    base = model.init_params(base_cfg, 0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 12)), jnp.int32)
    rng, out = np.random.default_rng(1), {}
    for precision in ("int8", "int4"):
        cfg = lora.with_lora(base_cfg, RANK, ALPHA, lora.TARGETS, precision)
        qbase = jax.jit(quant.quantize_base, static_argnums=1)(base, precision)
        shapes = lora.split(model.abstract_params(cfg))[1]
        adapters = jax.tree.map(lambda x: jnp.asarray(0.3 * rng.normal(size=x.shape)), shapes)
        out[precision] = cfg, base, qbase, adapters, tokens
    return out


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_base_matches_float64_reference(tiny, precision):
    """Catches a scale over the wrong axes (o's two input axes [H, K], a per-tensor scale), codes
    outside [-QMAX, QMAX] (int4's -8), round-half-away instead of to even, a quantized embedding
    or norm, and a forward whose in-matmul dequantization differs from codes * scale: codes and
    scales against numpy float64, then the quantized model's logits against the plain model's
    on the reference's dequantized weights."""
    cfg, base, qbase, adapters, tokens = tiny[precision]
    qmax, n = QMAX[precision], 0
    for i, layer in qbase["layers"].items():
        for module in ("attn", "mlp"):
            for name, got in layer[module].items():
                if name not in INPUT_AXES:
                    np.testing.assert_array_equal(got, base["layers"][i][module][name])
                    continue
                w = np.asarray(base["layers"][i][module][name], np.float64)
                amax = np.abs(w).max(axis=INPUT_AXES[name], keepdims=True)
                np.testing.assert_allclose(got["scale"], amax / qmax, rtol=2.5e-7)
                # codes of the scale as stored (it may be 1 ulp off max|w| / QMAX)
                scale = np.asarray(got["scale"], np.float64)
                want = np.clip(np.round(w / scale), -qmax, qmax)  # numpy: half to even
                assert got["codes"].dtype == jnp.dtype(precision)
                np.testing.assert_array_equal(np.asarray(got["codes"], np.float64), want)
                deq = quant.dequantize(got)
                np.testing.assert_allclose(deq, want * scale, rtol=1e-7, atol=0)
                n += 1
    assert n == 2 * len(INPUT_AXES)
    np.testing.assert_array_equal(qbase["embed"], base["embed"])
    ref = jax.tree.map(lambda x: x, base)  # the plain model on the reference's weights
    for i, layer in qbase["layers"].items():
        for module in ("attn", "mlp"):
            for name in set(layer[module]) & set(INPUT_AXES):
                q = layer[module][name]
                ref["layers"][i][module][name] = jnp.asarray(
                    np.asarray(q["codes"], np.float64) * np.asarray(q["scale"], np.float64),
                    jnp.float32,
                )
    fresh = jax.tree.map(jnp.zeros_like, adapters)  # the base's logits
    got = _logits(cfg, lora.join(qbase, fresh), tokens)
    np.testing.assert_allclose(got, _logits(lora.base_config(cfg), ref, tokens), atol=1e-5)
    assert float(jnp.abs(got - _logits(lora.base_config(cfg), base, tokens)).max()) > 1e-4


def test_adapter_gradients_through_the_quantized_base_match_a_float_base(tiny):
    """Catches a backward through the in-forward dequantization (quant.matmul's remat) that
    differs from the float model's, or that drops the base's path to the adapters of earlier
    layers: the adapters' gradients on the int4 base equal those of plain LoRA on its
    dequantized float32 weights, and the merged (sampler) logits equal the unmerged ones."""
    cfg, _, qbase, adapters, tokens = tiny["int4"]
    float_cfg = cfg.replace(lora_base_precision="compute")
    deq = quant.dequantize_tree(qbase)

    def loss(c, base):
        return lambda a: jnp.mean(jax.nn.log_softmax(model.apply(c, lora.join(base, a), tokens)))

    got = jax.jit(jax.grad(loss(cfg, qbase)))(adapters)
    want = jax.jit(jax.grad(loss(float_cfg, deq)))(adapters)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-7), got, want)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(got))
    merged = lora.merge(cfg, qbase, adapters)
    np.testing.assert_allclose(
        _logits(lora.base_config(cfg), merged, tokens),
        _logits(cfg, lora.join(qbase, adapters), tokens),
        atol=2e-5,
    )


def test_quantized_base_needs_lora():
    """Catches a quantized base accepted without adapters (nothing would train on it): the
    config and ModelConfig both refuse it with a one-line error naming the field."""
    c = _config(**{"model.lora.rank": 0, "model.lora.base_precision": "int4"})
    with pytest.raises(ConfigError, match="model.lora.base_precision"):
        check(c)
    with pytest.raises(ValueError, match="lora_base_precision"):
        tiny_model_cfg().replace(lora_base_precision="int8")
    with pytest.raises(ConfigError, match="model.lora.base_precision"):
        check(_config(**{"model.lora.base_precision": "nf4"}))


def test_memory_plan_counts_codes_scales_and_the_dequantized_copy():
    """Catches a planner that counts int4 codes as a byte (numpy's itemsize of jnp.int4), leaves
    out the per-channel scales, quantizes the embedding too, or forgets the train step's
    dequantized block matrices on one device: hand counts on the quickstart's embedded model."""
    c = quickstart.get_config()
    c.model.lora.rank = 8
    mesh = {"data": 1, "fsdp": 1, "tensor": 1}
    plans = {}
    for precision in ("compute", "int8", "int4"):
        c.model.lora.base_precision = precision
        plans[precision] = memory.plan(c, 1, "h100", mesh)
    d, f, h, n, k = 64, 192, 4, 2, 16  # 2 layers
    blocks = 2 * (d * h * k * 2 + d * n * k * 2 + d * f * 3)  # q, o; k, v; gate, up, down
    scales = 2 * (h * k + n * k * 2 + d + f * 2 + d)  # one per output channel
    f32 = plans["compute"].resident["frozen base (f32)"]
    for precision, code_bytes in (("int8", 1.0), ("int4", 0.5)):
        plan = plans[precision]
        assert f32 - plan.resident[f"frozen base ({precision})"] == (
            4 * blocks - code_bytes * blocks - 4 * scales
        )
        assert plan.phases["train step"]["dequantized base"] == 4 * blocks  # float32 compute
    assert "dequantized base" not in plans["compute"].phases["train step"]


# ----------------------------------------------------------------------------- the RL loop


def _qconfig(**overrides):
    return _config(**{"model.lora.base_precision": "int4", **overrides})


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
    """A rank-8 LoRA run on an int4 base (lag 0) after three RL steps, checkpointed after two:
    rows, base before, Run."""
    run = train.Run(_qconfig(), str(tmp_path_factory.mktemp("qlora_run")))
    run.reward_fn = coin_reward
    base_before = jax.tree.map(np.asarray, run.trainer.state.frozen)
    run.trainer.history.push(0, run.trainer.state.params)
    rows = [run.rl_step(s) for s in range(2)]
    run.save(2, force=True)
    run.ckpt.wait()
    rows.append(run.rl_step(2))
    yield run, rows, base_before
    run.close()


def test_three_rl_steps_on_an_int4_base_keep_ess_one(qlora_run):
    """Catches a sampler whose merged weights are not the trainer's dequantized base plus
    adapters (e.g. merged onto the float base or with codes unscaled): at lag 0 the float32 ESS
    stays 1 +- 1e-5 while the adapters move; the loss is finite at every step."""
    run, rows, _ = qlora_run
    for row in rows:
        assert abs(row["ess"] - 1.0) < 1e-5, row
        assert abs(row["ratio_max"] - 1.0) < 1e-5, row
        assert np.isfinite(row["loss"]) and np.isfinite(row["grad_norm"]), row
    assert rows[0]["grad_norm"] > 0
    assert any(b.any() for *_, b in lora.pairs(run.trainer.state.params))


def test_int4_base_stays_frozen_and_the_optimizer_holds_adapters_only(qlora_run):
    """Catches a base that is re-quantized or moves during training, a float copy of it kept
    in the state instead of the int4 codes, and optimizer moments of anything but adapters."""
    run, _, base_before = qlora_run
    jax.tree.map(
        np.testing.assert_array_equal, base_before, jax.device_get(run.trainer.state.frozen)
    )
    q = run.trainer.state.frozen["layers"][0]["attn"]["q"]
    assert q["codes"].dtype == jnp.int4 and q["scale"].dtype == jnp.float32
    n_adapters = sum(x.size for x in jax.tree.leaves(run.trainer.state.params))
    assert n_adapters == lora.num_adapter_params(run.model_cfg)
    opt_sizes = [x.size for x in jax.tree.leaves(run.trainer.state.opt_state) if x.ndim > 0]
    assert sum(opt_sizes) == 2 * n_adapters


def test_resume_on_an_int4_base_is_exact(tmp_path, qlora_run):
    """Catches a resume whose re-derived int4 base differs from the one trained on (the resumed
    step's row would differ from the uninterrupted run's), and checkpoints that store the base's
    codes: a new Run restores the fixture's step-2 checkpoint and redoes step 2."""
    run, rows, _ = qlora_run
    shutil.copytree(run.ckpt.directory, tmp_path / "checkpoints")
    resumed = train.Run(_qconfig(), str(tmp_path))
    try:
        resumed.reward_fn = coin_reward
        assert resumed.try_restore() == 2
        if not resumed.trainer.history.state():  # as train.run does
            resumed.trainer.history.push(2, resumed.trainer.state.params)
        row = resumed.rl_step(2)
    finally:
        resumed.close()
    volatile = ("tokens_per_s", "sample_s", "step_s")
    strip = lambda r: {k: v for k, v in r.items() if k not in volatile}  # noqa: E731
    assert strip(row) == strip(rows[2])

    saved = run.ckpt.saved_tree(2)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(saved)]
    assert not any("codes" in p or "frozen" in p or "embed" in p for p in paths), paths[:5]
    assert any("'lora'" in p for p in paths)

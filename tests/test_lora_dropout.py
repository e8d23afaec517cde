"""model.lora.dropout: inverted dropout on the adapters' inputs in the trainer's forwards only.

References: numpy float64 x W + (alpha / R) (x * mask / (1 - p)) A B for one projection, the
mask read back from the dropped input; a Monte Carlo mean over many rows' masks against the
dropout-free float64 projection (the expectation dropout must keep); the step's loss and
gradient at one micro-batch against two (ess_scope "step" is split-invariant, so the masks
must follow their rows).
"""

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
from conftest import tiny_model_cfg
from test_full_kl import _params
from test_lora_objectives import _logp
from test_train import tiny_config

from ess_jax import objectives as O
from ess_jax.config import schema
from ess_jax.io import peft_adapter
from ess_jax.model import decoder as model
from ess_jax.model import lora, scoring
from ess_jax.objectives.config import ObjectiveConfig
from ess_jax.parallel import sharding
from ess_jax.rl import accumulate, lora_policy, steps, update
from ess_jax.rl.full_kl import FullKL
from ess_jax.rl.optim import make_optimizer

RANK, ALPHA, P = 4, 8.0, 0.25


@pytest.fixture(scope="module")
def tiny():
    """The tiny LoRA model with dropout P, B random (as after training), and a short batch."""
    cfg = lora.with_lora(tiny_model_cfg(), RANK, ALPHA, lora.TARGETS, dropout=P)
    base = _params(lora.base_config(cfg), 0)  # numpy draws: no init program to compile
    rng = np.random.default_rng(1)
    adapters = jax.tree.map(
        lambda x: (0.3 * rng.standard_normal(x.shape)).astype(np.float32),
        lora.split(model.abstract_params(cfg))[1],
    )
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (4, 10)), jnp.int32)
    return cfg, base, adapters, tokens


def _jit0(fn):
    """fn jitted at XLA's optimization level 0: these checks are of values, and the compile is
    this file's cost."""

    def call(*args):
        return jax.jit(fn).lower(*args).compile({"xla_backend_optimization_level": 0})(*args)

    return call


def _row_keys(n: int, step: int = 0):
    return lora.wrap_keys(lora.dropout_keys(0, jnp.int32(step), n))


def test_one_projection_matches_float64_with_the_drawn_mask(tiny):
    """Catches dropout on the wrong operand (the base matmul, or the adapter output), a missing
    1 / (1 - p) rescale, or a keep rate that is not 1 - p: `up`'s projection against numpy
    float64 with the mask read back from `lora.dropout`, and the kept share of 64 x 6 x 64
    elements within 5 sigma of 1 - p."""
    cfg, base, adapters, _ = tiny
    mlp = model.bind(cfg, lora.join(base, adapters)).layers[0].mlp
    x = jax.random.normal(jax.random.key(3), (64, 6, cfg.hidden_size), jnp.float32)
    keys = _row_keys(64)
    dropped = np.asarray(lora.dropout(x, P, keys, lora.TARGETS.index("up")), np.float64)
    x64 = np.asarray(x, np.float64)
    kept = dropped != 0
    np.testing.assert_allclose(dropped[kept], x64[kept] / (1 - P), rtol=1e-6)
    share, sigma = kept.mean(), np.sqrt(P * (1 - P) / kept.size)
    assert abs(share - (1 - P)) < 5 * sigma, share
    pair = adapters["layers"][0]["mlp"]["lora"]["up"]
    w = np.asarray(base["layers"][0]["mlp"]["up"], np.float64)
    a, b = np.asarray(pair["a"], np.float64), np.asarray(pair["b"], np.float64)
    ref = x64 @ w + (ALPHA / RANK) * (dropped @ a) @ b
    got = lora.project(cfg, mlp, "up", x, keys=keys)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_dropout_keeps_the_projection_in_expectation(tiny):
    """Catches a biased dropout (e.g. no rescale, or a rescale by 1 - p): the mean over 4096
    rows of one input, each row with its own mask, against float64 x W + (alpha / R) x A B,
    within 5 standard errors of the rows' spread; and masks shared by rows (no spread)."""
    cfg, base, adapters, _ = tiny
    attn = model.bind(cfg, lora.join(base, adapters)).layers[1].attn
    n = 4096
    x1 = np.random.default_rng(4).standard_normal((1, cfg.hidden_size))
    x = jnp.broadcast_to(jnp.asarray(x1, jnp.float32)[:, None], (n, 1, cfg.hidden_size))
    got = np.asarray(lora.project(cfg, attn, "q", x, keys=_row_keys(n)), np.float64)[:, 0]
    pair = adapters["layers"][1]["attn"]["lora"]["q"]
    w = np.asarray(base["layers"][1]["attn"]["q"], np.float64)
    a, b = np.asarray(pair["a"], np.float64), np.asarray(pair["b"], np.float64)
    ref = np.tensordot(x1, w, 1) + (ALPHA / RANK) * np.tensordot(np.tensordot(x1, a, 1), b, 1)
    spread = got.std(axis=0)
    assert spread.min() > 0
    assert np.all(np.abs(got.mean(axis=0) - ref[0]) < 5 * spread / np.sqrt(n) + 1e-6)


def test_rate_zero_or_no_keys_change_nothing_bit_for_bit(tiny):
    """Catches dropout leaking into forwards that must not have it (the sampler, the proximal
    and reference scores get no keys) or into the default dropout 0: log-probs with keys at
    rate 0, and without keys at rate P, equal the plain forward's bit for bit; the step adds no
    keys at rate 0. With keys at rate P they differ, and the same keys give the same values."""
    cfg, base, adapters, tokens = tiny
    params = lora.join(base, adapters)
    cfg0 = cfg.replace(lora_dropout=0.0)
    keys = lora.dropout_keys(0, jnp.int32(0), tokens.shape[0])
    score = jax.jit(scoring.token_logprobs, static_argnums=(0, 4, 5))
    plain = score(cfg0, params, tokens, None, False, 0, None)
    np.testing.assert_array_equal(score(cfg0, params, tokens, None, False, 0, keys), plain)
    np.testing.assert_array_equal(score(cfg, params, tokens, None, False, 0, None), plain)
    dropped = score(cfg, params, tokens, None, False, 0, keys)
    assert float(jnp.abs(dropped - plain).max()) > 1e-3
    np.testing.assert_array_equal(score(cfg, params, tokens, None, False, 0, keys), dropped)
    batch = {"tokens": tokens}
    assert steps.with_dropout_keys(cfg0, batch, 0, jnp.int32(0), None) is batch


def test_keys_are_a_function_of_seed_update_and_row():
    """Catches masks that repeat across updates (the same noise every step), or that are not
    reproducible (a resume must redraw them): keys per (seed, update) are fixed, rows differ."""
    k = lambda seed, step: np.asarray(lora.dropout_keys(seed, jnp.int32(step), 8))  # noqa: E731
    np.testing.assert_array_equal(k(0, 3), k(0, 3))
    assert not np.array_equal(k(0, 3), k(0, 4))
    assert not np.array_equal(k(0, 3), k(1, 3))
    assert len({tuple(r) for r in k(0, 3)}) == 8


@pytest.mark.parametrize("ordered", [False, True])
def test_remat_redraws_the_same_masks(tiny, ordered):
    """Catches a rematerialised forward that draws new masks in the backward's recompute (its
    gradient would belong to no forward): the adapters' gradient with model.remat (free or
    ordered: model/remat.py's custom_vjp saves the typed keys) equals the one without, under
    dropout."""
    cfg, base, adapters, tokens = tiny
    keys = lora.dropout_keys(0, jnp.int32(5), tokens.shape[0])

    def grads(c):
        def loss(ad):
            logp = scoring.token_logprobs(c, lora.join(base, ad), tokens, dropout_keys=keys)
            return -logp.sum()

        return _jit0(jax.grad(loss))(adapters)

    got, ref = grads(cfg.replace(remat=True, remat_ordered=ordered)), grads(cfg)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):  # float32 sums reordered
        np.testing.assert_allclose(g, r, atol=1e-5 * float(jnp.abs(r).max()))


def test_step_loss_and_grad_do_not_depend_on_the_micro_batch_split(tiny):
    """Catches masks tied to a row's place in a micro-batch instead of to the row (keys that do
    not travel with their rows through the split): with ess_scope "step" and P3O (its loss reads
    the ESS: the statistics pass must see the gradient pass's masks), one micro-batch and two
    give the same loss and adapter gradient, of the adapters only."""
    cfg, base, adapters, tokens = tiny
    b, t = tokens.shape
    prompt = 4
    rng = np.random.default_rng(6)
    batch = {
        "tokens": tokens,
        "attn_mask": jnp.ones((b, t), bool),
        "mask": jnp.ones((b, t - prompt), bool),
        "behaviour_logp": jnp.asarray(-2.0 - rng.random((b, t - prompt)), jnp.float32),
        "advantages": jnp.asarray(np.repeat(rng.standard_normal((b, 1)), t - prompt, 1)),
    }
    ocfg = ObjectiveConfig(name="p3o", ess_scope="step")

    def run(c, m):
        def fn(ad, batch):
            batch = steps.with_dropout_keys(c, batch, 0, jnp.int32(0), None)
            logp_fn = lambda p, mb: steps.logp_fn_for(c, prompt)(lora.join(base, p), mb)  # noqa: E731
            return update.step_loss_and_grad(logp_fn, ad, batch, ocfg, m)[:2]

        return _jit0(fn)(adapters, batch)

    (l1, g1), (l2, g2) = run(cfg, 1), run(cfg, 2)
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    for a, r in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, r, atol=1e-5 * float(jnp.abs(r).max()))
    assert jax.tree.structure(g1) == jax.tree.structure(adapters)  # adapters only


def test_a_rows_mask_is_its_keys_alone_whatever_the_batch_mesh_or_default_prng(tiny):
    """Catches masks that depend on the batch a row is in (under jax_default_prng_impl "rbg"
    a vmap over keys ignores them: rows 2-3 alone got other masks than inside the batch) or on
    the mesh: rows 2-3 drawn alone, inside 8 rows, and inside 8 rows sharded over 8 devices,
    with the default impl set to rbg, give the same dropped input."""
    x = jax.random.normal(jax.random.key(8), (8, 5, 16), jnp.float32)
    before = jax.config.jax_default_prng_impl
    jax.config.update("jax_default_prng_impl", "rbg")
    try:
        keys = lora.dropout_keys(0, jnp.int32(2), 8)
        whole = lora.dropout(x, P, lora.wrap_keys(keys), 3)
        alone = lora.dropout(x[2:4], P, lora.wrap_keys(keys[2:4]), 3)
        rows = jax.sharding.NamedSharding(
            jax.make_mesh((8,), ("d",)), jax.sharding.PartitionSpec("d")
        )
        sharded = jax.jit(lambda x, k: lora.dropout(x, P, lora.wrap_keys(k), 3))(
            jax.device_put(x, rows), jax.device_put(keys, rows)
        )
    finally:
        jax.config.update("jax_default_prng_impl", before)
    np.testing.assert_array_equal(alone, whole[2:4])
    np.testing.assert_array_equal(sharded, whole)
    assert 0 < float(jnp.mean(whole == 0)) < 1


def test_score_fn_vcpo_pass_and_sft_step_use_the_right_masks(tiny):
    """Catches dropout in the proximal / reference scoring (`steps.score_fn` must ignore keys a
    batch carries), vcpo's per-row pass scoring rows without their keys (its w_i and baseline
    would then be dropout-free while the loss is not), and an SFT step without dropout or with
    the RL phase's keys: score_fn equals the plain forward; seq_grad_sq's log-probs equal the
    keyed logp_fn's; the SFT step's loss equals a float32 cross-entropy with SFT-phase keys."""
    cfg, base, adapters, tokens = tiny
    params, b, prompt = lora.join(base, adapters), tokens.shape[0], 4
    keys = lora.dropout_keys(0, jnp.int32(0), b)
    mask = jnp.ones(tokens.shape, bool)
    batch = {"tokens": tokens, "attn_mask": mask, lora.DROPOUT_KEYS: keys}
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    scored = steps.score_fn(cfg, prompt, mesh, 1)(params, batch)
    logp_fn = steps.logp_fn_for(cfg, prompt)
    plain = logp_fn(params, {"tokens": tokens, "attn_mask": mask})
    np.testing.assert_allclose(scored, plain, rtol=1e-5, atol=1e-5)
    rows = {**batch, "mask": jnp.ones((b, tokens.shape[1] - prompt), bool)}
    _, logp = _jit0(lambda p, r: accumulate.seq_grad_sq(logp_fn, p, r, 2))(params, rows)
    np.testing.assert_allclose(logp, logp_fn(params, rows), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(logp - plain).max()) > 1e-3

    tx = make_optimizer({**tiny_config().optim.to_dict(), "total_steps": 2})
    rep = sharding.replicated(mesh)
    state, state_sh = steps.init_state(
        jax.device_put(adapters, rep), tx, mesh, jax.device_put(base, rep)
    )
    sft_batch = {"tokens": tokens, "loss_mask": jnp.ones(tokens.shape, bool)}
    step = steps.make_sft_step(cfg, tx, state_sh, sharding.batch_sharding(mesh), seed=4)
    step = step.lower(state, sft_batch).compile({"xla_backend_optimization_level": 0})

    def ce(phase):
        k = lora.dropout_keys(4, jnp.int32(0), b, phase)
        # the loss mask is all ones, position 0 (no context) included with log-prob 0
        return -float(jnp.mean(scoring.token_logprobs(cfg, params, tokens, dropout_keys=k)))

    got = float(step(state, sft_batch)[1]["loss"])
    assert got == pytest.approx(ce(lora.SFT_DROPOUT), rel=1e-5)
    assert abs(got - ce(lora.RL_DROPOUT)) > 1e-4


def test_config_reaches_the_model_config_and_the_peft_export(tiny):
    """Catches model.lora.dropout refused or dropped on its way to ModelConfig, an export that
    writes lora_dropout 0 whatever the config, rates outside [0, 1) accepted, and dropout
    without adapters (rank 0) accepted silently."""
    config = tiny_config(**{"model.lora.rank": RANK, "model.lora.dropout": 0.1})
    schema.check(config)
    cfg = lora_policy.lora_config(config.model, tiny_model_cfg())
    assert cfg.lora_dropout == 0.1
    assert lora.base_config(cfg).lora_dropout == 0.0  # the sampler's merged model
    exported = peft_adapter.adapter_config(cfg, None)
    assert exported["lora_dropout"] == 0.1
    assert (
        peft.LoraConfig(**{k: v for k, v in exported.items() if k != "peft_type"}).lora_dropout
        == 0.1
    )
    with pytest.raises(ValueError, match="lora_dropout 1.0"):
        tiny_model_cfg(lora_rank=RANK, lora_dropout=1.0)
    with pytest.raises(ValueError, match="lora_rank 0"):
        tiny_model_cfg(lora_dropout=0.1)
    with pytest.raises(ValueError, match="model.lora.dropout"):
        schema.check(tiny_config(**{"model.lora.rank": RANK, "model.lora.dropout": 1.0}))
    with pytest.raises(ValueError, match="model.lora.dropout: 0.1 .*needs rank > 0"):
        schema.check(tiny_config(**{"model.lora.dropout": 0.1}))


def test_the_rl_step_drops_the_policy_forward_only(tiny):
    """Catches dropout that never reaches the jitted RL step, or that reaches pi_b's full-KL
    re-score: the real step (`update.make_rl_step`, 8 devices, P3O with the full KL at lag 0)
    on an on-policy batch (pi_b the dropout-free policy, float64 teacher forcing) re-scores
    pi_b within 2e-5 of the recorded log-probs, while the policy's dropped forward gives an
    ESS below 1 (1 exactly without dropout, tests/test_lora.py) and a positive KL."""
    cfg, base, adapters, _ = tiny
    b, p, t = 8, 4, 4
    rng = np.random.default_rng(7)
    tokens = rng.integers(3, cfg.vocab_size, (b, p + t)).astype(np.int32)
    attn = np.ones(tokens.shape, bool)
    batch = {
        "tokens": tokens,
        "attn_mask": attn,
        "mask": np.ones((b, t), np.float32),
        "advantages": np.repeat(rng.normal(size=(b, 1)), t, 1).astype(np.float32),
        "behaviour_logp": np.float32(
            _logp(lora.base_config(cfg), lora.merge(cfg, base, adapters), tokens, attn, p)
        ),
    }
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    tx = make_optimizer({**tiny_config().optim.to_dict(), "total_steps": 2})
    on_mesh = lambda tree: jax.device_put(tree, sharding.replicated(mesh))  # noqa: E731
    state, state_sh = steps.init_state(on_mesh(adapters), tx, mesh, on_mesh(base))
    ocfg = O.objective_config({"name": "p3o", "kl_estimator": "full"})
    full = FullKL.for_run(ocfg, tiny_config().rollout, 0, 1)
    behaviour = full.inputs(None, state_sh.params)
    batch_sh = sharding.batch_sharding(mesh)
    ucfg = update.UpdateConfig(cfg, ocfg, tx, group_size=4)
    key = update.StepKey(p, full)
    fn = update.make_rl_step(ucfg, key, state_sh, batch_sh, behaviour.shardings)
    batch = sharding.shard_batch(batch, mesh)
    program = fn.lower(state, batch, behaviour.params).compile(
        {"xla_backend_optimization_level": 0}
    )
    _, m = jax.device_get(program(state, batch, behaviour.params))
    assert m["rescore_err"] <= 2e-5
    assert m["ess"] < 1 - 1e-4
    assert m["kl_behaviour"] > 0

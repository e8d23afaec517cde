"""The normalised effective sample size (docs/method.md): properties, partial sums, and its scope
("step" must make loss and gradients independent of micro-batching and device count)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ess_jax import objectives as O
from ess_jax.rl import update as U

L = 16  # every example is padded to one shape so the jitted ESS compiles once
_ess = jax.jit(O.effective_sample_size)
log_ratios = st.lists(st.floats(-30.0, 30.0, allow_nan=False, width=32), min_size=1, max_size=L)


def _padded(values, pad_value=0.0):
    lr = np.full((1, L), pad_value, np.float32)
    lr[0, : len(values)] = values
    mask = np.zeros((1, L), bool)
    mask[0, : len(values)] = True
    return lr, mask


def _ess64(values):
    rho = np.exp(np.asarray(values, np.float64))
    return rho.sum() ** 2 / (len(rho) * (rho**2).sum())


@settings(max_examples=60, deadline=None)
@given(log_ratios)
def test_ess_in_unit_interval_and_matches_float64(values):
    lr, mask = _padded(values)
    ess = float(_ess(lr, mask))
    n = len(values)
    assert 1.0 / n - 1e-6 <= ess <= 1.0
    assert ess == pytest.approx(_ess64(values), rel=1e-5, abs=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.floats(-80.0, 80.0, width=32), st.integers(1, L))
def test_equal_ratios_give_one(log_ratio, n):
    lr, mask = _padded([log_ratio] * n)
    assert float(_ess(lr, mask)) == pytest.approx(1.0, abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(log_ratios, st.floats(-40.0, 40.0, width=32))
def test_scale_invariance(values, log_scale):
    # Scaling every ratio by c = exp(log_scale) shifts every log-ratio by log_scale.
    lr, mask = _padded(values)
    shifted, _ = _padded(np.float32(values) + np.float32(log_scale))
    assert float(_ess(shifted, mask)) == pytest.approx(float(_ess(lr, mask)), abs=2e-6)


@settings(max_examples=40, deadline=None)
@given(log_ratios, st.sampled_from([0.0, 50.0, -1e4, np.inf, -np.inf, np.nan]))
def test_padding_and_masked_tokens_change_nothing(values, pad_value):
    lr, mask = _padded(values)
    garbage, _ = _padded(values, pad_value)
    assert float(_ess(garbage, mask)) == float(_ess(lr, mask))
    # An extra padded row changes nothing either.
    two_rows = np.concatenate([lr, np.full((1, L), pad_value, np.float32)])
    two_masks = np.concatenate([mask, np.zeros((1, L), bool)])
    assert float(jax.jit(O.effective_sample_size)(two_rows, two_masks)) == pytest.approx(
        float(_ess(lr, mask)), abs=1e-7
    )


def test_extreme_ratios_are_finite():
    lr, mask = _padded([80.0, -80.0, 79.0, 0.0])
    ess = float(_ess(lr, mask))
    assert np.isfinite(ess)
    # exp(80) and exp(79) dominate: ESS = (1 + e^-1)^2 / (4 (1 + e^-2)).
    assert ess == pytest.approx((1 + np.exp(-1)) ** 2 / (4 * (1 + np.exp(-2))), rel=1e-6)
    lr, mask = _padded([80.0] * 5 + [-80.0] * 5)
    assert float(_ess(lr, mask)) == pytest.approx(25 / 50, rel=1e-6)


def test_empty_and_non_finite_give_one():
    lr, mask = _padded([0.5, 2.0])
    assert float(_ess(lr, np.zeros_like(mask))) == 1.0
    for bad in (np.nan, np.inf):
        lr_bad, mask = _padded([0.5, bad, 2.0])
        assert float(_ess(lr_bad, mask)) == 1.0


def test_stop_gradient():
    lr, mask = _padded([0.1, 1.0, -2.0])
    grad = jax.grad(lambda x: O.effective_sample_size(x, mask))(jnp.asarray(lr))
    assert np.all(np.asarray(grad) == 0.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_partial_sums_combine_to_the_whole(seed):
    rng = np.random.default_rng(seed)
    lr = rng.uniform(-60, 60, (8, 5)).astype(np.float32)
    mask = rng.random((8, 5)) < 0.7
    mask[2:4] = False  # an entirely empty part must merge cleanly
    whole = O.ess_from_sums(O.ess_sums(lr, mask))
    parts = [O.ess_sums(lr[i : i + 2], mask[i : i + 2]) for i in range(0, 8, 2)]
    merged = parts[0]
    for part in parts[1:]:
        merged = O.combine_ess_sums(merged, part)
    assert float(O.ess_from_sums(merged)) == pytest.approx(float(whole), rel=1e-6)
    assert float(merged.count) == mask.sum()
    # Two empty partials stay empty (ESS 1), never nan.
    empty = O.ess_sums(lr[2:3], mask[2:3])
    assert float(O.ess_from_sums(O.combine_ess_sums(empty, empty))) == 1.0


# ------------------------------------------- ESS scope: step vs micro-batch accumulation

D, V, B, T, G = 4, 7, 32, 6, 4


def _log_softmax(params, mb):
    """A tiny linear policy's whole distribution: log-softmax(features @ w + b), [B, T, V]."""
    logits = jnp.einsum("btd,dv->btv", mb["features"], params["w"]) + params["b"]
    return jax.nn.log_softmax(logits, axis=-1)


def _at_tokens(logp_BxTxV, mb):
    return jnp.take_along_axis(logp_BxTxV, mb["tokens"][..., None], axis=-1)[..., 0]


def _logp_fn(params, mb):
    """The tiny linear policy's log-probs of the batch's tokens."""
    return _at_tokens(_log_softmax(params, mb), mb)


def _policy_batch(seed=0):
    from ess_jax.rl.advantages import broadcast_to_tokens, group_advantages

    rng = np.random.default_rng(seed)
    f32 = lambda x: np.asarray(x, np.float32)
    params0 = {"w": f32(rng.normal(size=(D, V))), "b": f32(rng.normal(size=V))}
    params = jax.tree.map(lambda p: f32(p + 0.3 * rng.normal(size=p.shape)), params0)
    mid = jax.tree.map(lambda a, b: f32((a + b) / 2), params0, params)
    lengths = rng.integers(1, T + 1, B)
    lengths[5] = 0  # an empty sequence
    mask = np.arange(T)[None] < lengths[:, None]
    batch = {"features": f32(rng.normal(size=(B, T, D))), "tokens": rng.integers(0, V, (B, T))}
    noise = f32(rng.normal(0, 0.4, (B, T)))
    # Heavier off-policyness in the second half, so per-micro-batch ESS values really differ.
    noise[B // 2 :] *= 4
    batch["behaviour_logp"] = np.where(mask, np.asarray(_logp_fn(params0, batch)) + noise, 0)
    batch["prox_logp"] = np.asarray(_logp_fn(mid, batch))
    rewards = rng.integers(0, 2, B).astype(np.float32)
    adv = group_advantages(jnp.asarray(rewards), G)
    batch.update(advantages=np.asarray(broadcast_to_tokens(adv, mask)), mask=mask)
    return params, {k: np.asarray(v) for k, v in batch.items()}


@functools.cache
def _step(objective_cfg, m, seed=0, devices=1):
    """Loss, grads and metrics of one jitted step (cached: several tests share results)."""
    params, batch = _policy_batch(seed)
    if devices > 1:
        mesh = jax.make_mesh((devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        assert len(batch["mask"].sharding.device_set) == devices
        params = jax.device_put(params, NamedSharding(mesh, P()))
    fn = jax.jit(lambda p, b: U.step_loss_and_grad(_logp_fn, p, b, objective_cfg, m))
    loss, grads, metrics = fn(params, batch)
    return float(loss), jax.tree.map(np.asarray, grads), {k: float(v) for k, v in metrics.items()}


def _assert_close(a, b, tol=1e-6):
    loss_a, grads_a, metrics_a = a
    loss_b, grads_b, metrics_b = b
    assert abs(loss_a - loss_b) <= tol * max(1.0, abs(loss_b))
    for ga, gb in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True):
        np.testing.assert_allclose(ga, gb, rtol=0, atol=tol * max(1.0, np.abs(gb).max()))
    assert metrics_a.keys() == metrics_b.keys()
    for key in metrics_a:
        assert metrics_a[key] == pytest.approx(metrics_b[key], rel=tol, abs=tol), key


@pytest.mark.parametrize(
    "objective_cfg",
    [
        O.ObjectiveConfig(name="p3o"),
        O.ObjectiveConfig(name="p3o_dual"),
        # sequence-level normalisers (global sequence count) must be invariant too
        O.ObjectiveConfig(name="gspo", aggregation="seq_mean_token_mean", clip_eps_high=0.5),
        # no statistics pass (ESS only in the metrics): ess and ess_prox after the gradients
        O.ObjectiveConfig(name="grpo"),
        O.ObjectiveConfig(name="decoupled_ppo"),
    ],
    ids=lambda objective_cfg: objective_cfg.name,
)
def test_step_scope_is_invariant_to_microbatching(objective_cfg):
    whole = _step(objective_cfg, 1)
    assert 0.05 < whole[2]["ess"] < 0.95  # the cap and the KL term are both active
    for m in (2, 4):
        _assert_close(_step(objective_cfg, m), whole)


def _logp_entropy_fn(params, mb):
    """_logp_fn plus the policy's entropy per token, as the RL step's log-prob function gives
    it with an entropy bonus: a (logp, extras) pair whose extras carry gradient."""
    logp = _log_softmax(params, mb)
    return _at_tokens(logp, mb), {"entropy": -jnp.sum(jnp.exp(logp) * logp, axis=-1)}


def test_step_scope_with_extras_is_invariant_to_microbatching():
    """The statistics pass keeps the last micro-batch's forward for its gradient: catches the
    cotangent of a log-prob function's extras (here the entropy, under an entropy bonus) lost
    on that path, which drops that micro-batch's entropy gradient."""
    params, batch = _policy_batch(0)
    objective_cfg = O.ObjectiveConfig(name="p3o", beta_ent=0.5)
    fn = jax.jit(
        lambda p, m: U.step_loss_and_grad(_logp_entropy_fn, p, batch, objective_cfg, m),
        static_argnums=1,
    )
    whole = fn(params, 1)
    for m in (2, 4):
        loss, grads, metrics = fn(params, m)
        assert float(loss) == pytest.approx(float(whole[0]), rel=1e-6)
        for key in grads:
            np.testing.assert_allclose(
                grads[key], whole[1][key], rtol=0, atol=1e-6 * np.abs(whole[1][key]).max()
            )
        assert float(metrics["ess"]) == pytest.approx(float(whole[2]["ess"]), rel=1e-6)


@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("name", ["p3o", "p3o_dual", "grpo", "cispo"])
def test_forward_count_of_a_step(name, m):
    """Counts the micro-batch forwards one jitted step runs. Catches the no-grad statistics pass
    (M - 1 extra micro-batch forwards, ~+24% of an update at 4 micro-batches on bench/cpu.py's
    model) run for objectives that only report the ESS (GRPO and the other baselines would pay
    it, which also hides the ESS objective's real overhead in the bench), skipped for P3O,
    whose loss needs the step's ESS first, or run without reusing the last micro-batch's
    forward for its gradient from M = 3 on (2M forwards instead of 2M - 1); at M = 2 the
    reuse is off (see test_statistics_pass_memory_is_one_microbatch), 2M."""
    params, batch = _policy_batch(0)
    forwards = []

    def counting(p, mb):
        jax.debug.callback(lambda: forwards.append(1))
        return _logp_fn(p, mb)

    objective_cfg = O.ObjectiveConfig(name=name)
    out = jax.jit(lambda p: U.step_loss_and_grad(counting, p, batch, objective_cfg, m))(params)
    jax.block_until_ready(out)
    if name not in {n for n, o in O.OBJECTIVES.items() if o.ess_in_loss}:
        assert len(forwards) == m
    else:
        assert len(forwards) == (2 * m - 1 if m > 2 else 2 * m)


def test_the_last_forward_is_kept_from_three_microbatches():
    """Catches accumulate.keeps_last_microbatch's bound moved off M = 3 (the bound the RL step's
    loop trips, tools/compile_tpu.py's `loop_trips`, are read from): P3O at M = 3 runs 2M - 1
    = 5 micro-batch forwards, and the predicate says so for it and not for GRPO or M = 2."""
    from ess_jax.rl import accumulate

    params, batch = _policy_batch(0)
    batch = {k: v[:24] for k, v in batch.items()}  # rows that 3 micro-batches divide
    forwards = []

    def counting(p, mb):
        jax.debug.callback(lambda: forwards.append(1))
        return _logp_fn(p, mb)

    objective_cfg = O.ObjectiveConfig(name="p3o")
    out = jax.jit(lambda p: U.step_loss_and_grad(counting, p, batch, objective_cfg, 3))(params)
    jax.block_until_ready(out)
    assert len(forwards) == 5
    p3o, grpo = O.OBJECTIVES["p3o"], O.OBJECTIVES["grpo"]
    assert accumulate.keeps_last_microbatch(p3o, "step", 3)
    assert not accumulate.keeps_last_microbatch(p3o, "step", 2)
    assert not accumulate.keeps_last_microbatch(grpo, "step", 3)


@pytest.mark.parametrize("m", [2, 4])
def test_statistics_pass_memory_is_one_microbatch(m):
    """Catches a statistics pass that holds more than one micro-batch's activations: P3O's
    compiled temp memory must stay within 10% of GRPO's (no pass) on a model whose activations
    dominate. At M = 2 reusing the last micro-batch's forward leaves one-step scans, which XLA
    inlines, and the straight-line program holds both micro-batches' activations (planted:
    the reuse on at M = 2 gives 1.98x GRPO's here, fails)."""
    from ess_jax.model import decoder as model
    from ess_jax.rl import steps

    model_cfg = model.ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=512,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        pad_token_id=0,
    )
    prompt, resp, rows = 16, 112, 16
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), model.abstract_params(model_cfg)
    )
    spec = lambda shape, dt=jnp.float32: jax.ShapeDtypeStruct(shape, dt)
    batch = {
        "tokens": spec((rows, prompt + resp), jnp.int32),
        "attn_mask": spec((rows, prompt + resp), bool),
        "mask": spec((rows, resp), bool),
        "behaviour_logp": spec((rows, resp)),
        "advantages": spec((rows, resp)),
    }
    logp_fn = steps.logp_fn_for(model_cfg, prompt)

    def temp(name):
        objective_cfg = O.ObjectiveConfig(name=name)
        step = jax.jit(lambda p, b: U.step_loss_and_grad(logp_fn, p, b, objective_cfg, m))
        return step.lower(abstract, batch).compile().memory_analysis().temp_size_in_bytes

    assert temp("p3o") <= 1.1 * temp("grpo")


@pytest.mark.parametrize("name", sorted(n for n, o in O.OBJECTIVES.items() if not o.ess_in_loss))
def test_objectives_outside_ess_in_loss_do_not_read_the_ess(name):
    """Catches an objective whose loss reads ess / ess_prox but whose record says ess_in_loss=False:
    with ess_scope "step" it would silently get each micro-batch's own ESS. Its loss and
    gradient must not move when the supplied statistics do."""
    params, batch = _policy_batch(0)
    objective_cfg = O.ObjectiveConfig(name=name)

    def loss(p, ess):
        stats = {"ess": ess, "ess_prox": ess}
        return O.get_objective(name).loss(_logp_fn(p, batch), {**batch, **stats}, objective_cfg)[0]

    lo, hi = (jax.value_and_grad(loss)(params, e) for e in (0.2, 0.9))
    assert float(lo[0]) == float(hi[0])
    for a, b in zip(jax.tree.leaves(lo[1]), jax.tree.leaves(hi[1])):
        np.testing.assert_array_equal(a, b)


def test_step_scope_is_invariant_to_devices():
    objective_cfg = O.ObjectiveConfig(name="p3o")
    for m in (1, 4):
        _assert_close(_step(objective_cfg, m, devices=8), _step(objective_cfg, 1))


@pytest.mark.parametrize("scope", ["microbatch", "microbatch_local"])
def test_microbatch_scope_depends_on_the_split(scope):
    """A micro-batch scope whose ESS is silently the step's (the split would change nothing), or
    one that differs from "step" even when the step is a single micro-batch (e.g. a stray 1/M)."""
    micro = O.ObjectiveConfig(name="p3o", ess_scope=scope)
    whole = _step(micro, 1)
    _assert_close(whole, _step(O.ObjectiveConfig(name="p3o"), 1))  # one micro-batch: same
    split = _step(micro, 4)
    assert abs(split[0] - whole[0]) > 1e-3 * abs(whole[0])
    assert np.abs(split[1]["w"] - whole[1]["w"]).max() > 1e-3 * np.abs(whole[1]["w"]).max()


def test_step_scope_rejects_uneven_split():
    params, batch = _policy_batch()
    with pytest.raises(ValueError, match="divisible"):
        U.step_loss_and_grad(_logp_fn, params, batch, O.ObjectiveConfig(), 3)

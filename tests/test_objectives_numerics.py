"""The objectives' numerical edges: non-finite log-probs, ratio overflow, the MIS / TIS band and
sequence veto against verl's definitions, and the row shuffle of the micro-batch ESS scopes.
Pure loss functions on hand-built arrays; references in float64 numpy."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ess_jax import objectives as O
from ess_jax.objectives import scopes as A
from ess_jax.rl import update as U

LN3 = math.log(3.0)
K3_T2 = LN3 + 1 / 3 - 1  # k3 of a token with rho = 3 against pi_b
# Configs that reach every code path a dropped token or a huge ratio could break.
CONFIGS = [
    *({"name": n} for n in sorted(O.OBJECTIVES)),
    {"name": "p3o", "p3o_drop_cap": True},
    {"name": "p3o", "aggregation": "seq_mean_token_mean", "beta_kl": 0.1, "beta_ent": 0.01},
    {"name": "p3o_dual", "dual_version": "two_kl"},
    {"name": "gspo", "aggregation": "seq_mean_token_mean"},
    {"name": "decoupled_ppo", "behaviour_weight_cap": 2.0},
    {"name": "grpo_tis", "is_level": "sequence", "is_veto": 1e-4},
    {"name": "grpo_mis", "is_level": "sequence", "is_cap_low": 0.5, "is_veto": 1e-4},
]
IDS = ["-".join(f"{k}={v}" for k, v in kw.items() if k != "name") or kw["name"] for kw in CONFIGS]
IDS = [f"{kw['name']}:{i}" for kw, i in zip(CONFIGS, IDS)]


@functools.cache
def _jitted(kw):
    cfg = O.ObjectiveConfig(**dict(kw))
    fn = lambda lp, batch: O.OBJECTIVES[cfg.name].loss(lp, batch, cfg)
    return jax.jit(jax.value_and_grad(fn, has_aux=True))


def _run(logp, batch, **kw):
    (loss, metrics), grad = _jitted(tuple(sorted(kw.items())))(logp, batch)
    return float(loss), np.asarray(grad), {k: float(v) for k, v in metrics.items()}


# ---------------------------------------------------------------- non-finite log-probs


def test_p3o_with_an_infinite_logp_by_hand():
    """Catches P3O's NaN loss on a valid token with logp = -inf (cap weight 0 times -inf: the
    whole update is skipped), a dropped token still in the ESS (its ratio 0 lowers e_B from
    0.8), or dropped from N (the normaliser the scopes know before any forward: 3 here)."""
    logp = np.array([[-1.0, -2.0, -np.inf]], np.float32)
    batch = {
        "behaviour_logp": np.array([[-1.0, -2.0 - LN3, -1.5]], np.float32),
        "advantages": np.array([[2.0, 1.0, 1.0]], np.float32),
        "mask": np.array([[True, True, True]]),
    }
    loss, grad, m = _run(logp, batch, name="p3o")
    # the two kept tokens as in test_objectives.py::test_p3o_by_hand, over N = 3
    assert loss == pytest.approx((3.2 + 0.2 * K3_T2) / 3, rel=1e-6)
    np.testing.assert_allclose(grad, [[-1.6 / 3, (-0.8 + 0.2 * (2 / 3)) / 3, 0.0]], rtol=1e-6)
    assert m["ess"] == pytest.approx(0.8, rel=1e-6)
    assert m["nonfinite_frac"] == pytest.approx(1 / 3)
    assert (m["ratio_mean"], m["ratio_max"]) == (pytest.approx(4 / 3), pytest.approx(3.0))
    assert m["entropy_proxy"] == pytest.approx(1.0)
    # a NaN behaviour log-prob drops its token the same way
    nan_b = {**batch, "behaviour_logp": batch["behaviour_logp"].copy()}
    nan_b["behaviour_logp"][0, 2] = np.nan
    loss_b, grad_b, m_b = _run(np.array([[-1.0, -2.0, -1.5]], np.float32), nan_b, name="p3o")
    assert loss_b == pytest.approx(loss, rel=1e-6) and m_b["nonfinite_frac"] == m["nonfinite_frac"]
    np.testing.assert_allclose(grad_b, grad, rtol=1e-6)


def _random_batch(seed, b=3, t=5):
    rng = np.random.default_rng(seed)
    f32 = lambda x: np.asarray(x, np.float32)
    logp = f32(-rng.uniform(0.1, 3.0, (b, t)))
    prox = f32(logp - rng.normal(0, 0.2, (b, t)))
    batch = {
        "behaviour_logp": f32(prox - rng.normal(0, 0.5, (b, t))),
        "prox_logp": prox,
        "ref_logp": f32(logp - rng.normal(0, 0.3, (b, t))),
        "advantages": f32(np.repeat(rng.normal(size=(b, 1)), t, 1)),
        "mask": np.arange(t)[None] < np.array([[5], [4], [3]][:b]),
    }
    return logp, batch


@pytest.mark.parametrize("kw", CONFIGS, ids=IDS)
def test_nonfinite_tokens_are_dropped_and_keep_their_place_in_n(kw):
    """Catches, for every objective: a NaN / inf loss, gradient or metric from one valid token
    whose logp is -inf (bf16 trainer, masked vocabulary; left in, gspo_token's gradient is NaN,
    cispo's and reinforce's loss -inf) or whose behaviour / proximal / reference log-prob is not
    finite; such a token reaching any sum; and a normaliser that drops it. The batch must give
    exactly the losses of the same batch with those tokens masked and the original N and S
    supplied."""
    logp, batch = _random_batch(0)
    bad_logp, bad = logp.copy(), {k: v.copy() for k, v in batch.items()}
    bad_logp[0, 1] = -np.inf
    bad["behaviour_logp"][1, 2] = np.nan
    bad["prox_logp"][2, 0] = -np.inf
    bad["ref_logp"][0, 3] = np.inf
    dropped = np.zeros_like(batch["mask"])
    dropped[0, 1] = dropped[1, 2] = dropped[2, 0] = dropped[0, 3] = True
    loss, grad, m = _run(bad_logp, bad, **kw)
    assert np.isfinite(loss) and np.all(np.isfinite(grad)), (loss, grad)
    assert all(np.isfinite(v) for v in m.values()), m
    assert np.all(grad[dropped] == 0.0)
    n_tok, n_seq = batch["mask"].sum(), batch["mask"].any(-1).sum()
    masked = {**batch, "mask": batch["mask"] & ~dropped, "num_tokens": n_tok, "num_seqs": n_seq}
    want_loss, want_grad, want_m = _run(logp, masked, **kw)
    assert loss == pytest.approx(want_loss, rel=1e-6, abs=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-7)
    assert m["nonfinite_frac"] == pytest.approx(4 / n_tok)
    assert want_m["nonfinite_frac"] == 0.0
    for key in set(m) - {"nonfinite_frac"}:
        assert m[key] == pytest.approx(want_m[key], rel=1e-6, abs=1e-7), key


D, V, B, T = 3, 5, 16, 6


def _policy():
    """A linear-logit policy whose logp is -inf on a few valid tokens (a masked vocabulary)."""
    rng = np.random.default_rng(1)
    f32 = lambda x: np.asarray(x, np.float32)
    params0 = {"w": f32(rng.normal(size=(D, V))), "b": f32(rng.normal(size=V))}
    params = jax.tree.map(lambda p: f32(p + 0.3 * rng.normal(size=p.shape)), params0)
    mask = np.arange(T)[None] < rng.integers(1, T + 1, B)[:, None]
    batch = {"features": f32(rng.normal(size=(B, T, D))), "tokens": rng.integers(0, V, (B, T))}
    batch["banned"] = np.zeros((B, T), bool)
    batch["banned"][[0, 3, 9, 12], 0] = True  # valid tokens (every row has >= 1)

    def logp_fn(p, mb):
        logits = jnp.einsum("btd,dv->btv", mb["features"], p["w"]) + p["b"]
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), mb["tokens"][..., None], -1)
        return jnp.where(mb["banned"], -jnp.inf, logp[..., 0])

    clean = {**batch, "banned": np.zeros_like(batch["banned"])}
    noise = f32(rng.normal(0, 0.5, (B, T)))
    batch["behaviour_logp"] = np.where(mask, np.asarray(logp_fn(params0, clean)) + noise, 0.0)
    batch["prox_logp"] = f32(
        np.asarray(logp_fn(params0, clean)) * 0.5 + batch["behaviour_logp"] * 0.5
    )
    batch["advantages"] = f32(np.repeat(rng.normal(size=(B, 1)), T, 1))
    batch["mask"] = mask
    return logp_fn, params, batch


@pytest.mark.parametrize(
    "kw",
    [
        {"name": "p3o"},
        {"name": "grpo"},
        {"name": "gspo", "aggregation": "seq_mean_token_mean", "clip_eps_high": 0.5},
    ],
    ids=lambda kw: kw["name"],
)
def test_step_scope_with_dropped_tokens_is_invariant_to_microbatching(kw):
    """Catches step statistics that disagree with the loss's mask: an ESS from the statistics
    pass (P3O at M > 1) that counts the -inf tokens while the loss drops them, or normalisers
    taken from the kept tokens in one path and from the mask in another (GRPO's counts come
    from the mask alone at M > 1): the update would change with the micro-batch split."""
    logp_fn, params, batch = _policy()
    cfg = O.ObjectiveConfig(**kw)
    fn = jax.jit(lambda p, m: U.step_loss_and_grad(logp_fn, p, batch, cfg, m), static_argnums=1)
    loss1, grads1, m1 = fn(params, 1)
    assert np.isfinite(float(loss1)) and 0.05 < float(m1["ess"]) < 0.95
    assert float(m1["nonfinite_frac"]) == pytest.approx(4 / batch["mask"].sum())
    for m in (2, 4):
        loss, grads, metrics = fn(params, m)
        assert float(loss) == pytest.approx(float(loss1), rel=1e-6)
        for key in grads:
            scale = np.abs(np.asarray(grads1[key])).max()
            np.testing.assert_allclose(grads[key], grads1[key], rtol=0, atol=1e-6 * scale)
        for key in m1:
            assert float(metrics[key]) == pytest.approx(float(m1[key]), rel=1e-6, abs=1e-7), key


# ------------------------------------------------------------------------ ratio overflow


@pytest.mark.parametrize("kw", CONFIGS, ids=IDS)
def test_log_ratio_100_stays_finite(kw):
    """Catches exp overflow of an importance ratio (log ratio > ~88 in float32; unclamped, grpo's,
    dapo's and decoupled_ppo's loss is inf and their gradient inf / NaN): the ratio against pi_b,
    against pi_prox, pi_prox / pi_b and GSPO's sequence ratio are each pushed to e^+-100 here."""
    logp = np.full((4, 3), -1.0, np.float32)
    adv = np.array([[-1.0], [-1.0], [1.0], [-1.0]], np.float32) * np.ones((1, 3), np.float32)
    blogp, prox = logp.copy(), logp.copy()
    blogp[0, 1] = -101.0  # logp - blogp = 100, pi_prox = pi: rho and pi_prox / pi_b huge
    blogp[1, :] = prox[1, :] = -101.0  # every token: logp - prox = 100 (GSPO's mean too)
    blogp[2, 0] = 99.0  # logp - blogp = -100
    logp[3, 2], blogp[3, 2] = -1.0, -31.0  # 30: beyond the clamp, within float32
    batch = {"behaviour_logp": blogp, "prox_logp": prox, "ref_logp": logp - 1.0,
             "advantages": adv, "mask": np.ones((4, 3), bool)}  # fmt: skip
    loss, grad, m = _run(logp, batch, **kw)
    assert np.isfinite(loss) and np.all(np.isfinite(grad)), (loss, grad)
    assert all(np.isfinite(v) for v in m.values()), m


@pytest.mark.parametrize("log_ratio, want", [(19.5, math.exp(19.5)), (100.0, math.exp(20.0))])
def test_ratio_is_clamped_at_log_20_as_verl(log_ratio, want):
    """Pins the clamp at verl's 20: a clamp at 10 changes a ratio of e^19.5 (planted: fails),
    none overflows at 100. A negative advantage takes PPO's unclipped branch: loss r |A|, whose
    gradient is r below the clamp and 0 beyond it."""
    logp = np.array([[-1.0]], np.float32)
    batch = {"behaviour_logp": np.array([[-1.0 - log_ratio]], np.float32),
             "advantages": np.array([[-1.0]], np.float32), "mask": np.array([[True]])}  # fmt: skip
    loss, grad, m = _run(logp, batch, name="grpo")
    assert loss == pytest.approx(want, rel=1e-5)
    assert grad[0, 0] == pytest.approx(want if log_ratio < 20 else 0.0, rel=1e-5)
    assert m["ratio_max"] == pytest.approx(want, rel=1e-5)
    # the ESS is computed from the log-ratios (max-shifted sums), never from the clamped ratio
    assert m["ess"] == 1.0


# --------------------------------------------------------------- MIS / TIS: band and veto


def _np_is(logp, batch, cfg):
    """float64 TIS / MIS loss, gradient in logp, weight mean and outside share, written from
    verl's compute_rollout_importance_weights: w = pi_old / pi_b per token or per sequence
    (product); truncate (TIS) or mask outside [low, C] (MIS); a sequence with any token
    w_t < veto gets weight 0 (both modes). Masked tokens still count in N."""
    f = lambda x: np.where(batch["mask"], np.asarray(x, np.float64), 0.0)
    mask = batch["mask"]
    logp, blogp, adv, old = (
        f(logp),
        f(batch["behaviour_logp"]),
        f(batch["advantages"]),
        f(batch["prox_logp"]),
    )
    n = mask.sum()
    log_w_token = old - blogp
    log_w = log_w_token
    if cfg.is_level == "sequence":
        log_w = np.broadcast_to(log_w_token.sum(-1, keepdims=True), log_w.shape)
    w = np.exp(log_w)
    if cfg.name == "grpo_tis":
        outside = w > cfg.is_cap
        w = np.minimum(w, cfg.is_cap)
    else:
        outside = (w > cfg.is_cap) | (w < cfg.is_cap_low)
        w = np.where(outside, 0.0, w)
    if cfg.is_veto > 0:
        vetoed = np.any(mask & (np.exp(log_w_token) < cfg.is_veto), axis=-1, keepdims=True)
        outside = outside | vetoed
        w = np.where(vetoed, 0.0, w)
    w = np.where(mask, w, 0.0)
    r = np.exp(logp - old)
    lo, hi = 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high
    unclipped, clipped = r * adv, np.clip(r, lo, hi) * adv
    loss = np.where(mask, -w * np.minimum(unclipped, clipped), 0).sum() / n
    grad = np.where(mask & (unclipped <= clipped), -w * r * adv, 0) / n
    return loss, grad, w.sum() / n, (outside & mask).sum() / n


def _is_batch(seed):
    rng = np.random.default_rng(seed)
    b, t = 6, 7
    logp = (-rng.uniform(0.1, 4.0, (b, t))).astype(np.float32)
    old = (logp - rng.normal(0.0, 0.3, (b, t))).astype(np.float32)
    blogp = (old - rng.normal(0.0, 0.6, (b, t))).astype(np.float32)
    blogp[1, 3] = old[1, 3] + 12.0  # w_t = e^-12 < 1e-4: a catastrophic token
    blogp[4, 0] = old[4, 0] + 9.5  # e^-9.5 = 7.5e-5 < 1e-4
    blogp[2, 5] = old[2, 5] + 9.0  # e^-9 = 1.2e-4 > 1e-4: not vetoed
    mask = rng.random((b, t)) < 0.8
    mask[[1, 4, 2], [3, 0, 5]] = True
    batch = {"behaviour_logp": blogp, "prox_logp": old, "mask": mask,
             "advantages": np.repeat(rng.normal(size=(b, 1)), t, 1).astype(np.float32)}  # fmt: skip
    return logp, batch


VERL_MIS = {"is_cap": 2.0, "is_cap_low": 0.5, "is_veto": 1e-4}  # verl: low = 1 / C, veto 1e-4


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "kw",
    [
        {"name": "grpo_mis", **VERL_MIS},
        {
            "name": "grpo_mis",
            "is_level": "sequence",
            "is_cap": 4.0,
            "is_cap_low": 0.25,
            "is_veto": 1e-4,
        },  # fmt: skip
        {"name": "grpo_tis", "is_veto": 1e-4},
        {"name": "grpo_tis", "is_veto": 1e-3, "is_level": "sequence", "is_cap": 5.0},
        {"name": "grpo_mis"},  # today's defaults: [0, 2], no veto
    ],
)
def test_mis_band_and_sequence_veto_match_float64_reference(seed, kw):
    """Catches a veto that zeroes only the offending token instead of its whole sequence
    (planted: fails), a veto on the sequence weight instead of each token's, a veto off in TIS
    (verl applies it in both modes), a veto on by default, and a lower MIS bound ignored."""
    logp, batch = _is_batch(seed)
    cfg = O.ObjectiveConfig(**kw)
    loss, grad, m = _run(logp, batch, **kw)
    ref_loss, ref_grad, ref_wmean, ref_outside = _np_is(logp, batch, cfg)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert m["behaviour_weight_mean"] == pytest.approx(ref_wmean, rel=1e-5)
    assert m["behaviour_capped_frac"] == pytest.approx(ref_outside, abs=1e-6)
    # the reference can tell: the rows with a catastrophic token are (or, off, are not) zeroed
    rows_live = np.abs(np.asarray(grad)[[1, 4]]).sum()
    if kw.get("is_veto"):
        assert rows_live == 0.0
    elif kw == {"name": "grpo_mis"}:
        assert rows_live > 0.0


def test_veto_and_lower_bound_are_validated_and_off_by_default():
    """Catches a default that changes today's behaviour (veto on, or MIS's lower bound at verl's
    1 / C) and a veto threshold >= 1 accepted (it would veto nearly every sequence)."""
    default = O.ObjectiveConfig(name="grpo_mis")
    assert (default.is_cap_low, default.is_veto) == (0.0, 0.0)
    with pytest.raises(ValueError, match="is_veto"):
        O.ObjectiveConfig(name="grpo_mis", is_veto=1.0)
    assert {"is_veto", "is_cap_low"} <= set(O.OBJECTIVES["grpo_mis"].fields)
    assert "is_veto" in O.OBJECTIVES["grpo_tis"].fields


# ----------------------------------------------------- micro-batch scopes: the row shuffle

G, EXTERNAL, GROUPS, M, DEVICES = 4, 2, 32, 16, 8  # 50% external, first in each group


def _rows_per_microbatch(key):
    """The original row index of every row of every micro-batch: micro-batch k takes rows
    k, k + M, ... of the batch shuffled by `row_permutation` (none without a key).
    test_ess_scope.py::test_shuffled_microbatches_match_float64_reference checks that
    step_loss_and_grad's micro-batches are exactly these."""
    order = np.arange(G * GROUPS)
    if key is not None:
        order = np.asarray(A.row_permutation(key, G * GROUPS, DEVICES))
    return np.stack([order[k::M] for k in range(M)])


def test_microbatches_mix_external_and_policy_rows():
    """Catches the strided split alone in the micro-batch scopes: with groups laid out i*G + g
    and the external samples first in each group, at G = 4, M = 16 and 50% external every
    micro-batch is 0% or 100% external (shown below without a key), so each one's ESS measures
    one source only. Also catches a shuffle that loses or repeats rows, or moves a row off its
    device's block (each micro-batch must keep one row per device), and one that ignores its
    key."""
    block = G * GROUPS // DEVICES
    strided = _rows_per_microbatch(None)
    assert set(np.mean(strided % G < EXTERNAL, axis=1)) == {0.0, 1.0}  # the bug, kept for M=1
    rows = _rows_per_microbatch(jax.random.key(0))
    assert rows.shape == (M, G * GROUPS // M)
    np.testing.assert_array_equal(np.sort(rows.ravel()), np.arange(G * GROUPS))
    for mb in rows:
        np.testing.assert_array_equal(np.sort(mb // block), np.arange(DEVICES))
    share = np.mean(rows % G < EXTERNAL, axis=1)
    assert share.mean() == 0.5
    assert np.all((share > 0.0) & (share < 1.0)), share
    assert not np.array_equal(rows, _rows_per_microbatch(jax.random.key(1)))


def test_step_scope_ignores_the_key():
    """Catches a shuffle in the "step" scope: its results must stay bit-identical to the strided
    split (they do not depend on it, and the committed runs rely on bit-identical steps)."""
    logp_fn, params, batch = _policy()
    cfg = O.ObjectiveConfig(name="p3o")
    step = jax.jit(lambda p, k: U.step_loss_and_grad(logp_fn, p, batch, cfg, 4, k, 2))
    plain = jax.jit(lambda p: U.step_loss_and_grad(logp_fn, p, batch, cfg, 4))(params)
    shuffled = step(params, jax.random.key(3))
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(shuffled)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "scope, m, shuffled",
    [
        ("microbatch", 4, True),
        ("microbatch_local", 2, True),
        ("microbatch", 1, False),
        ("step", 4, False),
    ],  # fmt: skip
)
def test_rl_step_shuffles_by_seed_and_update_count(monkeypatch, scope, m, shuffled):
    """Catches an RL step that never hands the scopes a key (the fix off in training), one whose
    permutation ignores the update count (the same rows share a micro-batch at every update) or
    the run's seed, a shuffle in the "step" scope or at one micro-batch, and a row-block count
    other than the mesh's data-parallel size."""
    from conftest import tiny_model_cfg

    from ess_jax.parallel import sharding
    from ess_jax.rl import steps

    seen = {}

    def spy(logp_fn, params, batch, config, num_microbatches, key=None, row_blocks=1, **_):
        seen["row_blocks"] = row_blocks
        data = jnp.zeros(2, jnp.uint32) if key is None else jax.random.key_data(key)
        return jnp.float32(0.0), jax.tree.map(jnp.zeros_like, params), {"key": data}

    monkeypatch.setattr(U, "step_loss_and_grad", spy)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
    rep, bsh = sharding.replicated(mesh), sharding.batch_sharding(mesh)
    tx = optax.sgd(0.1)
    params = {"w": jnp.zeros(3)}
    state, state_sh = steps.init_state(jax.device_put(params, rep), tx, mesh)
    batch = jax.device_put({"mask": np.ones((16, 2), np.float32)}, bsh)
    cfg = O.ObjectiveConfig(ess_scope=scope)
    keys = {}
    for seed in (0, 5):
        ucfg = U.UpdateConfig(tiny_model_cfg(), cfg, tx, m, seed=seed)
        step = U.make_rl_step(ucfg, U.StepKey(1), state_sh, bsh)
        for n in (0, 3):
            s = jax.tree.map(jnp.copy, state)  # the step donates its state
            s = s.replace(step=jax.device_put(jnp.int32(n), rep))
            keys[seed, n] = tuple(np.asarray(step(s, batch)[1]["key"]))
    assert seen["row_blocks"] == 8
    if not shuffled:
        assert set(keys.values()) == {(0, 0)}
        return
    want = lambda seed, n: tuple(np.asarray(jax.random.key_data(
        jax.random.fold_in(jax.random.key(seed), n))))  # fmt: skip
    assert keys == {(s, n): want(s, n) for s, n in keys}
    assert len(set(keys.values())) == 4


def test_shuffle_moves_no_rows_between_devices():
    """Catches a shuffle that gathers across the batch sharding: the compiled micro-batch step
    must hold exactly the collectives of the strided split alone (the statistics' and the
    gradient's all-reduces). A permutation over the whole batch (planted: row_blocks=1) adds
    all-reduces of whole [B, T] arrays, XLA's form of a cross-device gather here."""
    mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    logp_fn, params, batch = _policy()
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    cfg = O.ObjectiveConfig(name="p3o", ess_scope="microbatch")
    fn = lambda p, b, k: U.step_loss_and_grad(logp_fn, p, b, cfg, 2, k, DEVICES)
    pattern = re.compile(r"= (.*?) (all-reduce|all-gather|all-to-all|collective-permute)\(")

    def collectives(key):
        text = jax.jit(fn).lower(params, batch, key).compile().as_text()
        return sorted(m.groups() for m in pattern.finditer(text))

    plain = collectives(None)
    assert plain and collectives(jax.random.key(0)) == plain

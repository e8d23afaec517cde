"""VCPO (`objectives/vcpo.py`) against a float64 numpy reference on a toy policy whose
per-sequence score-function gradient has a closed form (a logit table: d log softmax(W[c])[y] /
dW[c] = onehot(y) - softmax(W[c])), and its learning-rate factor applied at the update
(`rl/optim.py:apply_update`): s times the AdamW update, decay included, which a factor on the
loss cannot give."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ess_jax import objectives as O
from ess_jax.objectives import vcpo as V
from ess_jax.rl import accumulate, optim, steps
from ess_jax.rl import update as U

C, VOCAB, B, T, G = 3, 5, 8, 4, 4  # contexts, vocab, rows (2 groups of 4), time


def _logp_fn(params, mb):
    """The toy policy: token t of a row is drawn from softmax(W[ctx_t])."""
    logits = params["w"][mb["ctx"]]
    logp = jax.nn.log_softmax(logits, -1)
    return jnp.take_along_axis(logp, mb["y"][..., None], -1)[..., 0]


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 1.0, (C, VOCAB))
    ctx = rng.integers(0, C, (B, T))
    y = rng.integers(0, VOCAB, (B, T))
    lengths = np.array([4, 1, 3, 2, 4, 2, 1, 3])  # unequal lengths: unequal gradient norms
    mask = np.arange(T)[None] < lengths[:, None]
    logp = _np_logp(w, ctx, y)
    blogp = logp + rng.normal(0, 0.4, (B, T))  # pi_b off by ~0.4 nats a token
    rewards = rng.integers(0, 2, B).astype(np.float64)
    rewards[:G] = [1, 0, 0, 1]  # no constant group
    r = rewards.reshape(-1, G)
    adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-8)).reshape(-1)
    batch = {
        "ctx": ctx.astype(np.int32),
        "y": y.astype(np.int32),
        "mask": mask,
        "behaviour_logp": np.where(mask, blogp, 0.0).astype(np.float32),
        "advantages": np.where(mask, adv[:, None], 0.0).astype(np.float32),
    }
    return {"w": w.astype(np.float32)}, batch


def _np_logp(w, ctx, y):
    logits = w[ctx]
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return np.take_along_axis(logits, y[..., None], -1)[..., 0] - logz


def _np_score(w, ctx, y):
    """d logp_t / dW per token: [B, T, C, V]."""
    p = np.exp(w[ctx] - np.log(np.exp(w[ctx]).sum(-1, keepdims=True)))
    g = np.zeros((*ctx.shape, *w.shape))
    for i, t in np.ndindex(ctx.shape):
        g[i, t, ctx[i, t]] = np.eye(w.shape[1])[y[i, t]] - p[i, t]
    return g


def _reference(params, batch, base=1.0, cap=8.0, baseline_weight="paper"):
    """float64 VCPO: (loss, dloss/dW, lr_scale, ess_ratio, baseline per row); token-mean."""
    w = params["w"].astype(np.float64)
    mask = batch["mask"]
    logp = _np_logp(w, batch["ctx"], batch["y"])
    score = _np_score(w, batch["ctx"], batch["y"]) * mask[..., None, None]
    grad_sq = np.square(score.sum(1)).sum((1, 2))  # ||grad sum_t logp_it||^2
    log_w = np.where(mask, logp - batch["behaviour_logp"].astype(np.float64), 0.0).sum(1)
    iw = np.exp(log_w)
    ess = iw.sum() ** 2 / (B * np.square(iw).sum())
    scale = np.sqrt(min(1.0, ess / base))
    adv = batch["advantages"][:, 0].astype(np.float64)
    weight = {"paper": iw**2 * grad_sq, "no_norm": iw**2, "w": iw * grad_sq}[baseline_weight]
    wg, ag = weight.reshape(-1, G), adv.reshape(-1, G)
    base_row = np.repeat((wg * ag).sum(1) / (wg.sum(1) + 1e-8), G)
    coef = -np.minimum(iw, cap) * (adv - base_row) / mask.sum()  # per row, per token
    loss = (coef[:, None] * np.where(mask, logp, 0.0)).sum()
    grad = (coef[:, None, None, None] * score).sum((0, 1))
    return loss, grad, scale, ess, base_row


@pytest.mark.parametrize("m", [1, 2])
def test_vcpo_loss_grad_scale_and_baseline_match_float64(m):
    """Catches an OPOB weight other than w_i^2 ||grad log pi(y_i)||^2 (without the gradient
    norm, or with w_i instead of w_i^2: both planted below and told apart), a baseline over the
    whole batch or over a micro-batch's strided rows instead of each group (m = 2), an
    untruncated or token-level IS weight, and an ESS or lr scale off the sqrt rule."""
    params, batch = _problem()
    cfg = O.objective_config({"name": "vcpo", "vcpo_is_cap": 1.5})
    fn = jax.jit(lambda p, b: U.step_loss_and_grad(_logp_fn, p, b, cfg, m, group_size=G))
    loss, grads, metrics = fn(params, batch)
    ref_loss, ref_grad, scale, ess, _ = _reference(params, batch, cap=1.5)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(np.asarray(grads["w"]), ref_grad, rtol=2e-5, atol=1e-6)
    assert float(metrics["lr_scale"]) == pytest.approx(scale, rel=1e-5)
    assert float(metrics["ess_seq"]) == pytest.approx(ess, rel=1e-5)
    assert scale < 0.95  # the problem is off-policy enough for the factor to bite
    for planted in ("no_norm", "w"):
        wrong = _reference(params, batch, cap=1.5, baseline_weight=planted)[1]
        assert not np.allclose(np.asarray(grads["w"]), wrong, rtol=1e-3, atol=1e-4)


def test_seq_grad_sq_is_the_per_sequence_gradient_norm():
    """Catches a norm of the batch's summed gradient, of a per-token gradient, or one that
    counts padded tokens: ||grad_W sum_t logp_it||^2 per row against the closed form."""
    params, batch = _problem(1)
    sq, logp = jax.jit(lambda p, b: accumulate.seq_grad_sq(_logp_fn, p, b, 2))(params, batch)
    w = params["w"].astype(np.float64)
    score = _np_score(w, batch["ctx"], batch["y"]) * batch["mask"][..., None, None]
    np.testing.assert_allclose(np.asarray(sq), np.square(score.sum(1)).sum((1, 2)), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(logp), _np_logp(w, batch["ctx"], batch["y"]), atol=1e-6)


def test_ess_lr_scale_and_baseline_by_hand():
    """Catches an ESS not normalised by the number of sequences, a linear instead of a sqrt
    rule, a factor above 1, and a baseline eps other than their 1e-8 (weights 0 -> baseline 0)."""
    log_w = jnp.log(jnp.array([1.0, 2.0, 0.5, 4.0]))
    ess = float(V.ess_ratio(log_w, jnp.ones(4, bool)))
    assert ess == pytest.approx(7.5**2 / (4 * 21.25), rel=1e-6)  # (sum w)^2 / (B sum w^2)
    assert float(V.lr_scale(jnp.float32(ess), 1.0)) == pytest.approx(np.sqrt(ess), rel=1e-6)
    assert float(V.lr_scale(jnp.float32(ess), 0.5)) == 1.0  # min(1, ...)
    assert float(V.ess_ratio(log_w, jnp.array([True, False, False, False]))) == pytest.approx(1.0)
    base = V.opob_baseline(jnp.array([1.0, -1.0, 2.0, 0.0]), jnp.array([3.0, 1.0, 0.0, 0.0]), 2)
    np.testing.assert_allclose(np.asarray(base), [0.5, 0.5, 0.0, 0.0], atol=1e-7)
    with pytest.raises(ValueError, match="whole groups"):
        V.opob_baseline(jnp.zeros(6), jnp.ones(6), 4)


def _tx_and_state():
    tx = optim.make_optimizer(
        {"lr": 1e-2, "weight_decay": 0.1, "max_grad_norm": 1.0, "schedule": "constant"}
    )
    params = {"w": jnp.asarray(np.random.default_rng(2).normal(size=(C, VOCAB)), jnp.float32)}
    state = steps.TrainState(params, tx.init(params), jnp.int32(0), jnp.int32(0))
    return tx, state


def test_lr_scale_scales_the_update_not_the_gradient():
    """Catches the factor put on the loss or gradient (Adam divides it out: the planted variant
    below moves the params by the unscaled amount), and one that spares AdamW's decoupled
    weight decay (their code scales the optimizer's lr, which multiplies the decay)."""
    tx, state = _tx_and_state()
    grads = {"w": jnp.asarray(np.random.default_rng(3).normal(size=(C, VOCAB)), jnp.float32)}
    p0 = np.asarray(state.params["w"])
    s = 0.3
    apply = jax.jit(optim.apply_update, static_argnums=1)
    delta = np.asarray(apply(state, tx, 1.0, grads)[0].params["w"]) - p0
    scaled = np.asarray(apply(state, tx, 1.0, grads, jnp.float32(s))[0].params["w"]) - p0
    np.testing.assert_allclose(scaled, s * delta, rtol=1e-4, atol=2e-7)  # float32 p0 + delta
    # The decay's share of the update, -lr wd p, is material (so it is scaled above too).
    tx0 = optim.make_optimizer(
        {"lr": 1e-2, "weight_decay": 0.0, "max_grad_norm": 1.0, "schedule": "constant"}
    )
    state0 = state.replace(opt_state=tx0.init(state.params))
    delta0 = (
        np.asarray(
            jax.jit(optim.apply_update, static_argnums=1)(state0, tx0, 1.0, grads)[0].params["w"]
        )
        - p0
    )
    np.testing.assert_allclose(delta - delta0, -1e-2 * 0.1 * p0, rtol=1e-3, atol=3e-7)
    sg = {"w": grads["w"] * s}  # planted: the factor on the gradient
    wrong = np.asarray(apply(state, tx, 1.0, sg)[0].params["w"]) - p0
    assert not np.allclose(wrong, s * delta, rtol=1e-2)


def test_objectives_without_lr_scale_update_bit_identically():
    """Catches a factor applied to every objective (or a changed update path): grpo reports no
    lr_scale, and its update equals, bit for bit, tx.update + apply_updates as the step did
    before the hook existed."""
    tx, state = _tx_and_state()
    params, batch = _problem()
    cfg = O.objective_config({"name": "grpo"})
    state = state.replace(params=params, opt_state=tx.init(params))

    def both(state, batch):
        loss, grads, metrics = U.step_loss_and_grad(_logp_fn, state.params, batch, cfg, 1)
        new, _, _ = optim.apply_update(state, tx, loss, grads, metrics.get("lr_scale"))
        updates, _ = tx.update(grads, state.opt_state, state.params)
        return new.params, optax.apply_updates(state.params, updates), "lr_scale" in metrics

    new, today, has_scale = jax.jit(both)(state, batch)
    assert not has_scale
    np.testing.assert_array_equal(np.asarray(new["w"]), np.asarray(today["w"]))


def test_vcpo_config_and_refusals():
    """Catches the record's defaults drifting from their scripts' (base ESS ratio 1, IS cap 8),
    a non-positive field let through, the full KL (vcpo has no KL term) accepted, and a step
    without the group size (the baseline would have no groups); the loss called alone (as the
    generic objective tests call it) takes its own rows' lr_scale and no baseline."""
    cfg = O.objective_config({"name": "vcpo"})
    assert (cfg.vcpo_base_ess_ratio, cfg.vcpo_is_cap) == (1.0, 8.0)
    with pytest.raises(ValueError, match="vcpo_is_cap"):
        O.objective_config({"name": "vcpo", "vcpo_is_cap": 0.0})
    with pytest.raises(ValueError, match="no KL"):
        O.objective_config({"name": "vcpo", "kl_estimator": "full"})
    params, batch = _problem()
    with pytest.raises(ValueError, match="group_size"):
        U.step_loss_and_grad(_logp_fn, params, batch, cfg, 1)
    # The loss alone (no pass): advantages as given, lr_scale from its own rows.
    logp = _logp_fn(params, batch)
    _, metrics = O.OBJECTIVES["vcpo"].loss(logp, batch, cfg)
    assert float(metrics["lr_scale"]) == pytest.approx(_reference(params, batch)[2], rel=1e-5)
    assert float(metrics["opob_shift"]) == 0.0

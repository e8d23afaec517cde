"""ESS scopes against a float64 numpy re-implementation, with micro-batches of unequal token counts
on the 8-device mesh (every micro-batch has one row on each device, so its ESS is pooled over
devices as the reference code all-reduces it over ranks).

"microbatch" must be the reference code's default (FeynRL `normalize_loss=True`): ESS per
micro-batch, every micro-batch's loss sum divided by the token count of the whole optimizer step.
"microbatch_local" divides by the micro-batch's own token count and averages over micro-batches.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ess_jax import objectives as O
from ess_jax.objectives import scopes as A
from ess_jax.rl import update as U

D, V, B, T, M = 3, 5, 32, 8, 4  # 32 rows over 8 devices: row r is on device r // 4
DEVICES = 8
# Valid tokens per row by micro-batch (rows k, k + M, ...): short, medium, long, full.
LENGTHS = ((1, 3), (2, 5), (4, 8), (8, 9))
NOISE = (0.2, 0.5, 1.0, 1.6)  # off-policyness per micro-batch: their ESS values differ


def _logp_fn(params, mb):
    """A linear-logit policy: logits = features @ w + b, log-softmax, gather the tokens."""
    logits = jnp.einsum("btd,dv->btv", mb["features"], params["w"]) + params["b"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, mb["tokens"][..., None], axis=-1)[..., 0]


def _np_logp(params, batch):
    """float64 log-probs of the tokens and d logp / d logits (one-hot minus softmax)."""
    logits = np.einsum("btd,dv->btv", batch["features"], params["w"]) + params["b"]
    logits = logits - logits.max(-1, keepdims=True)
    logp_all = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    onehot = np.eye(V)[batch["tokens"]]
    logp = (logp_all * onehot).sum(-1)
    return logp, onehot - np.exp(logp_all)


@functools.cache
def _problem(seed=0):
    rng = np.random.default_rng(seed)
    f64 = lambda *s: rng.normal(size=s)
    params0 = {"w": f64(D, V), "b": f64(V)}
    params = {k: v + 0.3 * rng.normal(size=v.shape) for k, v in params0.items()}
    mid = {k: (params0[k] + params[k]) / 2 for k in params}
    mb = np.arange(B) % M  # the micro-batch of each row (accumulate._split is strided)
    lengths = np.array([rng.integers(*LENGTHS[k]) for k in mb])
    lengths[6] = 0  # an empty sequence
    mask = np.arange(T)[None] < lengths[:, None]
    batch = {"features": f64(B, T, D), "tokens": rng.integers(0, V, (B, T))}
    noise = rng.normal(size=(B, T)) * np.asarray(NOISE)[mb][:, None]
    batch["behaviour_logp"] = np.where(mask, _np_logp(params0, batch)[0] + noise, 0.0)
    batch["prox_logp"] = np.where(mask, _np_logp(mid, batch)[0], 0.0)
    batch["advantages"] = np.where(mask, rng.normal(size=(B, 1)), 0.0)
    batch["mask"] = mask
    # Round to float32 once, so the float64 reference sees exactly the inputs of the jitted step.
    f32 = lambda x: x.astype(np.float32) if x.dtype == np.float64 else x
    return jax.tree.map(f32, params), {k: f32(v) for k, v in batch.items()}


def _ess(lr, mask):
    rho = np.exp(lr[mask])
    return rho.sum() ** 2 / (rho.size * (rho**2).sum())


def _k3(logp, other):
    """k3 and its derivative in logp (the exponent is clamped to [-10, 10], as the paper code)."""
    expo = other - logp
    inside = np.abs(expo) < 10
    k3 = (logp - other) + np.exp(np.clip(expo, -10, 10)) - 1
    return k3, 1 - np.where(inside, np.exp(expo), 0.0)


def _reference(name, scope, params, batch, order=None):
    """float64 loss, grads {w, b} and metrics of one step in `scope` ("microbatch": the reference
    code's default; "microbatch_local": per-micro-batch token means averaged). Micro-batch k
    holds rows order[k::M] (`order`: the row shuffle; default none, the strided split)."""
    order = np.arange(B) if order is None else np.asarray(order)
    params = {k: v.astype(np.float64) for k, v in params.items()}
    f = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in batch.items()}
    mask = f["mask"]
    logp, dlogp_dlogits = _np_logp(params, f)
    logp = np.where(mask, logp, 0.0)
    blogp, prox, adv = f["behaviour_logp"], f["prox_logp"], f["advantages"]
    lr = logp - blogp
    rho = np.exp(lr)
    dloss_dlogp = np.zeros((B, T))
    ess = {"ess": [], "ess_prox": [], "ess_mix": []}
    per_token = {k: np.zeros((B, T)) for k in ("loss", "pg", "capped")}
    weight = np.zeros((B, T))  # each token's loss weight: 1 / its normaliser
    for k in range(M):
        rows = order[k::M]
        m = mask[rows]
        e_b, e_p = _ess(lr[rows], m), _ess((logp - prox)[rows], m)
        r, lp, a = rho[rows], logp[rows], adv[rows]
        if name == "p3o":
            cap = e_b
            kl, dkl = _k3(lp, blogp[rows])
            kl_w = 1 - e_b
        else:  # p3o_dual, "mixture": KL to pi_mix = (w_b pi_b + w_p pi_prox) / (w_b + w_p)
            cap = min(e_b, e_p)
            w_b, w_p = 1 - e_b, 1 - e_p
            log_mix = np.log(w_b * np.exp(blogp[rows]) + w_p * np.exp(prox[rows]))
            kl, dkl = _k3(lp, log_mix - np.log(w_b + w_p))
            kl_w = 1 - cap
            ess["ess_prox"].append(e_p)
            ess["ess_mix"].append(cap)
        ess["ess"].append(e_b)
        pg = -np.minimum(r, cap) * lp * a
        per_token["pg"][rows] = pg
        per_token["loss"][rows] = pg + kl_w * kl
        per_token["capped"][rows] = r > cap
        dloss_dlogp[rows] = -np.minimum(r, cap) * a + kl_w * dkl
        weight[rows] = 1 / mask.sum() if scope == "microbatch" else 1 / (M * m.sum())
    weight = np.where(mask, weight, 0.0)
    g_logits = (weight * dloss_dlogp)[..., None] * dlogp_dlogits
    grads = {"w": np.einsum("btd,btv->dv", f["features"], g_logits), "b": g_logits.sum((0, 1))}
    loss = np.sum(weight * per_token["loss"])
    kl_b, _ = _k3(logp, blogp)
    metrics = {
        "loss": loss,
        "pg_loss": np.sum(weight * per_token["pg"]),
        "ratio_mean": np.sum(weight * rho),
        "ratio_max": rho[mask].max(),
        "capped_frac": np.sum(weight * per_token["capped"]),
        "clip_frac": np.sum(weight * ((rho > 1.2) | (rho < 0.8))),
        "kl_behaviour": np.sum(weight * kl_b),
        "entropy_proxy": -np.sum(weight * logp),
        "nonfinite_frac": 0.0,  # every log-prob here is finite
        "lr_beyond_clamp_low": np.sum(weight * (lr < -10)),  # k3's exponent clamp
        "lr_beyond_clamp_high": np.sum(weight * (lr > 10)),
    }
    metrics.update({k: np.mean(v) for k, v in ess.items() if v})  # the logged mean over M
    # the mismatch metrics are the whole batch's, whatever the split: catches them taken from
    # one micro-batch, or from log-probs out of line with the shuffled rows
    a, outside = np.abs(lr[mask]), (rho[mask] > 1.2) | (rho[mask] < 0.8)
    metrics.update(
        logratio_p95=np.percentile(a, 95),
        logratio_max=a.max(),
        frac_outside_clip=outside.mean(),
        seq_logratio_mean=lr[mask].sum() / mask.any(-1).sum(),
    )
    return loss, grads, metrics


@functools.cache
def _jax_step(name, scope, shuffle_seed=None):
    params, batch = _problem()
    mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    assert len(batch["mask"].sharding.device_set) == DEVICES
    params = jax.device_put(params, NamedSharding(mesh, P()))
    cfg = O.ObjectiveConfig(name=name, ess_scope=scope)
    key = None if shuffle_seed is None else jax.random.key(shuffle_seed)
    fn = jax.jit(lambda p, b, k: U.step_loss_and_grad(_logp_fn, p, b, cfg, M, k, DEVICES))
    loss, grads, metrics = fn(params, batch, key)
    return float(loss), jax.tree.map(np.asarray, grads), {k: float(v) for k, v in metrics.items()}


def test_problem_has_unequal_microbatches():
    """Guards the fixture: with equal token counts (or ESS values) per micro-batch the scopes
    agree, and the tests below could not tell a wrong denominator from the right one."""
    params, batch = _problem()
    tokens = [batch["mask"][k::M].sum() for k in range(M)]
    assert len(set(tokens)) == M and max(tokens) > 3 * min(tokens), tokens
    loss, _, metrics = _reference("p3o_dual", "microbatch", params, batch)
    lr = np.asarray(_np_logp(params, batch)[0]) - batch["behaviour_logp"]
    ess = [_ess(lr[k::M], batch["mask"][k::M]) for k in range(M)]
    assert max(ess) - min(ess) > 0.2 and max(ess) < 0.999, ess  # the caps and the KL term bite
    assert 1e-6 < 1 - metrics["ess_mix"]  # the mixture's KL gate is open


@pytest.mark.parametrize("scope", ["microbatch", "microbatch_local"])
@pytest.mark.parametrize("name", ["p3o", "p3o_dual"])
def test_microbatch_scopes_match_float64_reference(name, scope):
    """Catches, in scope "microbatch" (the reference code's default): a micro-batch's loss
    divided by its own token count instead of the step's, an ESS over the whole step (or per
    device) instead of per micro-batch, or an ESS metric that is not the mean over
    micro-batches. In "microbatch_local": a denominator other than the micro-batch's own token
    count, or micro-batch means not averaged. Checks the loss, the gradients and every
    metric."""
    params, batch = _problem()
    loss, grads, metrics = _jax_step(name, scope)
    ref_loss, ref_grads, ref_metrics = _reference(name, scope, params, batch)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    for key in ("w", "b"):
        scale = np.abs(ref_grads[key]).max()
        np.testing.assert_allclose(grads[key], ref_grads[key], rtol=0, atol=1e-5 * scale)
    assert metrics.keys() == ref_metrics.keys()
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("name", ["p3o", "p3o_dual"])
def test_local_denominator_differs_from_the_reference_scope(name):
    """Catches a reference scope ("microbatch") that silently divides by the micro-batch's own
    token count: it would give the "microbatch_local" numbers here, which must differ."""
    ref, local = _jax_step(name, "microbatch"), _jax_step(name, "microbatch_local")
    assert abs(ref[0] - local[0]) > 0.05 * abs(ref[0])
    for key in ("w", "b"):
        diff = np.abs(ref[1][key] - local[1][key]).max()
        assert diff > 0.05 * np.abs(ref[1][key]).max(), key
    assert ref[2]["ess"] == pytest.approx(local[2]["ess"], rel=1e-6)  # same per-micro-batch ESS


@pytest.mark.parametrize("scope", ["microbatch", "microbatch_local"])
@pytest.mark.parametrize("name", ["p3o", "p3o_dual"])
def test_shuffled_microbatches_match_float64_reference(name, scope):
    """The micro-batch scopes shuffle rows within each device's block before the strided split
    (scopes.shuffle_rows). Catches a shuffle applied to some arrays of the batch and not others
    (a row's log-probs paired with another row's advantages or mask), or micro-batches that are
    not the permuted rows the reference takes; the 8-device mesh checks it under sharding. The
    unshuffled numbers must differ (else the test could not see a lost shuffle)."""
    params, batch = _problem()
    perm = np.asarray(A.row_permutation(jax.random.key(7), B, DEVICES))
    loss, grads, metrics = _jax_step(name, scope, 7)
    ref_loss, ref_grads, ref_metrics = _reference(name, scope, params, batch, perm)
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    for key in ("w", "b"):
        scale = np.abs(ref_grads[key]).max()
        np.testing.assert_allclose(grads[key], ref_grads[key], rtol=0, atol=1e-5 * scale)
    assert metrics.keys() == ref_metrics.keys()
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert abs(_jax_step(name, scope)[0] - loss) > 1e-3 * abs(loss)

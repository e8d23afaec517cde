"""Every source of pi_b and pi_prox pinned by value, not by direction.

- Dual anchor cap: p3o_dual caps at min(rho_b, min(e_b, e_prox)) in both versions, checked
  against a float64 reference on random batches where both e_b < e_prox and e_prox < e_b occur.
  Bug caught: a cap that ignores e_prox (min(rho_b, e_b)), invisible on batches with e_b < e_prox.
- Lag: with rollout.lag = k the recorded behaviour log-probs of step s equal the teacher-forced
  log-probs of the params saved after update max(0, s - k), and differ from those of the
  neighbouring versions. Bug caught: a policy history that keeps one version too many (or too
  few), which "ESS < 1" and the loop's own policy_lag bookkeeping do not see.
- Proximal snapshot: with updates_per_batch = n, every update of a rollout batch gets the
  prox_logp of the policy at the start of that batch. Bug caught: a snapshot re-taken before
  each update (ess_prox would be 1 for every update and the dual anchor silently becomes P3O),
  or one taken once per run instead of once per batch.
"""

import jax
import numpy as np
import pytest
from test_train import coin_reward, tiny_config

from ess_jax import objectives as O
from ess_jax.model import scoring
from ess_jax.parallel import sharding
from ess_jax.rl import rollout, train, update

_tf_logp = jax.jit(scoring.token_logprobs, static_argnums=0)


def _np_ess(log_ratio, mask):
    rho = np.exp(np.asarray(log_ratio, np.float64)[mask])
    return rho.sum() ** 2 / (rho.size * (rho**2).sum())


def _response_logp(cfg, params, tokens, attn_mask, resp_len):
    """Teacher-forced float32 log-probs of the last `resp_len` tokens, as float64."""
    return np.asarray(_tf_logp(cfg, params, tokens, attn_mask), np.float64)[:, -resp_len:]


# ----------------------------------------------------------------- dual anchor cap (float64)


def _dual_batch(seed, spread_b, spread_p, b=6, t=9):
    """Random batch whose behaviour and proximal log-ratios have the given spreads."""
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.0, 5.0, (b, t)).astype(np.float32)
    mask = rng.random((b, t)) < 0.8
    mask[0, :2] = True
    adv = np.repeat(rng.normal(size=(b, 1)), t, axis=1).astype(np.float32)
    batch = {
        "behaviour_logp": (logp - rng.normal(0.0, spread_b, (b, t))).astype(np.float32),
        "prox_logp": (logp - rng.normal(0.0, spread_p, (b, t))).astype(np.float32),
        "advantages": adv,
        "mask": mask,
    }
    return logp, batch


def _np_k3(logp, other):
    d = other - logp
    return (logp - other) + np.exp(np.clip(d, -10, 10)) - 1, 1 - np.exp(d) * (np.abs(d) < 10)


def _np_dual(logp, batch, version):
    """Float64 p3o_dual loss, gradient in logp, capped fraction, e_b and e_prox (docs/method.md)."""
    f64 = lambda x: np.asarray(x, np.float64)
    logp, blogp, prox, adv = map(
        f64, (logp, batch["behaviour_logp"], batch["prox_logp"], batch["advantages"])
    )
    mask = batch["mask"]
    n = mask.sum()
    e_b, e_p = _np_ess(logp - blogp, mask), _np_ess(logp - prox, mask)
    rho = np.exp(np.where(mask, logp - blogp, 0.0))
    cap = np.minimum(rho, min(e_b, e_p))
    term, dterm = -cap * logp * adv, -cap * adv
    if version == "two_kl":
        for coef, anchor in ((1 - e_b, blogp), (1 - e_p, prox)):
            kl, dkl = _np_k3(logp, anchor)
            term, dterm = term + coef * kl, dterm + coef * dkl
    else:
        e_mix = min(e_b, e_p)
        if 1 - e_mix > 1e-6:
            w_b, w_p = max(0.0, 1 - e_b), max(0.0, 1 - e_p)
            anchor = np.log((w_b * np.exp(blogp) + w_p * np.exp(prox)) / (w_b + w_p))
            kl, dkl = _np_k3(logp, anchor)
            term, dterm = term + (1 - e_mix) * kl, dterm + (1 - e_mix) * dkl
    loss = np.where(mask, term, 0).sum() / n
    grad = np.where(mask, dterm, 0) / n
    capped = (mask & (rho > min(e_b, e_p))).sum() / n
    return loss, grad, capped, e_b, e_p


_DUAL_CASES = [
    (seed, sb, sp) for seed in range(3) for sb, sp in ((0.3, 1.5), (1.5, 0.3), (1.0, 1.0))
]


@pytest.mark.parametrize("version", ["two_kl", "mixture"])
def test_dual_cap_uses_min_of_both_ess_vs_float64(version):
    """Catches a dual cap that ignores e_prox: half the batches have e_prox < e_b."""
    cfg = O.ObjectiveConfig(name="p3o_dual", dual_version=version)
    fn = jax.jit(jax.value_and_grad(lambda lp, b: O.p3o_dual(lp, b, cfg), has_aux=True))
    orders = set()
    for seed, sb, sp in _DUAL_CASES:
        logp, batch = _dual_batch(seed, sb, sp)
        (loss, m), grad = fn(logp, batch)
        ref_loss, ref_grad, ref_capped, e_b, e_p = _np_dual(logp, batch, version)
        orders.add(e_p < e_b)
        assert float(m["ess"]) == pytest.approx(e_b, rel=1e-5)
        assert float(m["ess_prox"]) == pytest.approx(e_p, rel=1e-5)
        assert float(m["ess_mix"]) == pytest.approx(min(e_b, e_p), rel=1e-5)
        assert float(m["capped_frac"]) == pytest.approx(ref_capped, abs=1e-6)
        assert abs(float(loss) - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
        scale = max(1.0, np.abs(ref_grad).max())
        np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-6 * scale)
    assert orders == {True, False}  # both e_prox < e_b and e_b < e_prox were exercised


# ----------------------------------------------------------------- the RL loop, instrumented


def _start(config, workdir):
    run = train.Run(config, str(workdir))
    run.reward_fn = coin_reward
    run.trainer.history.push(0, sharding.reshard(run.trainer.state.params, run.sample_sh))
    return run


def _record_rollouts(monkeypatch):
    """Every Rollout the loop collects, as numpy, in order."""
    real, rollouts = rollout.collect, []

    def collect(*args, **kwargs):
        out, metrics = real(*args, **kwargs)
        rollouts.append(jax.device_get(out))
        return out, metrics

    monkeypatch.setattr(rollout, "collect", collect)
    return rollouts


def test_lag_k_samples_come_from_the_params_after_update_s_minus_k(tmp_path, monkeypatch):
    """Catches a ParamHistory that keeps one version too many or too few: step s's pi_b must be
    exactly the policy saved after update max(0, s - k), not a neighbour."""
    k, n_steps = 2, 5
    run = _start(tiny_config(**{"rollout.lag": k, "optim.lr": 1e-2}), tmp_path)
    rollouts = _record_rollouts(monkeypatch)
    saved = [jax.device_get(run.trainer.state.params)]  # saved[v]: the params after update v
    for s in range(n_steps):
        run.rl_step(s)
        saved.append(jax.device_get(run.trainer.state.params))
    for s, r in enumerate(rollouts):
        mask = r.loss_mask > 0
        resp = r.behaviour_logp.shape[1]
        tf = {
            v: _response_logp(run.model_cfg, saved[v], r.tokens, r.attn_mask, resp)
            for v in range(s + 1)
        }
        want = max(0, s - k)
        err = {v: np.abs(tf[v] - r.behaviour_logp)[mask].max() for v in tf}
        assert err[want] <= 1e-5, (s, err)
        for v in (want - 1, want + 1):
            if v in tf:  # the neighbouring versions are really different policies
                assert err[v] > 1e-3, (s, v, err)


@pytest.mark.parametrize("objective", ["p3o_dual", "decoupled_ppo"])
def test_prox_snapshot_is_start_of_batch_for_all_updates(tmp_path, monkeypatch, objective):
    """Catches a proximal snapshot re-taken before each update (ess_prox 1 everywhere: the dual
    anchor becomes P3O) and one taken once per run rather than once per rollout batch."""
    n_upd, n_steps = 3, 2
    config = tiny_config(
        **{
            "objective.name": objective,
            "train.updates_per_batch": n_upd,
            "data.prompts_per_step": 6,  # 24 sequences: three updates of 8
            "optim.lr": 1e-2,
        }
    )
    run = _start(config, tmp_path)
    real_make, updates = update.make_rl_step, []

    def make_rl_step(*args, **kwargs):
        step_fn = real_make(*args, **kwargs)

        def recorded(state, mb):
            before = jax.device_get(state.params)  # the update donates the state
            new_state, metrics = step_fn(state, mb)
            updates.append((before, jax.device_get(mb), jax.device_get(metrics)))
            return new_state, metrics

        return recorded

    monkeypatch.setattr(update, "make_rl_step", make_rl_step)
    for s in range(n_steps):
        run.rl_step(s)
    assert len(updates) == n_steps * n_upd
    for i, (before, mb, metrics) in enumerate(updates):
        u = i % n_upd
        start = updates[i - u][0]  # the params when this rollout batch's first update began
        mask = mb["mask"] > 0
        resp = mask.shape[1]
        tf_start = _response_logp(run.model_cfg, start, mb["tokens"], mb["attn_mask"], resp)
        tf_now = _response_logp(run.model_cfg, before, mb["tokens"], mb["attn_mask"], resp)
        assert np.abs(mb["prox_logp"] - tf_start)[mask].max() <= 1e-5, (i, u)
        assert float(metrics["ess_prox"]) == pytest.approx(
            _np_ess(tf_now - tf_start, mask), rel=1e-5
        )
        if u == 0:
            assert abs(float(metrics["ess_prox"]) - 1.0) < 1e-6
        else:  # the policy has moved since the snapshot: pi_prox is not the live policy
            assert np.abs(mb["prox_logp"] - tf_now)[mask].max() > 1e-3, (i, u)
            assert float(metrics["ess_prox"]) < 1.0 - 1e-4, (i, u)

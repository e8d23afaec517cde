"""The baselines as their authors run them: VCPO's baseline weight (`objective.vcpo_baseline`)
and M2PO's three forms (`objective.m2po_form`), each against a float64 numpy transcription of
the code that defines it, written from that code and never calling ess_jax's:

- VCPO "authors": mit-han-lab/vcpo (c7f030f) megatron_actor.py `update_policy_per_traj`,
  `_compute_grad_norms`, `_update_grad_buffers` and staleness_utils.py `compute_opob_baseline`:
  one backward per trajectory, gradient buffers, the baseline moved in at the group's end;
  "paper": the same pipeline with the README's weight w^2 ||grad log pi||^2.
- M2PO "areal": inclusionAI/AReaL (4aef98d) actor.py `_apply_m2po_masking` /
  `_get_m2po_loss_mask`, functional.py `apply_rejection_sampling` / `ppo_actor_loss_fn`, the
  engine's loss weights, with torch's gradients of max and clamp at ties.
- M2PO "authors": Infini-AI-Lab/M2PO (af54a3e) core_algos.py `compute_m2po_policy_loss`,
  `kpo_clip_harmful_tokens`, `_solve_tau_from_sorted_delta2`, literally (their 1e-12s kept).

Random inputs have sigma(log w) (VCPO, per sequence) or sigma(log rho) (M2PO, per token) in
[0.3, 1]."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.mini import common
from ess_jax import objectives as O
from ess_jax.config.defaults import base_config
from ess_jax.config.fields import CHOICES
from ess_jax.objectives import vcpo as V
from ess_jax.rl import accumulate
from ess_jax.rl import update as U

# ----------------------------------------------------------------------------- VCPO

C, VOCAB, B, T, G = 3, 5, 8, 6, 4  # contexts, vocab, rows (2 groups of 4), time


def _logp_fn(params, mb):
    """A logit table: token t of a row is drawn from softmax(W[ctx_t])."""
    logp = jax.nn.log_softmax(params["w"][mb["ctx"]], -1)
    return jnp.take_along_axis(logp, mb["y"][..., None], -1)[..., 0]


def _np_logp_and_score(w, ctx, y):
    """float64 log-probs [B, T] and d logp_t / dW [B, T, C, V] (onehot(y) - softmax)."""
    logits = w[ctx]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    logp = np.log(np.take_along_axis(p, y[..., None], -1)[..., 0])
    score = np.zeros((*ctx.shape, *w.shape))
    for i, t in np.ndindex(ctx.shape):
        score[i, t, ctx[i, t]] = np.eye(w.shape[1])[y[i, t]] - p[i, t]
    return logp, score


def _vcpo_problem(sigma, seed):
    """Rows whose sequence log-weight has sd sigma; group 2 has a constant reward."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 1.0, (C, VOCAB))
    ctx, y = rng.integers(0, C, (B, T)), rng.integers(0, VOCAB, (B, T))
    lengths = rng.integers(1, T + 1, B)
    mask = np.arange(T)[None] < lengths[:, None]
    logp, _ = _np_logp_and_score(w, ctx, y)
    noise = rng.normal(0, 1, (B, T)) * sigma / np.sqrt(lengths)[:, None]
    rewards = np.array([1, 0, 0, 1, 1, 1, 1, 1], np.float64) if seed % 2 else rng.integers(0, 2, B)
    rewards[:G] = [1, 0, 1, 0]
    r = rewards.reshape(-1, G).astype(np.float64)
    adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-8)).reshape(-1)
    batch = {
        "ctx": ctx.astype(np.int32),
        "y": y.astype(np.int32),
        "mask": mask,
        "behaviour_logp": np.where(mask, logp - noise, 0.0).astype(np.float32),
        "advantages": np.where(mask, adv[:, None], 0.0).astype(np.float32),
    }
    return {"w": w.astype(np.float32)}, batch, rewards.astype(np.float64)


def _vcpo_their_pipeline(params, batch, rewards, cap, weight):
    """float64 transcription of their per-trajectory update (seq-mean-token-mean, micro-batch 1,
    B trajectories a minibatch, groups of G). Returns (the accumulated gradient, per-row
    coefficient of grad of the row's loss, per-row baseline). `weight`: "authors" (their
    grad_norm_unscaled^2 * rollout_seq_is^2) or "paper" (the README's w^2 ||grad log pi||^2)."""
    w = params["w"].astype(np.float64)
    mask = batch["mask"]
    logp, score = _np_logp_and_score(w, batch["ctx"], batch["y"])
    accum, buffer = np.zeros_like(w), np.zeros_like(w)
    records, coef, base = [], np.zeros(B), np.zeros(B)
    for i in range(B):
        length = mask[i].sum()
        log_w = np.sum(np.where(mask[i], logp[i] - batch["behaviour_logp"][i], 0.0))
        seq_is = np.exp(log_w)  # compute_is_info: rollout_seq_is, unclamped
        is_w = min(np.exp(np.clip(log_w, -20, 20)), cap)  # rollout_is_weights, sequence, detached
        score_sum = (score[i] * mask[i][:, None, None]).sum(0)
        # advantages = 1, old = logp detached (ratio 1), loss x rollout_is_weights, agg
        # seq-mean-token-mean over one sequence, loss_multiplier 1 / len(minibatch)
        g = -(1.0 / B) * is_w * score_sum / (length + 1e-8)
        unscaled = np.sqrt(np.square(g).sum()) * length / (1.0 / B)  # _compute_grad_norms
        norm_sq = unscaled**2 if weight == "authors" else np.square(score_sum).sum()
        records.append((i // G, norm_sq * seq_is**2, rewards[i]))
        group = rewards[(i // G) * G : (i // G + 1) * G]
        std = group.std()  # torch.std(unbiased=False)
        scale_r, scale_b = (rewards[i] / std, 1.0 / std) if std > 1e-8 else (rewards[i], 1.0)
        accum += scale_r * g
        buffer += scale_b * g
        if i % G == G - 1:  # last trajectory of the group: compute_opob_baseline, agg "mean"
            ws = [wt for gid, wt, _ in records if gid == i // G]
            rs = [rr for gid, _, rr in records if gid == i // G]
            b = sum(a * c for a, c in zip(ws, rs)) / (sum(ws) + 1e-8)
            accum += -b * buffer
            buffer[:] = 0.0
            for j in range(i - G + 1, i + 1):
                base[j] = b
                coef[j] = (rewards[j] - b) / std if std > 1e-8 else rewards[j] - b
    return accum, coef, base


@pytest.mark.parametrize("sigma,cap,seed,m", [(0.3, 8.0, 0, 1), (1.0, 8.0, 1, 2), (1.0, 1.5, 2, 1)])
def test_vcpo_baselines_match_their_pipeline(sigma, cap, seed, m):
    """Catches the "authors" weight without their min(w, cap)^2 (the "paper" form, planted
    below: its gradient and per-row coefficients differ from their pipeline's by ~10-30%), a
    "paper" weight that picked up the cap, a baseline that is not per group, and a form switch
    that does nothing; per-row coefficient A'_i = (R_i - b_g) / std_g against
    `batch_pass`'s opob_advantages, and the whole gradient against their buffers."""
    params, batch, rewards = _vcpo_problem(sigma, seed)
    out = {}
    for form in ("paper", "authors"):
        cfg = O.objective_config(
            {"name": "vcpo", "vcpo_is_cap": cap, "vcpo_baseline": form,
             "aggregation": "seq_mean_token_mean"}
        )  # fmt: skip
        step = jax.jit(
            lambda p, b, cfg=cfg: U.step_loss_and_grad(_logp_fn, p, b, cfg, m, group_size=G)
        )
        rows, _ = V.batch_pass(*accumulate.seq_grad_sq(_logp_fn, params, batch, m), batch, cfg, G)
        out[form] = (np.asarray(step(params, batch)[1]["w"]), np.asarray(rows["opob_advantages"]))
        ref_grad, ref_coef, _ = _vcpo_their_pipeline(params, batch, rewards, cap, form)
        np.testing.assert_allclose(out[form][1][:, 0], ref_coef, rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(out[form][0], ref_grad, rtol=2e-5, atol=1e-6)
    theirs = _vcpo_their_pipeline(params, batch, rewards, cap, "authors")
    assert not np.allclose(out["paper"][0], theirs[0], rtol=1e-2, atol=1e-4)
    assert not np.allclose(out["paper"][1][:, 0], theirs[1], rtol=1e-2, atol=1e-3)


# ----------------------------------------------------------------------------- M2PO

MB, MT = 8, 16  # rows, time


def _m2po_batch(sigma, seed, prox_gap=0.05):
    """Token log-ratios log pi_prox - log pi_b ~ N(0, sigma^2); pi_theta = pi_prox + N(0, gap^2)
    (updates after the batch's first; gap 0: the first, pi_theta = pi_prox)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, MT + 1, MB)
    mask = np.arange(MT)[None] < lengths[:, None]
    prox = -rng.uniform(0.1, 3.0, (MB, MT))
    logp = prox + rng.normal(0, prox_gap, (MB, MT)) if prox_gap else prox.copy()
    blogp = prox - rng.normal(0, sigma, (MB, MT))
    adv = rng.normal(0, 1, MB)
    adv[0] = 0.0  # a row with A = 0
    batch = {
        "mask": mask,
        "behaviour_logp": np.where(mask, blogp, 0.0).astype(np.float32),
        "prox_logp": np.where(mask, prox, 0.0).astype(np.float32),
        "advantages": np.where(mask, adv[:, None], 0.0).astype(np.float32),
    }
    return np.where(mask, logp, 0.0).astype(np.float32), batch


@functools.cache
def _m2po_fn(form, m):
    """The step's loss and gradient in the token log-probs themselves: the "params" are the
    [B, T] log-probs and each micro-batch reads its rows by index."""
    cfg = O.objective_config({"name": "m2po", "m2po_form": form})
    logp_fn = lambda lp, mb: lp[mb["row"]]  # noqa: E731
    return jax.jit(lambda lp, b: U.step_loss_and_grad(logp_fn, lp, b, cfg, m))


def _m2po(form, logp, batch, m=1):
    rows = {**batch, "row": np.arange(logp.shape[0], dtype=np.int32)}
    loss, grad, metrics = _m2po_fn(form, m)(jnp.asarray(logp), rows)
    return float(loss), np.asarray(grad), metrics


def _torch_max_clip_grad(adv, r, lo, hi):
    """d/dlogp of torch.max(-A r, -A torch.clamp(r, lo, hi)) with r = exp(logp - old): max
    gives each side half at a tie, clamp passes the gradient on [lo, hi] inclusive."""
    pg1, pg2 = -adv * r, -adv * np.clip(r, lo, hi)
    d1, d2 = -adv * r, -adv * r * ((r >= lo) & (r <= hi))
    return np.where(pg1 > pg2, d1, np.where(pg1 < pg2, d2, 0.5 * (d1 + d2))), np.maximum(pg1, pg2)


def _areal_m2po_mask(old, prox, loss_mask, threshold):
    """actor.py `_apply_m2po_masking` + `_get_m2po_loss_mask`: sort M2 descending, first suffix
    whose mean is < threshold, else mask all but one."""
    m2 = np.square(old - prox)[loss_mask]
    order = np.argsort(-m2, kind="stable")
    sorted_m2 = m2[order]
    n = sorted_m2.size
    suffix = np.cumsum(sorted_m2[::-1])[::-1] / np.arange(n, 0, -1)
    below = np.nonzero(suffix < threshold)[0]
    num_to_mask = below[0] if below.size else n - 1
    keep_sorted = np.arange(n) >= num_to_mask
    out = np.zeros(loss_mask.shape, bool)
    out[loss_mask] = keep_sorted[np.argsort(order)]
    return out


def _areal_reference(logp, batch, threshold=0.04, upper=5.0, normalise="kept", source="prox"):
    """float64 AReaL loss and d loss / d logp over micro-batches of the rows given (a list of
    row-index arrays), weighted by their share of the loss-mask tokens (fsdp_engine's
    loss_weight_fn). Planted variants: normalise "all" (by every token, as the "mask" form) and
    source "theta" (the mask from pi_theta, as the "mask" form)."""
    loss, grad = 0.0, np.zeros(logp.shape)
    total = batch["mask"].sum()
    for rows in batch["_micro"]:
        lm = batch["mask"][rows]
        lp = logp[rows].astype(np.float64)
        old = batch["behaviour_logp"][rows].astype(np.float64)
        prox = batch["prox_logp"][rows].astype(np.float64)
        adv = batch["advantages"][rows].astype(np.float64)
        m2_mask = _areal_m2po_mask(old, prox if source == "prox" else lp, lm, threshold)
        count = m2_mask.sum() if normalise == "kept" else lm.sum()  # ppo_actor_loss_fn's count
        in_bounds = np.exp(prox - old) <= upper  # apply_rejection_sampling: token, ratio, mask
        final = m2_mask & in_bounds
        behave_w = np.where(final, np.exp(prox - old), 0.0)
        r = np.where(final, np.exp(lp - prox), 0.0)
        d, pg = _torch_max_clip_grad(adv, r, 1.0, 1.0)  # eps_clip 0, eps_clip_higher None
        weight = lm.sum() / total
        loss += weight * np.where(final, pg * behave_w, 0.0).sum() / count
        grad[rows] = weight * np.where(final, d * behave_w, 0.0) / count
    return loss, grad


def _solve_tau(sorted_delta2, target_sum):
    """`_solve_tau_from_sorted_delta2`, literally (the callers only reach the tuple returns)."""
    total = sorted_delta2.sum()
    assert not target_sum >= total - 1e-12 and not target_sum <= 1e-12  # their bare returns
    csum = np.cumsum(sorted_delta2)
    n = sorted_delta2.size
    for k in range(n):
        left_sum, rest, m2 = csum[k], n - k - 1, sorted_delta2[k] - 1e-12
        if m2 * rest + left_sum >= target_sum - 1e-12:
            if k == 0:
                return 0.0, csum[-1] / n
            m2_after = (sorted_delta2[k - 1] * (rest + 1) + csum[k - 1]) / n
            return float(sorted_delta2[k - 1] - 1e-12) ** 0.5, m2_after
    raise AssertionError("unreachable")


def _authors_reference(logp, batch, budget=0.04, region="trust"):
    """float64 `compute_m2po_policy_loss` (miniclip None, token-mean) over the rows given:
    (loss, d loss / d logp, clip bounds). Planted variant: region "all" (tau over every
    token, not the trust-region ones)."""
    old = batch["behaviour_logp"].astype(np.float64)
    lp, mask = logp.astype(np.float64), batch["mask"]
    adv = batch["advantages"].astype(np.float64)
    delta = old - lp
    ratio = np.exp(-delta)
    adv_row = adv[:, 0]  # _get_trust_region_tokens_delta_sq: advantages[:, 0]
    pos, neg = (adv_row > 1e-12)[:, None], (adv_row < -1e-12)[:, None]
    harm = mask & ((pos & (ratio > 1 + 1e-12)) | (neg & (ratio < 1 - 1e-12)))
    d2 = np.square(delta)[harm if region == "trust" else mask]
    low, high = 0.0, 100000.0  # kpo_clip_harmful_tokens: no clipping needed
    if d2.size and d2.sum() / d2.size > budget + 1e-12:
        tau, _ = _solve_tau(np.sort(d2), budget * d2.size)
        low, high = np.exp(-tau), np.exp(tau)
    eps_low, eps_high = 1 - low, high - 1  # compute_m2po_policy_loss
    d, pg = _torch_max_clip_grad(adv, ratio, 1 - eps_low, 1 + eps_high)
    n = mask.sum()
    return np.where(mask, pg, 0.0).sum() / n, np.where(mask, d, 0.0) / n, (low, high)


def _micro(m, rows=MB):
    """Row indices of scopes' strided micro-batches (core.split_microbatches)."""
    return [np.arange(j, rows, m) for j in range(m)]


@pytest.mark.parametrize(
    "sigma,seed,gap,m", [(0.3, 0, 0.05, 1), (0.6, 1, 0.0, 1), (1.0, 2, 0.05, 2)]
)
def test_m2po_areal_matches_areal(sigma, seed, gap, m):
    """Catches the "areal" form normalised by every token (the "mask" form's N; planted below,
    off by x1.25 at sigma 0.3, x1.9 at 0.5), its mask taken from pi_theta instead of pi_prox
    (planted), a clip that is not zero-width or that kills the gradient at r = 1 (gap 0: torch
    passes it whole), and a normaliser over the step instead of each micro-batch (m = 2)."""
    logp, batch = _m2po_batch(sigma, seed, gap)
    loss, grad, _ = _m2po("areal", logp, batch, m)
    ref = {**batch, "_micro": _micro(m)}
    ref_loss, ref_grad = _areal_reference(logp, ref)
    assert loss == pytest.approx(ref_loss, rel=2e-5, abs=1e-7)
    np.testing.assert_allclose(grad, ref_grad, rtol=2e-5, atol=1e-7)
    for planted in ({"normalise": "all"}, {"source": "theta"})[: 2 if gap else 1]:
        assert not np.allclose(grad, _areal_reference(logp, ref, **planted)[1], rtol=1e-3)


def test_m2po_areal_rejects_above_5_and_keeps_it_in_the_count():
    """Catches no rejection at pi_prox / pi_b > 5 (AReaL's rejection_sampling.upper), a rejected
    token dropped from the normaliser (ppo_actor_loss_fn counts before rejecting), and a
    rejection at 5 inclusive: 127 tokens at |log| 0.01 keep M2's mean under 0.04 with one token
    at log 1.7 (ratio 5.47) and one just under log 5, so the M2PO mask keeps every token
    (mean M2 0.011 over 512) and only the rejection acts."""
    rng = np.random.default_rng(3)
    rows, time = 16, 32
    mask = np.ones((rows, time), bool)
    prox = -rng.uniform(0.5, 2.0, (rows, time))
    lr = rng.choice([-0.01, 0.01], (rows, time))
    lr[2, 5], lr[4, 0] = 1.7, np.log(5.0) - 1e-3  # rejected; kept just under the bound
    batch = {
        "mask": mask,
        "behaviour_logp": (prox - lr).astype(np.float32),
        "prox_logp": prox.astype(np.float32),
        "advantages": np.repeat(rng.normal(0, 1, (rows, 1)), time, 1).astype(np.float32),
    }
    logp = prox + rng.normal(0, 0.02, (rows, time))
    logp[2, 5], logp[4, 0] = prox[2, 5], prox[4, 0]  # r = 1: the zero-width clip passes both
    logp = logp.astype(np.float32)
    loss, grad, _ = _m2po("areal", logp, batch)
    ref = {**batch, "_micro": _micro(1, rows)}
    ref_loss, ref_grad = _areal_reference(logp, ref)
    assert loss == pytest.approx(ref_loss, rel=2e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=2e-5, atol=1e-8)
    assert grad[2, 5] == 0.0 and grad[4, 0] != 0.0
    no_rejection = _areal_reference(logp, ref, upper=np.inf)[1]
    assert no_rejection[2, 5] != 0.0


@pytest.mark.parametrize("sigma,seed", [(0.3, 4), (0.5, 5), (1.0, 6)])
def test_m2po_authors_matches_their_clip(sigma, seed):
    """Catches the "authors" form run as a mask (the "mask" form, planted below), its bound
    solved over every token instead of the trust-region ones (planted), a clip on the
    non-harmful side, and the bound's token left unclipped (their tau is sqrt(v - 1e-12))."""
    logp, batch = _m2po_batch(sigma, seed)  # log r = log pi_theta - log pi_b ~ N(0, sigma^2)
    loss, grad, metrics = _m2po("authors", logp, batch)
    ref_loss, ref_grad, (low, high) = _authors_reference(logp, batch)
    assert high < 2.0  # the clip binds at these sigmas
    assert loss == pytest.approx(ref_loss, rel=2e-5, abs=1e-7)
    np.testing.assert_allclose(grad, ref_grad, rtol=2e-5, atol=1e-7)
    assert 0.0 < float(metrics["capped_frac"]) < 0.5
    assert not np.allclose(grad, _authors_reference(logp, batch, region="all")[1], rtol=1e-3)
    assert not np.allclose(grad, _m2po("mask", logp, batch)[1], rtol=1e-3)


def test_m2po_authors_without_binding_is_the_unclipped_loss():
    """Catches a clip applied when the trust-region tokens' mean (log r)^2 is under the budget
    (their bounds are then [0, 1e5]): at sigma 0.05 every token keeps -A r's gradient."""
    logp, batch = _m2po_batch(0.05, 7)
    ref_loss, ref_grad, bounds = _authors_reference(logp, batch)
    assert bounds == (0.0, 100000.0)
    loss, grad, metrics = _m2po("authors", logp, batch)
    assert loss == pytest.approx(ref_loss, rel=2e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=2e-5, atol=1e-8)
    assert float(metrics["capped_frac"]) == 0.0


@pytest.mark.parametrize("form", ["areal", "authors"])
def test_m2po_forms_on_degenerate_batches_are_finite(form):
    """Catches a 0/0 or inf * 0 in a form's own parts (the kept-token ratio of "areal", the
    sorted trust-region values of "authors", padded with inf): no token, one token, every
    advantage zero, and non-finite log-probs, each with a finite loss, gradient and metrics;
    no token gives exactly 0."""
    logp = np.array([[-1.0, -0.5, -np.inf], [-2.0, -3.0, 0.0]], np.float32)
    base = {
        "behaviour_logp": np.array([[-1.5, -0.5, np.nan], [-2.0, -1.0, -np.inf]], np.float32),
        "prox_logp": np.array([[-1.2, -0.4, 0.0], [-2.0, -2.0, np.nan]], np.float32),
        "advantages": np.array([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], np.float32),
    }
    cfg = O.ObjectiveConfig(name="m2po", m2po_form=form)
    fn = jax.jit(jax.value_and_grad(lambda lp, b: O.m2po(lp, b, cfg), has_aux=True))
    zero_adv = {k: np.nan_to_num(v, nan=-1.0, neginf=-5.0) for k, v in base.items()}
    zero_adv.update(mask=np.ones((2, 3), bool), advantages=np.zeros((2, 3), np.float32))
    cases = {
        "none": {**base, "mask": np.zeros((2, 3), bool)},
        "one": {**base, "mask": np.array([[False, True, False], [False, False, False]])},
        "all": {**base, "mask": np.ones((2, 3), bool)},
        "zero_adv": zero_adv,
    }
    for name, batch in cases.items():
        lp = np.nan_to_num(logp, neginf=-4.0) if name == "zero_adv" else logp
        (loss, metrics), grad = fn(lp, batch)
        assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad))), name
        assert all(np.isfinite(float(v)) for v in metrics.values()), (name, metrics)
        if name == "none":
            assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0.0)


# ------------------------------------------------------------------------ plumbing


def test_forms_defaults_choices_and_arms():
    """Catches a default that changed the committed runs' meaning (m2po "mask", vcpo "paper"),
    a form the config accepts that the loss does not run (or the reverse), the "areal" form
    without the proximal re-score (it reads prox_logp) or a re-score for the others, and the
    configs/mini arms missing."""
    cfg = base_config().objective
    assert (cfg.m2po_form, cfg.vcpo_baseline) == ("mask", "paper")
    assert O.ObjectiveConfig().m2po_form == "mask"
    assert CHOICES["objective.m2po_form"] == ("mask", "areal", "authors")
    assert CHOICES["objective.vcpo_baseline"] == ("paper", "authors")
    logp, batch = _m2po_batch(0.5, 8)
    for form in CHOICES["objective.m2po_form"]:
        config = O.objective_config({"name": "m2po", "m2po_form": form})
        assert O.needs_prox(config) == (form == "areal")
        assert np.isfinite(_m2po(form, logp, batch)[0])
    for field, bad in (("m2po_form", "clip"), ("vcpo_baseline", "reference")):
        with pytest.raises(ValueError, match=field):
            O.ObjectiveConfig(**{field: bad})
    no_prox = {k: v for k, v in batch.items() if k != "prox_logp"}
    with pytest.raises(ValueError, match="prox_logp"):
        _m2po("areal", logp, no_prox)
    arms = common.OBJECTIVES
    assert arms["m2po_areal"]["m2po_form"] == "areal"
    assert arms["m2po_authors"]["m2po_form"] == "authors"
    assert arms["vcpo_authors"]["vcpo_baseline"] == "authors"
    for arm in ("m2po_areal", "m2po_authors", "vcpo_authors"):
        O.objective_config(arms[arm])

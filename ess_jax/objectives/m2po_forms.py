"""M2PO in its three forms, `objective.m2po_form` (docs/method.md, "M2PO's forms").

Zheng, Zhao, Chen, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale
Data on LLMs?" (arXiv 2510.01161). Its own site (github.com/Infini-AI-Lab/M2PO, docs/index.html,
Algorithm 1 and the objective image) masks tokens until the second moment of the remaining
ones is below tau_M2 = 0.04 and maximises 1/N sum M_t r_t A_t; the code that trains its runs
does something else (an adaptive clip bound). Three forms, each as one codebase runs it:

- "mask" (`losses.m2po`, the default): AReaL's `get_m2po_loss_mask` over every kept token,
  M2 against pi_b, rho = pi_theta / pi_b, no clip, masked tokens still count in N.
- "areal" (`m2po_areal`): inclusionAI/AReaL as its examples/math/gsm8k_m2po.yaml runs it
  (commit 4aef98d8d818af55b43621aaadba047ae10f4e77; areal/trainer/ppo/actor.py `grpo_loss_fn`,
  `_apply_m2po_masking`; areal/utils/functional/functional.py `ppo_actor_loss_fn`,
  `apply_rejection_sampling`; areal/engine/fsdp_engine.py's loss weights): the mask from
  (log pi_prox - log pi_b)^2; the decoupled PPO loss with eps_clip 0 on r = pi_theta / pi_prox
  times the behaviour weight pi_prox / pi_b; tokens with pi_prox / pi_b > 5 rejected
  (`rejection_sampling: {metric: ratio, upper: 5.0}`, token level, action mask); the sum over
  the arrays given divided by the tokens left after the M2PO mask (rejected ones still
  counted), weighted by the arrays' share of the step's tokens. Needs pi_prox (the record's
  `prox_forms`).
- "authors" (`m2po_authors`): Infini-AI-Lab/M2PO's code (commit
  af54a3e8feffb7a66a8258003aebefa37759cec0; verl/trainer/ppo/core_algos.py
  `compute_m2po_policy_loss`, `kpo_clip_harmful_tokens`, `_solve_tau_from_sorted_delta2`,
  `_get_trust_region_tokens_delta_sq`; train-scripts/m2po-qwen-math-7b-s256.sh: M2_budget
  0.04, miniclip unset): over the "trust-region" tokens (A > 0 and r > 1, or A < 0 and
  r < 1; r = pi_theta / pi_b), when their mean (log r)^2 exceeds m2_threshold, a bound tau is
  the largest of their |log r| whose cap keeps sum_j min((log r_j)^2, tau^2) under
  m2_threshold times their count, and PPO's clip runs at [exp(-tau), exp(tau)]; below the
  budget the clip is [0, 1e5]. No mask: every token counts, and the clip zeroes the gradient of
  the trust-region tokens beyond tau only.

All three act over the arrays given (a micro-batch, as both codebases' loss functions) and
aggregate by `objective.aggregation` (AReaL's token mean and the authors' verl token-mean are
`token_mean`). Stop-gradient everywhere but through logp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ess_jax.objectives.config import ObjectiveConfig
from ess_jax.objectives.core import Batch, Metrics, aux_logp, finish, prepare, ratio
from ess_jax.objectives.losses import m2po as m2po_mask_form
from ess_jax.objectives.losses import m2po_mask

# AReaL's gsm8k_m2po.yaml: actor.rejection_sampling.upper (metric "ratio": pi_prox / pi_b).
AREAL_REJECT = 5.0
# The authors' ratio bounds when no clip is needed: kpo_clip_harmful_tokens returns
# (0.0, 100000) as (low, high).
AUTHORS_NO_CLIP = (0.0, 1e5)
# `_get_trust_region_tokens_delta_sq`: an advantage counts as positive (negative) above 1e-12
# (below -1e-12).
ADV_EPS = 1e-12


def m2po_areal(
    logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig
) -> tuple[jax.Array, Metrics]:
    """AReaL's M2PO loss (module docstring), per kept token t of the arrays given:
    -A_t b_t max-clip(r_t) with r_t = pi_theta / pi_prox, b_t = pi_prox / pi_b, PPO's clip at
    [1, 1] (value -A_t min(r_t, 1) for A_t > 0, -A_t max(r_t, 1) for A_t < 0; the gradient of a
    token whose r moved past 1 in its advantage's direction is 0, and at r = 1 torch's max and
    clamp pass the whole of it); 0 where M2PO's mask (from log pi_prox - log pi_b) drops the
    token or b_t > 5; times n / n_kept, n the kept tokens given and n_kept those the mask
    leaves, so the token mean over the step is AReaL's micro-batch-weighted normalisation."""
    c = prepare(logp_BxT, batch, config)
    sg = jax.lax.stop_gradient
    prox = aux_logp(batch, "prox_logp", c.mask, config.name)
    behaviour_lr = jnp.where(c.mask, prox - c.blogp, 0.0)
    keep = m2po_mask(behaviour_lr, c.mask, config.m2_threshold)
    behaviour_w = ratio(behaviour_lr)
    rejected = keep & (behaviour_w > AREAL_REJECT)
    r = ratio(jnp.where(c.mask, c.logp - prox, 0.0))
    clipped = sg(((c.adv > 0) & (r > 1.0)) | ((c.adv < 0) & (r < 1.0)))
    surrogate = -c.adv * jnp.where(clipped, 1.0, r)
    scale = jnp.sum(c.mask, dtype=jnp.float32) / jnp.maximum(jnp.sum(keep, dtype=jnp.float32), 1)
    pg = jnp.where(keep & ~rejected, behaviour_w * surrogate, 0.0) * scale
    cut = c.mask & (~keep | rejected | clipped)
    extras = {"m2": jnp.sum(c.metric_w * jnp.square(behaviour_lr))}  # the mask's M2, before it
    return finish(c, batch, config, pg, pg, cut, extras)


def trust_region_bound(
    log_ratio: jax.Array, adv: jax.Array, mask: jax.Array, budget: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The authors' clip (module docstring) over the arrays given: (whether it binds, tau^2,
    the trust-region tokens). Their trust-region tokens have A > 1e-12 and log r > 0, or
    A < -1e-12 and log r < 0; with n of them, v their (log r)^2 ascending and
    f_k = sum_j min(v_j, v_k), k is the first index with f_k >= budget * n and tau^2 = v_{k-1}
    (0 when k = 0); it binds when the mean of v exceeds the budget. Stop-gradient."""
    lr = jax.lax.stop_gradient(log_ratio)
    region = mask & (((adv > ADV_EPS) & (lr > 0)) | ((adv < -ADV_EPS) & (lr < 0)))
    v = jnp.sort(jnp.where(region, jnp.square(lr), jnp.inf).reshape(-1))  # region's first
    n = jnp.sum(region, dtype=jnp.int32)
    i = jnp.arange(v.size)
    v = jnp.where(i < n, v, 0.0)
    csum = jnp.cumsum(v)
    capped_sum = csum + v * (n - i - 1).astype(jnp.float32)
    hit = (i < n) & (capped_sum >= budget * n.astype(jnp.float32))
    k = jnp.argmax(hit)
    tau2 = jnp.where(k > 0, v[jnp.maximum(k - 1, 0)], 0.0)
    binds = (n > 0) & (csum[-1] > budget * n.astype(jnp.float32))
    return binds, tau2, region


def m2po_authors(
    logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig
) -> tuple[jax.Array, Metrics]:
    """Infini-AI-Lab/M2PO's loss (module docstring): -max-clip(r_t) A_t with r = pi_theta / pi_b
    and PPO's clip at [exp(-tau), exp(tau)] (`trust_region_bound`, m2_threshold the budget) or
    [0, 1e5] when it does not bind. Clipped: the trust-region tokens with (log r)^2 >= tau^2
    (their tau is sqrt(v_{k-1} - 1e-12), so the token at the bound is clipped too) when it
    binds, else A > 0 tokens with r > 1e5. Their gradient is 0, every other token's is -A r."""
    c = prepare(logp_BxT, batch, config)
    sg = jax.lax.stop_gradient
    lr = sg(c.log_ratio)
    binds, tau2, region = trust_region_bound(lr, c.adv, c.mask, config.m2_threshold)
    tau = jnp.sqrt(tau2)
    low = jnp.where(binds, jnp.exp(-tau), AUTHORS_NO_CLIP[0])
    high = jnp.where(binds, jnp.exp(tau), AUTHORS_NO_CLIP[1])
    beyond = (c.adv > 0) & (lr > jnp.log(AUTHORS_NO_CLIP[1]))
    clipped = c.mask & jnp.where(binds, region & (jnp.square(lr) >= tau2), beyond)
    pg = -c.adv * jnp.where(clipped, sg(jnp.clip(c.rho, low, high)), c.rho)
    pg = jnp.where(c.mask, pg, 0.0)
    extras = {"m2": jnp.sum(c.metric_w * jnp.square(lr))}  # token mean of (log rho)^2
    return finish(c, batch, config, pg, pg, clipped, extras)


FORMS = {"mask": m2po_mask_form, "areal": m2po_areal, "authors": m2po_authors}


def m2po(logp_BxT: jax.Array, batch: Batch, config: ObjectiveConfig) -> tuple[jax.Array, Metrics]:
    """M2PO in the form `objective.m2po_form` names (FORMS; module docstring)."""
    return FORMS[config.m2po_form](logp_BxT, batch, config)

"""pi_b's whole distribution, re-scored inside the train step, for P3O's full-vocabulary KL
(`objective.kl_estimator = "full"`).

Axis alphabet: B rows, L = prompt + response length, T response length, C a chunk of T,
D model width, V vocab.

The sampler records only log pi_b(y_t) of the token it drew; KL(pi || pi_b) needs pi_b over the
whole vocabulary at every response position. The train step therefore runs a second forward
with the behaviour params and the sampler's knobs, so that pi_b is the distribution the sampler
drew from:
  params       the policy version the sampler held (the lagged one from the policy history, or
               the current params when they are the same: lag 0, one update per batch); rows
               drawn by the external model (policy_version -1) use its params and config
  compute      float32, as the float32 sampler computes (whatever `model.dtype` the trainer uses)
  temperature  logits / T, with the sampler's float32 T
  top-k/top-p  the sampler's own kept-support rule (`draw.kept_support`), renormalised
A bf16 / fp8 sampler or greedy decoding cannot be re-scored exactly (config/schema.py
check_full_kl refuses them).

With top-k / top-p, pi_b is 0 outside its kept support S, so KL(pi || pi_b) is +inf; the loss
then uses KL(pi(.|S) || pi_b), pi conditioned on S (`kl.kl_on_support`): the exact KL when
nothing is truncated.

Gradient flows through pi only (the behaviour params are stop-gradient). The LM heads run
`logits_chunk` response positions at a time, each chunk recomputed in the backward pass, so
neither model's [B, T, V] logits exist at once.

Cost: one extra forward of the behaviour model per update (no backward): about +1/3 of a train
step's FLOPs (forward + backward ~ 3 forwards; +1/4 with `model.remat`), plus its LM head once
more in the backward's recompute, on response positions only. With an external model both
behaviour models run on every row (each row then reads its own): two extra forwards.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ess_jax.model import decoder as model_lib
from ess_jax.model import lora, moe
from ess_jax.model.scoring import (
    entropy_from_logits,
    logprobs_from_logits,
    over_time,
    scored_hidden,
)
from ess_jax.objectives.kl import kl_on_support
from ess_jax.sampling.draw import kept_support


@dataclasses.dataclass(frozen=True)
class Behaviour:
    """How the sampler drew (static: part of the train step's compile key)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    external_cfg: model_lib.ModelConfig | None = None  # rows with policy_version -1

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(
                f"temperature {self.temperature}: greedy decoding draws from a point mass, "
                "KL(pi || pi_b) is infinite"
            )

    @classmethod
    def from_rollout(cls, rcfg, external_cfg: model_lib.ModelConfig | None = None) -> Behaviour:
        """From `config.rollout`; `external_cfg` only matters when external_fraction > 0."""
        return cls(
            temperature=float(rcfg.temperature),
            top_k=int(rcfg.top_k),
            top_p=float(rcfg.top_p),
            external_cfg=external_cfg if float(rcfg.external_fraction) > 0 else None,
        )


def behaviour_logprobs(logits_BxCxV: jax.Array, b: Behaviour) -> tuple[jax.Array, jax.Array]:
    """(log pi_b, kept support) from the behaviour model's logits, as `draw.draw`
    computes them: log_softmax(logits / T) renormalised over the kept support, -inf outside."""
    v = logits_BxCxV.shape[-1]
    scaled = logits_BxCxV.astype(jnp.float32) / jnp.float32(b.temperature)
    use_top_p = b.top_p < 1.0
    if 0 < b.top_k < v or use_top_p:
        rows = scaled.reshape(-1, v)  # the sampler's rule works on [rows, V]
        keep = kept_support(rows, b.top_k, jnp.float32(b.top_p), use_top_p).reshape(scaled.shape)
    else:
        keep = jnp.ones(scaled.shape, bool)
    masked = jnp.where(keep, scaled, -jnp.inf)
    logq = scaled - jax.nn.logsumexp(masked, axis=-1, keepdims=True)
    return jnp.where(keep, logq, -jnp.inf), keep


def logp_fn_for(
    cfg: model_lib.ModelConfig,
    prompt_len: int,
    behaviour: Behaviour,
    behaviour_params: dict,
    entropy: bool = False,
    chunk: int | None = None,
):
    """`logp_fn(params, mb)` for the RL update (rl/full_kl.FullKL.logp_fn): (logp_BxT, extras) with
      logp                     the policy's response log-probs (temperature 1, float32, with
                               gradient)
      kl_full                  per-token KL(pi || pi_b) (on pi_b's support), gradient through pi
      rescored_behaviour_logp  log pi_b(y_t) of the re-score: must match the recorded one
      entropy                  (with `entropy`) the policy's full-distribution entropy
    `behaviour_params`: {"policy": ..., "external": ... (iff behaviour.external_cfg)}. `mb` needs
    tokens, attn_mask and, with an external model, policy_version ([B] or [B, 1]); a recorded
    routing (moe.ROUTING) is replayed by the policy and its pi_b alike. `chunk`:
    response positions per LM-head call (default: cfg.logits_chunk; <= 0: all at once)."""
    chunk = cfg.logits_chunk if chunk is None else chunk
    sg = jax.lax.stop_gradient
    # (config, params) of each behaviour model, in float32 as the float32 sampler computes
    sources = [(cfg.replace(dtype="float32"), sg(behaviour_params["policy"]))]
    if behaviour.external_cfg is not None:
        ext_cfg = behaviour.external_cfg.replace(dtype="float32")
        sources.append((ext_cfg, sg(behaviour_params["external"])))

    def logp_fn(params, mb):
        tokens, mask = mb["tokens"], mb["attn_mask"].astype(bool)

        def response_hidden(c, p, keys=None, routing=None):  # what predicts the responses
            return scored_hidden(c, p, tokens, mask, prompt_len, keys, routing)

        # the policy with its LoRA dropout (keys in mb: the trainer's step), pi_b without; the
        # policy's recorded routing replayed in both (the external model routes itself)
        routing = mb.get(moe.ROUTING)
        policy, x = response_hidden(cfg, params, mb.get(lora.DROPOUT_KEYS), routing)
        behaviours = [
            response_hidden(c, p, routing=routing if i == 0 else None)
            for i, (c, p) in enumerate(sources)
        ]
        external_rows = mb["policy_version"].reshape(-1) < 0 if len(sources) > 1 else None

        def score(x_BxCxD, tgt_BxC, *xb_BxCxD):
            logits = policy.logits(cfg, x_BxCxD)
            logits_b = [m.logits(c, h) for (m, _), (c, _), h in zip(behaviours, sources, xb_BxCxD)]
            if external_rows is not None:  # each row reads the model that drew it
                logits_b = [jnp.where(external_rows[:, None, None], logits_b[1], logits_b[0])]
            logq, keep = behaviour_logprobs(sg(logits_b[0]), behaviour)
            out = {
                "kl_full": kl_on_support(logits, logq, keep),
                "rescored_behaviour_logp": jnp.take_along_axis(logq, tgt_BxC[..., None], -1)[
                    ..., 0
                ],
            }
            if entropy:
                out["entropy"] = entropy_from_logits(logits)
            return logprobs_from_logits(logits, tgt_BxC), out

        logp, extras = over_time(
            score, chunk, x, tokens[:, prompt_len:], *(h for _, h in behaviours)
        )
        valid = mask[:, prompt_len:]
        extras = {k: jnp.where(valid, v, 0.0) for k, v in extras.items()}
        return jnp.where(valid, logp, 0.0), extras

    return logp_fn

"""One collection step: draw G completions per prompt through a rollout engine, score them,
build the Rollout.

The rows come from a `RolloutEngine` (sampling/engine.py): the policy's (`policy_engine`, the
in-JAX sampler by default) and, with rollout.external_fraction, another model's
(`external_engine`). Every source of off-policyness in docs/method.md is a knob here (all off
by default):
  rollout.temperature / top_k / top_p   the sampler's distribution differs from the trainer's
  rollout.precision                     the sampler's weights and compute (float32, bfloat16,
                                        float16, fp8 formats, int8 / int4 weights, fp8
                                        activations: sampling/precision.py)
  rollout.kv_cache_precision            its KV cache: compute dtype | bfloat16 | fp8
  rollout.lag                           samples come from the policy `lag` versions old
  rollout.external_fraction (+ external_checkpoint)
                                        that share of each group is drawn by another model,
                                        whose own log-probs become pi_b
The trainer always scores at temperature 1 in float32; pi_b is what the engine recorded.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ess_jax.data.layout import RowLayout
from ess_jax.model import moe
from ess_jax.rl import advantages as adv_lib
from ess_jax.rl import lora_policy
from ess_jax.sampling import engine as engine_lib
from ess_jax.sampling import sampler as sampler_lib

EXTERNAL_VERSION = -1  # Rollout.policy_version of the rows the external model drew


@struct.dataclass
class Rollout:
    """A fixed-shape batch of B = prompts * G sequences in `layout` (data/layout.py): row i*G+g
    is sample g of prompt i."""

    tokens: jax.Array  # [B, P+T] int32: left-padded prompt then response
    attn_mask: jax.Array  # [B, P+T] bool: real tokens (prompt and response up to EOS)
    loss_mask: jax.Array  # [B, T] float32: response tokens that are trained on
    behaviour_logp: jax.Array  # [B, T] float32: log pi_b recorded by the engine
    advantages: jax.Array  # [B, T] float32: group advantage broadcast over the response
    rewards: jax.Array  # [B] float32
    policy_version: jax.Array  # [B] int32: trainer step whose params drew it (-1: external)
    layout: RowLayout = struct.field(pytree_node=False)
    prompt_len: int = struct.field(pytree_node=False, default=0)
    # [B, P+T, Ls, X] int32: an MoE policy's experts per token and sparse layer as the engine
    # routed them (moe.NOT_RECORDED on the external model's rows and where none); None: none
    routing: jax.Array | None = None

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]


def engine_knobs(rcfg) -> dict:
    """The in-JAX sampler's knobs of config.rollout besides its format: the KV cache's
    precision and the sampler calls per batch (rollout.sample_microbatches)."""
    return dict(
        kv_cache=str(rcfg.get("kv_cache_precision", "compute")),
        calls=int(rcfg.get("sample_microbatches", 1)),
    )


def policy_engine(cfg, rcfg) -> engine_lib.JaxEngine:
    """The policy's engine: the in-JAX sampler in rollout.precision (lora_policy.engine: with
    model.lora it is pushed the base and the adapters joined)."""
    return lora_policy.engine(cfg, str(rcfg.precision), **engine_knobs(rcfg))


def external_engine(cfg, params, rcfg) -> engine_lib.JaxEngine:
    """The external model's engine (rollout.external_checkpoint) in rollout.external_precision,
    its params fixed at construction as version EXTERNAL_VERSION."""
    precision = str(rcfg.external_precision)
    return engine_lib.JaxEngine(
        cfg, precision=precision, params=params, version=EXTERNAL_VERSION, **engine_knobs(rcfg)
    )


class ParamHistory:
    """The last `lag + 1` policy versions, so rollouts can come from a stale policy.

    This is the actor-learner pipeline of async RL: the actor samples with weights that are
    `lag` updates old. Early in training the oldest available version is used.
    """

    def __init__(self, lag: int):
        if lag < 0:
            raise ValueError(f"rollout.lag must be >= 0, got {lag}")
        self.lag = lag
        self._versions: collections.deque = collections.deque(maxlen=lag + 1)

    def push(self, version: int, params) -> None:
        if self.lag:  # a copy: the trainer donates its params buffers on the next update
            params = jax.tree.map(jnp.copy, params)
        self._versions.append((version, params))

    def behaviour(self) -> tuple[int, Any]:
        return self._versions[0]

    def state(self) -> list[tuple[int, Any]]:
        return list(self._versions)

    def restore(self, versions: Sequence[tuple[int, Any]]) -> None:
        self._versions.clear()
        self._versions.extend(versions)


def _sampling(rcfg, num_samples: int) -> sampler_lib.SamplingConfig:
    return sampler_lib.SamplingConfig(
        temperature=float(rcfg.temperature),
        top_k=int(rcfg.top_k),
        top_p=float(rcfg.top_p),
        max_new_tokens=int(rcfg.max_new_tokens),
        num_samples=num_samples,
        stop_ids=tuple(rcfg.stop_ids),
    )


def _generate(engine, prompts, pmask, sampling, rng) -> engine_lib.Generation:
    gen = engine.generate(prompts, pmask, sampling, rng)
    engine_lib.check_rows(gen, prompts, pmask, sampling)
    return gen


def _join_groups(first, second, first_layout: RowLayout, second_layout: RowLayout):
    """Rows of two layouts over the same prompts -> one layout with each prompt's rows of
    `first` then those of `second` in its group."""
    out = np.concatenate(
        [first_layout.grouped(np.asarray(first)), second_layout.grouped(np.asarray(second))],
        axis=1,
    )
    return out.reshape(-1, *out.shape[2:])


def collect(
    policy: engine_lib.RolloutEngine,
    prompt_batch: dict,
    tokenizer,
    reward_fn: Callable[[str, dict], float],
    rcfg,
    rng: jax.Array,
    external: engine_lib.RolloutEngine | None = None,
) -> tuple[Rollout, dict]:
    """Draw (the engines' `generate`), score and package one rollout batch. Returns
    (Rollout, metrics)."""
    group = int(rcfg.group_size)
    prompts, pmask = prompt_batch["prompt_tokens"], prompt_batch["prompt_mask"]
    layout = RowLayout(prompts.shape[0], group)
    n_ext = int(round(float(rcfg.external_fraction) * group)) if external is not None else 0
    rng_pol, rng_ext = jax.random.split(rng)
    gen = _generate(policy, prompts, pmask, _sampling(rcfg, group - n_ext), rng_pol)
    fields = {k: getattr(gen, k) for k in ("sequences", "sequence_mask", "behaviour_logp")}
    fields.update(tokens=gen.tokens, response_mask=gen.response_mask, version=gen.version)
    if gen.routing is not None:
        fields["routing"] = gen.routing
    if n_ext:
        ext = _generate(external, prompts, pmask, _sampling(rcfg, n_ext), rng_ext)
        ext_fields = {k: getattr(ext, k) for k in fields if k not in ("version", "routing")}
        ext_fields["version"] = np.full_like(ext.version, EXTERNAL_VERSION)
        if "routing" in fields:  # another model's experts: the policy routes those rows itself
            shape = (len(ext.version), *gen.routing.shape[1:])
            ext_fields["routing"] = np.full(shape, moe.NOT_RECORDED, np.int32)
        # external samples first in each group, their pi_b is the external model's log-prob
        fields = {
            k: _join_groups(ext_fields[k], v, ext.layout, gen.layout) for k, v in fields.items()
        }

    resp_mask = fields["response_mask"].astype(bool)
    texts = completions_text(tokenizer, fields["tokens"], resp_mask)
    examples = layout.repeat(list(prompt_batch["examples"]))
    rewards = np.array([reward_fn(t, ex) for t, ex in zip(texts, examples)], np.float32)
    lengths = resp_mask.sum(-1)
    if float(rcfg.overlong_buffer) > 0:  # DAPO soft overlong penalty
        rewards = rewards + np.asarray(
            adv_lib.overlong_penalty(lengths, int(rcfg.max_new_tokens), int(rcfg.overlong_buffer)),
            np.float32,
        )

    adv_N = adv_lib.group_advantages(jnp.asarray(rewards), group, mode=rcfg.advantage_mode)
    loss_mask = resp_mask.astype(np.float32)
    if rcfg.dynamic_sampling:  # DAPO: groups with identical rewards carry no signal
        keep = layout.repeat(np.asarray(adv_lib.dynamic_sampling_mask(jnp.asarray(rewards), group)))
        loss_mask = loss_mask * keep[:, None]
    rollout = Rollout(
        tokens=fields["sequences"].astype(np.int32),
        attn_mask=fields["sequence_mask"].astype(bool),
        loss_mask=loss_mask,
        behaviour_logp=np.where(resp_mask, fields["behaviour_logp"], 0.0).astype(np.float32),
        advantages=np.asarray(adv_lib.broadcast_to_tokens(adv_N, resp_mask)),
        rewards=rewards,
        policy_version=fields["version"].astype(np.int32),
        layout=layout,
        prompt_len=int(prompts.shape[1]),
        routing=fields.get("routing"),
    )
    grouped = layout.grouped(rewards)  # [prompts, G]
    metrics = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "response_len": float(lengths.mean()),
        "frac_groups_solved": float((grouped.max(-1) > 0).mean()),
        # groups whose rewards are all equal: their advantages are 0 (no reward signal)
        "frac_groups_constant": float((grouped.max(-1) == grouped.min(-1)).mean()),
    }
    return rollout, metrics


def completions_text(tokenizer, tokens_BxT: np.ndarray, mask_BxT: np.ndarray) -> list[str]:
    """Decoded responses, each cut at its own EOS (the mask excludes what follows)."""
    return [
        tokenizer.decode(
            np.asarray(r)[np.asarray(m).astype(bool)].tolist(), skip_special_tokens=True
        )
        for r, m in zip(tokens_BxT, mask_BxT)
    ]

"""One collection step: sample G completions per prompt, score them, build the Rollout.

Every source of off-policyness in docs/method.md is a knob here (all off by default):
  rollout.temperature / top_k / top_p   the sampler's distribution differs from the trainer's
  rollout.precision                     the sampler's weights and compute (float32, bfloat16,
                                        float16, fp8 formats, int8 / int4 weights, fp8
                                        activations: sampling/precision.py)
  rollout.kv_cache_precision            its KV cache: compute dtype | bfloat16 | fp8
  rollout.lag                           samples come from the policy `lag` versions old
  rollout.external_fraction (+ external_checkpoint)
                                        that share of each group is drawn by another model,
                                        whose own log-probs become pi_b
The trainer always scores at temperature 1 in float32; pi_b is what the sampler recorded.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ess_jax.parallel import sharding as sharding_lib
from ess_jax.rl import advantages as adv_lib
from ess_jax.sampling import sampler as sampler_lib


@struct.dataclass
class Rollout:
    """A fixed-shape batch of B = prompts * G sequences; row i*G+g is sample g of prompt i."""

    tokens: jax.Array  # [B, P+T] int32: left-padded prompt then response
    attn_mask: jax.Array  # [B, P+T] bool: real tokens (prompt and response up to EOS)
    loss_mask: jax.Array  # [B, T] float32: response tokens that are trained on
    behaviour_logp: jax.Array  # [B, T] float32: log pi_b recorded by the sampler
    advantages: jax.Array  # [B, T] float32: group advantage broadcast over the response
    rewards: jax.Array  # [B] float32
    policy_version: jax.Array  # [B] int32: trainer step whose params drew it (-1: external)
    prompt_len: int = struct.field(pytree_node=False, default=0)

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]


@dataclasses.dataclass
class PolicySource:
    """A model that can draw samples: config, params (any layout: the sampler moves them to
    the sample layout for the duration of a collection) and a version number. `prepared`: the
    sampler format (rollout.precision) the params are already in, in the sample layout
    (lora_policy.source's merge); None: the sampler prepares them itself."""

    cfg: Any
    params: Any
    version: int
    prepared: str | None = None

    def check_format(self, precision: str, who: str = "") -> None:
        """Refuses a sampler run in `precision` on params prepared in another format."""
        if self.prepared not in (None, precision):
            raise ValueError(
                f"{who}the policy's params are prepared in {self.prepared}, not {precision}"
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


_FIELDS = ("tokens", "response_mask", "behaviour_logp", "sequences", "sequence_mask")


def draw(
    src: PolicySource,
    prompts,
    prompt_mask,
    sampling,
    rng,
    precision: str,
    calls: int,
    kv_cache: str = "compute",
):
    """The sampler's outputs as numpy arrays, the prompts split over `calls` sampler calls
    (each holds a KV cache for only its share of the rows: rollout.sample_microbatches)."""
    if len(prompts) % calls:
        raise ValueError(
            f"config.rollout.sample_microbatches: {calls} does not divide {len(prompts)} prompts"
        )
    src.check_format(precision)
    if src.prepared is None:
        params = sampler_lib.sample_layout(src.cfg, src.params)  # once for all calls
    else:
        params = src.params
    prepared = src.prepared is not None
    parts = []
    for i, (p, m) in enumerate(zip(np.split(prompts, calls), np.split(prompt_mask, calls))):
        key = rng if calls == 1 else jax.random.fold_in(rng, i)
        out = sampler_lib.sample(
            src.cfg,
            params,
            p,
            m,
            sampling,
            key,
            precision=precision,
            kv_cache=kv_cache,
            prepared=prepared,
        )
        parts.append({k: sharding_lib.to_host(getattr(out, k)) for k in _FIELDS})
    fields = {k: np.concatenate([part[k] for part in parts]) for k in _FIELDS}
    return fields, np.full((len(fields["tokens"]),), src.version, np.int32)


def _interleave_groups(a, b, num_prompts: int):
    """[P*Ga, ...] and [P*Gb, ...] -> [P*(Ga+Gb), ...] keeping each prompt's rows together."""
    a = np.asarray(a).reshape(num_prompts, -1, *np.shape(a)[1:])
    b = np.asarray(b).reshape(num_prompts, -1, *np.shape(b)[1:])
    out = np.concatenate([a, b], axis=1)
    return out.reshape(-1, *out.shape[2:])


def collect(
    policy: PolicySource,
    prompt_batch: dict,
    tokenizer,
    reward_fn: Callable[[str, dict], float],
    rcfg,
    rng: jax.Array,
    external: PolicySource | None = None,
) -> tuple[Rollout, dict]:
    """Sample, score and package one rollout batch. Returns (Rollout, metrics)."""
    group = int(rcfg.group_size)
    prompts, pmask = prompt_batch["prompt_tokens"], prompt_batch["prompt_mask"]
    num_prompts = prompts.shape[0]
    n_ext = int(round(float(rcfg.external_fraction) * group)) if external is not None else 0
    base = dict(
        temperature=float(rcfg.temperature),
        top_k=int(rcfg.top_k),
        top_p=float(rcfg.top_p),
        max_new_tokens=int(rcfg.max_new_tokens),
        stop_ids=tuple(rcfg.stop_ids),
    )
    rng_pol, rng_ext = jax.random.split(rng)
    calls = int(rcfg.get("sample_microbatches", 1))
    kv = dict(kv_cache=str(rcfg.get("kv_cache_precision", "compute")))
    fields, version = draw(
        policy,
        prompts,
        pmask,
        sampler_lib.SamplingConfig(num_samples=group - n_ext, **base),
        rng_pol,
        rcfg.precision,
        calls,
        **kv,
    )
    if n_ext:
        ext_fields, ext_version = draw(
            external,
            prompts,
            pmask,
            sampler_lib.SamplingConfig(num_samples=n_ext, **base),
            rng_ext,
            rcfg.external_precision,
            calls,
            **kv,
        )
        # external samples first in each group, their pi_b is the external model's log-prob
        fields = {k: _interleave_groups(ext_fields[k], v, num_prompts) for k, v in fields.items()}
        version = _interleave_groups(np.full_like(ext_version, -1), version, num_prompts)

    resp_mask = fields["response_mask"].astype(bool)
    texts = completions_text(tokenizer, fields["tokens"], resp_mask)
    examples = [ex for ex in prompt_batch["examples"] for _ in range(group)]
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
        keep = np.repeat(
            np.asarray(adv_lib.dynamic_sampling_mask(jnp.asarray(rewards), group)), group
        )
        loss_mask = loss_mask * keep[:, None]
    rollout = Rollout(
        tokens=fields["sequences"].astype(np.int32),
        attn_mask=fields["sequence_mask"].astype(bool),
        loss_mask=loss_mask,
        behaviour_logp=np.where(resp_mask, fields["behaviour_logp"], 0.0).astype(np.float32),
        advantages=np.asarray(adv_lib.broadcast_to_tokens(adv_N, resp_mask)),
        rewards=rewards,
        policy_version=version.astype(np.int32),
        prompt_len=int(prompts.shape[1]),
    )
    grouped = rewards.reshape(-1, group)  # [B / G, G]
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

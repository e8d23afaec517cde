"""The rollout-engine seam: what the RL loops ask of whatever draws their rollouts.

`RolloutEngine` is the interface. The synchronous loop and the actor-learner (rl/actor_learner.py
`SyncLoop`, `Sampler`, both through rl/collect.py `Collector.collect`) push a params version with
`update_params`, draw every rollout batch through `generate` (rl/rollout.py `collect`), and
call `release` once the batch is drawn. `JaxEngine` is the in-JAX sampler (sampler.py) behind
it. docs/rollout_engines.md says what another engine (vLLM, SGLang) must provide to be valid
here and where it plugs in.

The contract of `generate`, checked on every batch by `check_rows` (shapes and row layout; the
log-probs' exactness is what `logprob_gap` measures against `score`):
  rows        RowLayout(num_prompts, num_samples): row i * n + j is sample j of prompt i,
              its `sequences` start with prompt i exactly as given (left pads included)
  behaviour_logp  log of the probability with which each response token was drawn: after
              temperature, then top-k, then top-p over the renormalised top-k distribution,
              renormalised over the kept support (draw.py's rule), in the engine's own
              numerics; 0 on pads; 0 for greedy (a point mass)
  version     the params version that drew each row (the `update_params` version)
  routing     optional (None): a mixture-of-experts policy's top-k experts of every token in
              every sparse layer, as the engine routed it (model.routing_replay "sampler")
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from ess_jax.data.layout import RowLayout
from ess_jax.model.scoring import scored_hidden
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.sampling import precision as precision_lib
from ess_jax.sampling import sampler as sampler_lib
from ess_jax.sampling.rescore import Behaviour, behaviour_logprobs
from ess_jax.sampling.sampler import SamplerParams, SamplingConfig


@dataclasses.dataclass(frozen=True)
class Generation:
    """One `generate` call's rows, numpy on the host, in `layout` (B = layout.num_rows rows,
    T = max_new_tokens, P the prompts' width, L = P + T)."""

    tokens: np.ndarray  # [B, T] int32: the response, pad id after the stop token
    response_mask: np.ndarray  # [B, T] bool: the drawn tokens, stop token included
    behaviour_logp: np.ndarray  # [B, T] float32: log pi_b of each drawn token (module docstring)
    sequences: np.ndarray  # [B, L] int32: the row's prompt as given, then the response
    sequence_mask: np.ndarray  # [B, L] bool: real tokens (prompt and response)
    version: np.ndarray  # [B] int32: the params version that drew the row
    layout: RowLayout
    # [B, L, Ls, X] int32: a mixture-of-experts policy's experts per token and sparse layer as
    # drawn (moe.NOT_RECORDED where none); None: not recorded (a dense model, an engine that
    # does not report it), the trainer then routes every token itself
    routing: np.ndarray | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    """What draws rollouts for the RL loops (module docstring; docs/rollout_engines.md)."""

    def update_params(self, version: int, params: Any) -> None:
        """Draw from `params` (the trainer's params pytree: LoRA adapters alone with
        model.lora) as policy version `version` from the next `generate` on."""

    def generate(
        self, prompt_tokens_BxP, prompt_mask_BxP, sampling: SamplingConfig, rng: jax.Array
    ) -> Generation:
        """`sampling.num_samples` responses to each left-padded prompt, with exact behaviour
        log-probs under `sampling`'s temperature / top-k / top-p, and the version."""

    def score(
        self, sequences_BxL, sequence_mask_BxL, prompt_len: int, sampling: SamplingConfig
    ) -> np.ndarray:
        """Teacher-forced log pi_b of the response tokens (positions prompt_len..L-1) under the
        current version and `sampling`'s truncation, [B, T] float32, 0 on pads: what
        `generate` records for rows it drew, to the engine's numeric noise."""

    def release(self) -> None:
        """Free what drawing holds (the engine's copy of the weights, the pushed version): the
        loops call it once a rollout batch is drawn, and push a version before the next."""


def check_rows(gen: Generation, prompt_tokens_BxP, prompt_mask_BxP, sampling) -> None:
    """ValueError unless `gen` has the shapes of `sampling` on these prompts and its rows are
    in the row layout (each row's sequence starts with its own prompt, rows i*n .. i*n+n-1 for
    prompt i), its sequences end with its tokens."""
    prompts = np.asarray(prompt_tokens_BxP)
    pmask = np.asarray(prompt_mask_BxP).astype(bool)
    want = RowLayout(prompts.shape[0], sampling.num_samples)
    b, p, t = want.num_rows, prompts.shape[1], sampling.max_new_tokens
    if gen.layout != want:
        raise ValueError(f"rollout engine: rows in {gen.layout}, the request is {want}")
    shapes = {
        "tokens": (b, t),
        "response_mask": (b, t),
        "behaviour_logp": (b, t),
        "sequences": (b, p + t),
        "sequence_mask": (b, p + t),
        "version": (b,),
    }
    for name, shape in shapes.items():
        if np.shape(getattr(gen, name)) != shape:
            raise ValueError(f"rollout engine: {name} {np.shape(getattr(gen, name))}, not {shape}")
    seq, seq_mask = np.asarray(gen.sequences), np.asarray(gen.sequence_mask).astype(bool)
    if not (
        np.array_equal(seq[:, :p], want.repeat(prompts))
        and np.array_equal(seq_mask[:, :p], want.repeat(pmask))
    ):
        raise ValueError(
            "rollout engine: rows out of the row layout (row i * n + j must be sample j of "
            "prompt i, its sequence starting with that prompt as given)"
        )
    if not (
        np.array_equal(seq[:, p:], np.asarray(gen.tokens))
        and np.array_equal(seq_mask[:, p:], np.asarray(gen.response_mask).astype(bool))
    ):
        raise ValueError("rollout engine: sequences do not end with the rows' tokens")
    if gen.routing is not None and np.shape(gen.routing)[:2] != (b, p + t):
        raise ValueError(
            f"rollout engine: routing {np.shape(gen.routing)}, not ({b}, {p + t}, layers, top-k)"
        )


def logprob_gap(engine: RolloutEngine, gen: Generation, prompt_len: int, sampling) -> float:
    """max |behaviour_logp - score| over the drawn tokens of `gen`: how far an engine's recorded
    pi_b is from its own teacher-forced one (the in-JAX sampler in float32: <= 1e-5)."""
    scored = engine.score(gen.sequences, gen.sequence_mask, prompt_len, sampling)
    mask = np.asarray(gen.response_mask).astype(bool)
    if not mask.any():
        return 0.0
    return float(np.abs(np.asarray(scored) - np.asarray(gen.behaviour_logp))[mask].max())


_FIELDS = ("tokens", "response_mask", "behaviour_logp", "sequences", "sequence_mask")


class JaxEngine:
    """The in-JAX sampler (sampler.py) as a `RolloutEngine`.

    `precision` and `kv_cache` are the sampler's formats (rollout.precision,
    rollout.kv_cache_precision); `calls` splits each `generate` into that many sampler calls
    over the prompts (rollout.sample_microbatches: each holds a KV cache for only its share),
    call i with key fold_in(rng, i) (one call: rng itself). `prepare(params, precision)` makes
    the sampler's copy (`SamplerParams`) of what `update_params` gets: by default
    `sampler.prepare` (the sample layout, then the format), for LoRA the merge straight into
    the format (rl/lora_policy.py `engine`). The copy is made at the first `generate` after
    `update_params` and kept until `release` or the next `update_params`.

    `cfg` is the model config; `params` and `version` those of the current version as given
    (in their own layout). The loops push a version before every batch and `release` it after:
    the engine holds the trainer's buffers only while it draws. Params given at construction
    (`params`, `version`: a model that never changes, the external one) stay through `release`.
    """

    def __init__(
        self,
        cfg,
        *,
        precision: str = "float32",
        kv_cache: str = "compute",
        calls: int = 1,
        prepare=None,
        params=None,
        version: int = 0,
    ):
        if precision not in precision_lib.PRECISIONS:
            raise ValueError(f"precision {precision!r} not in {precision_lib.PRECISIONS}")
        self.cfg, self.precision, self.kv_cache, self.calls = cfg, precision, kv_cache, calls
        self._prepare = prepare or functools.partial(sampler_lib.prepare, cfg)
        self._fixed = (int(version), params) if params is not None else (None, None)
        self.version, self.params = self._fixed
        self._copy: SamplerParams | None = None

    def update_params(self, version: int, params) -> None:
        self.version, self.params, self._copy = int(version), params, None

    def release(self) -> None:
        """Drops the sampler's copy and the pushed params (back to those of construction)."""
        self._copy = None
        self.version, self.params = self._fixed

    def sampler_params(self) -> SamplerParams:
        """The sampler's copy of the current version (made once per version until `release`)."""
        if self.params is None:
            raise ValueError("rollout engine: no params yet (update_params first)")
        if self._copy is None:
            copy = self._prepare(self.params, self.precision)
            if copy.precision != self.precision:
                raise ValueError(
                    f"the policy's params are prepared in {copy.precision}, not {self.precision}"
                )
            self._copy = copy
        return self._copy

    def generate(self, prompt_tokens_BxP, prompt_mask_BxP, sampling, rng) -> Generation:
        prompts, pmask = np.asarray(prompt_tokens_BxP), np.asarray(prompt_mask_BxP)
        calls = self.calls
        if len(prompts) % calls:
            raise ValueError(
                f"config.rollout.sample_microbatches: {calls} does not divide {len(prompts)} "
                "prompts"
            )
        sp = self.sampler_params()
        parts = []
        for i, (p, m) in enumerate(zip(np.split(prompts, calls), np.split(pmask, calls))):
            key = rng if calls == 1 else jax.random.fold_in(rng, i)
            out = sampler_lib.sample_prepared(sp, p, m, sampling, key, kv_cache=self.kv_cache)
            names = _FIELDS + (("routing",) if sp.cfg.num_experts else ())
            parts.append({k: sharding_lib.to_host(getattr(out, k)) for k in names})
        fields = {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}
        layout = RowLayout(len(prompts), sampling.num_samples)
        version = np.full((layout.num_rows,), self.version, np.int32)
        return Generation(**fields, version=version, layout=layout)

    def score(
        self, sequences_BxL, sequence_mask_BxL, prompt_len: int, sampling, routing=None
    ) -> np.ndarray:
        """`RolloutEngine.score`; `routing` ([B, L, Ls, X], a `Generation`'s): replayed."""
        sp = self.sampler_params()
        seq = np.asarray(sequences_BxL).astype(np.int32)
        mask = np.asarray(sequence_mask_BxL).astype(bool)
        if sampling.temperature == 0:  # greedy: a point mass on every drawn token
            return np.zeros((seq.shape[0], seq.shape[1] - prompt_len), np.float32)
        behaviour = Behaviour(sampling.temperature, sampling.top_k, sampling.top_p)
        cfg = precision_lib.sample_config(sp.cfg, sp.precision)
        fn = _score_fn(cfg, int(prompt_len), behaviour)
        return np.asarray(jax.device_get(fn(sp.params, seq, mask, routing)))


@functools.lru_cache(maxsize=16)
def _score_fn(cfg, prompt_len: int, behaviour: Behaviour):
    """Teacher-forced log pi_b in the sampler's format: its dequantized weights and compute
    dtype, the logits tempered and truncated as `draw.draw` does (rescore.behaviour_logprobs),
    a recorded routing replayed if one is given."""

    def score(params, tokens_BxL, mask_BxL, routing_BxLxLsxX):
        params = precision_lib.dequantize(params)
        module, x = scored_hidden(
            cfg, params, tokens_BxL, mask_BxL, prompt_len, routing_BxTxLxX=routing_BxLxLsxX
        )
        logq, _ = behaviour_logprobs(module.logits(cfg, x), behaviour)
        tgt = tokens_BxL[:, prompt_len:]
        logp = jnp.take_along_axis(logq, tgt[..., None], axis=-1)[..., 0]
        return jnp.where(mask_BxL[:, prompt_len:], logp, 0.0)

    return jax.jit(score)

"""In-JAX sampler: jitted prefill + `lax.while_loop` decode that records exact log-probs.

Axis alphabet: B rows (prompts * num_samples), P prompt length, T response length
(= max_new_tokens), S cache length (= P + T), V vocab.

Per sampled token the sampler records three float32 log-quantities (0 on masked positions):
  raw_logp        log pi(y_t) over the full vocabulary at temperature 1 in the sampler's
                  precision: what the trainer's `scoring.token_logprobs` recomputes (tested
                  equal to <= 1e-5 in float32).
  behaviour_logp  log of the probability with which y_t was *actually drawn*: after
                  temperature, top-k and top-p, renormalised over the kept support.
  log_kept_mass   log of the tempered probability mass of that kept support (0 when nothing
                  is truncated), so behaviour_logp = log_softmax(logits / T)[y_t] - log_kept_mass.

The objectives use `behaviour_logp` as pi_b. The importance ratio exp(logp - blogp) corrects
for the distribution the data came from; that is the truncated, tempered, low-precision
distribution the sampler drew from, not the full-vocabulary temperature-1 one. Using
`raw_logp` instead would silently hide every off-policy source the paper studies
(temperature, truncation; precision shows up in both) and give ratios ~1 where they are not.
Greedy decoding (temperature 0) draws from a point mass on the argmax, so its
behaviour_logp = log 1 = 0 and log_kept_mass = 0 (the T -> 0 limit).

Sampler precision (`sample(..., precision=, kv_cache=)`): one of precision.FORMATS (float32,
bfloat16, float16, fp8 weight formats, int8 / int4 weights, fp8 activations; precision.py says
what each rounds) and the KV cache's precision ("compute", "bfloat16", "fp8": model/kv_cache.py).
The low-precision modes reproduce the train/inference mismatch of the paper's FP8-rollout
experiment; every recorded log-prob is that of the rounded model that drew the token.

On a mixture-of-experts model the sampler also records `routing`, each token's top-k experts in
each sparse layer as its own rounded router chose them (the prompt's in the prefill, response
token t's in the decode step that feeds it): what the trainer replays under
model.routing_replay "sampler" (model/moe.py `route`).

The sampler's copy of the params (`SamplerParams`, made by `prepare`): the params in the
sample layout and in `precision`'s format. `sample` prepares it per call; `sample_prepared`
takes one made once (per rollout batch: sampling/engine.py; LoRA's merge straight into the
format: rl/lora_policy.py).

Cost and compilation (the programs: decode.py): the prompts are taken at the width they come
in; the prompt widths are data/batching.py's buckets (`PromptBatcher`, `bucket_width`), which
the sampler does not pad further. The prefill attends over the prompt only, and decode runs in
up to 4 segments (`decode_bounds`), each attending over the prompt and the response positions
its bound allows, so a step costs what is filled (within 2x), not the whole budget; the KV
cache is updated in place and zero-padded between segments. Temperature / top_p are traced,
so a run compiles one prefill and <= 4 decode programs per (model, batch, prompt width,
max_new_tokens, num_samples, top_k, stop_ids, precision, kv cache, mesh).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding

from ess_jax.config.domains import KV_CACHE_PRECISIONS
from ess_jax.model import decoder as model_lib
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.sampling import decode as decode_lib
from ess_jax.sampling import precision as precision_lib
from ess_jax.sampling.decode import decode_bounds  # noqa: F401  (re-exported: part of the API)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to draw. temperature 0 = greedy; top_k 0 and top_p 1.0 = off (composable:
    temperature, then top-k, then top-p over the renormalised top-k distribution).
    `stop_ids=None` uses the model config's eos_token_id; () means no stop token."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    num_samples: int = 1
    stop_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.temperature < 0 or not 0.0 < self.top_p <= 1.0 or self.top_k < 0:
            raise ValueError(f"invalid sampling config {self}")
        if self.max_new_tokens < 1 or self.num_samples < 1:
            raise ValueError(f"max_new_tokens and num_samples must be >= 1: {self}")

    def replace(self, **kw) -> SamplingConfig:
        return dataclasses.replace(self, **kw)


@struct.dataclass
class SampleOutput:
    """Row i*n + j is sample j of prompt i. [B, T] fields cover response positions only."""

    tokens: jax.Array  # [B, T] int32, pad id after the stop token
    response_mask: jax.Array  # [B, T] bool: sampled tokens, the stop token included
    behaviour_logp: jax.Array  # [B, T] float32: log pi_b, the drawing distribution
    raw_logp: jax.Array  # [B, T] float32: full-vocab, temperature-1 log-prob
    log_kept_mass: jax.Array  # [B, T] float32: log tempered mass of the kept support
    lengths: jax.Array  # [B] int32: response tokens, stop token included
    finished: jax.Array  # [B] bool: ended with a stop token (False: hit max_new_tokens)
    sequences: jax.Array  # [B, P+T] int32: the (original-width) prompt, then the response
    sequence_mask: jax.Array  # [B, P+T] bool: what the trainer teacher-forces on
    # [B, P+T, Ls, X] int32: the experts each token went to in each sparse layer (decode.py
    # DecodeState.routing; moe.NOT_RECORDED where none); [B, P+T, 0, 0] for a dense model
    routing: jax.Array


@dataclasses.dataclass(frozen=True)
class SamplerParams:
    """The sampler's copy of a policy: `params` in `precision`'s format (precision.FORMATS) and
    in the sample layout on `mesh` (None: one device), for the model config `cfg` (a LoRA
    policy's copy is merged: the plain model's config)."""

    cfg: model_lib.ModelConfig
    params: Any
    precision: str
    mesh: Mesh | None = None

    def __post_init__(self):
        if self.precision not in precision_lib.PRECISIONS:
            raise ValueError(f"precision {self.precision!r} not in {precision_lib.PRECISIONS}")


@functools.lru_cache(maxsize=32)
def programs(cfg: model_lib.ModelConfig, st: decode_lib.Static, mesh: Mesh | None):
    """(prefill, decode) for one static configuration; jit caches per shape. Public for the
    tools that lower them without sampling (memory/programs.py, tests, bench)."""
    prefill = jax.jit(functools.partial(decode_lib.prefill, cfg=cfg, st=st, mesh=mesh))
    return prefill, decode_lib.Decode(cfg, st, mesh)


# ----------------------------------------------------------------------------- public API


_compiled_keys: set = set()


def params_mesh(params) -> Mesh | None:
    """The mesh `params` live on, None for a single device."""
    sh = getattr(jax.tree.leaves(params)[0], "sharding", None)
    return sh.mesh if isinstance(sh, NamedSharding) and sh.mesh.size > 1 else None


def _place(x, mesh: Mesh | None):
    if mesh is None or mesh.size == 1:
        return jnp.asarray(x)
    spec = sharding_lib.logical_to_spec(
        ("batch",) + (None,) * (np.ndim(x) - 1), np.shape(x), mesh, sharding_lib.SAMPLE_RULES
    )
    return sharding_lib.put_host_array(np.asarray(x), NamedSharding(mesh, spec))


def sample_layout(cfg: model_lib.ModelConfig, params, mesh: Mesh | None = None):
    """`params` in the sampling layout (a copy unless they are there already)."""
    mesh = mesh if mesh is not None else params_mesh(params)
    if mesh is None or mesh.size == 1:
        return params
    target = model_lib.param_shardings(cfg, mesh, "sample")
    if any(
        getattr(x, "sharding", None) != t
        for x, t in zip(jax.tree.leaves(params), jax.tree.leaves(target))
    ):
        params = sharding_lib.reshard(params, target)
    return params


def prepare(
    cfg: model_lib.ModelConfig, params, precision: str = "float32", mesh: Mesh | None = None
) -> SamplerParams:
    """The sampler's copy of `params`: moved to the sample layout (a copy unless they are there
    already; `mesh` default: the mesh the params live on, if any), then cast or quantized to
    `precision` (precision.prepare_params; float32: no copy)."""
    if precision not in precision_lib.PRECISIONS:
        raise ValueError(f"precision {precision!r} not in {precision_lib.PRECISIONS}")
    mesh = mesh if mesh is not None else params_mesh(params)
    if mesh is None or mesh.size == 1:
        mesh = None
    else:
        params = sample_layout(cfg, params, mesh)
    if precision != "float32":
        params = precision_lib.prepare_fn(precision)(params)
    return SamplerParams(cfg, params, precision, mesh)


def sample(
    cfg: model_lib.ModelConfig,
    params,
    prompt_tokens_BxP,
    prompt_mask_BxP,
    sampling: SamplingConfig,
    rng: jax.Array,
    *,
    precision: str = "float32",
    mesh: Mesh | None = None,
    kv_cache: str = "compute",
) -> SampleOutput:
    """Draw `sampling.num_samples` completions of each left-padded prompt from `params`,
    prepared for this call (`prepare`; `sample_prepared` says the rest).

    `precision` is the sampler's numeric mode (precision.FORMATS). With a `mesh` (default: the
    mesh the params live on, if any) the params are moved to the sample layout if they are
    not there yet and the rows are split over the data axes; the numbers are the same as
    unsharded."""
    sp = prepare(cfg, params, precision, mesh)
    return sample_prepared(sp, prompt_tokens_BxP, prompt_mask_BxP, sampling, rng, kv_cache=kv_cache)


def sample_prepared(
    sp: SamplerParams,
    prompt_tokens_BxP,
    prompt_mask_BxP,
    sampling: SamplingConfig,
    rng: jax.Array,
    *,
    kv_cache: str = "compute",
) -> SampleOutput:
    """Draw `sampling.num_samples` completions of each left-padded prompt from the sampler's
    copy `sp`, used as it is: rows i*n .. i*n+n-1 are the samples of prompt i.

    The prompts are taken at their width (data/batching.py buckets them); `kv_cache` is the KV
    cache's precision (KV_CACHE_PRECISIONS; "compute": the compute dtype).
    """
    if kv_cache not in KV_CACHE_PRECISIONS:
        raise ValueError(f"kv_cache {kv_cache!r} not in {KV_CACHE_PRECISIONS}")
    cfg, mesh = sp.cfg, sp.mesh
    mask_np = np.asarray(prompt_mask_BxP).astype(bool)
    tokens_np = np.asarray(prompt_tokens_BxP).astype(np.int32)
    if mask_np.ndim != 2 or mask_np.shape != tokens_np.shape:
        raise ValueError(f"prompt tokens {tokens_np.shape} and mask {mask_np.shape} must be BxP")
    if not mask_np[:, -1].all():
        raise ValueError("prompts must be left-padded: the last column must be real tokens")

    stop_ids = sampling.stop_ids
    if stop_ids is None:
        eos = cfg.eos_token_id
        stop_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    st = decode_lib.Static(
        max_new_tokens=sampling.max_new_tokens,
        num_samples=sampling.num_samples,
        greedy=sampling.temperature == 0,
        top_k=sampling.top_k,
        use_top_p=sampling.top_p < 1.0,
        stop_ids=tuple(sorted(set(stop_ids))),
        pad_id=int(cfg.pad_token_id or 0),
        kv_cache=kv_cache,
    )
    sample_cfg = precision_lib.sample_config(cfg, sp.precision)
    _compiled_keys.add((sample_cfg, st, mesh))
    prefill, decode = programs(sample_cfg, st, mesh)
    temperature = jnp.float32(max(sampling.temperature, 1e-6))
    top_p = jnp.float32(sampling.top_p)
    prompts, pmask = _place(tokens_np, mesh), _place(mask_np, mesh)
    state = prefill(sp.params, prompts, pmask, rng, temperature, top_p)
    state = decode(sp.params, state, temperature, top_p)

    n = sampling.num_samples
    prompts, pmask = jnp.repeat(prompts, n, axis=0), jnp.repeat(pmask, n, axis=0)
    return SampleOutput(
        tokens=state.tokens,
        response_mask=state.mask,
        behaviour_logp=state.behaviour_logp,
        raw_logp=state.raw_logp,
        log_kept_mass=state.log_kept_mass,
        lengths=state.mask.sum(-1).astype(jnp.int32),
        finished=state.done,
        sequences=jnp.concatenate([prompts, state.tokens], axis=1),
        sequence_mask=jnp.concatenate([pmask, state.mask], axis=1),
        routing=state.routing,
    )


def compile_cache_size() -> int:
    """Compiled decode programs held (tests use it to count the programs per prompt width)."""
    return sum(programs(*key)[1].cache_size() for key in _compiled_keys)

"""The sampler's jitted programs: the prefill, the decode segments and their KV cache.

sampler.py holds the public API (`sample`) and what the recorded log-probs mean; this module
the programs it compiles per static configuration (`Static`): `prefill` (prompt forward,
first token) and `Decode` (one state-donating `lax.while_loop` per segment of
`decode_bounds`). Decode runs in up to 4 segments, each attending over the prompt and the
response positions its bound allows, so a step costs what is filled (within 2x), not the
whole budget. The KV cache has the current segment's length: the prefill allocates the first
segment's, and `Decode` zero-pads it, layer by layer, between segments (see `Decode` for why
a longer cache sliced per step is slower).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding

from ess_jax.model import decoder as model_lib
from ess_jax.model import kv_cache, moe
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.sampling import draw as draw_lib
from ess_jax.sampling import precision as precision_lib


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything that changes the compiled program (the compile-cache key)."""

    max_new_tokens: int
    num_samples: int
    greedy: bool
    top_k: int
    use_top_p: bool
    stop_ids: tuple[int, ...]
    pad_id: int
    kv_cache: str = "compute"  # the KV cache's precision (config/domains.KV_CACHE_PRECISIONS)

    def init_cache(self, cfg, batch: int, length: int) -> list[dict]:
        """The KV cache in this configuration's precision."""
        if self.kv_cache == "fp8":
            return kv_cache.init_cache(cfg, batch, length, fp8=True)
        dtype = None if self.kv_cache == "compute" else jnp.dtype(self.kv_cache)
        return kv_cache.init_cache(cfg, batch, length, dtype)


@struct.dataclass
class DecodeState:
    step: jax.Array  # int32 scalar: the next response column to fill
    tokens: jax.Array  # [B, T]
    mask: jax.Array  # [B, T]
    behaviour_logp: jax.Array
    raw_logp: jax.Array
    log_kept_mass: jax.Array
    done: jax.Array  # [B]: emitted a stop token
    positions: jax.Array  # [B]: RoPE position of the last sampled token
    cache: list
    kv_mask: jax.Array  # [B, S]
    rng: jax.Array
    # [B, P + T, Ls, X] int32: each token's experts in each sparse layer as the sampler routed
    # it (moe.NOT_RECORDED where it never went through the model: prompt pads, the last
    # response column, the stop token and what follows); [B, P + T, 0, 0] for a dense model
    routing: jax.Array


def _constrain(tree, mesh: Mesh | None, logical):
    if mesh is None or mesh.size == 1:
        return tree

    def one(x, names):
        spec = sharding_lib.logical_to_spec(
            names[: x.ndim], x.shape, mesh, sharding_lib.SAMPLE_RULES
        )
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(lambda x: one(x, logical), tree)


def constrain_state(s: DecodeState, mesh) -> DecodeState:
    rows = ("batch", None)
    return s.replace(
        tokens=_constrain(s.tokens, mesh, rows),
        mask=_constrain(s.mask, mesh, rows),
        behaviour_logp=_constrain(s.behaviour_logp, mesh, rows),
        raw_logp=_constrain(s.raw_logp, mesh, rows),
        log_kept_mass=_constrain(s.log_kept_mass, mesh, rows),
        done=_constrain(s.done, mesh, rows),
        positions=_constrain(s.positions, mesh, rows),
        kv_mask=_constrain(s.kv_mask, mesh, rows),
        routing=_constrain(s.routing, mesh, ("batch", None, None, None)),
        cache=[_constrain_cache(layer, mesh) for layer in s.cache],
    )


def _constrain_cache(layer_cache: dict, mesh) -> dict:
    """One layer's K and V in the sample layout (their logical axes: kv_cache.CACHE_AXES)."""
    return {k: _constrain(x, mesh, kv_cache.CACHE_AXES[k]) for k, x in layer_cache.items()}


def _write(s: DecodeState, col, tok, blp, rlp, lkm, active, st: Static) -> DecodeState:
    def put(buf, val, fill):
        return jax.lax.dynamic_update_slice_in_dim(
            buf, jnp.where(active, val, fill).astype(buf.dtype)[:, None], col, axis=1
        )

    stop = jnp.isin(tok, jnp.asarray(st.stop_ids, jnp.int32)) if st.stop_ids else False
    return s.replace(
        tokens=put(s.tokens, tok, st.pad_id),
        mask=put(s.mask, active, False),
        behaviour_logp=put(s.behaviour_logp, blp, 0.0),
        raw_logp=put(s.raw_logp, rlp, 0.0),
        log_kept_mass=put(s.log_kept_mass, lkm, 0.0),
        done=s.done | (active & stop),
    )


def next_token(logits_BxV, key, temperature, top_p, st: Static):
    """`draw.draw` under this configuration's greedy / top-k / top-p switches."""
    return draw_lib.draw(
        logits_BxV,
        key,
        temperature,
        top_p,
        greedy=st.greedy,
        top_k=st.top_k,
        use_top_p=st.use_top_p,
    )


def decode_bounds(max_new_tokens: int) -> tuple[int, ...]:
    """Response lengths at which a decode segment ends: T/8, T/4, T/2, T (none below 32).

    Segment j's cache holds the prompt and the first bounds[j] response positions, so a step's
    attention costs at most twice what is filled (the cache grows between segments, see
    `Decode`). At most 4 decode programs per static configuration; T <= 32 is one segment.
    """
    t = max_new_tokens
    return tuple(sorted({max(min(t, 32), t >> k) for k in range(4)}))


def prefill(params, prompts_BxP, mask_BxP, rng, temperature, top_p, *, cfg, st, mesh):
    """Prompt forward on the B unique prompts, repeat n times, draw response token 0.

    The cache is allocated at the first decode segment's length (prompt + bounds[0]) and
    attention runs over the prompt only: the cost is the prompt's, whatever the generation
    budget."""
    params = precision_lib.dequantize(params)
    b, p = prompts_BxP.shape
    t, n = st.max_new_tokens, st.num_samples
    kv_mask = jnp.concatenate([mask_BxP, jnp.ones((b, t), bool)], axis=1)
    positions = model_lib.positions_from_mask(mask_BxP)
    module = model_lib.bind(cfg, params)
    cache = st.init_cache(cfg, b, p + decode_bounds(t)[0])  # the first segment's length
    x, cache, routed = module.hidden_routed(
        cfg, prompts_BxP, positions, kv_mask, cache, 0, attend_len=p
    )
    routing = jnp.full((b, p + t, *moe.routing_shape(cfg)), moe.NOT_RECORDED, jnp.int32)
    if routed is not None:  # the prompt's routing, pads left unrecorded
        real = mask_BxP[:, :, None, None]
        routing = routing.at[:, :p].set(jnp.where(real, routed.experts, moe.NOT_RECORDED))
    logits = module.logits(cfg, x[:, -1:])  # the last position only: no [B, P, V] logits
    rep = functools.partial(jnp.repeat, repeats=n, axis=0)  # sample j of prompt i: row i*n+j
    zeros = jnp.zeros((b * n, t), jnp.float32)
    s = DecodeState(
        step=jnp.ones((), jnp.int32),
        tokens=jnp.full((b * n, t), st.pad_id, jnp.int32),
        mask=jnp.zeros((b * n, t), bool),
        behaviour_logp=zeros,
        raw_logp=zeros,
        log_kept_mass=zeros,
        done=jnp.zeros((b * n,), bool),
        positions=rep(positions[:, -1]) + 1,
        cache=jax.tree.map(rep, cache),
        kv_mask=rep(kv_mask),
        rng=rng,
        routing=rep(routing),
    )
    s = constrain_state(s, mesh)
    # gather the vocab before repeating: vocab-sharded -> row-sharded has no cheap path
    last = _constrain(logits[:, -1], mesh, ("batch", None))
    last = _constrain(rep(last), mesh, ("batch", None))
    tok, blp, rlp, lkm = next_token(last, jax.random.fold_in(rng, 0), temperature, top_p, st)
    return _write(s, 0, tok, blp, rlp, lkm, jnp.ones((b * n,), bool), st)


def decode_segment(params, s: DecodeState, temperature, top_p, *, bound, cfg, st, mesh):
    """Draw response tokens up to (not including) column `bound`, stopping early once every
    row has emitted a stop id; attention reads the whole cache: the prompt and `bound`
    response positions."""
    prompt_width = s.kv_mask.shape[1] - st.max_new_tokens
    length = kv_cache.cache_length(s.cache[0])
    if length != prompt_width + bound:
        raise ValueError(
            f"decode segment to {bound}: the KV cache holds {length} positions, not the prompt's "
            f"{prompt_width} + {bound} (Decode grows it between segments)"
        )
    kv_mask = s.kv_mask[:, :length]

    def cond(s):
        return (s.step < bound) & ~jnp.all(s.done)

    def body(s):
        prev = jax.lax.dynamic_index_in_dim(s.tokens, s.step - 1, axis=1, keepdims=True)
        module = model_lib.bind(cfg, precision_lib.dequantize(params))
        x, cache, routed = module.hidden_routed(
            cfg, prev, s.positions[:, None], kv_mask, s.cache, prompt_width + s.step - 1
        )
        logits = module.logits(cfg, x)
        if routed is not None:  # the fed token's (response column step - 1) routing
            experts = jnp.where(~s.done[:, None, None, None], routed.experts, moe.NOT_RECORDED)
            s = s.replace(
                routing=jax.lax.dynamic_update_slice_in_dim(
                    s.routing, experts, prompt_width + s.step - 1, axis=1
                )
            )
        logits = _constrain(logits[:, 0], mesh, ("batch", None))  # whole vocab rows per device
        key = jax.random.fold_in(s.rng, s.step)
        tok, blp, rlp, lkm = next_token(logits, key, temperature, top_p, st)
        s = _write(s.replace(cache=cache), s.step, tok, blp, rlp, lkm, ~s.done, st)
        return constrain_state(s.replace(step=s.step + 1, positions=s.positions + 1), mesh)

    return jax.lax.while_loop(cond, body, s)


def grow_layer(layer_cache: dict, length: int, mesh):
    """One layer's K and V zero-padded to `length` positions, in the sample layout."""
    return _constrain_cache(kv_cache.grow_layer(layer_cache, length), mesh)


class Decode:
    """Draws response tokens 1..T-1: one jitted, state-donating while loop per segment of
    `decode_bounds` (each segment's loop exits at once if every row has stopped).

    The cache holds the prompt and the current segment's response positions: allocated at the
    first segment's length by the prefill, zero-padded to the next one's between segments, a
    layer at a time (so beside the grown cache at most one layer's old K and V are alive). A
    decode step attends over its whole cache, read after the step's in-place write. Attending
    over a slice of a cache allocated at full length instead makes XLA fuse the slice with the
    write, read the old buffer and so copy the whole cache twice per layer and step: on
    bench/cpu.py's model, batch 32, 64 + 256 positions, the first three segments then take
    54-61 ms per step (the last, which attends over more keys, 36), against 25-30 with the
    growing cache (BENCHMARKS.md; tests/test_decode_cache.py checks the compiled loops for
    copies, on CPU).
    Once every row has stopped, the remaining segments (and their grows) are skipped."""

    def __init__(self, cfg, st, mesh):
        kw = dict(cfg=cfg, st=st, mesh=mesh)
        self.bounds = decode_bounds(st.max_new_tokens)
        self.segments = [
            jax.jit(functools.partial(decode_segment, bound=b, **kw), donate_argnums=(1,))
            for b in self.bounds
        ]
        self.max_new_tokens = st.max_new_tokens
        self.grow_layer = jax.jit(functools.partial(grow_layer, mesh=mesh), static_argnums=(1,))

    def grow(self, cache: list, length: int) -> list:
        """Zero-pads each layer of `cache` to `length` positions, replacing the list's entries
        in place (the state holding the list sees the grown cache): unless the caller holds
        the old layers elsewhere, each is freed as soon as its padded copy exists."""
        for i in range(len(cache)):
            cache[i] = self.grow_layer(cache[i], length)
        return cache

    def __call__(self, params, s: DecodeState, temperature, top_p) -> DecodeState:
        prompt_width = s.kv_mask.shape[1] - self.max_new_tokens
        for j, (bound, segment) in enumerate(zip(self.bounds, self.segments)):
            if j and bool(jnp.all(s.done)):  # every row stopped: nothing left to draw
                break
            if kv_cache.cache_length(s.cache[0]) < prompt_width + bound:
                self.grow(s.cache, prompt_width + bound)
            s = segment(params, s, temperature, top_p)
        return s

    def cache_size(self) -> int:
        return sum(f._cache_size() for f in self.segments) + self.grow_layer._cache_size()

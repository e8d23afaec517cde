"""Flax NNX decoder for the Llama / Qwen2 / Qwen3 / Qwen3-MoE families.

Axis alphabet used in names: B batch, T time (query), S cache/key length, D model width,
H query heads, N kv heads, K head dim, F MLP width, V vocab, L layers.

A block's feed-forward is the dense SwiGLU `MLP`, or in a Qwen3-MoE model's sparse layers
(`ModelConfig.is_sparse`) moe.py's mixture of experts (param keys `router`, `expert_gate`,
`expert_up`, `expert_down` in place of `gate`, `up`, `down`).

Parameters are float32 masters; `ModelConfig.dtype` is the compute dtype. Every parameter
carries logical axis names (`out_sharding` metadata) that sharding.py maps to mesh axes.

Functional API (stable, used by the sampler, the trainer and external checks; teacher-forced
log-probs are `scoring.token_logprobs`):
  apply(cfg, params, tokens_BxT) -> logits_BxTxV (float32)
  forward(cfg, params, tokens_BxT, positions_BxT, kv_mask_BxS, cache, cache_index, attend_len)
(`cache`: None, or kv_cache.init_cache's list of per-layer keys and values)
`params` is a plain nested dict of arrays (`nnx.State.to_pure_dict()` of `Decoder`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from ess_jax.model import kv_cache, lora, moe, quant, splash
from ess_jax.model.blockwise_decode import decode_step_attention
from ess_jax.model.config import ModelConfig
from ess_jax.model.layers import (
    apply_rope,
    attention,
    dense,
    fused_attention,
    matmul_input,
    rms_norm,
    rope_inv_freq,
)
from ess_jax.parallel.sharding import BATCH, SAMPLE_RULES, TRAIN_RULES, tree_shardings

Params = dict[str, Any]


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple, scale: float) -> nnx.Param:
    value = scale * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _matrix(cfg, rngs: nnx.Rngs, name: str, shape: tuple[int, ...], axes: tuple, scale: float):
    """A block matrix: float32, or its codes and scales with a quantized base (quant.py)."""
    value = scale * jax.random.normal(rngs.params(), shape, jnp.float32)
    return quant.matrix_param(cfg, name, value, axes)


def _ones(shape: tuple[int, ...], axes: tuple) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, jnp.float32), out_sharding=axes, eager_sharding=False)


def _zeros(shape: tuple[int, ...], axes: tuple) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, jnp.float32), out_sharding=axes, eager_sharding=False)


def shard_rows(x_BxTxD: jax.Array) -> jax.Array:
    """Rows over the data-parallel mesh axes when traced under a mesh (`jax.set_mesh` or
    `use_abstract_mesh`, as the trainer's steps are). Without it GSPMD follows the FSDP-sharded
    weights and every device computes the activations of the whole global batch."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(a for a in BATCH if a in mesh.axis_names and mesh.shape[a] > 1)
    if not axes or x_BxTxD.shape[0] % math.prod(mesh.shape[a] for a in axes):
        return x_BxTxD
    spec = PartitionSpec(axes, *([None] * (x_BxTxD.ndim - 1)))
    return jax.lax.with_sharding_constraint(x_BxTxD, spec)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, n, k = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if h % n:
            raise ValueError(f"num_heads={h} must be a multiple of num_kv_heads={n}")
        s = 1.0 / math.sqrt(d)
        self.q = _matrix(cfg, rngs, "q", (d, h, k), ("embed", "heads", "head_dim"), s)
        self.k = _matrix(cfg, rngs, "k", (d, n, k), ("embed", "kv_heads", "head_dim"), s)
        self.v = _matrix(cfg, rngs, "v", (d, n, k), ("embed", "kv_heads", "head_dim"), s)
        o_axes, o_scale = ("heads", "head_dim", "embed"), 1.0 / math.sqrt(h * k)
        self.o = _matrix(cfg, rngs, "o", (h, k, d), o_axes, o_scale)
        if cfg.qkv_bias:
            self.q_bias = _zeros((h, k), ("heads", "head_dim"))
            self.k_bias = _zeros((n, k), ("kv_heads", "head_dim"))
            self.v_bias = _zeros((n, k), ("kv_heads", "head_dim"))
        if cfg.qk_norm:
            self.q_norm = _ones((k,), ("norm",))
            self.k_norm = _ones((k,), ("norm",))
        self.lora = lora.make_adapters(cfg, lora.ATTENTION_TARGETS)

    def __call__(
        self,
        cfg,
        x_BxTxD,
        positions_BxT,
        kv_mask_BxS,
        cache,
        cache_index,
        attend_len,
        lora_keys=None,
    ):
        dt = cfg.compute_dtype
        x_BxTxD = matmul_input(x_BxTxD, cfg.activation_fp8)
        q = lora.project(cfg, self, "q", x_BxTxD, keys=lora_keys)
        k = lora.project(cfg, self, "k", x_BxTxD, keys=lora_keys)
        v = lora.project(cfg, self, "v", x_BxTxD, keys=lora_keys)
        if cfg.qkv_bias:
            q, k, v = (
                q + self.q_bias[...].astype(dt),
                k + self.k_bias[...].astype(dt),
                v + self.v_bias[...].astype(dt),
            )
        if cfg.qk_norm:
            q = rms_norm(q, self.q_norm[...], cfg.rms_norm_eps)
            k = rms_norm(k, self.k_norm[...], cfg.rms_norm_eps)
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, dict(cfg.rope_scaling or ()))
        q, k = apply_rope(q, positions_BxT, inv_freq), apply_rope(k, positions_BxT, inv_freq)

        t = x_BxTxD.shape[1]
        # Keys/values as [B, N, S, K]: the layout the score einsum reads without a transpose
        # (the KV cache stores keys as [B, N, K, S] instead: kv_cache).
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        b, _, h, kd = q.shape
        n = k.shape[1]
        q = q.reshape(b, t, n, h // n, kd)  # GQA: group query heads by their kv head
        # static when the queries are key positions offset .. offset + t - 1 (causal blocks)
        offset = cache_index if isinstance(cache_index, int) else None
        if cache is None:  # full-sequence forward: keys are this call's tokens
            k_all, v_all, new_cache, query_idx, offset = k, v, None, jnp.arange(t), 0
        else:  # write this call's keys into the cache (keys transposed: kv_cache), in place
            new_cache = kv_cache.write(cache, k, v, cache_index)
            query_idx = cache_index + jnp.arange(t)
            if t == 1:  # a decode step
                out = decode_step_attention(
                    cfg, q[:, 0], new_cache, kv_mask_BxS, query_idx[0], attend_len
                )
                out = matmul_input(out.reshape(b, 1, h, kd), cfg.activation_fp8, 2)
                return lora.project(cfg, self, "o", out, n_in=2), new_cache
            k_all, v_all = kv_cache.read(new_cache, dt)
            if attend_len is not None:  # attend over the filled prefix of the cache only
                k_all, v_all = k_all[..., :attend_len], v_all[:, :, :attend_len]
                kv_mask_BxS = kv_mask_BxS[:, :attend_len]
            k_all = k_all.transpose(0, 1, 3, 2)  # several queries (the prefill): [B, N, S, K]

        if cfg.attention_impl == "splash" and cache is None and t > 1 and splash.takes(dt):
            # the trainer's and the scorer's forwards (queries = keys 0 .. t - 1); the
            # sampler's prefill keeps the einsum path. Segments: pads 0, real tokens 1
            out = splash.splash_attention(q, k_all, v_all, kv_mask_BxS.astype(jnp.int32))
        elif t > 1 and (
            cfg.attention_impl == "xla"
            # the cuDNN path is bfloat16 only: float32 forwards (a float32 sampler) use einsum
            or (cfg.attention_impl == "cudnn" and dt == jnp.bfloat16)
        ):
            causal = offset == 0 and t == k_all.shape[2]  # queries = key positions 0 .. t - 1
            out = fused_attention(
                q, k_all, v_all, kv_mask_BxS, query_idx, cfg.attention_impl, causal
            )
        else:
            out = attention(q, k_all, v_all, kv_mask_BxS, query_idx, cfg.logits_chunk, offset)
        out = matmul_input(out.reshape(b, t, h, kd), cfg.activation_fp8, 2)
        return lora.project(cfg, self, "o", out, n_in=2, keys=lora_keys), new_cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate = _matrix(cfg, rngs, "gate", (d, f), ("embed", "mlp"), 1.0 / math.sqrt(d))
        self.up = _matrix(cfg, rngs, "up", (d, f), ("embed", "mlp"), 1.0 / math.sqrt(d))
        self.down = _matrix(cfg, rngs, "down", (f, d), ("mlp", "embed"), 1.0 / math.sqrt(f))
        self.lora = lora.make_adapters(cfg, lora.MLP_TARGETS)

    def __call__(self, cfg, x_BxTxD, lora_keys=None):
        x_BxTxD = matmul_input(x_BxTxD, cfg.activation_fp8)
        g = lora.project(cfg, self, "gate", x_BxTxD, keys=lora_keys)
        u = lora.project(cfg, self, "up", x_BxTxD, keys=lora_keys)
        h = matmul_input(jax.nn.silu(g) * u, cfg.activation_fp8)
        return lora.project(cfg, self, "down", h, keys=lora_keys)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer: int = 0):
        self.attn_norm = _ones((cfg.hidden_size,), ("norm",))
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = _ones((cfg.hidden_size,), ("norm",))
        self.mlp = moe.MoE(cfg, rngs=rngs) if cfg.is_sparse(layer) else MLP(cfg, rngs=rngs)

    def __call__(
        self,
        cfg,
        x,
        positions,
        kv_mask,
        cache,
        cache_index,
        attend_len=None,
        lora_keys=None,
        replay=None,
    ):
        """(output, updated cache, routed): routed is the MoE block's (experts [B, T, X], router
        logits [B, T, E]), None in a dense layer; `replay` ([B, T, X]) its recorded experts."""
        h, new_cache = self.attn(
            cfg,
            rms_norm(x, self.attn_norm[...], cfg.rms_norm_eps),
            positions,
            kv_mask,
            cache,
            cache_index,
            attend_len,
            lora_keys,
        )
        x = x + h
        h = rms_norm(x, self.mlp_norm[...], cfg.rms_norm_eps)
        if not isinstance(self.mlp, moe.MoE):
            return x + self.mlp(cfg, h, lora_keys), new_cache, None
        h, routed = self.mlp(cfg, h, lora_keys, replay)
        return x + h, new_cache, routed


class Decoder(nnx.Module):
    """Token embedding, L pre-norm blocks, final norm, (tied or untied) LM head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        # 1/sqrt(D): with tied embeddings the initial logits are O(1), not O(sqrt(D)) (a
        # near-deterministic random policy would give RL no exploration and ratios of 1)
        self.embed = _param(
            rngs,
            (cfg.vocab_size, cfg.hidden_size),
            ("vocab", "embed"),
            1.0 / math.sqrt(cfg.hidden_size),
        )
        self.layers = nnx.List([Block(cfg, rngs=rngs, layer=i) for i in range(cfg.num_layers)])
        self.final_norm = _ones((cfg.hidden_size,), ("norm",))
        if not cfg.tie_embeddings:
            self.lm_head = _param(
                rngs,
                (cfg.hidden_size, cfg.vocab_size),
                ("embed", "vocab"),
                1.0 / math.sqrt(cfg.hidden_size),
            )

    def hidden(self, cfg, *args, **kwargs):
        """Final-norm hidden states [B, T, D] (compute dtype) and the updated cache: those of
        `hidden_routed` (its arguments), without the routing."""
        x, new_cache, _ = self.hidden_routed(cfg, *args, **kwargs)
        return x, new_cache

    def hidden_routed(
        self,
        cfg,
        tokens_BxT,
        positions_BxT,
        kv_mask_BxS,
        cache=None,
        cache_index=0,
        attend_len=None,
        lora_keys=None,
        routing=None,
    ):
        """Final-norm hidden states [B, T, D] (compute dtype), the updated cache and the sparse
        layers' `moe.Routed` record (None for a dense model).

        `kv_mask_BxS`: the keys that may be attended (bool), or, without a cache, packed rows'
        segment ids (int, 0 on pads; data/packing.py): each query then sees its own segment
        only (layers.visible; splash takes them as its segments), with `positions_BxT`
        restarting per segment.

        With a cache, `attend_len` (a static int) limits attention to the first `attend_len`
        cache positions (they must hold every key the queries may see): the sampler's prefill
        attends over the prompt only. Not for decode loops: sliced after the in-place write,
        the cache is copied at every step (decode.Decode grows the cache per segment instead).
        `lora_keys` ([B] PRNG keys; None: none) draw LoRA dropout masks (lora.dropout), those of
        layer i from the keys folded with i. `routing` ([B, T, Ls, X] int32; None: none) is a
        recorded routing to replay (moe.route), the j-th sparse layer's at [:, :, j]."""
        x = shard_rows(jnp.take(self.embed[...], tokens_BxT, axis=0).astype(cfg.compute_dtype))
        new_cache, routed = [], []
        for i, layer in enumerate(self.layers):
            keys = lora.fold_rows(lora_keys, i)
            replay = None
            if routing is not None and cfg.is_sparse(i):
                replay = routing[:, :, len(routed)]
            if cfg.remat and cache is None:  # the recompute redraws the same dropout masks
                x, c, r = jax.checkpoint(
                    lambda x, p, m, k, e, layer=layer: layer(cfg, x, p, m, None, 0, None, k, e)
                )(x, positions_BxT, kv_mask_BxS, keys, replay)
            else:
                x, c, r = layer(
                    cfg,
                    x,
                    positions_BxT,
                    kv_mask_BxS,
                    None if cache is None else cache[i],
                    cache_index,
                    attend_len,
                    keys,
                    replay,
                )
            x = shard_rows(x)
            new_cache.append(c)
            if r is not None:
                routed.append(r)
        x = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
        record = None
        if routed:
            experts, logits = zip(*routed)
            record = moe.Routed(jnp.stack(experts, axis=2), jnp.stack(logits))
        return x, (None if cache is None else new_cache), record

    def logits(self, cfg, x_BxTxD):
        head_DxV = self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]
        return dense(x_BxTxD, head_DxV.astype(cfg.compute_dtype), out_dtype=jnp.float32)

    def __call__(self, cfg, *args, **kwargs):
        """float32 logits and the updated cache; the arguments are `hidden`'s."""
        x, new_cache = self.hidden(cfg, *args, **kwargs)
        return self.logits(cfg, x), new_cache


# ----------------------------------------------------------------------------- functional API


@functools.lru_cache(maxsize=32)
def _abstract(cfg: ModelConfig):
    # outside any context mesh: under a jitted step's (sharding.under_mesh) NNX would read the
    # params' logical axis names as mesh axes and fail, on a config first bound there
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))


def _init(cfg: ModelConfig, key: jax.Array) -> Params:
    return nnx.to_pure_dict(nnx.state(Decoder(cfg, rngs=nnx.Rngs(key)), nnx.Param))


def init_params(cfg: ModelConfig, rng: jax.Array | int = 0, shardings=None) -> Params:
    """Random float32 parameters as a plain nested dict.

    With `shardings` (e.g. `param_shardings(cfg, mesh)`) each parameter is created
    directly in its shard: the full model never exists on one device.
    """
    # rbg keys: XLA:CPU takes ~10x longer to compile threefry for every param's normal draw
    key = jax.random.key(rng, impl="rbg") if isinstance(rng, int) else rng
    leaves, treedef = jax.tree.flatten(shardings)
    return _init_fn(cfg, tuple(leaves), treedef)(key)


@functools.lru_cache(maxsize=8)
def _init_fn(cfg: ModelConfig, sharding_leaves: tuple, treedef):
    # jitted (eager NNX init compiles op by op) and cached per (config, layout)
    shardings = jax.tree.unflatten(treedef, sharding_leaves) if sharding_leaves else None
    return jax.jit(functools.partial(_init, cfg), out_shardings=shardings)


def abstract_params(cfg: ModelConfig) -> Params:
    """ShapeDtypeStructs of the parameters, without allocating them (a fresh dict each call)."""
    return jax.tree.map(lambda x: x, _abstract_pure(cfg))


def logical_axes(cfg: ModelConfig) -> Params:
    """Same tree as the params, each leaf the tuple of its logical axis names."""
    return jax.tree.map(lambda x: x, _logical_pure(cfg), is_leaf=lambda x: isinstance(x, tuple))


@functools.lru_cache(maxsize=32)
def _abstract_pure(cfg: ModelConfig) -> Params:
    return nnx.to_pure_dict(_abstract(cfg)[1])


@functools.lru_cache(maxsize=32)
def _logical_pure(cfg: ModelConfig) -> Params:
    specs = nnx.to_pure_dict(nnx.get_partition_spec(_abstract(cfg)[1]))
    return jax.tree.map(tuple, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def bind(cfg: ModelConfig, params: Params) -> Decoder:
    """The NNX module holding `params` (cheap: no copy, usable inside jit)."""
    graphdef, state = _abstract(cfg)
    state = jax.tree.map(lambda x: x, state)  # fresh container, the cached one stays abstract
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def positions_from_mask(mask_BxT: jax.Array) -> jax.Array:
    """RoPE positions that start at 0 on each row's first real token (left padding)."""
    return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


def forward(
    cfg, params, tokens_BxT, positions_BxT, kv_mask_BxS, cache=None, cache_index=0, attend_len=None
):
    """Logits (float32) and the updated cache. `kv_mask_BxS` marks keys that may be attended;
    `attend_len` (static) limits a cached forward's attention to the cache's first positions."""
    return bind(cfg, params)(
        cfg, tokens_BxT, positions_BxT, kv_mask_BxS.astype(bool), cache, cache_index, attend_len
    )


def apply(
    cfg: ModelConfig, params: Params, tokens_BxT: jax.Array, mask_BxT: jax.Array | None = None
) -> jax.Array:
    """Causal forward over whole sequences: logits_BxTxV in float32."""
    if mask_BxT is None:
        mask_BxT = jnp.ones(tokens_BxT.shape, bool)
    logits, _ = forward(cfg, params, tokens_BxT, positions_from_mask(mask_BxT), mask_BxT)
    return logits


def num_params(params: Params) -> int:
    return sum(x.size for x in jax.tree.leaves(params))


def param_shardings(cfg: ModelConfig, mesh: Mesh, mode: str = "train"):
    """Shardings of the model params in the `train` or `sample` layout: `logical_axes` mapped
    onto `mesh` by the rules of parallel/sharding.py."""
    rules = {"train": TRAIN_RULES, "sample": SAMPLE_RULES}.get(mode)
    if rules is None:
        raise ValueError(f"unknown sharding mode {mode!r}; valid: train, sample")
    return tree_shardings(abstract_params(cfg), logical_axes(cfg), mesh, rules)

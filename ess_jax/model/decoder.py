"""Flax NNX decoder for the Llama / Qwen2 / Qwen3 / Qwen3-MoE families.

Axis alphabet used in names: B batch, T time (query), S cache/key length, D model width,
H query heads, N kv heads, K head dim, F MLP width, V vocab, L layers.

A block's self-attention is self_attention.py's `Attention`; its feed-forward is the dense
SwiGLU `MLP`, or in a Qwen3-MoE model's sparse layers
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

from ess_jax.model import lora, moe, param_init, remat
from ess_jax.model.config import ModelConfig
from ess_jax.model.layers import dense, matmul_input, rms_norm
from ess_jax.model.self_attention import Attention
from ess_jax.parallel.sharding import SAMPLE_RULES, TRAIN_RULES, row_axes, tree_shardings

Params = dict[str, Any]


def shard_rows(x_BxTxD: jax.Array) -> jax.Array:
    """Rows over the data-parallel mesh axes when traced under a mesh (`jax.set_mesh` or
    `use_abstract_mesh`, as the trainer's steps are). Without it GSPMD follows the FSDP-sharded
    weights and every device computes the activations of the whole global batch."""
    axes = row_axes(jax.sharding.get_abstract_mesh(), x_BxTxD.shape[0])
    if not axes:
        return x_BxTxD
    spec = PartitionSpec(axes, *([None] * (x_BxTxD.ndim - 1)))
    return jax.lax.with_sharding_constraint(x_BxTxD, spec)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        in_axes, out_axes = ("embed", "mlp"), ("mlp", "embed")
        self.gate = param_init.matrix(cfg, rngs, "gate", (d, f), in_axes, 1.0 / math.sqrt(d))
        self.up = param_init.matrix(cfg, rngs, "up", (d, f), in_axes, 1.0 / math.sqrt(d))
        self.down = param_init.matrix(cfg, rngs, "down", (f, d), out_axes, 1.0 / math.sqrt(f))
        self.lora = lora.make_adapters(cfg, lora.MLP_TARGETS)

    def __call__(self, cfg, x_BxTxD, lora_keys=None):
        x_BxTxD = matmul_input(x_BxTxD, cfg.activation_fp8)
        g = lora.project(cfg, self, "gate", x_BxTxD, keys=lora_keys)
        u = lora.project(cfg, self, "up", x_BxTxD, keys=lora_keys)
        h = matmul_input(jax.nn.silu(g) * u, cfg.activation_fp8)
        return lora.project(cfg, self, "down", h, keys=lora_keys)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer: int = 0):
        self.attn_norm = param_init.ones((cfg.hidden_size,), ("norm",))
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = param_init.ones((cfg.hidden_size,), ("norm",))
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
        self.embed = param_init.normal(
            rngs,
            (cfg.vocab_size, cfg.hidden_size),
            ("vocab", "embed"),
            1.0 / math.sqrt(cfg.hidden_size),
        )
        self.layers = nnx.List([Block(cfg, rngs=rngs, layer=i) for i in range(cfg.num_layers)])
        self.final_norm = param_init.ones((cfg.hidden_size,), ("norm",))
        if not cfg.tie_embeddings:
            self.lm_head = param_init.normal(
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
                checkpoint = remat.remat if cfg.remat_ordered else jax.checkpoint
                x, c, r = checkpoint(
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


class _ShapeKeys:
    """The `rngs` of a Decoder traced for its shapes only: every draw the same key. nnx.Rngs
    would count its draws in a traced Variable, and NNX's every update of it reads the
    tracer's `sharding`, whose error message walks the whole trace: quadratic in the params
    (the paper's four model configs: 4.8 s with nnx.Rngs, 0.7 s with this, same shapes)."""

    def params(self) -> jax.Array:
        return jax.random.key(0)


@functools.lru_cache(maxsize=32)
def _abstract(cfg: ModelConfig):
    # outside any context mesh: under a jitted step's (sharding.under_mesh) NNX would read the
    # params' logical axis names as mesh axes and fail, on a config first bound there
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=_ShapeKeys())))


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

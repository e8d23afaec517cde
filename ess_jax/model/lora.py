"""Low-rank adapters (LoRA, Hu et al. 2021, arXiv:2106.09685) on the decoder's block matmuls.

Axis alphabet as in decoder.py; R the adapter rank. A targeted weight W [*I, *O] (q [D, H, K],
o [H, K, D], gate [D, F], ...) gets A [*I, R] and B [R, *O]; the layer computes

    x W + (alpha / R) (x A) B            (`project`: in the matmuls, the trainer's form)
    x (W + (alpha / R) A B)              (`merge`: one dense weight, the sampler's form)

B starts at zero, so a fresh adapter leaves the model unchanged. A and B carry the logical axis
names of W's input and output axes (the rank axis is "lora_rank", replicated by every rule), so
`param_shardings` places each adapter on the mesh axes of its base matmul.

In the params tree an adapter pair sits beside its weights, `layers/<i>/attn/lora/q/{a,b}`;
`split` takes every `lora` subtree out (the trainable adapters) and leaves the frozen base,
`join` puts them back for a forward. The trainer differentiates the adapters only: the base is
an argument of the step, never an optimizer parameter (rl/steps.TrainState.frozen). With
`cfg.lora_base_precision` "int8" / "int4" (QLoRA) the base's block matrices are codes and scales
(quant.py), dequantized inside `project` and by `merge`: trainer and sampler see one base.

Dropout (`cfg.lora_dropout` p > 0, PEFT's lora_dropout) acts on each adapter's input only:
x W + (alpha / R) (dropout(x) A) B, dropout(x) = x * mask / (1 - p), an independent mask per
row, layer and target. A forward draws it only when given per-row dropout keys
(`dropout_keys`): the trainer's differentiated forwards (rl/update.py). The sampler (merged
weights), the proximal / reference scoring and the full-KL re-score of pi_b run without it, so
with p > 0 the ratio pi / pi_b of an on-policy token is no longer 1: the trainer sees a noisy
copy of the policy that drew it. A row's masks depend on its key alone, not on the
micro-batch it lands in: the ESS statistics pass and the gradient pass see the same masks.

Why not qwix (0.1.8) or flax.nnx.LoRA: qwix finds the weight of an intercepted dot_general by
tracing its right operand back to an `nnx.Param` of the calling module; `layers.dense` reshapes
the head-split q / k / v / o weights ([D, H, K], [H, K, D]) to 2-D first, and in the eager call
that creates the adapters the reshape hides the param: `find_param` returned None for all four,
so q, k, v and o would silently get no adapters (the 2-D MLP weights were found). `nnx.LoRA`
is 2-D only (in_features x out_features), has no alpha / R scale, and computes x @ a @ b over
[B, T, D] (the two-axis weight-gradient contraction `dense` avoids); it would hold the same two
arrays as here with less control.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ess_jax.config.domains import LORA_TARGETS
from ess_jax.model import quant
from ess_jax.model.layers import dense

TARGETS = LORA_TARGETS  # q, k, v, o, gate, up, down
ATTENTION_TARGETS, MLP_TARGETS = TARGETS[:4], TARGETS[4:]
RANK_AXIS = "lora_rank"  # a logical axis no sharding rule names: replicated
# The batch entry of the per-row dropout keys: each row's threefry key data, [B, 2] uint32
DROPOUT_KEYS = "lora_dropout_keys"
# Threefry whatever jax_default_prng_impl says: under "rbg" a vmap over per-row keys draws
# bits that depend on the batch the row is in, not on its key alone
KEY_IMPL = "threefry2x32"
# Phases (RL, SFT), folded in after the update count: a tag >= 2**31 is never one of the
# shuffle's block keys (split children 0 .. blocks - 1 of the same seed and update count)
RL_DROPOUT, SFT_DROPOUT = 0x8000010A, 0x8000010B


def weight_axes(cfg) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple, tuple]]:
    """{target: (input shape, output shape, input axes, output axes)} of the base weights."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    h, n, k = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    emb = ("embed",)
    return {
        "q": ((d,), (h, k), emb, ("heads", "head_dim")),
        "k": ((d,), (n, k), emb, ("kv_heads", "head_dim")),
        "v": ((d,), (n, k), emb, ("kv_heads", "head_dim")),
        "o": ((h, k), (d,), ("heads", "head_dim"), emb),
        "gate": ((d,), (f,), emb, ("mlp",)),
        "up": ((d,), (f,), emb, ("mlp",)),
        "down": ((f,), (d,), ("mlp",), emb),
    }


def scale(cfg) -> float:
    return cfg.lora_alpha / cfg.lora_rank


def targets_of(cfg, names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(n for n in names if cfg.lora_rank and n in cfg.lora_targets)


def make_adapters(cfg, names: tuple[str, ...]) -> nnx.Dict | None:
    """The adapter params of one Attention (or MLP) module, zeros with their logical axes (the
    values come from `init_adapters` or a checkpoint); None when none of `names` is targeted."""
    chosen = targets_of(cfg, names)
    if not chosen:
        return None
    shapes, r = weight_axes(cfg), cfg.lora_rank

    def param(shape, axes):
        return nnx.Param(jnp.zeros(shape, jnp.float32), out_sharding=axes, eager_sharding=False)

    out = {}
    for name in chosen:
        i_shape, o_shape, i_axes, o_axes = shapes[name]
        out[name] = nnx.Dict(
            a=param((*i_shape, r), (*i_axes, RANK_AXIS)),
            b=param((r, *o_shape), (RANK_AXIS, *o_axes)),
        )
    return nnx.Dict(out)


def project(
    cfg, module, name: str, x: jax.Array, n_in: int = 1, keys: jax.Array | None = None
) -> jax.Array:
    """`module`'s weight `name` applied to x (the last `n_in` axes), plus its adapter if any.
    `keys` ([B] PRNG keys of this layer, `fold_rows`; None: no dropout) draw the adapter
    input's dropout mask when cfg.lora_dropout > 0."""
    dt = cfg.compute_dtype
    y = quant.matmul(x, getattr(module, name), n_in, dt)  # dequantized here if quantized
    adapters = getattr(module, "lora", None)
    if adapters is None or name not in adapters:
        return y
    pair = adapters[name]
    x = dropout(x, cfg.lora_dropout, keys, TARGETS.index(name))
    xa = dense(x, pair["a"][...].astype(dt), n_in) * jnp.asarray(scale(cfg), dt)  # [..., R]
    return y + dense(xa, pair["b"][...].astype(dt))


# ----------------------------------------------------------------------------- dropout


def dropout_keys(seed: int, step: jax.Array, batch_size: int, phase: int = RL_DROPOUT):
    """[B, 2] uint32: the threefry key data of each row's dropout key for optimizer update
    `step` of `phase` (RL_DROPOUT, SFT_DROPOUT): a function of the run's seed, the phase and the
    update count, so a rerun or a resume draws the same (a skipped, non-finite update leaves
    the count, and the next update redraws its keys)."""
    key = jax.random.fold_in(jax.random.key(seed, impl=KEY_IMPL), step)
    key = jax.random.fold_in(key, np.uint32(phase))
    return jax.random.key_data(jax.random.split(key, batch_size))


def wrap_keys(key_data: jax.Array | None) -> jax.Array | None:
    """Typed keys of `dropout_keys`' data (threefry, as drawn); None stays None."""
    return None if key_data is None else jax.random.wrap_key_data(key_data, impl=KEY_IMPL)


def fold_rows(keys: jax.Array | None, i: int) -> jax.Array | None:
    """Every row's key folded with `i` (a layer or target index); None stays None."""
    return None if keys is None else jax.vmap(jax.random.fold_in, (0, None))(keys, i)


def dropout(x: jax.Array, rate: float, keys: jax.Array | None, i: int) -> jax.Array:
    """Inverted dropout of x [B, ...]: each element kept with probability 1 - rate and scaled by
    1 / (1 - rate) (the expectation is x), row b's mask drawn from fold_in(keys[b], i). x itself
    at rate 0 or without keys."""
    if not rate or keys is None:
        return x
    keep = 1.0 - rate
    mask = jax.vmap(lambda k: jax.random.bernoulli(k, keep, x.shape[1:]))(fold_rows(keys, i))
    scaled = (x.astype(jnp.float32) / keep).astype(x.dtype)  # 1 / keep not rounded to bf16
    return jnp.where(mask, scaled, jnp.zeros((), x.dtype))


# ----------------------------------------------------------------------------- param trees


def split(params: dict) -> tuple[dict, dict]:
    """(base, adapters): the params without their `lora` subtrees, and those subtrees alone
    (same paths), e.g. adapters["layers"][0]["attn"]["lora"]["q"]["a"]."""
    base, adapters = {}, {}
    for key, value in params.items():
        if key == "lora":
            adapters[key] = value
        elif isinstance(value, dict):
            b, a = split(value)
            base[key] = b
            if a:
                adapters[key] = a
        else:
            base[key] = value
    return base, adapters


def join(base: dict | None, adapters: dict) -> dict:
    """The full params of a LoRA model (base None: `adapters` are already full params)."""
    if base is None:
        return adapters
    out = dict(base)
    for key, value in adapters.items():
        out[key] = join(base[key], value) if key in base else value
    return out


def pairs(adapters: dict):
    """(layer, target, a, b) for every adapter pair of an adapters tree."""
    for i, layer in adapters["layers"].items():
        for module in ("attn", "mlp"):
            for name, pair in layer.get(module, {}).get("lora", {}).items():
                yield i, module, name, pair["a"], pair["b"]


def delta(cfg, a: jax.Array, b: jax.Array) -> jax.Array:
    """(alpha / R) A B: the weight change of one adapter pair, W's shape, float32."""
    return scale(cfg) * jnp.tensordot(a, b, axes=1)


def merge(cfg, base: dict, adapters: dict) -> dict:
    """Base params with every adapter folded into its weight, W + (alpha / R) A B: the params of
    the plain model `base_config(cfg)` (jit-able; float32). A quantized base (QLoRA) enters
    dequantized, codes * scale: the weights the trainer's forward computes with."""
    out = quant.dequantize_tree(base)  # fresh dicts, shared leaves
    for i, module, name, a, b in pairs(adapters):
        w = out["layers"][i][module][name]
        out["layers"][i][module][name] = w + delta(cfg, a, b).astype(w.dtype)
    return out


def base_config(cfg):
    """The ModelConfig of the base model alone (no adapters in its params tree, its block
    matrices in the param dtype: `merge`'s output)."""
    return cfg.replace(lora_rank=0, lora_base_precision="compute", lora_dropout=0.0)


def with_lora(
    cfg,
    rank: int,
    alpha: float,
    targets: tuple[str, ...],
    base_precision="compute",
    dropout: float = 0.0,
):
    """`cfg` with adapters of `rank` on `targets` (their input's dropout `dropout`), its frozen
    base in `base_precision`."""
    unknown = set(targets) - set(TARGETS)
    if unknown:
        raise ValueError(f"LoRA targets {sorted(unknown)}: not among {', '.join(TARGETS)}")
    return cfg.replace(
        lora_rank=int(rank),
        lora_alpha=float(alpha),
        lora_targets=tuple(targets),
        lora_base_precision=base_precision,
        lora_dropout=float(dropout),
    )


def init_adapters(cfg, key: jax.Array, shardings: Any = None) -> dict:
    """Fresh adapters of a LoRA `cfg`: A ~ N(0, 1 / fan_in) (fan_in = prod of W's input axes;
    PEFT draws a uniform of the same scale), B = 0. With `shardings` (`split` of
    param_shardings' tree), each is created in its shard."""
    shapes, r = weight_axes(cfg), cfg.lora_rank

    def build(key):
        tree: dict = {"layers": {}}
        for i in range(cfg.num_layers):
            layer = {}
            for module, names in (("attn", ATTENTION_TARGETS), ("mlp", MLP_TARGETS)):
                chosen = targets_of(cfg, names)
                if not chosen:
                    continue
                pairs_ = {}
                for name in chosen:
                    i_shape, o_shape = shapes[name][:2]
                    k = jax.random.fold_in(key, i * len(TARGETS) + TARGETS.index(name))
                    a = jax.random.normal(k, (*i_shape, r), jnp.float32)
                    pairs_[name] = {
                        "a": a / math.sqrt(math.prod(i_shape)),
                        "b": jnp.zeros((r, *o_shape), jnp.float32),
                    }
                layer[module] = {"lora": pairs_}
            tree["layers"][i] = layer
        return tree

    return jax.jit(build, out_shardings=shardings)(key)


def num_adapter_params(cfg) -> int:
    """Trainable parameters of a LoRA `cfg`: R (prod(I) + prod(O)) per targeted weight."""
    shapes, total = weight_axes(cfg), 0
    for name in targets_of(cfg, TARGETS):
        i_shape, o_shape = shapes[name][:2]
        total += cfg.lora_rank * (math.prod(i_shape) + math.prod(o_shape))
    return total * cfg.num_layers

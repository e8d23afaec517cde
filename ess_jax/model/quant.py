"""Symmetric integer / fp8 weight quantization of the block matrices, and QLoRA's frozen base.

A quantized matrix is {"codes", "scale"}: scale (float32, W's shape with its input axes kept as
size 1, or every axis for one scale per tensor) = max|w| / QMAX over those axes (1 where all are
zero); codes = w / scale rounded to nearest, ties to even (the float casts; `jnp.round` then a
clip to [-QMAX, QMAX] for the integers). Dequantized, it is codes * scale in float32. The
sampler's formats (sampling/precision.py) and model.lora.base_precision both use `quantize`.

QLoRA (Dettmers et al. 2023, arXiv:2305.14314): with `ModelConfig.lora_base_precision` "int8"
(codes in [-127, 127]) or "int4" ([-7, 7], stored as jnp.int4), the frozen base holds the seven
block matrices q/k/v/o/gate/up/down (adapter targets or not) as codes with per-output-channel
scales, and `matmul` dequantizes each inside the forward, next to its use. The embedding (a
gather, not a matmul), the LM head (tied to it in several families, and the producer of the
log-probs every ratio is made of) and the norm vectors stay in the param dtype: as in
bitsandbytes' QLoRA, which quantizes nn.Linear layers and skips lm_head, and in the sampler's
formats. On XLA:CPU a jnp.int4 argument counts 0.5 byte per element in the compiled program's
memory analysis (the planner counts that), though the CPU client's buffer holds one byte per
element (`on_device_size_in_bytes` of a [1024, 1024] int4 array: 1048576); the forward reads
int4 codes on CPU. Packing on accelerators is not measured here.

In-house rather than qwix (0.1.8, on PyPI, not a dependency): the quantizer is the ten lines the
sampler's formats already use (tested against float64 numpy in tests/test_formats.py and
tests/test_qlora.py), and qwix's QLoRA intercepts dot_generals and traces their weight back to
an `nnx.Param`, which misses the head-split q / k / v / o weights `layers.dense` reshapes
(lora.py's docstring).

`matmul` wraps the dequantize-and-dot in `jax.checkpoint`, so the backward dequantizes again
instead of keeping the forward's float copy as the residual of x W. Compiled train step on
XLA:CPU (memory-minimising scheduler, tests/test_plan_memory.py's model, 8 devices, FSDP):
23.2 MB per device with it against 24.4 MB without (float32; bfloat16 14.7 against 15.7), and
24.5 MB for LoRA on the float32 base. On one device XLA:CPU dequantizes every block matrix once
at the step's start either way (the step's temporaries grow by 0.96x the block matrices in the
compute dtype against the float base; an optimization barrier tying the dequantization to the
activations changed nothing: XLA:CPU expands the barriers). The planner counts that copy
(memory/terms.py); with FSDP it is among the gathered weights it already counts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ess_jax.config.domains import LORA_BASE_PRECISIONS
from ess_jax.model.layers import dense

# weight matrix name -> its contraction (input) axes; the rest are output channels
INPUT_AXES = {
    "q": (0,),
    "k": (0,),
    "v": (0,),
    "o": (0, 1),
    "gate": (0,),
    "up": (0,),
    "down": (0,),
    # an MoE layer's expert stacks (moe.py, [E, in, out]): scales per expert and output channel
    "expert_gate": (1,),
    "expert_up": (1,),
    "expert_down": (1,),
}
# model.lora.base_precision -> (codes dtype, QMAX); "compute": the base in the param dtype
BASE_FORMATS = {"int8": ("int8", 127.0), "int4": ("int4", 7.0)}
assert ("compute", *BASE_FORMATS) == LORA_BASE_PRECISIONS, "config/domains.py lists them"


def quantize(w: jax.Array, codes: str, qmax: float, axes: tuple[int, ...]) -> dict:
    """{"codes", "scale"} of `w` with one scale per slice over `axes` (module docstring)."""
    amax = jnp.max(jnp.abs(w), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / qmax, 1.0).astype(jnp.float32)
    x = w / scale
    if jnp.issubdtype(jnp.dtype(codes), jnp.integer):
        x = jnp.clip(jnp.round(x), -qmax, qmax)
    return {"codes": x.astype(codes), "scale": scale}


def is_quantized(x) -> bool:
    return isinstance(x, dict) and set(x) == {"codes", "scale"}


def dequantize(q: dict, dtype=jnp.float32) -> jax.Array:
    """codes * scale, computed in float32, returned in `dtype`."""
    return (q["codes"].astype(jnp.float32) * q["scale"]).astype(dtype)


def dequantize_tree(params, dtype=jnp.float32):
    """Every {"codes", "scale"} leaf of a params tree as its `dtype` matrix; the rest as is."""
    return jax.tree.map(
        lambda x: dequantize(x, dtype) if is_quantized(x) else x, params, is_leaf=is_quantized
    )


def code_bytes(dtype) -> float:
    """Bytes per element of `dtype`, sub-byte types packed (int4: 0.5)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).bits / 8
    return float(dtype.itemsize)


# ----------------------------------------------------------------------------- QLoRA's base


def quantize_matrix(name: str, w: jax.Array, precision: str) -> dict:
    """Block matrix `name` in base precision `precision` ("int8" / "int4"), per output channel."""
    codes, qmax = BASE_FORMATS[precision]
    return quantize(w, codes, qmax, INPUT_AXES[name])


def quantize_base(params, precision: str):
    """A base params tree with its block matrices quantized (`quantize_matrix`); "compute": as
    is. The tree of a ModelConfig with lora_base_precision `precision` (jit-able)."""
    if precision == "compute":
        return params

    def leaf(path, x):
        name = getattr(path[-1], "key", None)
        return quantize_matrix(name, x, precision) if name in INPUT_AXES and x.ndim >= 2 else x

    return jax.tree_util.tree_map_with_path(leaf, params)


def matrix_param(cfg, name: str, value: jax.Array, axes: tuple) -> nnx.Param | nnx.Dict:
    """The decoder's param for block matrix `name`: `value` itself, or with a quantized base
    its codes (W's logical axes) and scale (the input axes, size 1, unnamed)."""
    param = lambda v, a: nnx.Param(v, out_sharding=a, eager_sharding=False)  # noqa: E731
    if cfg.lora_base_precision == "compute":
        return param(value, axes)
    q = quantize_matrix(name, value, cfg.lora_base_precision)
    scale_axes = tuple(None if i in INPUT_AXES[name] else a for i, a in enumerate(axes))
    return nnx.Dict(codes=param(q["codes"], axes), scale=param(q["scale"], scale_axes))


def matmul(x: jax.Array, weight, n_in: int, dtype) -> jax.Array:
    """x times a decoder weight (`matrix_param`'s) in compute `dtype`, a quantized one
    dequantized inside the forward and again in the backward (module docstring)."""
    if not isinstance(weight, nnx.Dict):
        return dense(x, weight[...].astype(dtype), n_in)

    @jax.checkpoint
    def product(x, codes, scale):
        return dense(x, dequantize({"codes": codes, "scale": scale}, dtype), n_in)

    return product(x, weight["codes"][...], weight["scale"][...])

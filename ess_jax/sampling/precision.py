"""The sampler's numeric modes: float32, bfloat16, and fp8 weights with per-channel scales.

"bfloat16": weight matrices (and so the compute) in bfloat16, norm vectors float32 (the model
does its statistics in float32 either way). "fp8": the seven block matrices q/k/v/o/gate/up/
down stored as float8_e4m3fn with per-output-channel float32 scales, dequantised into each
forward's bfloat16 matmuls; embedding and LM head stay bfloat16, as in common FP8 serving
recipes. sampler.py prepares the copy once per `sample` call and dequantises inside its jitted
forwards.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ess_jax.config.schema import PRECISIONS  # noqa: F401  (the sampler's modes, listed there)

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
# weight matrix name -> its contraction (input) axes; the rest are output channels
FP8_INPUT_AXES = {
    "q": (0,),
    "k": (0,),
    "v": (0,),
    "o": (0, 1),
    "gate": (0,),
    "up": (0,),
    "down": (0,),
}


def prepare_params(params, precision: str):
    """Sampler-side copy of the params. Norm vectors stay float32 (the model does its
    statistics in float32 either way); casting matrices here rather than inside every
    decode step is numerically identical to the model's own `.astype(compute_dtype)`."""

    def leaf(path, x):
        name = getattr(path[-1], "key", None)
        if x.ndim < 2:
            return x
        if precision == "fp8" and name in FP8_INPUT_AXES:
            axes = FP8_INPUT_AXES[name]
            amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
            scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
            return {"w8": (x / scale).astype(FP8), "scale": scale}
        return x.astype(jnp.bfloat16)

    return jax.tree_util.tree_map_with_path(leaf, params)


def dequantize(params):
    """fp8 {'w8', 'scale'} leaves -> bfloat16 matrices, inside the forward that uses them."""

    def is_q(x):
        return isinstance(x, dict) and set(x) == {"w8", "scale"}

    return jax.tree.map(
        lambda x: (x["w8"].astype(jnp.float32) * x["scale"]).astype(jnp.bfloat16) if is_q(x) else x,
        params,
        is_leaf=is_q,
    )


@functools.lru_cache(maxsize=8)
def prepare_fn(precision: str):
    return jax.jit(functools.partial(prepare_params, precision=precision))

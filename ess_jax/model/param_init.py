"""How the decoder's modules (decoder.py, self_attention.py, moe.py) create their parameters:
float32 masters, each carrying its logical axis names (`out_sharding` metadata) that
parallel/sharding.py maps to mesh axes; a block matrix with a quantized base is quant.py's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ess_jax.model import quant


def param(value: jax.Array, axes: tuple) -> nnx.Param:
    """`value` as a parameter with logical `axes`, created lazily (eager_sharding off)."""
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple, scale: float) -> nnx.Param:
    """scale x a standard normal draw, float32."""
    return param(scale * jax.random.normal(rngs.params(), shape, jnp.float32), axes)


def ones(shape: tuple[int, ...], axes: tuple) -> nnx.Param:
    return param(jnp.ones(shape, jnp.float32), axes)


def zeros(shape: tuple[int, ...], axes: tuple) -> nnx.Param:
    return param(jnp.zeros(shape, jnp.float32), axes)


def matrix(cfg, rngs: nnx.Rngs, name: str, shape: tuple[int, ...], axes: tuple, scale: float):
    """A block matrix `name` drawn as `normal`: float32, or its codes and scales with a
    quantized base (quant.matrix_param)."""
    value = scale * jax.random.normal(rngs.params(), shape, jnp.float32)
    return quant.matrix_param(cfg, name, value, axes)

"""What the model's Pallas TPU kernels (splash.py's attention, grouped.py's expert matmul) share:
their matmul precision."""

from __future__ import annotations

import jax


def under_precision(kernel, precision, n_diff: int):
    """`kernel`(*args) with its forward and its backward traced under
    jax.default_matmul_precision(precision) (None: unchanged); the first `n_diff` args are
    differentiated, the others (segment ids, group sizes) get no cotangent. bfloat16 products
    accumulate exactly in float32 at any precision, but Mosaic refuses a bfloat16 product at
    "highest" ("Bad lhs type"), which jax_default_matmul_precision may ask for (the tests do).
    The backward kernels are traced when the gradient is, outside any context around the
    forward call: hence the custom_vjp."""
    if precision is None:
        return kernel

    @jax.custom_vjp
    def run(*args):
        with jax.default_matmul_precision(precision):
            return kernel(*args)

    def fwd(*args):
        rest = args[n_diff:]
        with jax.default_matmul_precision(precision):
            out, vjp = jax.vjp(lambda *d: kernel(*d, *rest), *args[:n_diff])
        return out, (vjp, rest)

    def bwd(res, g):
        vjp, rest = res
        with jax.default_matmul_precision(precision):
            return (*vjp(g), *(None for _ in rest))

    run.defvjp(fwd, bwd)
    return run

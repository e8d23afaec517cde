"""The sampler's numeric modes (`rollout.precision`): what each one rounds, and how.

Every mode but float32 computes in a 16-bit dtype; the norm vectors stay float32 (the model does
its statistics in float32 either way). The weight formats quantize the seven block matrices
q/k/v/o/gate/up/down (`INPUT_AXES`; in an MoE layer the expert stacks, per expert, in place of
gate/up/down, its router staying bfloat16) with symmetric scales, scale = max|w| / QMAX over each
output channel (all input axes of the matrix) or over the whole tensor, codes = w / scale
rounded to nearest, ties to even (the float casts; `jnp.round` then a clip for the integers);
the embedding and LM head stay bfloat16, as in common quantized-serving recipes. Inside each
forward the codes are dequantized to codes * scale in bfloat16 (`dequantize`), as weight-only
kernels do before their bf16 matmul. The quantizer itself is model/quant.py's, shared with
model.lora.base_precision (QLoRA's frozen base).

  mode              weights of the block matrices                   compute   QMAX
  float32           float32 (no copy)                               float32
  bfloat16          bfloat16                                        bfloat16
  float16           float16                                         float16
  fp8               float8_e4m3fn, per output channel               bfloat16  448
  fp8_e4m3_tensor   float8_e4m3fn, one scale per tensor             bfloat16  448
  fp8_e5m2          float8_e5m2, per output channel                 bfloat16  57344
  int8              int8 in [-127, 127], per output channel         bfloat16  127
  int4              int4 in [-7, 7] (symmetric), per output channel bfloat16  7
  fp8_act           fp8's weights, and the inputs of the block      bfloat16  448
                    matmuls rounded through float8_e4m3fn with one
                    dynamic scale per token (max |x| over the
                    contraction axes / 448: model/layers.fp8_activation)

fp8_act's scaling rule is that of per-token dynamic FP8 serving (weights per channel,
activations per token): a row's rounding depends on its own activations only, never on the
other rows of the batch. Attention's own products (q.k, p.v) and the LM head stay bfloat16.
The KV cache's precision is a separate knob (`rollout.kv_cache_precision`, model/kv_cache.py).
sampler.py prepares the copy once per `sample` call and dequantizes inside its jitted forwards.

Hand-written casts, not qwix (the JAX quantization library): the sampler quantizes a params
dict once per collection and the forward reads plain arrays, so a format is ~10 lines here,
tested against a float64 numpy reference; qwix intercepts a Flax module's dot_generals, which
would also catch the attention einsums of the prefill, and would be one more dependency.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ess_jax.config.domains import PRECISIONS
from ess_jax.model import quant
from ess_jax.model.quant import INPUT_AXES


@dataclasses.dataclass(frozen=True)
class Format:
    """One sampler mode: the block matrices' codes (None: a plain cast to `compute`), their
    largest magnitude and scale granularity, and whether the matmul inputs go through fp8."""

    compute: str  # the sampler's compute dtype (and the dtype of every unquantized matrix)
    codes: str | None = None
    qmax: float = 0.0
    per_channel: bool = True
    activation_fp8: bool = False

    @property
    def integer(self) -> bool:
        return self.codes is not None and self.codes.startswith("int")

    @property
    def code_bytes(self) -> float:
        """Bytes per code, packed (int4: 0.5), as the memory planner counts them."""
        info = jnp.iinfo if self.integer else jnp.finfo
        return info(self.codes).bits / 8


FORMATS = {
    "float32": Format("float32"),
    "bfloat16": Format("bfloat16"),
    "float16": Format("float16"),
    "fp8": Format("bfloat16", "float8_e4m3fn", 448.0),
    "fp8_e4m3_tensor": Format("bfloat16", "float8_e4m3fn", 448.0, per_channel=False),
    "fp8_e5m2": Format("bfloat16", "float8_e5m2", 57344.0),
    "int8": Format("bfloat16", "int8", 127.0),
    "int4": Format("bfloat16", "int4", 7.0),
    "fp8_act": Format("bfloat16", "float8_e4m3fn", 448.0, activation_fp8=True),
}
assert tuple(FORMATS) == PRECISIONS, "config/domains.py PRECISIONS lists the formats"


def quantize(w, fmt: Format, input_axes: tuple[int, ...]) -> dict:
    """{"codes", "scale"} of a matrix (model/quant.py's `quantize`): one scale per output
    channel (over `input_axes`) or per tensor (over every axis)."""
    axes = input_axes if fmt.per_channel else tuple(range(w.ndim))
    return quant.quantize(w, fmt.codes, fmt.qmax, axes)


def prepare_params(params, precision: str):
    """Sampler-side copy of the params in `precision` (module docstring). Casting matrices here
    rather than inside every decode step is numerically identical to the model's own
    `.astype(compute_dtype)`."""
    fmt = FORMATS[precision]

    def leaf(path, x):
        name = getattr(path[-1], "key", None)
        if x.ndim < 2:
            return x
        if fmt.codes is not None and name in INPUT_AXES:
            return quantize(x, fmt, INPUT_AXES[name])
        return x.astype(jnp.bfloat16 if fmt.codes is not None else fmt.compute)

    return jax.tree_util.tree_map_with_path(leaf, params)


def dequantize(params):
    """{'codes', 'scale'} leaves -> bfloat16 matrices codes * scale, inside the forward that
    uses them; every other leaf as it is."""
    return quant.dequantize_tree(params, jnp.bfloat16)


def sample_config(cfg, precision: str):
    """The ModelConfig the sampler computes with in `precision`."""
    fmt = FORMATS[precision]
    return cfg.replace(dtype=fmt.compute, activation_fp8=fmt.activation_fp8)


@functools.lru_cache(maxsize=16)
def prepare_fn(precision: str):
    return jax.jit(functools.partial(prepare_params, precision=precision))

"""The sampler's low-precision formats (sampling/precision.py), its fp8 activations
(model/layers.py) and KV cache precisions (model/kv_cache.py) against a float64 numpy
quantization reference written here, independent of ml_dtypes and of jax's casts:

  scale = max|w| / QMAX over each output channel (all input axes of the matrix) or the whole
  tensor (1 for an all-zero slice); codes = w / scale rounded to the nearest value of the
  format's grid, ties to even: a float format's grid has `mant` mantissa bits above its
  smallest normal exponent and the subnormal spacing below it; the integer formats round to
  integers and clip to the symmetric [-QMAX, QMAX] (int4: [-7, 7], never -8).

Then each format's log-ratios on a one-matrix toy with a closed form, and the float32 sampler's
ESS. tests/test_knobs_exact.py checks that each format's recorded behaviour log-probs in a real
RL step are those of the model rounded by this reference.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ess_jax.model import kv_cache, layers
from ess_jax.sampling import precision

# name -> (grid: ("float", mantissa bits, smallest normal exponent) or ("int",), QMAX, per
# channel, activations through fp8): the formats as docs/running.md states them
REFERENCE = {
    "fp8": (("float", 3, -6), 448.0, True, False),
    "fp8_e4m3_tensor": (("float", 3, -6), 448.0, False, False),
    "fp8_e5m2": (("float", 2, -14), 57344.0, True, False),
    "int8": (("int",), 127.0, True, False),
    "int4": (("int",), 7.0, True, False),
    "fp8_act": (("float", 3, -6), 448.0, True, True),
}
# the contraction (input) axes of each block matrix: the rest are output channels
INPUT_AXES = {"q": (0,), "k": (0,), "v": (0,), "o": (0, 1), "gate": (0,), "up": (0,), "down": (0,)}
E4M3 = ("float", 3, -6)


def round_to_grid(x, grid):
    """x (float64) rounded to the nearest value of `grid`, ties to even."""
    x = np.asarray(x, np.float64)
    if grid[0] == "int":
        return np.round(x)  # numpy rounds half to even
    _, mant, min_exp = grid
    exp = np.floor(np.log2(np.maximum(np.abs(x), 2.0**min_exp)))
    step = 2.0 ** (exp - mant)
    return np.round(x / step) * step


def ref_quantize(w, name, fmt):
    """(codes, scale) of a block matrix by the reference (module docstring), in float64."""
    grid, qmax, per_channel, _ = REFERENCE[fmt]
    w = np.asarray(w, np.float64)
    axes = INPUT_AXES[name] if per_channel else tuple(range(w.ndim))
    amax = np.abs(w).max(axis=axes, keepdims=True)
    scale = np.where(amax > 0, amax / qmax, 1.0)
    return np.clip(round_to_grid(w / scale, grid), -qmax, qmax), scale


def ref_weights(params, fmt):
    """The sampler's weights of `fmt` by the reference: block matrices codes * scale rounded to
    bfloat16 (the dequantized matmul operand), other matrices bfloat16 (float16 for
    "float16"), norm vectors float32. Scales are taken as max|w| * fl(1 / QMAX) in float32, as
    XLA computes a division by a constant (a scale 1 ulp off flips bf16 roundings)."""
    half = ml_dtypes.bfloat16 if fmt != "float16" else np.float16

    def leaf(path, x):
        x = np.asarray(x, np.float32)
        name = getattr(path[-1], "key", None)
        if x.ndim < 2:
            return x
        if fmt in REFERENCE and name in INPUT_AXES:
            grid, qmax, per_channel, _ = REFERENCE[fmt]
            axes = INPUT_AXES[name] if per_channel else tuple(range(x.ndim))
            amax = np.abs(x).max(axis=axes, keepdims=True)
            scale = np.where(amax > 0, amax * np.float32(1 / qmax), 1.0).astype(np.float32)
            codes = np.clip(round_to_grid(x / scale, grid), -qmax, qmax).astype(np.float32)
            x = codes * scale
        return x.astype(half)

    return jax.tree_util.tree_map_with_path(leaf, params)


@pytest.fixture(scope="module")
def params():
    from conftest import tiny_model_cfg

    from ess_jax.model import decoder as model

    cfg = tiny_model_cfg()
    p = jax.tree.map(np.array, jax.device_get(model.init_params(cfg, 7)))
    p["layers"][0]["mlp"]["up"][:, 3] = 0.0  # an all-zero output channel: scale 1, codes 0
    return cfg, p


@pytest.mark.parametrize("fmt", list(REFERENCE))
def test_weight_codes_and_scales_match_the_numpy_reference(params, fmt):
    """Catches: a format rounding to the wrong grid (e5m2 as e4m3, int4 clipped to [-8, 7] or
    scaled by 8), a scale over the wrong axes (per tensor where per channel is meant, o's
    output channel taken as its heads), truncation instead of round-to-nearest, a zero channel
    divided by 0, and the embedding or norms quantized too."""
    cfg, p = params
    q = jax.device_get(precision.prepare_fn(fmt)(p))
    codes_dtype = {"fp8_e5m2": ml_dtypes.float8_e5m2, "int8": np.int8, "int4": ml_dtypes.int4}
    for i, layer in p["layers"].items():
        for block in ("attn", "mlp"):
            for name, w in layer[block].items():
                if name not in INPUT_AXES:
                    continue
                got = q["layers"][i][block][name]
                assert got["codes"].dtype == codes_dtype.get(fmt, ml_dtypes.float8_e4m3fn)
                _, want_scale = ref_quantize(w, name, fmt)
                assert got["scale"].shape == want_scale.shape, (name, got["scale"].shape)
                np.testing.assert_allclose(got["scale"], want_scale, rtol=2.5e-7)
                # the codes of the scale as stored (it may be 1 ulp off max|w| / QMAX)
                grid, qmax = REFERENCE[fmt][:2]
                want_codes = np.clip(round_to_grid(w / got["scale"], grid), -qmax, qmax)
                np.testing.assert_array_equal(got["codes"].astype(np.float64), want_codes)
                if fmt == "int4":
                    assert np.abs(want_codes).max() == 7 and want_codes.min() >= -7
    assert q["embed"].dtype == jnp.bfloat16 and q["final_norm"].dtype == np.float32
    zero = q["layers"][0]["mlp"]["up"]
    assert not zero["codes"][:, 3].astype(np.float32).any()
    if REFERENCE[fmt][2]:  # per channel
        assert zero["scale"][0, 3] == 1.0


def test_16_bit_formats_cast_every_matrix(params):
    """Catches float16 computing in bfloat16 (or on bfloat16 weights) and a 16-bit format
    quantizing the block matrices."""
    cfg, p = params
    for fmt, dtype in (("bfloat16", jnp.bfloat16), ("float16", jnp.float16)):
        q = jax.device_get(precision.prepare_fn(fmt)(p))
        assert q["layers"][1]["attn"]["o"].dtype == dtype and q["embed"].dtype == dtype
        assert q["layers"][1]["attn_norm"].dtype == np.float32
        assert precision.sample_config(cfg, fmt).compute_dtype == dtype
    assert precision.sample_config(cfg, "fp8_act").activation_fp8
    assert not precision.sample_config(cfg, "fp8").activation_fp8


@pytest.mark.parametrize("n_in", [1, 2])
def test_fp8_activations_are_rounded_per_token(n_in):
    """Catches a per-tensor activation scale (a row's rounding would then depend on the other
    rows of the batch), a scale over the wrong axes, and codes that skip the e4m3 grid."""
    rng = np.random.default_rng(0)
    scales = np.float32([1, 30, 1e-3])[:, None, None, None]  # rows of very different sizes
    x = rng.normal(size=(3, 5, 4, 8)).astype(np.float32) * scales
    x[1, 2] = 0.0  # an all-zero token
    codes, scale = jax.device_get(layers.e4m3_quantize(jnp.asarray(x), tuple(range(4 - n_in, 4))))
    axes = tuple(range(4 - n_in, 4))
    amax = np.abs(x.astype(np.float64)).max(axis=axes, keepdims=True)
    want_scale = np.where(amax > 0, amax / 448.0, 1.0)
    np.testing.assert_allclose(scale, want_scale, rtol=2.5e-7)
    want = round_to_grid(x / scale.astype(np.float64), E4M3)
    np.testing.assert_array_equal(codes.astype(np.float64), want)
    out = np.asarray(layers.fp8_activation(jnp.asarray(x, jnp.bfloat16), n_in), np.float32)
    xb = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    codes_b, scale_b = jax.device_get(layers.e4m3_quantize(jnp.asarray(xb), axes))
    np.testing.assert_array_equal(
        out, (codes_b.astype(np.float32) * scale_b).astype(ml_dtypes.bfloat16).astype(np.float32)
    )
    assert not out[1, 2].any()


def test_fp8_kv_cache_writes_codes_and_a_scale_per_token_and_head(params):
    """Catches an fp8 cache scaled per tensor or over the positions instead of the head dim,
    scales written to the wrong positions, and a read that skips the scales; a bfloat16 cache
    of a float32 model must hold bf16-rounded values."""
    cfg, _ = params
    rng = np.random.default_rng(1)
    b, n, t, kd = 2, cfg.num_kv_heads, 3, cfg.head_dim
    k = rng.normal(size=(b, n, t, kd)).astype(np.float32) * 5
    v = rng.normal(size=(b, n, t, kd)).astype(np.float32) / 7
    cache = kv_cache.init_cache(cfg, b, 6, fp8=True)[0]
    new = kv_cache.write(cache, jnp.asarray(k), jnp.asarray(v), 2)
    keys, values = jax.device_get(kv_cache.read(new, jnp.float32))
    for got, x in ((keys.transpose(0, 1, 3, 2), k), (values, v)):
        amax = np.abs(x.astype(np.float64)).max(-1, keepdims=True)
        scale = amax / 448.0
        want = round_to_grid(x / scale, E4M3) * scale
        np.testing.assert_allclose(got[:, :, 2:5], want, rtol=1e-6)
        assert not got[:, :, :2].any() and not got[:, :, 5:].any()
    assert new["k"].dtype == jnp.float8_e4m3fn and new["k_scale"].shape == (b, n, 1, 6)
    grown = kv_cache.grow_layer(new, 9)
    assert grown["v_scale"].shape == (b, n, 9, 1) and kv_cache.cache_length(grown) == 9
    bf = kv_cache.write(kv_cache.init_cache(cfg, b, 6, jnp.bfloat16)[0], k, v, 0)
    np.testing.assert_array_equal(
        np.asarray(kv_cache.read(bf, jnp.float32)[1], np.float32)[:, :, :3],
        v.astype(ml_dtypes.bfloat16).astype(np.float32),
    )


def _log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.mark.parametrize("fmt", ["bfloat16", "float16", *REFERENCE])
def test_one_matrix_toy_log_ratios_have_their_closed_form(fmt):
    """A one-matrix policy pi(y | x) = softmax(x W)[y], W the "up" matrix [D, V] (each vocab
    entry an output channel). The sampler's copy of W is W' (codes * scale), and under fp8_act
    x' = the fp8 rounding of x with its per-row scale, so the log-ratio of token y is, in
    closed form, log pi - log pi_b = (x.W_y - x'.W'_y) - (lse(x W) - lse(x' W')), with W' and
    x' from the float64 reference. Catches a format whose dequantized weights, or fp8_act's
    rounded inputs, differ from the reference's in the way they enter the logits (transposed
    channels, a dropped scale, activations left unrounded)."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(6, 16)).astype(np.float32)
    w = (rng.normal(size=(16, 24)) / 4).astype(np.float32)
    sample = jax.device_get(precision.prepare_fn(fmt)({"up": w}))
    w_b = np.asarray(jax.jit(precision.dequantize)(sample)["up"], np.float32)
    cfg = precision.sample_config(_ToyCfg(), fmt)
    x_in = layers.matmul_input(jnp.asarray(x, cfg.compute_dtype), cfg.activation_fp8)
    logits_b = np.asarray(x_in, np.float64) @ w_b.astype(np.float64)
    got = _log_softmax(x.astype(np.float64) @ w) - _log_softmax(logits_b)

    want_w = ref_weights({"up": w}, fmt)["up"].astype(np.float64)
    x_ref = x.astype(ml_dtypes.bfloat16 if fmt != "float16" else np.float16).astype(np.float64)
    if REFERENCE.get(fmt, (0, 0, 0, False))[3]:
        amax = np.abs(x_ref).max(-1, keepdims=True).astype(np.float32)
        a_scale = (amax * np.float32(1 / 448)).astype(np.float64)  # as XLA divides by 448
        x_ref = round_to_grid(x_ref / a_scale, E4M3) * a_scale
        x_ref = x_ref.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    z, z_b = x.astype(np.float64) @ w, x_ref @ want_w
    lse = lambda a: np.log(np.exp(a - a.max(-1, keepdims=True)).sum(-1)) + a.max(-1)  # noqa: E731
    want = (z - z_b) - (lse(z) - lse(z_b))[:, None]
    np.testing.assert_allclose(got, want, atol=2e-6)
    assert np.abs(want).max() > 1e-4  # the format really rounds something


class _ToyCfg:
    """Just enough of a ModelConfig for precision.sample_config."""

    dtype, activation_fp8 = "float32", False

    def replace(self, **kw):
        out = _ToyCfg()
        out.__dict__.update(kw)
        out.compute_dtype = jnp.dtype(out.dtype)
        return out

"""`model.attention_impl`: the several-query forwards through jax.nn.dot_product_attention
(layers.fused_attention) give layers.attention's numbers, and the settings that cannot run
are refused by name. "xla" is the CPU-testable twin of "cudnn" (same call, same layouts, mask
and head grouping; only jax's `implementation` argument differs), whose speed and numbers
are a GPU run's to measure (bench/gpu.py, section train_fused)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model_cfg

from configs import quickstart
from ess_jax.config import schema as config_checks
from ess_jax.config.schema import ConfigError
from ess_jax.model import decoder as model
from ess_jax.model import layers, scoring
from ess_jax.rl import experiment
from ess_jax.sampling import sampler

# GQA with 2 query heads per kv head and Qwen2's q/k/v biases: a wrong head grouping or a
# dropped bias changes the numbers
CFG = tiny_model_cfg(qkv_bias=True, family="qwen2")


def _batch(seed):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 96, (3, 21)), jnp.int32)
    # left pads (fully masked query rows), a right-padded row, a full row
    mask = jnp.ones((3, 21), bool).at[0, :5].set(False).at[2, 17:].set(False)
    return rng, tokens, mask


def _random_qkv_biases(params, seed):
    """init_params zeroes the q/k/v biases; random ones make a dropped bias visible."""
    rng = np.random.default_rng(seed)

    def fill(path, x):
        name = jax.tree_util.keystr(path)
        if name.endswith("_bias']"):
            return jnp.asarray(rng.normal(size=x.shape), x.dtype)
        return x

    return jax.tree_util.tree_map_with_path(fill, params)


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-6), ("bfloat16", 3e-2)])
def test_xla_fused_attention_matches_einsum_log_probs_and_gradients(dtype, tol):
    """Catches, in fused_attention: query heads grouped with the wrong kv head (n * g + j vs
    j * n + g), the causal or padding mask transposed or dropped, keys not moved to jax's
    [B, S, N, K] layout, the odd-length padding (T = 21 here) leaking weight, and pad query
    rows turning NaN (their gradients would poison every weight). Float32 agrees to rounding;
    bfloat16 to its own rounding. Compared: the log-probs predicted from real positions (the
    first real token of a left-padded row is predicted from a pad position, whose output
    differs between the paths by design: fused_attention's docstring) and every gradient."""
    cfg = CFG.replace(dtype=dtype)
    params = _random_qkv_biases(model.init_params(cfg, 0), 1)
    rng, tokens, mask = _batch(0)
    fused = cfg.replace(attention_impl="xla")

    lp = jax.jit(lambda p: scoring.token_logprobs(cfg, p, tokens, mask))(params)
    lp_f = jax.jit(lambda p: scoring.token_logprobs(fused, p, tokens, mask))(params)
    assert np.isfinite(np.asarray(lp_f)).all()
    from_real = jnp.pad(mask[:, :-1], ((0, 0), (1, 0)))  # position t - 1 is a real token
    np.testing.assert_allclose(lp_f * from_real, lp * from_real, rtol=tol, atol=tol)
    assert float(jnp.abs(lp * from_real).sum()) > 1.0  # not vacuous

    w = jnp.asarray(rng.normal(size=tokens.shape), jnp.float32) * from_real
    loss = lambda c: lambda p: jnp.sum(w * scoring.token_logprobs(c, p, tokens, mask))
    g = jax.jit(jax.grad(loss(cfg)))(params)
    g_f = jax.jit(jax.grad(loss(fused)))(params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_f)):
        assert np.isfinite(np.asarray(b)).all()
        scale = max(1.0, float(jnp.abs(a).max()))
        np.testing.assert_allclose(b, a, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("t,causal", [(6, False), (7, True), (7, False)])
def test_fused_attention_layer_against_float64_numpy(t, causal):
    """The layer alone against a float64 numpy softmax attention written from the definition
    (causal, key padding, GQA), so both paths are not only equal to each other; odd T takes
    the padded path, `causal` jax's is_causal."""
    rng = np.random.default_rng(3)
    b, n, g, kd = 2, 2, 2, 4
    q = rng.normal(size=(b, t, n, g, kd))
    k = rng.normal(size=(b, n, t, kd))
    v = rng.normal(size=(b, n, t, kd))
    kv_mask = np.ones((b, t), bool)
    kv_mask[1, :2] = False
    out = layers.fused_attention(
        *(jnp.asarray(x, jnp.float32) for x in (q, k, v)),
        jnp.asarray(kv_mask),
        jnp.arange(t),
        "xla",
        causal,
    )
    want = np.zeros_like(q)
    for bi in range(b):
        for i in range(t):
            keys = [s for s in range(i + 1) if kv_mask[bi, s]]
            if not keys:
                continue  # a pad query: any finite value
            for ni in range(n):
                for gi in range(g):
                    s = np.array([q[bi, i, ni, gi] @ k[bi, ni, j] for j in keys]) / np.sqrt(kd)
                    p = np.exp(s - s.max())
                    want[bi, i, ni, gi] = (p / p.sum()) @ v[bi, ni, keys]
    out = np.asarray(out)
    assert np.isfinite(out).all()
    real = kv_mask[:, :, None, None, None].repeat(n, 2).repeat(g, 3).repeat(kd, 4)
    np.testing.assert_allclose(out[real], want[real], rtol=1e-5, atol=1e-5)


def test_sampler_prefill_through_fused_attention_draws_the_same_tokens():
    """The sampler's prefill (keys read back from the cache after the write, attended over the
    prompt only) through the fused path: same tokens and behaviour log-probs as einsum's.
    Decode steps keep the one-query path, so a difference would come from the prefill (a
    causal mask dropped in fused_attention, planted, fails here too)."""
    params = _random_qkv_biases(model.init_params(CFG, 1), 2)
    rng = np.random.default_rng(1)
    prompts = rng.integers(3, 96, (2, 20)).astype(np.int32)
    mask = np.ones((2, 20), bool)
    mask[0, :6] = False
    sc = sampler.SamplingConfig(max_new_tokens=6, num_samples=2, stop_ids=())
    key = jax.random.key(0)
    a = sampler.sample(CFG, params, prompts, mask, sc, key)
    b = sampler.sample(CFG.replace(attention_impl="xla"), params, prompts, mask, sc, key)
    np.testing.assert_array_equal(b.tokens, a.tokens)
    np.testing.assert_allclose(b.behaviour_logp, a.behaviour_logp, atol=1e-5)
    assert float(np.abs(np.asarray(a.behaviour_logp)).sum()) > 0


def test_unknown_attention_impl_is_refused_by_name():
    """A misspelt implementation silently running the einsum path would make a GPU bench of
    'flash' measure the default."""
    with pytest.raises(ValueError, match=r"attention_impl: unknown 'flash'; one of einsum"):
        CFG.replace(attention_impl="flash")
    c = quickstart.get_config("tiny")
    c.model.attention_impl = "flash"
    with pytest.raises(ConfigError, match=r"^config\.model\.attention_impl: must be one of"):
        config_checks.check(c)


def test_cudnn_is_refused_off_the_gpu_and_in_float32(monkeypatch):
    """cuDNN's kernel exists on NVIDIA GPUs only and has no float32: a run asking for it on
    the CPU must say so before compiling, not fail inside XLA; in float32 on a GPU it would
    silently run the einsum path for the whole run."""
    c = quickstart.get_config("tiny")
    c.model.attention_impl = "cudnn"
    c.model.dtype = "bfloat16"
    msg = r"^config\.model\.attention_impl: 'cudnn' runs on NVIDIA GPUs only; this run's backend"
    with pytest.raises(ConfigError, match=msg + r" is 'cpu'"):
        experiment.validate(c)
    monkeypatch.setattr(experiment.jax, "default_backend", lambda: "gpu")
    experiment.validate(c)  # bfloat16 on a GPU: accepted
    c.model.dtype = "float32"
    with pytest.raises(ConfigError, match=r"'cudnn' needs model.dtype 'bfloat16', got 'float32'"):
        experiment.validate(c)


def test_setting_reaches_the_model_from_embedded_and_checkpoint_sources(tmp_path):
    """Catches model.attention_impl dropped on one of load_policy's two paths (the embedded
    model's constructor, or the replace after loading a checkpoint): the run would silently
    use the einsum attention."""
    from ess_jax.io import weights

    m = quickstart.get_config("tiny").model
    m.attention_impl = "xla"
    cfg, params, _ = experiment.load_policy(m)
    assert cfg.attention_impl == "xla"
    weights.save_hf(cfg.replace(attention_impl="einsum"), params, str(tmp_path / "hf"))
    m.source = str(tmp_path / "hf")
    loaded, _, _ = experiment.load_policy(m, need_tokenizer=False)
    assert loaded.attention_impl == "xla"


def test_mask_goes_to_jax_as_a_boolean_mask_not_a_float_bias(monkeypatch):
    """Catches the mask handed to jax.nn.dot_product_attention as a float `bias`: from jax 0.11
    on (the GPU machine's), cuDNN's backward then computes and writes a [B, 1, T, S] bias
    gradient that nobody reads; for a boolean `mask` it skips it (jax's
    cudnn.fused_attention_stablehlo: `bias_is_differentiable`). No GPU here, so the call itself
    is checked: a boolean mask, no bias, the odd-length padding masked for every query, and
    `is_causal` set (dropped, the mask alone keeps the numbers, but the kernel loses its skip
    of the blocks above the diagonal)."""
    calls = []
    real = jax.nn.dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    rng = np.random.default_rng(5)
    t = 7  # odd: one padded query and key
    q, k, v = (
        jnp.asarray(rng.normal(size=s), jnp.float32)
        for s in ((1, t, 2, 2, 4), (1, 2, t, 4), (1, 2, t, 4))
    )
    kv_mask = jnp.ones((1, t), bool).at[0, :2].set(False)
    jax.grad(lambda q: layers.fused_attention(q, k, v, kv_mask, jnp.arange(t), "xla", True).sum())(
        q
    )
    assert calls and all(c.get("bias") is None for c in calls)
    assert calls[0]["is_causal"] is True  # the kernel may skip blocks above the diagonal
    mask = calls[0]["mask"]
    assert mask.dtype == jnp.bool_ and mask.shape == (1, 1, t + 1, t + 1)
    assert not np.asarray(mask)[..., t, :].any() and not np.asarray(mask)[..., :, t].any()
    assert np.asarray(mask)[0, 0, 3, :4].tolist() == [False, False, True, True]  # pads, causal


def test_cudnn_training_forward_and_backward_lower_for_cuda(monkeypatch):
    """No GPU here, but jax lowers a CUDA program on the CPU: the gradient of the log-probs
    with attention_impl "cudnn" must lower to one cuDNN attention call forward and one backward
    per layer. Catches, before a GPU run pays for it: the odd-length padding dropped (jax then
    refuses "Unsupported sequence length Q 21" for a masked training kernel), a layout or head
    size that jax's cuDNN checks refuse, a training forward that silently keeps the einsum
    path, and the causal mask type lost. cuDNN's version check is stubbed: it only asks that
    cuDNN be installed. Whether cuDNN itself accepts the graph is decided when XLA compiles on
    a GPU."""
    import re

    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 90100)
    cfg = CFG.replace(dtype="bfloat16", head_dim=16, attention_impl="cudnn")
    params = model.init_params(cfg, 0)
    _, tokens, mask = _batch(0)  # T = 21, left pads
    grad = jax.jit(jax.grad(lambda p: scoring.token_logprobs(cfg, p, tokens, mask).sum()))
    text = grad.trace(params).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @__cudnn\$(\w+)", text)
    assert sorted(calls) == ["fmhaScaleBiasSoftmax"] * 2 + ["fmhaScaleBiasSoftmaxBackward"] * 2
    assert text.count("mask_type\\22: \\22CAUSAL\\22") == 4

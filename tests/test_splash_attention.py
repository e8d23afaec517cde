"""`model.attention_impl = "splash"` (ess_jax/model/splash.py): jax's Pallas splash kernel gives
the einsum path's numbers (layers.attention, and a float64 numpy attention) with left pads,
packed segments and GQA, in float32 and bfloat16; it compiles for a TPU slice; a run off a TPU
is refused. The kernel runs in Pallas interpret mode on this CPU (`splash.INTERPRET`, set here
only); the TPU compile checks that the real kernel lowers.

Tolerances. float32: the kernel and the einsum path differ in summation order only (measured
max abs error 5e-7 forward, 2e-6 on gradients of size ~5; log-probs 1e-6): 1e-5. bfloat16
(8-bit mantissa, one ulp = 2**-7 relative): the kernel rounds q / sqrt(K) to bfloat16 and keeps
its probabilities in float32, the einsum path rounds the probabilities instead, so the two differ
by about one rounding of the output (measured 0.008 forward, 0.016 on gradients of size ~5 at
the layer; 0.015 on log-probs, 2% of the largest gradient through a one-layer model). Each
bfloat16 check also asks that the kernel be no further from the float64 (layer) or float32
(model) numbers than 2x the einsum path's own bfloat16 error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model_cfg
from jax.sharding import NamedSharding, PartitionSpec

from configs import quickstart
from ess_jax.config.schema import ConfigError
from ess_jax.model import decoder as model
from ess_jax.model import layers, scoring, splash
from ess_jax.parallel import sharding
from ess_jax.rl import experiment

B, T, N, G, K = 2, 21, 2, 2, 8  # T: not a multiple of 128, so the wrapper pads
# row 0: 5 left pads (segment 0) then a prompt + response (1); row 1: two packed sequences
SEG = np.ones((B, T), np.int32)
SEG[0, :5] = 0
SEG[1, 10:] = 2
REAL = np.broadcast_to((SEG > 0)[:, :, None, None, None], (B, T, N, G, K))


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setattr(splash, "INTERPRET", True)


def _float64_attention(q, k, v, seg):
    """Causal softmax attention within segments, written from the definition: query t of row b
    sees key s <= t with seg[b, s] == seg[b, t]; query head (n, g) uses kv head n."""
    out = np.zeros_like(q)
    for b in range(q.shape[0]):
        for t in range(q.shape[1]):
            keys = [s for s in range(t + 1) if seg[b, s] == seg[b, t]]
            for n in range(q.shape[2]):
                scores = q[b, t, n] @ k[b, n, keys].T / np.sqrt(q.shape[-1])  # [G, keys]
                p = np.exp(scores - scores.max(-1, keepdims=True))
                out[b, t, n] = (p / p.sum(-1, keepdims=True)) @ v[b, n, keys]
    return out


def _einsum_attention(q, k, v):
    """layers.attention on SEG's rows: row 0 with its key mask, row 1's two sequences each
    on its own (positions restarting at 0), concatenated."""

    def causal(q, k, v, mask):
        return layers.attention(q, k, v, jnp.asarray(mask), jnp.arange(q.shape[1]), 0, 0)

    row0 = causal(q[:1], k[:1], v[:1], SEG[:1] > 0)
    first, second = (
        causal(q[1:, a:z], k[1:, :, a:z], v[1:, :, a:z], np.ones((1, z - a), bool))
        for a, z in ((0, 10), (10, T))
    )
    return jnp.concatenate([row0, jnp.concatenate([first, second], 1)], 0)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2**-6)])
def test_layer_matches_einsum_and_float64_with_left_pads_packed_rows_and_gqa(dtype, tol):
    """Catches, in splash.splash_attention: query heads grouped with the wrong kv head (n * g
    + j vs j * n + g), the 1 / sqrt(K) scale dropped or applied twice, a left pad seen by a
    real query (segments not passed), packed sequences attending to each other, the padding to
    128 leaking weight or not sliced off, the causal mask dropped, and a wrong gradient of q, k
    or v (the kernel's backward, and the bfloat16 custom_vjp around it)."""
    rng = np.random.default_rng(0)
    q64, k64, v64 = (rng.normal(size=s) for s in ((B, T, N, G, K), (B, N, T, K), (B, N, T, K)))
    q, k, v = (jnp.asarray(x, dtype) for x in (q64, k64, v64))
    w = jnp.asarray(rng.normal(size=q.shape) * REAL, jnp.float32)  # pad queries unread
    seg = jnp.asarray(SEG)

    def value_and_grads(attend):
        def loss(q, k, v):
            out = attend(q, k, v).astype(jnp.float32)
            return jnp.sum(w * out), out

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    grads, out = value_and_grads(lambda q, k, v: splash.splash_attention(q, k, v, seg))
    grads_e, out_e = value_and_grads(_einsum_attention)
    out, out_e = np.asarray(out), np.asarray(out_e)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[REAL], out_e[REAL], rtol=tol, atol=tol)
    want = _float64_attention(q64, k64, v64, SEG)
    err, err_e = (np.abs(x - want)[REAL].max() for x in (out, out_e))
    assert err <= (1e-6 if dtype == "float32" else 2 * err_e), (err, err_e)
    # not vacuous: attending across the packed rows' boundary changes the output by > 0.1
    crossed = _float64_attention(q64, k64, v64, (SEG > 0).astype(int))
    assert np.abs(crossed - want)[1, 10:].max() > 0.1
    for g, g_e in zip(grads, grads_e):
        g, g_e = np.asarray(g, np.float32), np.asarray(g_e, np.float32)
        assert np.isfinite(g).all() and np.abs(g_e).max() > 0.5
        np.testing.assert_allclose(g, g_e, rtol=tol, atol=tol * np.abs(g_e).max())


def _model_batch():
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 96, (4, T)), jnp.int32)
    # left pads, a right-padded row, full rows
    mask = jnp.ones((4, T), bool).at[0, :5].set(False).at[2, 17:].set(False)
    from_real = jnp.pad(mask[:, :-1], ((0, 0), (1, 0)))  # position t - 1 is a real token
    w = jnp.asarray(rng.normal(size=tokens.shape), jnp.float32) * from_real
    return tokens, mask, from_real, w


def _logprobs_and_grads(cfg, params, tokens, mask, w, mesh=None):
    def loss(p):
        lp = scoring.token_logprobs(cfg, p, tokens, mask)
        return jnp.sum(w * lp), lp

    f = jax.grad(loss, has_aux=True)
    g, lp = jax.jit(f if mesh is None else sharding.under_mesh(f, mesh))(params)
    return lp, g


# GQA (4 query heads, 2 kv heads) with Qwen2's q/k/v biases; one layer keeps interpret mode cheap
CFG = tiny_model_cfg(qkv_bias=True, family="qwen2", num_layers=1)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2**-5)])
def test_model_log_probs_and_gradients_match_einsum(dtype, tol):
    """Catches the decoder not sending its full-sequence forward through the kernel with its
    key mask as segment ids (a left pad attended), pad query rows turning NaN (their gradients
    would poison every weight), and a kernel less accurate in bfloat16 than the einsum path.
    Compared: the log-probs predicted from real positions (a pad position's output differs by
    design: splash.py) and every parameter gradient, against the einsum model's."""
    cfg = CFG.replace(dtype=dtype)
    params = model.init_params(cfg, 0)
    tokens, mask, from_real, w = _model_batch()
    lp, g = _logprobs_and_grads(cfg, params, tokens, mask, w)
    lp_s, g_s = _logprobs_and_grads(cfg.replace(attention_impl="splash"), params, tokens, mask, w)
    assert np.isfinite(np.asarray(lp_s)).all()
    np.testing.assert_allclose(lp_s * from_real, lp * from_real, rtol=tol, atol=tol)
    assert float(jnp.abs(lp * from_real).sum()) > 1.0  # not vacuous
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_s)):
        assert np.isfinite(np.asarray(b)).all()
        np.testing.assert_allclose(b, a, rtol=tol, atol=tol * float(jnp.abs(a).max()))
    if dtype == "bfloat16":  # as close to the float32 model as the einsum path in bfloat16
        lp32, _ = _logprobs_and_grads(CFG, params, tokens, mask, w)
        err, err_e = (float(jnp.abs((x - lp32) * from_real).max()) for x in (lp_s, lp))
        assert err <= 2 * err_e, (err, err_e)


def test_under_a_mesh_rows_and_heads_sharded():
    """Catches the kernel's shard_map taking the wrong specs (rows over fsdp, heads over
    tensor): a kv head sent with another device's query heads, rows mixed up, or a crash.
    Float32, params and batch on a {fsdp 2, tensor 2} mesh of the fake CPU devices."""
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2}, jax.devices()[:4])
    params = jax.device_put(model.init_params(CFG, 0), model.param_shardings(CFG, mesh))
    tokens, mask, from_real, w = (
        jax.device_put(x, sharding.batch_sharding(mesh)) for x in _model_batch()
    )
    lp, g = _logprobs_and_grads(CFG, params, tokens, mask, w, mesh)
    cfg = CFG.replace(attention_impl="splash")
    lp_s, g_s = _logprobs_and_grads(cfg, params, tokens, mask, w, mesh)
    np.testing.assert_allclose(lp_s * from_real, lp * from_real, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_s)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(jnp.abs(a).max()))


def test_forward_and_backward_compile_for_tpu(monkeypatch):
    """The real kernel (not interpret mode) lowered and compiled by libtpu for v5e:2x2, the
    one-layer model's bfloat16 log-probs and their gradient, rows sharded over fsdp and heads
    over tensor. Catches a kernel call that does not lower for TPU (a block shape Mosaic
    refuses, a bfloat16 product at the tests' "highest" matmul precision: "Bad lhs type"), one
    GSPMD must partition ("Mosaic kernels cannot be automatically partitioned": the shard_map
    dropped), and a kernel that gathers the batch (collectives beyond the einsum program's).
    One Mosaic call per layer forward; the backward adds the dq and dkv kernels."""
    from ess_jax.memory import tpu

    monkeypatch.setattr(splash, "INTERPRET", False)
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2}, tpu.topology_devices("v5e:2x2"))
    rows = NamedSharding(mesh, PartitionSpec(sharding.BATCH, None))
    tokens = jax.ShapeDtypeStruct((4, T), jnp.int32, sharding=rows)
    mask = jax.ShapeDtypeStruct((4, T), jnp.bool_, sharding=rows)
    compiled = {}
    for impl in ("einsum", "splash"):
        cfg = CFG.replace(dtype="bfloat16", attention_impl=impl)
        params = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            model.abstract_params(cfg),
            model.param_shardings(cfg, mesh),
        )
        fwd = lambda p, t, m, cfg=cfg: scoring.token_logprobs(cfg, p, t, m)
        grad = jax.grad(lambda p, t, m, cfg=cfg: jnp.sum(scoring.token_logprobs(cfg, p, t, m)))
        for name, f in (("forward", fwd), ("gradient", grad)):
            c = jax.jit(sharding.under_mesh(f, mesh)).lower(params, tokens, mask).compile()
            compiled[impl, name] = c.as_text()
    for name, calls in (("forward", 1), ("gradient", 3)):
        text = compiled["splash", name]
        assert text.count("tpu_custom_call") == calls, name
        assert "tpu_custom_call" not in compiled["einsum", name]
        splash_coll = tpu.collective_bytes(text)
        einsum_coll = tpu.collective_bytes(compiled["einsum", name])
        assert all(v <= einsum_coll.get(kind, 0) for kind, v in splash_coll.items()), name


def test_splash_is_refused_off_the_tpu_and_in_float16(monkeypatch):
    """The kernel lowers for TPUs only: a run asking for it on the CPU (or a GPU) must say so
    in one line before compiling, not fail inside Mosaic; in float16 (no TPU kernel) it must
    be refused, not fall back to einsum for the whole run."""
    c = quickstart.get_config("tiny")
    c.model.attention_impl = "splash"
    msg = r"^config\.model\.attention_impl: 'splash' runs on TPUs only; this run's backend"
    with pytest.raises(ConfigError, match=msg + r" is 'cpu' \(use 'einsum'\)$"):
        experiment.validate(c)
    monkeypatch.setattr(experiment.jax, "default_backend", lambda: "tpu")
    for dtype in ("float32", "bfloat16"):
        c.model.dtype = dtype
        experiment.validate(c)  # on a TPU: accepted
    c.model.dtype = "float16"
    with pytest.raises(ConfigError, match=r"'splash' needs model.dtype float32 / bfloat16"):
        experiment.validate(c)

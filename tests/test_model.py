"""The NNX decoder against Hugging Face PyTorch, and its own invariants (causality, jit,
sharding, KV cache, bfloat16)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ess_jax.io import weights
from ess_jax.model import decoder as model
from ess_jax.model import kv_cache, scoring
from ess_jax.parallel import sharding

TOL = 1e-4  # float32 max abs logit difference allowed against PyTorch

# family, tied embeddings, extra HF config
CASES = {
    "llama": (
        "llama",
        False,
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 50000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    "llama_tied": ("llama", True, {}),
    "qwen2": ("qwen2", False, {}),
    "qwen2_tied": ("qwen2", True, {}),
    "qwen3": ("qwen3", True, {}),
}


def _hf_model(family, tied, extra, seed=0):
    """A tiny random HF PyTorch model with weights large enough to make logits non-trivial."""
    torch = pytest.importorskip("torch")
    import transformers

    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[family]
    hf_cfg = cls(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        attn_implementation="eager",
        **extra,
    )
    torch.manual_seed(seed)
    m = getattr(transformers, cls.__name__.replace("Config", "ForCausalLM"))(hf_cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[-1]))
    return m


def torch_logits(m, tokens, mask=None):
    import torch

    kw = {}
    if mask is not None:
        kw["attention_mask"] = torch.tensor(np.asarray(mask), dtype=torch.long)
        kw["position_ids"] = torch.tensor(np.asarray(model.positions_from_mask(mask)))
    with torch.no_grad():
        return m(torch.tensor(np.asarray(tokens)), **kw).logits.numpy()


_apply = jax.jit(model.apply, static_argnums=0)


def random_tokens(vocab, b=2, t=12, seed=0):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab)


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_hf_torch(case, tmp_path):
    import torch
    import transformers

    family, tied, extra = CASES[case]
    m = _hf_model(family, tied, extra)
    m.save_pretrained(tmp_path / "hf")
    cfg, params = weights.load_hf(tmp_path / "hf")
    assert (cfg.family, cfg.tie_embeddings) == (family, tied)
    assert ("lm_head" in params) != tied

    tokens = random_tokens(cfg.vocab_size)
    ref = torch_logits(m, tokens)
    apply = _apply
    logits = apply(cfg, params, tokens)
    assert logits.dtype == jnp.float32
    diff = max_diff(logits, ref)
    print(f"{case}: max |logits - torch| = {diff:.2e}")
    assert diff <= TOL

    # left padding: our positions_from_mask == HF position_ids; only real tokens compared
    mask = jnp.ones(tokens.shape, bool).at[1, :3].set(False)
    ref_pad = torch_logits(m, tokens, mask)
    got_pad = apply(cfg, params, tokens, mask)
    assert max_diff(got_pad[1, 3:], ref_pad[1, 3:]) <= TOL

    # per-token log-probs agree with torch's log_softmax
    lp = scoring.token_logprobs(cfg, params, tokens)
    ref_lp = torch.log_softmax(torch.tensor(ref[:, :-1]), -1).numpy()
    ref_lp = np.take_along_axis(ref_lp, np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    assert max_diff(lp[:, 1:], ref_lp) <= TOL and np.all(np.asarray(lp[:, 0]) == 0)
    # scored from a prompt width on (the RL step's LM head skips the prompt), left-padded
    lp_s = scoring.token_logprobs(cfg, params, tokens, mask, start=4)
    ref_s = torch.log_softmax(torch.tensor(ref_pad[:, 3:-1]), -1).numpy()
    ref_s = np.take_along_axis(ref_s, np.asarray(tokens)[:, 4:, None], -1)[..., 0]
    assert max_diff(lp_s, ref_s) <= TOL

    # save_hf -> load_hf round trip is exact; torch loads our files and agrees
    weights.save_hf(cfg, params, tmp_path / "ours")
    cfg2, params2 = weights.load_hf(tmp_path / "ours")
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)
    assert max_diff(apply(cfg2, params2, tokens), ref) <= TOL
    m2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(m2) is type(m)
    assert max_diff(torch_logits(m2, tokens), ref) <= TOL


@pytest.fixture(scope="module")
def tiny():
    cfg = model.ModelConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        qkv_bias=True,
        qk_norm=True,
        family="custom",
    )
    # numpy init (no per-op dispatch); norms and biases non-trivial so every path matters
    rng = np.random.default_rng(0)

    def init(path, x):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            return jnp.asarray(1 + 0.1 * rng.standard_normal(x.shape), jnp.float32)
        scale = 1.0 if "embed" in name else 0.1 if "bias" in name else x.shape[0] ** -0.5
        return jnp.asarray(scale * rng.standard_normal(x.shape), jnp.float32)

    return cfg, jax.tree_util.tree_map_with_path(init, model.abstract_params(cfg))


def test_causality(tiny):
    cfg, params = tiny
    tokens = random_tokens(cfg.vocab_size, t=10)
    changed = tokens.at[:, 6].set((tokens[:, 6] + 1) % cfg.vocab_size)
    a, b = _apply(cfg, params, tokens), _apply(cfg, params, changed)
    np.testing.assert_allclose(a[:, :6], b[:, :6], atol=1e-6, rtol=0)
    assert max_diff(a[:, 6:], b[:, 6:]) > 1e-3


def test_jit_equals_no_jit(tiny):
    cfg, params = tiny
    tokens = random_tokens(cfg.vocab_size)
    eager = model.apply(cfg, params, tokens)
    jitted = _apply(cfg, params, tokens)
    np.testing.assert_allclose(jitted, eager, atol=1e-5, rtol=1e-5)


def test_sharded_forward_equals_single_device(tiny):
    cfg, params = tiny
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    shardings = model.param_shardings(cfg, mesh, "train")
    sharded_params = jax.device_put(params, shardings)
    assert sharded_params["layers"][0]["mlp"]["gate"].sharding.spec == jax.P("fsdp", "tensor")
    tokens = random_tokens(cfg.vocab_size, b=4)
    mask = jnp.ones(tokens.shape, bool).at[1, :2].set(False)
    batch = sharding.shard_batch({"tokens": tokens, "mask": mask}, mesh)
    assert len(batch["tokens"].sharding.device_set) == 8
    with jax.set_mesh(mesh):
        got = _apply(cfg, sharded_params, batch["tokens"], batch["mask"])
    want = _apply(cfg, params, tokens, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_row_axes_split_rows_only_where_the_data_parallel_ranks_divide_them():
    """Catches rows split over the data-parallel axes when their ranks do not divide the rows
    (a sharding constraint or shard_map that cannot place a batch of 2 on 4 ranks), over an
    axis of one rank or over "tensor" (which splits heads, not rows): the one rule the
    decoder's activations, the splash kernel and the grouped experts split rows by."""
    axes = ("data", "fsdp", "tensor", "expert")
    mesh = lambda *shape: jax.sharding.AbstractMesh(shape, axes)
    assert sharding.row_axes(mesh(2, 2, 2, 1), 8) == ("data", "fsdp")
    assert sharding.row_axes(mesh(2, 2, 2, 1), 2) == ()
    assert sharding.row_axes(mesh(1, 4, 2, 2), 16) == ("fsdp", "expert")
    assert sharding.row_axes(mesh(1, 1, 8, 1), 8) == ()
    assert sharding.row_axes(mesh(1, 1, 1, 1), 3) == ()


def test_kv_cache_decode_matches_full_forward(tiny):
    cfg, params = tiny
    b, t, prompt = 3, 12, 5
    tokens = random_tokens(cfg.vocab_size, b=b, t=t)
    # row 1 and 2 are left-padded (2 and 4 pads), as a batch of prompts would be
    mask = jnp.ones((b, t), bool).at[1, :2].set(False).at[2, :4].set(False)
    positions = model.positions_from_mask(mask)
    full = _apply(cfg, params, tokens, mask)

    step = jax.jit(model.forward, static_argnums=0)
    cache = kv_cache.init_cache(cfg, b, t)
    logits, cache = step(cfg, params, tokens[:, :prompt], positions[:, :prompt], mask, cache, 0)
    outs = [logits]
    for i in range(prompt, t):  # one token at a time, teacher forced
        logits, cache = step(
            cfg, params, tokens[:, i : i + 1], positions[:, i : i + 1], mask, cache, i
        )
        outs.append(logits)
    decoded = jnp.concatenate(outs, axis=1)
    real = np.asarray(mask)
    assert np.isfinite(np.asarray(decoded)).all()
    np.testing.assert_allclose(
        np.asarray(decoded)[real], np.asarray(full)[real], atol=1e-5, rtol=1e-5
    )


def test_bfloat16_compute_is_close_not_identical(tiny):
    cfg, params = tiny
    tokens = random_tokens(cfg.vocab_size)
    f32 = _apply(cfg, params, tokens)
    bf16 = _apply(cfg.replace(dtype="bfloat16"), params, tokens)
    assert bf16.dtype == jnp.float32  # logits always float32
    diff, scale = max_diff(bf16, f32), float(jnp.max(jnp.abs(f32)))
    print(f"bf16 vs f32: max diff {diff:.3e}, logit scale {scale:.2f}")
    assert 0 < diff < 0.05 * scale
    # same greedy choice almost everywhere
    assert float(jnp.mean(jnp.argmax(bf16, -1) == jnp.argmax(f32, -1))) > 0.9


def test_dense_is_the_einsum_in_float64_and_checks_shapes():
    """layers.dense merges the leading axes (and, with n_in=2, the contracted ones) into one
    2-D matmul. Catches a wrong merge order (e.g. heads and head_dim swapped when flattening
    the o-projection [H, K, D]), a dropped leading axis, and mismatched weights passing
    silently: compared with a float64 numpy einsum on every shape the model uses."""
    from ess_jax.model.layers import dense

    rng = np.random.default_rng(0)
    x3 = rng.normal(size=(2, 5, 6))
    w_dhk = rng.normal(size=(6, 3, 4))
    x4 = rng.normal(size=(2, 5, 3, 4))
    w_hkd = rng.normal(size=(3, 4, 6))
    cases = [
        (
            dense(jnp.asarray(x3, jnp.float32), jnp.asarray(w_dhk, jnp.float32)),
            np.einsum("btd,dhk->bthk", x3, w_dhk),
        ),
        (
            dense(jnp.asarray(x4, jnp.float32), jnp.asarray(w_hkd, jnp.float32), n_in=2),
            np.einsum("bthk,hkd->btd", x4, w_hkd),
        ),
        (
            dense(
                jnp.asarray(x3, jnp.float32),
                jnp.asarray(w_dhk[:, 0], jnp.float32),
                out_dtype=jnp.float32,
            ),
            np.einsum("btd,dk->btk", x3, w_dhk[:, 0]),
        ),
    ]
    for got, want in cases:
        assert got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not match"):
        dense(jnp.zeros((2, 5, 7)), jnp.zeros((6, 3)))


def _attention_f64(q, k, v, kv_mask, query_idx):
    """Causal masked softmax attention in float64 numpy: q [B, T, N, G, K], k/v [B, N, S, K]."""
    scores = np.einsum("btngk,bnsk->bngts", q, k) / np.sqrt(q.shape[-1])
    allowed = (np.arange(k.shape[2])[None, :] <= query_idx[:, None])[None] & kv_mask[:, None]
    scores = np.where(allowed[:, None, None], scores, -np.inf)
    with np.errstate(invalid="ignore"):  # rows that see no key: NaN, never compared
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
    return np.einsum("bngts,bnsk->btngk", p, v)


@pytest.mark.parametrize(
    "t,offset,chunk",
    [(130, 0, 0), (256, 0, 0), (200, 37, 0), (130, 0, 48), (100, 0, 0)],
    ids=["3-uneven-blocks", "4-blocks", "offset-37", "chunked", "one-block"],
)
def test_attention_causal_blocks_in_float64(t, offset, chunk):
    """layers.attention with a static query offset splits the queries into causal blocks, each
    over the keys up to its last query. Catches a block that drops keys its queries may see (an
    off-by-one at the block's end, the offset ignored), a block whose outputs land at the wrong
    rows, and a wrong gradient through the blocks: output and gradients against a float64
    numpy reference and against one unblocked call, with left-padded rows."""
    from ess_jax.model import layers

    rng = np.random.default_rng(t + offset)
    b, n, g, k, s = 2, 2, 2, 8, offset + t + 5  # 5 keys past the last query: always masked
    q = rng.normal(size=(b, t, n, g, k))
    keys, vals = rng.normal(size=(2, b, n, s, k))
    kv_mask = np.ones((b, s), bool)
    kv_mask[1, : offset + 9] = False  # a left-padded row: its first queries see no key
    idx = offset + np.arange(t)
    want = _attention_f64(q, keys, vals, kv_mask, idx)
    args = [jnp.asarray(x, jnp.float32) for x in (q, keys, vals)]
    rest = (jnp.asarray(kv_mask), jnp.asarray(idx))

    def f(qq, kk, vv, query_offset):
        return layers.attention(qq, kk, vv, *rest, chunk, query_offset)

    got = f(*args, offset)
    rows = np.asarray(kv_mask[:, offset:][:, :t])  # queries with at least their own key
    np.testing.assert_allclose(np.asarray(got)[rows], want[rows], rtol=1e-4, atol=1e-5)
    # a query that sees no key (a pad) averages whatever keys it is given, so its output is
    # unspecified; the model never reads it (pads attend nowhere real, their loss is masked)
    w = jnp.asarray(rng.normal(size=got.shape) * rows[:, :, None, None, None], jnp.float32)
    grads = [
        jax.grad(lambda *a, o=o: jnp.sum(f(*a, o) * w), argnums=(0, 1, 2))(*args)
        for o in (offset, None)  # None: one unblocked call over all keys
    ]
    for blocked, whole in zip(*grads):
        np.testing.assert_allclose(np.asarray(blocked), np.asarray(whole), rtol=1e-4, atol=1e-5)


def test_bind_inside_a_context_mesh_on_a_config_never_bound_before():
    """Catches model.bind failing inside a jitted step's context mesh (sharding.under_mesh) when
    its config has never been bound outside one: NNX then reads the params' logical axis names
    ('vocab', 'embed') as mesh axes. The full-KL re-score binds pi_b's float32 config inside
    the train step, which would then work only if the sampler had bound that config first."""
    cfg = model.ModelConfig(vocab_size=263, hidden_size=24, num_heads=2, num_kv_heads=1,
                            head_dim=12, intermediate_size=40)  # fmt: skip
    mesh = sharding.make_mesh({"fsdp": 2}, jax.devices()[:2])
    params = model.init_params(cfg, 1)
    tokens = jnp.arange(10, dtype=jnp.int32).reshape(2, 5)

    fresh = cfg.replace(rms_norm_eps=1.5e-6)  # a config no test has bound yet
    inside = jax.jit(sharding.under_mesh(lambda p, x: model.apply(fresh, p, x), mesh))
    got = inside(params, tokens)  # the bug: "Resource axis: vocab ... not found in mesh"
    want = model.apply(fresh, params, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)

"""`model.decode_attention = "blockwise"` (ess_jax/model/blockwise_decode.py): a decode step that
reads only the filled blocks of the KV cache gives `layers.decode_attention`'s numbers over the
whole cache (float32 and bfloat16, left pads, grouped heads, an fp8 cache, positions at block
edges and inside blocks, a cache length the block does not divide), the sampler draws the same
tokens with the same recorded log-probs, its compiled decode loops copy no cache, and the
knob reaches the model from the experiment config.

Tolerances. float32: the two paths differ in summation order only (the softmax's sum over
blocks, the value product's sum over blocks): measured max abs 1e-6 on outputs of size ~2,
1.4e-6 on the sampler's log-probs: 1e-5. bfloat16: the probabilities are rounded at the same
point as in the dense path, so only a float32 rounding of the softmax sum can move one across a
bfloat16 rounding edge (measured: equal): one bfloat16 ulp of the output."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model_cfg

from configs import quickstart
from ess_jax.config.schema import ConfigError, check
from ess_jax.data import bucket_width
from ess_jax.data.tokenizer import char_tokenizer
from ess_jax.model import blockwise_decode, kv_cache, layers
from ess_jax.model import decoder as model
from ess_jax.parallel import sharding
from ess_jax.rl import experiment
from ess_jax.sampling import decode, sampler

B, N, G, K, S, BLOCK = 3, 2, 3, 8, 43, 8  # S: 5 full blocks and a last one clamped to S - 8
# block edges (7 | 8, 15 | 16), inside blocks, the clamped last block (40, 42); row 0 with 5
# left pads, row 1 with 12 (its first real key in block 1), row 2 none
QUERIES = (12, 15, 16, 17, 23, 24, 31, 40, 42)
MASK = np.ones((B, S), bool)
MASK[0, :5] = False
MASK[1, :12] = False

blockwise = jax.jit(blockwise_decode.blockwise_decode_attention, static_argnums=4)


def _cache(dtype, fp8, seed=0):
    """One layer's cache of S random keys and values (as decode writes them), and a query."""
    cfg = tiny_model_cfg(num_layers=1, num_kv_heads=N, head_dim=K, dtype=jnp.dtype(dtype).name)
    rng = np.random.default_rng(seed)
    k, v = (jnp.asarray(rng.normal(size=(B, N, S, K)) * a, dtype) for a in (2.0, 1.0))
    cache = kv_cache.write(kv_cache.init_cache(cfg, B, S, fp8=fp8)[0], k, v, 0)
    return cache, jnp.asarray(rng.normal(size=(B, N, G, K)) * 2, dtype)


@pytest.mark.parametrize(
    "dtype, fp8, tol",
    [(jnp.float32, False, 1e-5), (jnp.float32, True, 1e-5), (jnp.bfloat16, False, 2**-7)],
)
def test_layer_matches_dense_decode_attention(dtype, fp8, tol):
    """Catches a block read too few (planted: filled_blocks = query_idx // block, which misses
    the step's own key at every position but a block's last: fails), one too many read
    unmasked (positions past query_idx), the clamped last block counting the overlap twice
    (planted: the `pos >= j * block` mask dropped: fails at 40 and 42), a left-pad mask
    dropped or shifted by the block's start, heads grouped as (G, N) instead of (N, G), an
    fp8 cache's scales sliced at other positions than its codes, and the probabilities
    rounded after the value product instead of before: the blockwise output against the
    dense path's over the whole cache at each position of QUERIES."""
    cache, q = _cache(dtype, fp8)
    k, v = kv_cache.read(cache, dtype)
    mask = jnp.asarray(MASK)
    for qi in QUERIES:
        want = np.asarray(layers.decode_attention(q, k, v, mask, qi), np.float32)
        got = np.asarray(blockwise(q, cache, mask, jnp.int32(qi), BLOCK), np.float32)
        scale = np.maximum(np.abs(want), 1.0) if dtype == jnp.bfloat16 else 1.0
        assert np.all(np.abs(got - want) <= tol * scale), (qi, np.abs(got - want).max())


def test_reads_only_the_filled_blocks():
    """Catches a loop that runs over the whole cache (the point of the path) or stops a block
    early: with every key past the filled blocks NaN, the output stays finite, and the trip
    count is query_idx // block + 1 at and around a block edge."""
    cache, q = _cache(jnp.float32, False)
    qi = 17  # filled blocks 0, 1, 2: positions 0 .. 23
    poisoned = {n: x for n, x in cache.items()}
    poisoned["k"] = cache["k"].at[..., 24:].set(jnp.nan)
    poisoned["v"] = cache["v"].at[:, :, 24:].set(jnp.nan)
    out = blockwise(q, poisoned, jnp.asarray(MASK), jnp.int32(qi), BLOCK)
    assert np.isfinite(np.asarray(out)).all()
    assert [int(blockwise_decode.filled_blocks(i, BLOCK)) for i in (6, 7, 8, 9)] == [1, 1, 2, 2]


def _prompts():
    """Two left-padded prompts of 20 and 14 tokens at their bucket's width (32), as a
    PromptBatcher pads them."""
    rng = np.random.default_rng(1)
    prompts = rng.integers(3, 96, (2, 20)).astype(np.int32)
    mask = np.ones((2, 20), bool)
    mask[0, :6] = False
    pad = ((0, 0), (bucket_width(20) - 20, 0))
    return np.pad(prompts, pad), np.pad(mask, pad)


@pytest.mark.parametrize("kv, tol, sharded", [("compute", 1e-5, False), ("fp8", 1e-4, True)])
def test_sampler_records_the_same_tokens_and_log_probs(kv, tol, sharded):
    """Catches a blockwise path that changes what the float32 sampler records (the behaviour
    log-probs the objectives read as pi_b) beyond float32 rounding, or one that only the
    first decode segment exercises: 40 new tokens run two segments (caches of 32 + 32 and
    32 + 40 positions, blocks of 10: the last block of each clamped), left-padded prompts,
    same seed; tokens equal, behaviour and raw log-probs within `tol` (measured max abs
    1.4e-6). An fp8 cache (through kv_cache.read_block's scales) rounds each step's new keys
    and values to 3 mantissa bits, so a float32 difference in one step's attention output can
    move a later key by one fp8 step: measured 2.6e-5. That case runs on a data 2 x fsdp 2 x
    tensor 2 mesh (rows and kv heads split, as the sampler lays them out), both paths."""
    cfg = tiny_model_cfg()
    params = model.init_params(cfg, 1)
    prompts, mask = _prompts()
    sc = sampler.SamplingConfig(max_new_tokens=40, num_samples=2, stop_ids=())
    key = jax.random.key(0)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}) if sharded else None
    a = sampler.sample(cfg, params, prompts, mask, sc, key, kv_cache=kv, mesh=mesh)
    bw = cfg.replace(decode_attention="blockwise", decode_block=10)
    b = sampler.sample(bw, params, prompts, mask, sc, key, kv_cache=kv, mesh=mesh)
    np.testing.assert_array_equal(b.tokens, a.tokens)
    np.testing.assert_array_equal(b.response_mask, a.response_mask)
    assert bool(np.asarray(a.response_mask).all())  # all 40 columns: both segments ran
    np.testing.assert_allclose(b.behaviour_logp, a.behaviour_logp, atol=tol, rtol=0)
    np.testing.assert_allclose(b.raw_logp, a.raw_logp, atol=tol, rtol=0)


def test_compiled_decode_loops_never_copy_the_cache():
    """Catches a blockwise step that copies the KV cache, which would cost more than the
    unfilled blocks it skips (planted: the block loops reading the layer's cache from before
    the step's write, so the in-place write must copy it: 8 copies in the first segment): no
    copy of anything shaped like K or V of a block or more in either segment's compiled
    loop, with the cache itself in the program (not vacuous)."""
    cfg = tiny_model_cfg(decode_attention="blockwise", decode_block=16)
    b, p, t = 4, 16, 64  # decode_bounds(64) = (32, 64)
    st = decode.Static(64, 1, False, 0, False, (), 0)
    prefill, dec = sampler.programs(cfg, st, None)
    params = model.init_params(cfg, 0)
    toks = jnp.asarray(np.random.default_rng(0).integers(1, 96, (b, p)), jnp.int32)
    one = jnp.float32(1.0)
    s = prefill(params, toks, jnp.ones((b, p), bool), jax.random.key(0), one, one)
    n, kd = cfg.num_kv_heads, cfg.head_dim
    for bound, segment in zip(dec.bounds, dec.segments):
        if kv_cache.cache_length(s.cache[0]) < p + bound:
            dec.grow(s.cache, p + bound)
        hlo = segment.lower(params, s, one, one).compile().as_text()
        assert f"f32[{b},{n},{kd},{p + bound}]" in hlo
        # a copy of K or V of a block's positions or more ([B, N, G, K] accumulators are not)
        shapes = re.findall(rf"= f32\[{b},{n},(\d+),(\d+)\]\{{[0-9,]*\}} copy\(", hlo)
        copies = [x for x in shapes if kd in (int(x[0]), int(x[1])) and max(map(int, x)) >= 16]
        assert copies == [], f"segment to {bound}: {len(copies)} copies of the KV cache"
        s = segment(params, s, one, one)
    assert int(s.step) == t


def test_knob_reaches_the_model_and_a_bad_value_is_refused():
    """Catches model.decode_attention / decode_block dropped between the config and the
    ModelConfig (experiment.trainer_settings, which both of load_policy's paths apply), and
    a misspelt value or a block of 0 that would silently run the dense path."""
    c = quickstart.get_config()
    c.model.decode_attention, c.model.decode_block = "blockwise", 64
    cfg = experiment.embedded_model_config(c.model, char_tokenizer())
    assert (cfg.decode_attention, cfg.decode_block) == ("blockwise", 64)
    with pytest.raises(ValueError, match=r"decode_attention: unknown 'paged'; one of dense"):
        cfg.replace(decode_attention="paged")
    for field, value in (("decode_attention", "paged"), ("decode_block", 0)):
        bad = quickstart.get_config()
        bad.model[field] = value
        with pytest.raises(ConfigError, match=rf"^config\.model\.{field}: "):
            check(bad)

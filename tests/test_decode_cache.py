"""The sampler's KV cache across decode segments (ess_jax/sampling/decode.py): no copy of the
cache in any compiled decode loop, the cache grown a layer at a time between segments, and a segment
refusing a cache of the wrong length. (That the grown cache carries the right keys is
test_sampler's: a two-segment generation equals teacher forcing.)"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model_cfg

from ess_jax.model import decoder as model
from ess_jax.model import kv_cache
from ess_jax.sampling import decode, sampler

CFG = tiny_model_cfg(num_layers=3)
B, P, T = 4, 16, 128  # decode_bounds(128) = (32, 64, 128): three segments, two grows
ONE = jnp.float32(1.0)


def _prefilled(stop_ids=()):
    st = decode.Static(
        max_new_tokens=T,
        num_samples=1,
        greedy=False,
        top_k=0,
        use_top_p=False,
        stop_ids=stop_ids,
        pad_id=0,
    )
    prefill, dec = sampler.programs(CFG, st, None)
    params = model.init_params(CFG, 0)
    toks = jnp.asarray(np.random.default_rng(0).integers(1, 96, (B, P)), jnp.int32)
    s = prefill(params, toks, jnp.ones((B, P), bool), jax.random.key(0), ONE, ONE)
    return params, s, dec


def test_compiled_decode_loops_never_copy_the_cache():
    """Catches a decode step that copies the KV cache: with the cache allocated at its full
    length and each segment attending over a slice of it, XLA fuses the slice with the
    step's write and copies the whole cache twice per layer and step in every segment but
    the last (planted: 12 copies in each of the first two segments here; 54-61 vs 25-30 ms
    per step on bench/cpu.py's model)."""
    params, s, dec = _prefilled()
    assert dec.bounds == (32, 64, 128)
    for bound, segment in zip(dec.bounds, dec.segments):
        if kv_cache.cache_length(s.cache[0]) < P + bound:
            dec.grow(s.cache, P + bound)
        hlo = segment.lower(params, s, ONE, ONE).compile().as_text()
        n, kd, length = CFG.num_kv_heads, CFG.head_dim, kv_cache.cache_length(s.cache[0])
        assert f"f32[{B},{n},{kd},{length}]" in hlo  # keys: not vacuous
        assert f"f32[{B},{n},{length},{kd}]" in hlo  # values
        # a copy of anything shaped like K or V of some positions
        shape = rf"f32\[{B},{n},(\d+,{kd}|{kd},\d+)\]"
        copies = re.findall(rf"= {shape}\{{[0-9,]*\}} copy\(", hlo)
        assert copies == [], f"segment to {bound}: {len(copies)} copies of the KV cache"
        s = segment(params, s, ONE, ONE)
    assert int(s.step) == T and bool(s.mask.all())


def test_cache_grows_one_layer_at_a_time():
    """Catches a grow that keeps every old layer alive until all are padded (the peak would be
    the old cache plus the new one, ~1.5x the final cache at the last grow): when layer i is
    padded, only layers i.. of the old length may still be live."""
    params, s, dec = _prefilled()
    s = dec.segments[0](params, s, ONE, ONE)
    old = {s.cache[0]["k"].shape, s.cache[0]["v"].shape}
    live = []
    pad = dec.grow_layer

    def counting(layer, length):
        live.append(sum(1 for a in jax.live_arrays() if a.shape in old))
        return pad(layer, length)

    dec.grow_layer = counting
    try:
        dec.grow(s.cache, P + 64)
    finally:
        dec.grow_layer = pad
    assert live == [2 * (CFG.num_layers - i) for i in range(CFG.num_layers)], live
    assert all(kv_cache.cache_length(layer) == P + 64 for layer in s.cache)
    assert not any(a.shape in old for a in jax.live_arrays())


def test_segment_refuses_a_cache_of_the_wrong_length():
    """A segment handed a cache that was not grown (a caller skipping Decode) must say so, not
    fail on a broadcast deep in the attention."""
    params, s, dec = _prefilled()
    s = dec.segments[0](params, s, ONE, ONE)
    msg = r"decode segment to 64: the KV cache holds 48 positions, not the prompt's 16 \+ 64"
    with pytest.raises(ValueError, match=msg):
        dec.segments[1](params, s, ONE, ONE)


def test_no_growth_once_every_row_has_stopped():
    """Catches Decode growing (copying) the cache for segments with nothing left to draw: with
    every id a stop id, each row stops at its first token, and the cache keeps the first
    segment's length (planted: no early exit, it ends at the whole length)."""
    params, s, dec = _prefilled(stop_ids=tuple(range(CFG.vocab_size)))
    assert bool(s.done.all())
    out = dec(params, s, ONE, ONE)
    assert kv_cache.cache_length(out.cache[0]) == P + dec.bounds[0]
    assert int(out.mask.sum()) == B and bool(out.mask[:, 0].all())


def test_keys_are_cached_transposed_and_a_wrong_layout_is_refused():
    """Catches keys cached as [B, N, S, K] instead of [B, N, K, S] (a decode step's score
    product then reduces along the minor axis: 7-11% slower per step on bench/cpu.py's model,
    BENCHMARKS.md), on both the prefilled and the grown cache, and a hand-built cache in the
    [B, N, S, K] layout being written into silently (dynamic_update_slice would clamp the
    index)."""
    n, kd = CFG.num_kv_heads, CFG.head_dim
    params, s, dec = _prefilled()
    first = P + dec.bounds[0]
    assert (s.cache[0]["k"].shape, s.cache[0]["v"].shape) == ((B, n, kd, first), (B, n, first, kd))
    s = dec.segments[0](params, s, ONE, ONE)
    dec.grow(s.cache, P + 64)
    assert all(layer["k"].shape == (B, n, kd, P + 64) for layer in s.cache)
    old = {"k": jnp.zeros((B, n, 40, kd)), "v": jnp.zeros((B, n, 40, kd))}
    new_k = jnp.ones((B, n, 1, kd))
    with pytest.raises(ValueError, match=r"not \[B, N, K, S\] / \[B, N, S, K\] with K = 8"):
        kv_cache.write(old, new_k, new_k, 0)

"""bench/tpu_attention.py's analytic model of the splash kernel (the TPU compiler does not cost
a Pallas custom call), against a count made by hand of one small case."""

import pytest

from bench import tpu_attention


def test_splash_model_counts_blocks_by_hand():
    """Catches a model that counts the masked (upper) blocks of the causal mask, reads K and V
    once per row instead of once per visible block, forgets the backward's two kernels or
    their float32 statistics, or ignores the padding of T to the kernel's 128-wide lanes.
    T = 1024: blocks of 512, nb = 2, 3 visible (query, key) block pairs; one [512, 128] bf16
    block is 131072 bytes, one block's float32 log-sum-exp 2048, with rowsum(dO * O) 4096.
    Forward: Q 2 + K, V 6 + O 2 blocks + 2 lse. dK/dV: K, V 4 + (Q, dO) 6 blocks + 3 stats +
    dK, dV 4. dQ: (Q, dO) 4 blocks + 2 stats + K, V 6 + dQ 2. 36 blocks, per head."""
    per_head = 36 * 131072 + 2 * 2048 + 5 * 4096
    flops_per_head = 9 * 2 * 512 * 512 * 128 * 3  # 2 forward + 7 backward products per pair
    got = tpu_attention.splash_model(1, 1024, 2, 128, 2, peak=1e12, bandwidth=1e9)
    assert (got["block"], got["padded_length"]) == (512, 1024)
    assert got["bytes_accessed"] == 2 * per_head
    assert got["flops"] == 2 * flops_per_head
    assert got["seconds"] == pytest.approx(2 * per_head / 1e9)  # bandwidth-bound here
    padded = tpu_attention.splash_model(1, 1000, 2, 128, 2, peak=1e12, bandwidth=1e9)
    assert padded["bytes_accessed"] == got["bytes_accessed"] and padded["padded_length"] == 1024
    compute_bound = tpu_attention.splash_model(3, 1024, 2, 128, 2, peak=1e9, bandwidth=1e15)
    assert compute_bound["seconds"] == pytest.approx(3 * 2 * flops_per_head / 1e9)

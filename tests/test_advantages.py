"""Group advantages (GRPO, Dr.GRPO, RLOO) and DAPO's filters, against hand-computed values."""

import math

import jax
import numpy as np
import pytest

from ess_jax.rl import advantages

# Two groups of 3: rewards (1, 0, 0) and (1, 1, 1).
REWARDS = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], np.float32)


def test_grpo_zscore_with_bessel_std():
    adv = np.asarray(advantages.group_advantages(REWARDS, 3))
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # n - 1 = 2
    want = [(2 / 3) / (std + 1e-8), -(1 / 3) / (std + 1e-8), -(1 / 3) / (std + 1e-8), 0, 0, 0]
    np.testing.assert_allclose(adv, want, rtol=1e-6, atol=1e-7)
    assert adv[0] == pytest.approx(2 / math.sqrt(3), rel=1e-6)  # not the biased-std 2^0.5


def test_drgrpo_and_rloo():
    np.testing.assert_allclose(
        advantages.group_advantages(REWARDS, 3, "drgrpo"),
        [2 / 3, -1 / 3, -1 / 3, 0, 0, 0],
        rtol=1e-6,
    )
    # RLOO: r_i minus the mean of the other two samples.
    np.testing.assert_allclose(
        advantages.group_advantages(REWARDS, 3, "rloo"), [1.0, -0.5, -0.5, 0, 0, 0], rtol=1e-6
    )


@pytest.mark.parametrize("mode", advantages.MODES)
def test_group_of_one_gets_zero_and_jit(mode):
    np.testing.assert_array_equal(advantages.group_advantages(REWARDS, 1, mode), np.zeros(6))
    jitted = jax.jit(advantages.group_advantages, static_argnums=(1, 2))(REWARDS, 3, mode)
    np.testing.assert_allclose(jitted, advantages.group_advantages(REWARDS, 3, mode), rtol=1e-6)


def test_errors():
    with pytest.raises(ValueError, match="groups of 4"):
        advantages.group_advantages(REWARDS, 4)
    with pytest.raises(ValueError, match="rloo"):
        advantages.group_advantages(REWARDS, 3, mode="ppo")
    with pytest.raises(ValueError, match="cache_len"):
        advantages.overlong_penalty(np.array([3]), 10, 0)


def test_broadcast_to_tokens():
    mask = np.array([[1, 1, 0], [0, 0, 0]], bool)
    out = np.asarray(advantages.broadcast_to_tokens(np.array([2.0, -1.0]), mask))
    np.testing.assert_array_equal(out, [[2.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    assert out.dtype == np.float32


def test_dynamic_sampling_mask():
    np.testing.assert_array_equal(advantages.dynamic_sampling_mask(REWARDS, 3), [True, False])
    np.testing.assert_array_equal(advantages.dynamic_sampling_mask(REWARDS, 2), [True, True, False])
    np.testing.assert_array_equal(
        advantages.dynamic_sampling_mask(np.array([0.0, 0.0]), 1), [False] * 2
    )


def test_overlong_penalty():
    # max_len 20, cache 4: free up to 16, then -1/4 per token, -1 beyond 20.
    lengths = np.array([10, 16, 17, 19, 20, 21, 100])
    want = [0.0, 0.0, -0.25, -0.75, -1.0, -1.0, -1.0]
    np.testing.assert_allclose(advantages.overlong_penalty(lengths, 20, 4), want, rtol=1e-6)

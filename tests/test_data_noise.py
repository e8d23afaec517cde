"""Noisy-teacher demonstrations for the SFT warm start."""

import pytest

from ess_jax.data import get_task
from ess_jax.data.noise import corrupt_demonstrations
from ess_jax.rewards import get_reward


def test_noise_changes_one_digit_of_the_chosen_share_and_nothing_else():
    examples = get_task("addition", digits=2).examples("train", 400)
    noisy = corrupt_demonstrations(examples, 0.5, seed=3)
    assert noisy == corrupt_demonstrations(examples, 0.5, seed=3)  # deterministic
    changed = 0
    reward = get_reward("addition")
    for ex, nz in zip(examples, noisy):
        assert {k: v for k, v in ex.items() if k != "demonstration"} == {
            k: v for k, v in nz.items() if k != "demonstration"
        }
        diff = [
            i for i, (a, b) in enumerate(zip(ex["demonstration"], nz["demonstration"])) if a != b
        ]
        assert len(ex["demonstration"]) == len(nz["demonstration"]) and len(diff) <= 1
        if diff:
            changed += 1
            assert reward(nz["demonstration"], nz) == 0.0  # a corrupted demo is wrong
    assert 150 < changed < 250  # ~50% of 400
    assert corrupt_demonstrations(examples, 0.0) == examples


def test_noise_rate_out_of_range():
    with pytest.raises(ValueError, match="noise rate"):
        corrupt_demonstrations([], 1.5)

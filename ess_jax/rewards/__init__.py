"""Verifiable rewards: pure `(completion_text, example) -> float` functions by name.

Every reward first cuts the completion at its EOS marker (`truncate_at_eos`), so
text the policy wrote after finishing never counts.
"""

from collections.abc import Callable

from ess_jax.rewards.addition import addition_reward
from ess_jax.rewards.countdown import countdown_reward, evaluate_countdown
from ess_jax.rewards.eos import EOS_MARKERS, truncate_at_eos
from ess_jax.rewards.format import format_reward
from ess_jax.rewards.gsm8k import extract_final_number, gsm8k_reward
from ess_jax.rewards.math_answer import math_reward
from ess_jax.rewards.sort import sort_reward

RewardFn = Callable[[str, dict], float]

REWARDS: dict[str, RewardFn] = {
    "addition": addition_reward,
    "sort": sort_reward,
    "countdown": countdown_reward,
    "gsm8k": gsm8k_reward,
    "math": math_reward,
    # DeepScaleR answers are MATH-style; the alias lets a config name the dataset.
    "deepscaler": math_reward,
    "format": format_reward,
}


def get_reward(name: str) -> RewardFn:
    """The reward function registered as `name`; ValueError listing valid names."""
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; valid: {sorted(REWARDS)}") from None


__all__ = [
    "EOS_MARKERS",
    "REWARDS",
    "RewardFn",
    "addition_reward",
    "countdown_reward",
    "evaluate_countdown",
    "extract_final_number",
    "format_reward",
    "get_reward",
    "gsm8k_reward",
    "math_reward",
    "sort_reward",
    "truncate_at_eos",
]

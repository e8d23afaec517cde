"""Exact-match reward for the synthetic addition task ("12+34=" -> "46")."""

from ess_jax.rewards.eos import truncate_at_eos


def addition_reward(completion: str, example: dict) -> float:
    """1.0 iff the completion (before EOS, whitespace stripped) is exactly the sum."""
    return float(truncate_at_eos(completion).strip() == str(example["answer"]).strip())

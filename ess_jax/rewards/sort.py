"""Exact-match reward for the synthetic sorting task ("sort 3 1 2:" -> "1 2 3")."""

from ess_jax.rewards.eos import truncate_at_eos


def sort_reward(completion: str, example: dict) -> float:
    """1.0 iff the completion's whitespace-separated items equal the sorted list."""
    # Comparing split() lists forgives runs of spaces, not order or missing items.
    return float(truncate_at_eos(completion).split() == str(example["answer"]).split())

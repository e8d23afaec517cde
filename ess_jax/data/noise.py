"""Noisy demonstrations: a weaker teacher for the SFT warm start.

RL with a verifier is most useful when the starting policy knows the answer but is not sure of
it. Training the warm start on demonstrations of which a fraction carry a wrong digit gives
exactly that: the right answer is the mode, but a share of the probability sits on near-misses.
"""

from __future__ import annotations

import numpy as np

DIGITS = "0123456789"


def corrupt_demonstrations(examples: list[dict], rate: float, seed: int = 0) -> list[dict]:
    """Copies of `examples` where a `rate` fraction of demonstrations has one digit changed.

    Deterministic for a seed; demonstrations without digits are left as they are. Only the
    `demonstration` field changes: prompts, answers and rewards stay exact.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"demonstration noise rate must be in [0, 1], got {rate}")
    rng = np.random.default_rng(seed)
    out = []
    for ex in examples:
        demo = ex["demonstration"]
        where = [i for i, ch in enumerate(demo) if ch in DIGITS]
        if where and rng.random() < rate:
            i = where[rng.integers(len(where))]
            wrong = [d for d in DIGITS if d != demo[i]]
            demo = demo[:i] + wrong[rng.integers(len(wrong))] + demo[i + 1 :]
            ex = {**ex, "demonstration": demo}
        out.append(ex)
    return out

"""Run-time signs that a run has stopped learning, as warnings (the run goes on).

`HealthWatch(vocab_size).update(row)` reads one RL step's metrics row and returns the warning
lines it triggers:
- near uniform: `entropy_proxy` (the mean -log pi of the sampled tokens; log V when pi is
  uniform over the V tokens) reaches UNIFORM_FRACTION x log V: the samples are noise, as after
  a diverged update (an lr far too high) or from an untrained model.
- no reward signal: every group's rewards are equal (`frac_groups_constant` 1, or no group kept
  by dynamic sampling's resampling) for CONSTANT_STEPS steps in a row: every advantage is 0, so
  only the KL and entropy terms move the policy.
Each warning is given once when its condition starts and again only after it has cleared;
`report` logs them, one line each, clear of the progress bar.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping

from tqdm import tqdm

CONSTANT_STEPS = 10
UNIFORM_FRACTION = 0.9


def all_groups_constant(row: Mapping) -> bool:
    """Every group of the step's batch has equal rewards (zero advantages)."""
    if "ds_groups_kept" in row:  # dynamic sampling with resampling: the batch actually trained
        return row["ds_groups_kept"] == 0
    return row.get("frac_groups_constant") == 1.0


class HealthWatch:
    """Keeps the streaks across steps; `update(row)` -> warning lines for that step."""

    def __init__(
        self,
        vocab_size: int,
        constant_steps: int = CONSTANT_STEPS,
        uniform_fraction: float = UNIFORM_FRACTION,
    ):
        self.log_v = math.log(vocab_size)
        self.vocab_size, self.constant_steps = vocab_size, constant_steps
        self.uniform_fraction = uniform_fraction
        self._uniform = False
        self._constant_streak = 0

    def update(self, row: Mapping) -> list[str]:
        out = []
        step = row.get("step")
        entropy = row.get("entropy_proxy")
        uniform = entropy is not None and entropy >= self.uniform_fraction * self.log_v
        if uniform and not self._uniform:
            out.append(
                f"step {step}: the policy is near uniform: entropy_proxy {entropy:.3f} is "
                f"{entropy / self.log_v:.0%} of log V = {self.log_v:.3f} (V = {self.vocab_size}); "
                "a diverged update (optim.lr too high?) or an untrained model"
            )
        self._uniform = uniform
        self._constant_streak = self._constant_streak + 1 if all_groups_constant(row) else 0
        if self._constant_streak == self.constant_steps:
            out.append(
                f"step {step}: every group's rewards have been equal for {self.constant_steps} "
                "steps in a row: every advantage is 0, so the policy gets no reward signal (a "
                "task too hard or too easy for it, a broken reward, or a collapsed policy)"
            )
        return out


def report(warnings: Iterable[str]) -> None:
    for warning in warnings:
        with tqdm.external_write_mode():
            logging.warning(warning)

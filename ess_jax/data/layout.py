"""The row layout of a rollout batch: which rows are the samples of which prompt.

A rollout batch of `num_prompts` prompts with `group_size` (G) samples each has
B = num_prompts * G rows, and row i * G + g is sample g of prompt i: each prompt's samples are
G consecutive rows (a group). Everything that compares the samples of one prompt reads this
record: the group advantages and DAPO's masks (rl/advantages.py), the rollout's external rows
(first in each group) and group metrics (rl/rollout.py), dynamic sampling's refill by whole
groups (rl/dynamic_sampling.py), VCPO's per-group baseline (objectives/vcpo.py); a rollout
engine's rows must come in it (sampling/engine.py checks them).

With train.pack_rows the forwards run on packed rows (data/packing.py), but the batch keeps
this layout: every per-sequence array and every group computation reads these rows, and the
packed rows are read back onto them.

The methods work on numpy and jax arrays alike (they use the arrays' own `reshape` and
`repeat`), so the record is usable inside a jitted function; lists, tuples and dicts of these
go through `repeat`.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """B = num_prompts * group_size rows; row i * group_size + g is sample g of prompt i."""

    num_prompts: int
    group_size: int

    def __post_init__(self):
        if self.num_prompts < 0 or self.group_size < 1:
            raise ValueError(
                f"a row layout needs num_prompts >= 0 and group_size >= 1, got {self.num_prompts}"
                f" prompts of {self.group_size}"
            )

    @classmethod
    def of_rows(cls, num_rows: int, group_size: int) -> RowLayout:
        """The layout of `num_rows` rows in groups of `group_size`; ValueError if they are not
        whole groups."""
        if group_size < 1 or num_rows % group_size:
            raise ValueError(f"{num_rows} rows do not split into groups of {group_size}")
        return cls(num_rows // group_size, group_size)

    @property
    def num_rows(self) -> int:
        return self.num_prompts * self.group_size

    def group_of(self, row):
        """The prompt (group) index of a row index (an int or an integer array)."""
        return row // self.group_size

    def rows_of(self, group: int) -> slice:
        """The rows of group `group`."""
        return slice(group * self.group_size, (group + 1) * self.group_size)

    def grouped(self, x_B):
        """[B, ...] -> [num_prompts, G, ...]: row i * G + g at [i, g]."""
        self._check(x_B)
        return x_B.reshape(self.num_prompts, self.group_size, *x_B.shape[1:])

    def flat(self, x_PxG):
        """[num_prompts, G, ...] -> [B, ...], the inverse of `grouped`."""
        return x_PxG.reshape(self.num_rows, *x_PxG.shape[2:])

    def repeat(self, x_P: Any) -> Any:
        """One value per prompt -> one per row: rows i * G .. i * G + G - 1 get x_P[i]. Numpy
        and jax arrays (axis 0), lists, tuples and dicts of these."""
        return repeat_for_group(x_P, self.group_size)

    def _check(self, x_B) -> None:
        if x_B.shape[0] != self.num_rows:
            raise ValueError(
                f"{x_B.shape[0]} rows, the layout has {self.num_prompts} prompts x "
                f"{self.group_size} samples = {self.num_rows}"
            )


def repeat_for_group(x: Any, G: int) -> Any:
    """Repeats each row G times: rows i*G .. i*G+G-1 of the result are row i.

    Works on numpy / jax arrays (axis 0), lists and tuples, and dicts of these.
    """
    if G < 1:
        raise ValueError(f"group size must be >= 1, got {G}")
    if isinstance(x, dict):
        return {k: repeat_for_group(v, G) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(item for item in x for _ in range(G))
    if hasattr(x, "repeat") and hasattr(x, "shape"):
        return x.repeat(G, axis=0)
    raise TypeError(f"cannot repeat rows of {type(x).__name__}")

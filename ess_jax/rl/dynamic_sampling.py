"""DAPO dynamic sampling: a rollout batch of `data.prompts_per_step` groups whose rewards are
not all equal (a group with equal rewards has zero advantage everywhere: no signal).

rollout.dynamic_sampling=False: the step's one sampling round is the batch, as it comes.
rollout.dynamic_sampling=True, rollout.max_resample_rounds=0 (the default): the constant groups
    stay in the batch with a zero loss mask (`rollout.collect` masks them). configs/mini's DAPO
    arm runs this: one sampling round per step, the setting its recorded metrics rows come
    from.
rollout.dynamic_sampling=True, rollout.max_resample_rounds=K > 0 (the DAPO paper): up to K
    extra rounds, each a fresh batch of prompts_per_step prompts from the data stream (the
    batcher advances, so the checkpointed data position covers them), sampled by the same
    policy with the round's own key `fold_in(step key, round)` (round 0 uses the step key
    itself, as without resampling). The slots of the first round's constant groups are
    refilled in order by the non-constant groups of the extra rounds; the groups left over
    when the batch is full are dropped (their prompts are consumed). Slots still empty after
    K rounds keep their constant group, masked as with K=0, with a warning.

Every kept group is a whole group from one round (its rows in the round's `Rollout.layout`,
data/layout.py), with the rewards, advantages and behaviour log-probs that round recorded.
Rounds whose prompts fall in different length buckets are left-padded to the widest
(positions come from the attention mask, so left pads change nothing the trainer computes).

Metrics (only when K > 0, so that the rows of K = 0 runs do not change): ds_rounds (sampling
rounds used, 1 to K + 1), ds_groups_kept (non-constant groups in the batch), ds_groups_masked
(constant groups left in it, masked), ds_frac_constant (constant groups / all groups sampled
this step). reward_mean, reward_std, response_len and frac_groups_solved stay those of the first
round: an unfiltered sample of prompts_per_step prompts, comparable with arms that do not
resample.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax
import numpy as np

from ess_jax.data.layout import RowLayout
from ess_jax.model import moe
from ess_jax.rl import advantages as adv_lib
from ess_jax.rl import rollout as rollout_lib
from ess_jax.sampling.engine import RolloutEngine


def _constant_groups(r: rollout_lib.Rollout) -> np.ndarray:
    """One bool per group: True when all its rewards are equal (the groups `collect` masks)."""
    return ~np.asarray(adv_lib.dynamic_sampling_mask(r.rewards, r.layout.group_size))


def collect_batch(
    policy: RolloutEngine,
    batcher,
    tokenizer,
    reward_fn: Callable[[str, dict], float],
    rcfg,
    rng: jax.Array,
    external: RolloutEngine | None = None,
) -> tuple[rollout_lib.Rollout, dict]:
    """One step's rollout batch: `rollout.collect` on `next(batcher)` with the engines' current
    versions, refilled from extra rounds as the module docstring says. Returns (Rollout,
    metrics)."""

    def one_round(round_: int):
        key = rng if round_ == 0 else jax.random.fold_in(rng, round_)
        return rollout_lib.collect(
            policy, next(batcher), tokenizer, reward_fn, rcfg, key, external=external
        )

    first, metrics = one_round(0)
    max_rounds = int(rcfg.get("max_resample_rounds", 0))
    if not (rcfg.dynamic_sampling and max_rounds > 0):
        return first, metrics
    constant = _constant_groups(first)
    empty = np.flatnonzero(constant)  # the slots to refill, in order
    donors: list[tuple[rollout_lib.Rollout, int]] = []  # (round's rollout, group index)
    n_constant, n_sampled, rounds = int(constant.sum()), len(constant), 1
    while len(donors) < len(empty) and rounds <= max_rounds:
        extra, _ = one_round(rounds)
        c = _constant_groups(extra)
        donors += [(extra, int(i)) for i in np.flatnonzero(~c)]
        n_constant, n_sampled, rounds = n_constant + int(c.sum()), n_sampled + len(c), rounds + 1
    slots = [(first, i) for i in range(len(constant))]
    for slot, donor in zip(empty, donors):
        slots[slot] = donor
    masked = max(0, len(empty) - len(donors))
    if masked:
        logging.warning(
            "dynamic sampling: %d of %d groups still have constant rewards after %d extra "
            "rounds (rollout.max_resample_rounds); they stay in the batch, masked",
            masked,
            len(slots),
            max_rounds,
        )
    batch = first if all(src is first for src, _ in slots) else _assemble(slots, tokenizer)
    metrics.update(
        ds_rounds=rounds,
        ds_groups_kept=len(slots) - masked,
        ds_groups_masked=masked,
        ds_frac_constant=n_constant / n_sampled,
    )
    return batch, metrics


def _assemble(slots, tokenizer) -> rollout_lib.Rollout:
    """A Rollout of the given (rollout, group index) slots, prompts left-padded to the widest."""
    width = max(src.prompt_len for src, _ in slots)
    pad_id = tokenizer.pad_token_id

    def take(name: str, left_pad=None):
        parts = []
        for src, i in slots:
            x = np.asarray(getattr(src, name))[src.layout.rows_of(i)]
            if left_pad is not None and src.prompt_len < width:
                pad = [(0, 0), (width - src.prompt_len, 0)] + [(0, 0)] * (x.ndim - 2)
                x = np.pad(x, pad, constant_values=left_pad)
            parts.append(x)
        return np.concatenate(parts)

    return rollout_lib.Rollout(
        tokens=take("tokens", left_pad=pad_id),
        attn_mask=take("attn_mask", left_pad=False),
        loss_mask=take("loss_mask"),
        behaviour_logp=take("behaviour_logp"),
        advantages=take("advantages"),
        rewards=take("rewards"),
        policy_version=take("policy_version"),
        layout=RowLayout(len(slots), slots[0][0].layout.group_size),
        prompt_len=width,
        routing=None if slots[0][0].routing is None else take("routing", moe.NOT_RECORDED),
    )

"""Group-relative advantages (GRPO, Dr.GRPO, RLOO) and DAPO's batch filters, pure and jit-able.

Axis alphabet: N sequences (N = prompts * G in the row layout of data/layout.py `RowLayout`:
rows i*G .. i*G+G-1 are the G samples of prompt i), G group size, T time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ess_jax.config.domains import ADVANTAGE_MODES
from ess_jax.data.layout import RowLayout

MODES = ADVANTAGE_MODES  # rollout.advantage_mode's domain: the config check refuses any other


def _groups(x_N: jax.Array, group_size: int) -> tuple[RowLayout, jax.Array]:
    """The rows' layout and x as [prompts, G] float32; ValueError unless whole groups."""
    layout = RowLayout.of_rows(x_N.shape[0], group_size)
    return layout, layout.grouped(x_N.astype(jnp.float32))


def group_advantages(
    rewards_N: jax.Array, group_size: int, mode: str = "grpo", eps: float = 1e-8
) -> jax.Array:
    """Per-sequence advantages [N] from rewards [N]; a group of one sample gets 0.

    grpo:   (r - mean_g) / (std_g + eps), std with Bessel's correction (n - 1).
    drgrpo: r - mean_g (Dr.GRPO drops the std, which up-weights near-solved prompts).
    rloo:   r - mean of the other G - 1 samples = G / (G - 1) (r - mean_g).
    """
    if mode not in MODES:
        raise ValueError(f"unknown advantage mode {mode!r}; valid: {list(MODES)}")
    layout, r_NgxG = _groups(rewards_N, group_size)
    if group_size == 1:
        return jnp.zeros(rewards_N.shape, jnp.float32)
    centred = r_NgxG - r_NgxG.mean(axis=1, keepdims=True)
    if mode == "grpo":
        std = jnp.sqrt(jnp.sum(centred**2, axis=1, keepdims=True) / (group_size - 1))
        adv = centred / (std + eps)
    elif mode == "drgrpo":
        adv = centred
    else:
        adv = centred * (group_size / (group_size - 1))
    return layout.flat(adv)


def broadcast_to_tokens(adv_N: jax.Array, mask_NxT: jax.Array) -> jax.Array:
    """Advantage of each sequence on each of its valid tokens, 0 on pads -> [N, T] float32."""
    return jnp.where(mask_NxT.astype(bool), adv_N.astype(jnp.float32)[:, None], 0.0)


def dynamic_sampling_mask(rewards_N: jax.Array, group_size: int) -> jax.Array:
    """DAPO dynamic sampling: one bool per group [N / G], True when its rewards are not all equal.

    Groups with equal rewards have zero advantage and only dilute the token mean; drop them
    (or resample) by multiplying the token mask by the row layout's repeat of `keep`.
    """
    _, r_NgxG = _groups(rewards_N, group_size)
    return r_NgxG.max(axis=1) > r_NgxG.min(axis=1)


def overlong_penalty(length_N: jax.Array, max_len: int, cache_len: int) -> jax.Array:
    """DAPO soft overlong punishment added to the reward [N].

    0 up to max_len - cache_len, then linear down to -1 at max_len, and -1 beyond.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"need 0 < cache_len <= max_len, got {cache_len}, {max_len}")
    length = length_N.astype(jnp.float32)
    soft_start = max_len - cache_len
    ramp = (soft_start - length) / cache_len
    return jnp.where(length <= soft_start, 0.0, jnp.where(length <= max_len, ramp, -1.0))

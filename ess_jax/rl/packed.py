"""train.pack_rows in the RL update: the rollout's sequences packed into rows of
train.pack_length positions (data/packing.py) for the trainer's forwards and the scoring passes;
every per-token quantity read back onto the padded batch's [B, T] grid.

What stays padded: the rows of the batch (`data.layout.RowLayout`: groups of G consecutive
rows), every per-token array the objectives read (mask, behaviour_logp, advantages, prox_logp,
ref_logp) and the log-probs they get. A packed forward gives log-probs per packed position and
`scoring.unpack` reads each padded row's response positions back, so the losses, the ESS scopes,
the sequence-level quantities (GSPO's sequence ratio, VCPO's per-group baseline, the group
advantages) and every metric are the padded batch's computation, on the same numbers to float32
rounding. The packing follows the update's split: the rows of micro-batch k on device d are
packed together (data/packing.cells), after the row shuffle of the micro-batch scopes, which the
host draws here as `update_step` draws it in the program (`row_order`), so every micro-batch
holds the same sequences packed as padded. With train.pack_microbatches "tokens" the split
follows the packing instead (`regroup`): the update's sequences packed into rows of
pack_length, one packed row per device per micro-batch, and the padded rows regrouped on the
devices to match (`regroup_rows`), M set per update (StepKey.num_microbatches); only the
"step" ESS scope, whose numbers do not depend on the split, runs it (config/schema.py).

Batch keys: PACKED ("packed_tokens", "packed_segments", "packed_positions", [R, S], split
strided by micro-batch, never shuffled), INDEX ("pack_index" [B, T], a row array that travels
with its row through the shuffle), MICRO ("pack_micro" [B, 1], the scoring pass's only).
Not packed: VCPO's per-sequence gradient pass (one backward per sequence by definition: it
reads the padded rows). Refused with packing (config/schema.py): objective.kl_estimator "full"
(pi_b's re-score reads the padded rows) and model.lora.dropout (its masks are drawn per padded
row and position).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ess_jax.config.schema import fail
from ess_jax.data import packing
from ess_jax.model import scoring
from ess_jax.objectives import scopes
from ess_jax.parallel import sharding as sharding_lib

PACKED = ("packed_tokens", "packed_segments", "packed_positions")
INDEX = "pack_index"
MICRO = "pack_micro"


def by_tokens(config) -> bool:
    """Whether a run's micro-batches are cut by tokens (train.pack_microbatches "tokens", with
    train.pack_rows)."""
    t = config.train
    return bool(t.get("pack_rows", False)) and t.get("pack_microbatches", "rows") == "tokens"


def length_for(pack_length: int, width: int) -> int:
    """The packed rows' length: train.pack_length, or with 0 the padded rows' width P + T."""
    return pack_length or width


def pack(tokens_BxL, mask_BxL, prompt_len, pack_length, num_micro, row_blocks, order=None):
    """`packing.pack` of a batch's host arrays; a sequence longer than the packed rows is
    refused naming train.pack_length."""
    tokens_BxL, mask_BxL = np.asarray(tokens_BxL), np.asarray(mask_BxL, bool)
    length = _checked_length(pack_length, mask_BxL)
    return packing.pack(tokens_BxL, mask_BxL, prompt_len, length, num_micro, row_blocks, order)


def _checked_length(pack_length: int, mask_BxL) -> int:
    """`length_for` the batch; a sequence longer than that is refused naming the field."""
    length = length_for(pack_length, mask_BxL.shape[1])
    longest = int(packing.sequence_lengths(mask_BxL).max(initial=0))
    if longest > length:
        fail(
            "train.pack_length",
            f"{length} is shorter than a sequence of {longest} tokens (prompt + response); use "
            "0 (the prompt width + rollout.max_new_tokens) or at least that",
        )
    return length


def regroup(tokens_BxL, mask_BxL, prompt_len, pack_length, row_blocks):
    """train.pack_microbatches "tokens": (`packing.regroup` of an update's host rows, the
    regrouped rows packed one row per cell); a sequence longer than the packed rows is refused
    as in `pack`."""
    tokens_BxL, mask_BxL = np.asarray(tokens_BxL), np.asarray(mask_BxL, bool)
    length = _checked_length(pack_length, mask_BxL)
    rg = packing.regroup(mask_BxL, length, row_blocks)
    tokens, mask = rg.take(tokens_BxL), rg.take(mask_BxL)
    return rg, packing.pack(tokens, mask, prompt_len, length, rg.num_micro, row_blocks)


@functools.lru_cache(maxsize=16)
def regroup_fn(mesh):
    """(rows [B, ...], index [B''], real [B'']) -> rows [B'', ...], laid out as the batch:
    row g is row index[g], zero where real[g] is False. A sequence may change device (the
    regroup balances the devices' packed rows), so the partitioner gathers the row arrays
    (the per-token float32 arrays of one update: MBs, against the step's GBs)."""

    def gather(rows, index, real):
        def one(x):
            keep = real.reshape(-1, *[1] * (x.ndim - 1))
            return jnp.where(keep, x[index], jnp.zeros((), x.dtype))

        return jax.tree.map(one, rows)

    return jax.jit(sharding_lib.under_mesh(gather, mesh),
                   out_shardings=sharding_lib.batch_sharding(mesh))  # fmt: skip


def regroup_rows(rows: dict, rg: packing.Regroup, mesh):
    """An update's device rows [B, ...] regrouped as `rg` says (`regroup_fn`)."""
    return regroup_fn(mesh)(rows, jnp.asarray(rg.index), jnp.asarray(rg.real))


def update_arrays(rows: packing.PackedRows) -> dict:
    """The arrays an update's rows gain: PACKED and INDEX."""
    return dict(zip(PACKED, (rows.tokens, rows.segments, rows.positions)), **{INDEX: rows.index})


def score_arrays(rows: packing.PackedRows, mask_BxL) -> dict:
    """The arrays of the packed scoring pass (`score_fn`)."""
    return {**update_arrays(rows), MICRO: rows.micro[:, None], "attn_mask": np.asarray(mask_BxL)}


def row_order(seed: int, step: int, config, num_micro: int, batch_size: int, row_blocks: int):
    """The order in which `update_step` reads its rows at optimizer step `step`: the micro-batch
    scopes' shuffle (scopes.row_permutation of fold_in(key(seed), step), the key update_step
    draws), or None where it does not shuffle."""
    if not scopes.shuffled(config, num_micro):
        return None
    key = jax.random.fold_in(jax.random.key(seed), step)
    return np.asarray(scopes.row_permutation(key, batch_size, row_blocks))


def split(batch: dict) -> tuple[dict, dict]:
    """(the batch without PACKED, PACKED): the packed rows join the rows only after the row
    shuffle and the batch pass, which read the padded rows."""
    return {k: v for k, v in batch.items() if k not in PACKED}, {
        k: batch[k] for k in PACKED if k in batch
    }


def is_packed(mb) -> bool:
    return PACKED[0] in mb


def token_logprobs(cfg, params, mb, prompt_len: int, entropy: bool = False):
    """The response log-probs (and entropies) of micro-batch `mb`'s padded rows, computed on its
    packed rows: `scoring.packed_token_logprobs`."""
    packed = {k.removeprefix("packed_"): mb[k] for k in PACKED}
    valid = mb["attn_mask"][:, prompt_len:].astype(bool)
    return scoring.packed_token_logprobs(cfg, params, packed, mb[INDEX], valid, entropy)


@functools.lru_cache(maxsize=16)
def score_fn(cfg, prompt_len: int, mesh, num_chunks: int):
    """The packed scoring pass (proximal / reference log-probs): `score_arrays` of a batch
    packed in `num_chunks` micro-batches -> log-probs [B, T], chunk by chunk as the padded
    pass (`steps.score_fn`) goes."""

    def score(params, arrays):
        chunks = {
            k: arrays[k].reshape(-1, num_chunks, arrays[k].shape[1]).swapaxes(0, 1) for k in PACKED
        }

        def one(c):
            return scoring.packed_position_logprobs(
                cfg, params, c["packed_tokens"], c["packed_segments"], c["packed_positions"]
            )

        lp_KxRxS = jax.lax.map(one, chunks)
        per_chunk = math.prod(lp_KxRxS.shape[1:])
        index = arrays[MICRO] * per_chunk + arrays[INDEX]
        valid = arrays["attn_mask"][:, prompt_len:].astype(bool)
        return scoring.unpack(lp_KxRxS, index, valid)

    options = sharding_lib.compiler_options(cfg, mesh)
    return jax.jit(sharding_lib.under_mesh(score, mesh), compiler_options=options)


def pad_shares(rows: packing.PackedRows, mask_BxL) -> dict:
    """The metrics row's pad shares of the packed rows and of the padded ones."""
    return {"pad_frac_packed": rows.pad_share, "pad_frac_padded": padded_share(mask_BxL)}


def padded_share(mask_BxL) -> float:
    """The share of a padded batch's positions that hold no token."""
    return float(1.0 - np.mean(np.asarray(mask_BxL, bool)))

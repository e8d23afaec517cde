"""Packed rows: a batch's sequences laid end to end in rows of a fixed length, for the forwards
that cost per position (the trainer's and the scoring passes'), and the index that reads each
response position back from them (`train.pack_rows`).

A padded batch has B rows of L = P + T positions: a left-padded prompt, then the response up to
its stop, then pads. Its real tokens (the row's `attn_mask`) are one run per row. Packed, each
sequence's real tokens are one segment of a packed row: segment ids 1, 2, ... in the row (0 on
the pads after the last segment), positions 0 .. len - 1 restarting per segment (the padded
row's positions, which start at its first real token), and a forward that never attends
across segments sees what the padded row's forward sees. A sequence longer than the packed
row is refused (`sequence_lengths` tells the caller which).

Which sequences share packed rows follows the trainer's split of its rows, so that every
micro-batch and every device holds the same sequences packed as padded: a "cell" is the rows of
one micro-batch (strided: rows k, k + M, ... of the batch in `order`) on one device's block
(B / D contiguous rows). Each cell is packed on its own by first-fit decreasing (longest first,
ties by row: deterministic) into n rows, n the same for every cell (the most any cell needs,
rounded up by `row_count` and at most a cell's size, so batches of similar lengths share one
program). Packed row g = d n M + j M + k holds the j-th row of micro-batch k on device d:
its strided split by M gives micro-batch k's D n rows, device d's n of them in its block.

Axis alphabet: B rows of the padded batch, L their length, T response positions (from
`start`), R packed rows, S the packed length, M micro-batches, D device blocks.
No jax here: numpy only.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """A padded batch's sequences packed, and where each response position went.

    `index` [B, T]: for response position t of padded row b (its position start + t), the flat
    position (row * S + column) in the packed rows of b's micro-batch, ordered as the strided
    split gives them (0 where the padded row has no real token there). `micro` [B]: each padded
    row's micro-batch."""

    tokens: np.ndarray  # [R, S] int32, 0 on pads
    segments: np.ndarray  # [R, S] int32: 1, 2, ... per sequence of the row, 0 on pads
    positions: np.ndarray  # [R, S] int32: restart at 0 on each segment, 0 on pads
    index: np.ndarray  # [B, T] int32
    micro: np.ndarray  # [B] int32

    @property
    def pad_share(self) -> float:
        """The share of the packed rows' positions that hold no token."""
        return float(np.mean(self.segments == 0))


def sequence_lengths(mask_BxL: np.ndarray) -> np.ndarray:
    """Real tokens per row [B]; ValueError if a row's real tokens are not one run (packing keeps
    each sequence's tokens in order and contiguous, as the padded row's forward reads them)."""
    mask = np.asarray(mask_BxL, bool)
    lengths = mask.sum(-1)
    first = np.argmax(mask, -1)
    last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], -1)
    gaps = np.flatnonzero((lengths > 0) & (last - first + 1 != lengths))
    if gaps.size:
        raise ValueError(f"row {gaps[0]}: its real tokens are not one contiguous run")
    return lengths


def first_fit_decreasing(lengths, capacity: int) -> list[list[int]]:
    """Bins of item indices, each holding at most `capacity`: items longest first (ties: lower
    index first), each into the first bin with room, else a new bin. Items of length 0 go in no
    bin."""
    order = sorted((i for i in range(len(lengths)) if lengths[i] > 0), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        size = int(lengths[i])
        if size > capacity:
            raise ValueError(f"item {i} of length {size} exceeds the capacity {capacity}")
        for b, free in enumerate(room):
            if size <= free:
                bins[b].append(i)
                room[b] -= size
                break
        else:
            bins.append([i])
            room.append(capacity - size)
    return bins


def row_count(needed: int) -> int:
    """The packed rows per cell for `needed`: the next of 1, 2, 3, 4, 6, 8, 12, 16, ... (powers
    of two and 1.5 times them): at most a third more rows than needed, and few distinct counts,
    so few programs to compile."""
    power = 1 << max(needed - 1, 0).bit_length()
    return power * 3 // 4 if power >= 4 and power * 3 // 4 >= needed else power


def cells(batch_size: int, num_micro: int, row_blocks: int, order=None) -> list[list[list[int]]]:
    """cells[d][k]: the padded rows (indices into the batch) of micro-batch k on device block d,
    in the order the trainer reads them: the batch in `order` (row r of the reordered batch is
    row order[r]; None: as is), split strided into `num_micro` micro-batches, its rows in
    `row_blocks` contiguous blocks."""
    if batch_size % num_micro or batch_size % row_blocks:
        raise ValueError(
            f"{batch_size} rows do not split into {num_micro} micro-batches and {row_blocks} blocks"
        )
    order = np.arange(batch_size) if order is None else np.asarray(order)
    block = batch_size // row_blocks
    out = [[[] for _ in range(num_micro)] for _ in range(row_blocks)]
    for r in range(batch_size):
        out[r // block][r % num_micro].append(int(order[r]))
    return out


def pack(
    tokens_BxL: np.ndarray,
    mask_BxL: np.ndarray,
    start: int,
    length: int,
    num_micro: int = 1,
    row_blocks: int = 1,
    order=None,
) -> PackedRows:
    """The batch's sequences packed into rows of `length` positions, cell by cell (`cells`: the
    micro-batches of the batch in `order`, on `row_blocks` devices); `start` is the first
    response position of the padded rows (the prompt width). ValueError if a sequence is longer
    than `length` or its tokens are not one run."""
    tokens_BxL, mask_BxL = np.asarray(tokens_BxL), np.asarray(mask_BxL, bool)
    b, width = tokens_BxL.shape
    lengths = sequence_lengths(mask_BxL)
    first = np.argmax(mask_BxL, -1)
    grid = cells(b, num_micro, row_blocks, order)
    bins = [  # cell by cell (d, k), each bin's padded rows
        [[cell[i] for i in bin_] for bin_ in first_fit_decreasing(lengths[cell], length)]
        for block in grid
        for cell in block
    ]
    most = max(len(cell) for block in grid for cell in block)
    needed = max([len(c) for c in bins] + [1])
    n = min(row_count(needed), max(most, 1))
    rows = row_blocks * n * num_micro
    tokens = np.zeros((rows, length), np.int32)
    segments = np.zeros((rows, length), np.int32)
    positions = np.zeros((rows, length), np.int32)
    index = np.zeros((b, width - start), np.int32)
    micro = np.zeros((b,), np.int32)
    for block in grid:
        for k, cell in enumerate(block):
            micro[cell] = k
    pos = np.arange(start, width)
    for c, cell_bins in enumerate(bins):
        d, k = divmod(c, num_micro)
        for j, members in enumerate(cell_bins):
            g, local = d * n * num_micro + j * num_micro + k, d * n + j
            col = 0
            for seg, row in enumerate(members, 1):
                size, lo = int(lengths[row]), int(first[row])
                tokens[g, col : col + size] = tokens_BxL[row, lo : lo + size]
                segments[g, col : col + size] = seg
                positions[g, col : col + size] = np.arange(size)
                # response position t is padded position start + t: column col + that - lo
                real = mask_BxL[row, start:]
                index[row] = np.where(real, local * length + col + pos - lo, 0)
                col += size
    return PackedRows(tokens, segments, positions, index, micro)


# ------------------------------------------------------------ micro-batches by a token budget


@dataclasses.dataclass(frozen=True)
class Regroup:
    """A batch's rows regrouped into micro-batches by a token budget (`regroup`): regrouped row
    g = d C M + j M + k holds the j-th sequence of micro-batch k on device block d (`index`:
    its row of the batch; a dummy where `real` is False), so that the strided split by M gives
    micro-batch k, device d's C rows of it in its block, as `pack` lays out a cell."""

    index: np.ndarray  # [D C M] int32: the batch row each regrouped row holds (dummies: 0)
    real: np.ndarray  # [D C M] bool
    num_micro: int  # M

    def take(self, x: np.ndarray) -> np.ndarray:
        """`x`'s rows regrouped, zero on the dummies."""
        x = np.asarray(x)[self.index]
        return np.where(self.real.reshape(-1, *[1] * (x.ndim - 1)), x, np.zeros_like(x))


def microbatch_count(needed: int) -> int:
    """The micro-batches for `needed` packed rows per device: `needed` up to 16, else the next
    multiple of a sixteenth of its power of two (17, 18, 20, ..., 32, 34, 36, ...): at most
    1/16 more than needed, and few distinct counts, so few programs to compile."""
    step = 1 << max(needed.bit_length() - 5, 0)
    return -(-needed // step) * step


def regroup(mask_BxL: np.ndarray, length: int, row_blocks: int = 1) -> Regroup:
    """Micro-batches cut by a token budget: the batch's sequences packed first-fit decreasing
    into rows of `length` positions, packed row i going to device i mod D as its micro-batch
    i div D (one packed row per device per micro-batch; the devices' loads differ by one row at
    most), M = `microbatch_count` of the rows a device gets. A sequence may so change device:
    the caller gathers the rows across devices (rl/packed.py). C, the sequences of the fullest
    packed row, rounded up by `row_count`. Rows with no real token (nothing to score) are left
    out. ValueError if a sequence is longer than `length`.

    Pads at the synthetic lengths of bench/packing.py (1024 rows; prompts of up to 1024 tokens,
    responses lognormal, median a quarter of the budget, 4 devices): 1-4% at E3's and E5's
    budgets, against 64-67% padded (docs/tpu.md)."""
    mask_BxL = np.asarray(mask_BxL, bool)
    bins = first_fit_decreasing(sequence_lengths(mask_BxL), length)
    m = microbatch_count(max(-(-len(bins) // row_blocks), 1))
    c = row_count(max([len(bin_) for bin_ in bins] + [1]))
    index = np.zeros((row_blocks * c * m,), np.int32)
    real = np.zeros((row_blocks * c * m,), bool)
    for i, members in enumerate(bins):
        d, k = i % row_blocks, i // row_blocks
        for j, row in enumerate(members):
            index[d * c * m + j * m + k], real[d * c * m + j * m + k] = row, True
    return Regroup(index, real, m)


def long_tailed_mask(rng: np.random.Generator, rows: int, prompt: int, gen: int) -> np.ndarray:
    """[rows, prompt + gen] real-token mask of the response lengths assumed where the paper
    states none (bench/packing.py, the token-budget programs of memory/programs.py): prompts
    of 1 .. `prompt` tokens, left-padded; responses lognormal with median gen / 4 (sigma 0.8),
    cut to 1 .. `gen`, the first at `gen` (the longest, as the padded width assumes)."""
    plen = rng.integers(1, prompt + 1, rows)
    rlen = np.clip(np.round(rng.lognormal(np.log(max(gen / 4, 1.0)), 0.8, rows)), 1, gen)
    rlen[0] = gen
    pos = np.arange(prompt + gen)[None]
    return (pos >= prompt - plen[:, None]) & (pos < prompt + rlen[:, None])

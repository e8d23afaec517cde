"""bench/packing.py --plan: the pad shares of the packing plan alone (no model), the figures
docs/tpu.md gives for the paper's micro-batch shapes."""

from bench import packing as bench_packing


def test_plan_pads_follow_the_cells():
    """Catches a plan that packs across micro-batches or devices (each cell, one micro-batch's
    sequences on one device, packs on its own, so one sequence per cell saves nothing), pad
    shares not measured against the positions the forwards run on, and a token-budget plan
    (train.pack_microbatches "tokens") whose positions are not one row per device per
    micro-batch."""
    one_per_cell = bench_packing.plan(64, 16, 4, 16, 256, 0)
    positions = one_per_cell["positions"]
    assert (positions["padded"], positions["packed"]) == (64 * 272, 64 * 272)
    shares = one_per_cell["pad_share"]
    assert abs(shares["packed"] - shares["padded"]) < 1e-12 and shares["padded"] > 0.5
    # micro-batches by tokens ignore the row cells: one packed row per device per micro-batch
    m = one_per_cell["micro_by_tokens"]
    assert positions["packed_by_tokens"] == 4 * m * 272 < positions["packed"] // 2
    assert abs(shares["packed_by_tokens"] - (1 - (1 - shares["padded"]) * 64 / (4 * m))) < 1e-9
    whole = bench_packing.plan(64, 1, 1, 16, 256, 0)
    assert whole["pad_share"]["padded"] == shares["padded"]  # the same synthetic batch
    # (lognormal responses, median 64 of 256: over half the padded positions are pads)
    assert whole["positions"]["packed"] <= whole["positions"]["padded"] // 2
    tokens = (1 - shares["padded"]) * 64 * 272
    assert abs(whole["pad_share"]["packed"] - (1 - tokens / whole["positions"]["packed"])) < 1e-9

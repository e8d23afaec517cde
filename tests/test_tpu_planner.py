"""The TPU memory planner against the committed TPU compiles (results/tpu/*.json, written by
tools/compile_tpu.py): every program within 10% of the compiler but the pinned misses,
TPU_COEF the fit of tools/fit_tpu_terms.py, the decode layouts' conditions, and the TPU plan's
phases. Plans and reads records only: nothing compiles.
"""

import dataclasses
import glob
import os
import re
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import compile_tpu  # noqa: E402  (tools/compile_tpu.py)
import tpu_table  # noqa: E402  (tools/tpu_table.py)

# The planner's known misses, stated in docs/tpu.md, each held out of the fit and pinned to the
# band it is reported in (record file in results/tpu -> program -> planner error). RL steps: E5's
# on v4-8, +15%, and on v5p-8 with v4-8's mesh and micro-batches (tensor 4, no FSDP, one row per
# device), +17% (at 4 rows: -8%); E3's on v6e-8, -29% (at 1 row -26.5%, at 4 -32%; E2's there
# is -1.4%, +13% without collective matmuls; on v5p with v6e-8's mesh and micro-batches:
# +9%; on v6e-8 without collective matmuls +4.9%). At fsdp 8 with jax.checkpoint's remat
# (model.remat_ordered False: `remat_unordered` records) the compiler undoes the remat: E3's step
# on tpu7x-8 -51%, E5's -70%, E3's on v5p with tpu7x-8's mesh and micro-batches -70%, its first 4
# and 8 layers -22% and -43%; with the latency-hiding scheduler off (LIBTPU_INIT_ARGS) the whole
# step is +17% and the 8 layers +14%. With model.remat_ordered, as the tpu7x-8 preset has it, the
# same step on v5p is +16.5% and its 8 layers +17%, E3's first 4 layers on v5p-8 +13% (TPU_COEF is
# free remat's fit), but E3's step on tpu7x-8 -28% (model.logits_chunk 512, the preset's for a
# bfloat16 sampler there) and E5's -53%, its first 4 and 8 layers there -17% and -36% (the
# collective matmuls' output buffers, tpu_terms.NO_COLLECTIVE_MATMUL; without them the 8 layers
# are -13% and the whole step -4.2%, E3's +7.5%, with the scheduler off the 4 layers -3.4%; with
# the scheduler held to 13% and 25% of HBM, model.scheduler_memory_percent, the 8 layers -17.6%
# and the whole step -14.8%, and E3's on v6e-8 at 60% -20.7%); the 8 layers at fsdp 4 x data 2 on
# the same chips (free remat) +23%. Without remat (TPU_COEF's no_remat terms, fitted to E3's
# first 2, 4 and 8 layers and E5's first 4 on v5p-8, within 10% in sample): E5's first 8 layers
# +14.6% (held out), and the `tiny` preset's step (SmolLM2-135M on v5e:2x2, float32, unchunked
# attention) -21.5%.
MESH8 = "e3_temperature_1p2__p3o__v5p-16__tpu7x-8_mesh__rl_step"  # fsdp 8 on v5p
E5X = "e5_fp8__p3o__tpu7x-8__rl_step"  # E5's step slices on tpu7x-8
MISSES = {
    "e5_fp8__p3o__v4-8.json": {"rl_step": (0.10, 0.20)},
    "e5_fp8__p3o__v5p-8__tensor4_rows1.json": {"rl_step": (0.10, 0.20)},
    "e3_temperature_1p2__p3o__v6e-8.json": {"rl_step": (-0.35, -0.20)},
    "e3_temperature_1p2__p3o__v6e-8__rl_step__4_rows.json": {"rl_step": (-0.36, -0.28)},
    "e3_temperature_1p2__p3o__v6e-8__rl_step__1_row.json": {"rl_step": (-0.30, -0.22)},
    "e2_qwen25_1p5b__p3o__v6e-8__rl_step__no_collective_matmul.json": {"rl_step": (0.08, 0.18)},
    "e5_fp8__p3o__v6e-8__rl_step__collective_matmul_auto.json": {"rl_step": (-0.38, -0.30)},
    "e3_temperature_1p2__p3o__tpu7x-8__remat_unordered.json": {"rl_step": (-0.55, -0.45)},
    "e5_fp8__p3o__tpu7x-8__remat_unordered.json": {"rl_step": (-0.75, -0.65)},
    f"{MESH8}__remat_unordered.json": {"rl_step": (-0.75, -0.65)},
    f"{MESH8}__4_layers__remat_unordered.json": {"rl_step": (-0.25, -0.18)},
    f"{MESH8}__8_layers__remat_unordered.json": {"rl_step": (-0.48, -0.38)},
    f"{MESH8}__remat_unordered__no_lhs.json": {"rl_step": (0.12, 0.22)},
    f"{MESH8}__8_layers__remat_unordered__no_lhs.json": {"rl_step": (0.10, 0.18)},
    "e3_temperature_1p2__p3o__tpu7x-8.json": {"rl_step": (-0.33, -0.23)},
    "e3_temperature_1p2__p3o__v5p-8__rl_step__4_layers__remat_ordered.json": {
        "rl_step": (0.08, 0.18),
    },
    "e5_fp8__p3o__tpu7x-8.json": {"rl_step": (-0.58, -0.48)},
    f"{E5X}__4_layers.json": {"rl_step": (-0.22, -0.12)},
    f"{E5X}__8_layers.json": {"rl_step": (-0.41, -0.31)},
    f"{E5X}__8_layers__no_collective_matmul.json": {"rl_step": (-0.18, -0.08)},
    f"{E5X}__8_layers__no_collective_matmul__knob.json": {"rl_step": (-0.18, -0.08)},
    f"{E5X}__8_layers__scheduler_limit_13.json": {"rl_step": (-0.20, -0.15)},
    f"{E5X}__scheduler_limit_25.json": {"rl_step": (-0.17, -0.12)},
    "e3_temperature_1p2__p3o__v6e-8__rl_step__scheduler_limit_60.json": {"rl_step": (-0.24, -0.17)},
    f"{MESH8}.json": {"rl_step": (0.12, 0.22)},
    f"{MESH8}__8_layers.json": {"rl_step": (0.12, 0.22)},
    "e3_temperature_1p2__p3o__v5p-16__fsdp4_data2__rl_step__8_layers__remat_unordered.json": {
        "rl_step": (0.18, 0.28),
    },
    "e5_fp8__p3o__v5p-8__rl_step__8_layers__no_remat.json": {"rl_step": (0.10, 0.20)},
    "e3_temperature_1p2__p3o__tiny__v5e-2x2.json": {"rl_step": (-0.27, -0.16)},
    # first 4 layers of a step without the statistics pass (P3O's kept micro-batch sets the
    # fitted slices' peak; GRPO's whole E3 and E5 steps are +2.2% and +6.3%: docs/tpu.md)
    **{f"{arm}__v5p-8__rl_step__4_layers.json": {"rl_step": (0.18, 0.28)} for arm in (
        "e1_clip_sweep__grpo_eps0.2", "e1_clip_sweep__gspo", "e1_clip_sweep__cispo",
        "e1_clip_sweep__dapo", "e3_temperature_1p2__grpo_tis")},
    "e3_temperature_1p2__grpo_tis__tiny__v5e-2x2__score.json": {"score": (-0.20, -0.12)},
    "e3_temperature_1p2__p3o__v5e-256.json": {"eval/prefill": (0.12, 0.20)},
    # Qwen3-4B's 4K-token steps on v5e-16, whatever the objective (E5's 16K-token one, in the
    # fit, is -2.0%), and E8's scoring pass, as E3's there; every program of each (docs/tpu.md)
    "e8_dual_anchor__t1.2_p3o_dual_two_kl__v5e-16.json": {
        "rl_step": (-0.16, -0.10), "score": (-0.13, -0.08),
    },
    "e1_clip_sweep__gspo__v5e-16.json": {"rl_step": (-0.15, -0.09)},
    "e3_temperature_1p2__p3o__v5e-16__rl_step.json": {"rl_step": (-0.16, -0.10)},
    # E2 (Qwen2.5-1.5B: 2 kv heads over tensor 4) on v4-8: decode segments whose compiled
    # bytes do not grow with the segment's length (v4 is extrapolated)
    "e2_qwen25_1p5b__p3o__v4-8.json": {
        "sample/decode512": (-0.20, -0.14), "sample/decode1024": (-0.20, -0.14),
        "eval/decode512": (0.08, 0.14), "eval/decode1024": (0.08, 0.13),
        "eval/decode2048": (-0.15, -0.09),
    },
    "e3_temperature_1p2__grpo_tis__tpu7x-8__score.json": {"score": (-0.62, -0.52)},
    "e3_temperature_1p2__grpo_tis__tpu7x-8__score__no_collective_matmul.json": {
        "score": (-0.35, -0.25),
    },
    "e3_temperature_1p2__grpo_tis__v5p-16__tpu7x-8_mesh__score.json": {"score": (-0.18, -0.10)},
    "e3_temperature_1p2__grpo_tis__v5e-16__score.json": {"score": (-0.13, -0.08)},
    "e3_temperature_1p2__grpo_tis__v5e-16__score__no_collective_matmul.json": {
        "score": (-0.15, -0.08),
    },
}  # fmt: skip


def test_planner_within_10_percent_of_every_committed_compile_but_the_pinned_misses(monkeypatch):
    """Catches a TPU planner term that drifts from the compiler (a decode segment planned at
    the whole length's cache, the reshard without its second copy, every layer's gathered
    weights in the step: XLA:CPU's terms, +48% to +78%; a splash step planned with the einsum
    path's LM-head coefficient, +36% on E3's 4 layers; an fp8 sampler's decode segment with a
    large cache planned without its dequantised q and o projections, -15% on E5's; a float32
    segment at one row per device planned with the bfloat16 copy of the weights, +36%; a
    single prompt's prefill planned with the whole embedding table, +40% without FSDP and
    +14% with it; a KV cache counted by its elements where the TPU pads its minor dimension to
    128 lanes, -15% on the `tiny` preset's prefill; a scoring pass planned with one query
    chunk's scores where the compiler keeps two, -23% on E3's, or without the collective
    matmuls' pieces on a tensor-parallel mesh, -31% on E3's on v6e-8) on any program of the
    committed records but MISSES, and committed planner bytes, beside bytes or verdicts other
    than the planner's (every record replanned: a planner change left without --replan)."""
    records = tpu_table.read_records()
    assert len(records) >= 5
    files = [
        os.path.basename(p) for p in sorted(glob.glob(os.path.join(tpu_table.RESULTS, "*.json")))
    ]
    by_file = dict(zip(files, records))  # read_records reads them in this order
    assert set(MISSES) <= set(by_file)
    for file, rec in by_file.items():
        for name, p in rec["programs"].items():
            if "planner_bytes" in p and "error" not in p:  # tpu7x-8's crashed sampler: none
                err = (p["planner_bytes"] - p["compiler_bytes"]) / p["compiler_bytes"]
                low, high = MISSES.get(file, {}).get(name, (-0.10, 0.10))
                assert low <= err <= high, (file, name, f"{err:+.1%}")
    # a plan on v6e, or of a free remat at fsdp 8 on any TPU, prints the compiled steps
    # against their plans: the records' ratios
    from ess_jax.memory import tpu_terms

    def ratio(file):
        step = by_file[file]["programs"]["rl_step"]
        return round(step["compiler_bytes"] / step["planner_bytes"], 2)

    assert tpu_terms.EXTRAPOLATED_STEPS == {
        "v6e": ("E5 on v6e-8", ratio("e5_fp8__p3o__v6e-8__rl_step__collective_matmul_auto.json")),
        "tpu7x": ("E5 on tpu7x-8", ratio("e5_fp8__p3o__tpu7x-8.json")),
    }
    # ... the largest of the generation's whole RL steps with libtpu's flags and collective
    # matmuls (the config's own setting: E5's file turns them off on v6e-8) and the preset's
    # remat (the free remat's are UNORDERED_FSDP_8_STEPS)
    import plan_memory  # tools/plan_memory.py

    monkeypatch.chdir(ROOT)  # the records name their config files from the repository's root

    def collective_matmul(rec):
        config, _ = plan_memory.load_planned(rec["config"])
        return compile_tpu.overridden(config, rec.get("set")).model.collective_matmul

    for gen, (_, printed) in tpu_terms.EXTRAPOLATED_STEPS.items():
        steps = [
            ratio(file) for file, rec in by_file.items()
            if rec["topology"].startswith(f"{gen}:") and "rl_step" in rec["programs"]
            and rec["layers"] is None and "libtpu_init_args" not in rec
            and not any("remat" in s for s in rec.get("set") or ())
            and collective_matmul(rec) == "auto"
        ]  # fmt: skip
        assert len(steps) >= 2 and max(steps) == printed, (gen, steps)
    assert tpu_terms.WITHOUT_COLLECTIVE_MATMUL == {
        "v6e": ratio("e5_fp8__p3o__v6e-8__rl_step__no_collective_matmul.json"),
        "tpu7x": ratio(f"{E5X}__no_collective_matmul.json"),
    }
    assert tpu_terms.SCHEDULER_LIMITED == {
        "v6e": (
            "E3 on v6e-8",
            60,
            ratio("e3_temperature_1p2__p3o__v6e-8__rl_step__scheduler_limit_60.json"),
        ),
        "tpu7x": ("E5 on tpu7x-8", 25, ratio(f"{E5X}__scheduler_limit_25.json")),
    }
    assert tpu_terms.UNORDERED_FSDP_8_STEPS == (
        ("E3 on tpu7x-8", ratio("e3_temperature_1p2__p3o__tpu7x-8__remat_unordered.json")),
        ("E5 on tpu7x-8", ratio("e5_fp8__p3o__tpu7x-8__remat_unordered.json")),
        ("E3 on v5p with tpu7x-8's mesh", ratio(f"{MESH8}__remat_unordered.json")),
    )
    for file, rec in by_file.items():  # the unordered records say so; the compiler flags too
        assert ("model.remat_ordered=False" in (rec.get("set") or [])) == ("unordered" in file)
        flags = rec.get("libtpu_init_args")
        assert (flags == "--xla_tpu_enable_latency_hiding_scheduler=false") == ("no_lhs" in file)
        limit = re.search(r"scheduler_limit_(\d+)", file)
        assert (flags or "").startswith(tpu_terms.SCHEDULER_LIMIT) == bool(limit), file
        assert not limit or flags == f"{tpu_terms.SCHEDULER_LIMIT}={limit[1]}", file
        off = flags == tpu_terms.NO_COLLECTIVE_MATMUL
        off |= "model.collective_matmul=none" in (rec.get("set") or [])
        assert off == ("no_collective_matmul" in file), file
    # the knob compiles the same step as the process-wide flags, byte for byte
    slice8 = f"{E5X}__8_layers__no_collective_matmul"
    knob, flags = by_file[f"{slice8}__knob.json"], by_file[f"{slice8}.json"]
    assert knob["set"] == ["model.collective_matmul=none"] and "libtpu_init_args" not in knob
    (a,), (b,) = knob["programs"].values(), flags["programs"].values()
    assert {**a, "compile_seconds": 0} == {**b, "compile_seconds": 0}
    monkeypatch.chdir(ROOT)
    for rec in records:
        assert compile_tpu.replan(rec) == rec, (rec["config"], rec["topology"])


def test_tpu_coefficients_are_the_fit_of_the_committed_compiles():
    """Catches TPU_COEF's train-step coefficients that are not what tools/fit_tpu_terms.py
    fits to the committed RL-step compiles (results/tpu/, results/tpu_fit/), a fit record the
    planner cannot rebuild, a held-out compile that leaks into the fit, and a step off by
    more than 10%: an untied model planned with a tied table's gradient (+57% on the untied
    Qwen3-4B widths), a mixture-of-experts step without its dispatched rows (-44% to -74%), a
    splash step given the einsum fit's LM-head coefficient (+36% on E3's 4 layers), a step
    without remat planned with XLA:CPU's terms (+45% to +84% on E3's and E5's slices)."""
    import fit_tpu_terms  # tools/fit_tpu_terms.py

    from ess_jax.memory import tpu_terms

    rows = fit_tpu_terms.read_rows()
    # fit: 8 dense einsum steps, the Qwen3-30B-A3B 2-layer slices at 1 and 4 rows per device and
    # its 8-layer one, E3's and E5's splash steps on v5p-8 (4 layers and whole); held out:
    # Qwen2.5-1.5B's widths on v5e:2x4 and Qwen3-4B's untied, E7 on v5p-64, E5 with
    # micro-batches by tokens, E3's and E5's first 4 layers with einsum, the 4- and 6-layer MoE
    # slices and the whole 48-layer step, E5 on v4-8 and on v5p-8 with v4-8's mesh (tensor 4, no
    # FSDP) at v5p-8's micro-batches, at 2 rows per device and at v4-8's (1), the splash steps
    # of E2 on v5e-8, E5 on v5e-16 and E3 on v5p-64, E3 on v6e-8, on v5p with v6e-8's mesh, E3
    # and E5 on tpu7x-8 (remat ordered, and free: `remat_unordered`), E5's first 4 and 8 layers
    # there and its step and 8 layers without collective matmuls (the 8 twice: LIBTPU_INIT_ARGS
    # and model.collective_matmul) and under the scheduler's memory limit at 13% (the whole step
    # at 25%), its 4 layers without the scheduler, E3's step on v6e-8 and on tpu7x-8 without
    # collective matmuls, E3's on v6e-8 under the scheduler's limit at 60% and at 4 rows per
    # device, E5's on v6e-8 with and without collective matmuls (the second twice: its step
    # alone, and the whole run with the preset, which turns them off), E3's and E5's first
    # 4 layers on v5p-8 with model.remat_ordered, E3 on v5p with tpu7x-8's mesh (whole and its
    # first 8 layers with model.remat_ordered; with jax.checkpoint's remat whole and its first 4
    # and 8 layers, with and without the scheduler) and with fsdp 4 x data 2 (8 layers). Without
    # remat: fit, E3's first 2, 4 and 8 layers and E5's first 4 on v5p-8; held out, E3's first
    # 4 at 1 row per device, E5's first 8, E2's first 4 on v5e-8 and the `tiny` preset's step;
    # on v6e-8, E3's step at 1 row per device and E2's, with and without collective matmuls;
    # E3's P3O, E8's dual-anchor (two KLs) and E1's GSPO steps on v5e-16, E2's on v4-8
    assert sum(r[1] == "fit" for r in rows) == 19 and sum(r[1] == "held-out" for r in rows) == 69
    coef = fit_tpu_terms.fit([r for r in rows if r[1] == "fit"])
    assert {k: round(v, 2) for k, v in coef.items()} == {
        k: tpu_terms.TPU_COEF[k] for k in fit_tpu_terms.TERMS
    }
    for row in rows:  # in sample and held out, the step within 10% of the compiler, but
        low, high = MISSES.get(row[0].removeprefix("tpu/"), {}).get("rl_step", (-0.10, 0.10))
        assert low <= fit_tpu_terms.error(row, tpu_terms.TPU_COEF) <= high, row[0]


def test_decode_layouts_by_rows_cache_and_heads():
    """Catches the TPU decode layouts (tpu_terms.hoisted_weights, docs/tpu.md's E5) applied
    where the compiles show none: a quantized sampler's bfloat16 q and o copies below 32 MiB
    of one layer's keys per device or with the heads split over tensor (E5 with tensor 4 would
    be planned +3 points higher, inside the 10% band), float32 weights' bfloat16 copy at one
    row per device (+36% on E5's eval), or the key copy at two rows; and tpu7x's layouts
    (tpu_terms.RELAID_WHOLE) not applied there: a bfloat16 segment with q / k / v relaid only
    (-35% to -24% on E3's sampler on tpu7x-8), float32 at one row without the bfloat16
    copy (-27% to -21% on E5's eval), or applied to v5p or to a quantized sampler."""
    from configs.paper import e5_fp8
    from ess_jax.memory import planner, terms, tpu_terms

    cfg = planner.model_config(e5_fp8.get_config("p3o,v5p-8").model)  # Qwen3-4B
    t1, t4 = planner.abstract_mesh({"fsdp": 4}), planner.abstract_mesh({"tensor": 4})
    d, h, n, k, layers = 2560, 32, 8, 128, 36
    relaid, q_and_o = layers * d * (h + 2 * n) * k * 2, layers * 2 * d * h * k * 2
    hoisted = tpu_terms.hoisted_weights
    # one layer's keys: 4 rows x 8 kv heads x 128 x positions x 2 bytes; 32 MiB at 4096
    assert hoisted(cfg, t1, "fp8", 4, 4095, "compute") == relaid
    assert hoisted(cfg, t1, "fp8", 4, 4096, "compute") == relaid + q_and_o
    assert hoisted(cfg, t1, "bfloat16", 4, 4096, "compute") == relaid
    # tensor 4: a quarter of the heads per device, no q / o copies at any length
    assert hoisted(cfg, t4, "fp8", 16, 17408, "compute") == layers * d * (h + 2 * n) // 4 * k * 2
    # float32: one row, k and v relaid out in float32 (and the keys from 32 MiB: 1 row x 8 x
    # 128 x 8192 x 4 bytes); two rows, the bfloat16 copy of every block matrix
    kv_f32 = layers * d * 2 * n * k * 4
    f32 = dataclasses.replace(cfg, dtype="float32")
    assert hoisted(f32, t1, "float32", 1, 8191, "compute") == kv_f32
    assert hoisted(f32, t1, "float32", 1, 8192, "compute") == kv_f32 + layers * n * k * 8192 * 4
    assert hoisted(f32, t1, "float32", 2, 8192, "compute") == terms.block_bytes(
        f32, t1, np.dtype("bfloat16"), "sample"
    )
    # tpu7x: every 16-bit param relaid (the block matrices and the table: Qwen3-4B's
    # 4,022,468,096 params x 2 bytes, whole on each device: the sample layout has no FSDP);
    # float32, the bfloat16 copy from one row (with the one-row key copy); quantized as on v5p
    bf16, x7 = np.dtype("bfloat16"), "tpu7x"
    assert hoisted(cfg, t1, "bfloat16", 4, 4096, "compute", x7) == 4_022_468_096 * 2
    assert hoisted(f32, t1, "float32", 1, 8191, "compute", x7) == terms.block_bytes(
        f32, t1, bf16, "sample"
    )
    assert (
        hoisted(f32, t1, "float32", 1, 8192, "compute", x7)
        == terms.block_bytes(f32, t1, bf16, "sample") + layers * n * k * 8192 * 4
    )
    assert hoisted(cfg, t1, "fp8", 4, 4096, "compute", x7) == relaid + q_and_o
    assert tpu_terms.RELAID_WHOLE == ("tpu7x",)  # v6e's sampler segments are within 4.4%


def test_tpu_plan_has_the_compilers_terms():
    """Catches plan() on a TPU device falling back to XLA:CPU's terms (every layer's gathered
    weights in the step, no reshard phase), TPU terms leaking into a GPU plan, and a reshard
    that counts VMEM-sized models' gathers as HBM temporaries."""
    from configs.paper import e3_temperature_1p2
    from ess_jax.config.defaults import base_config
    from ess_jax.memory import planner, tpu_terms

    c = e3_temperature_1p2.get_config("p3o,v5p-8")
    tpu, gpu = planner.plan(c, 4, "v5p"), planner.plan(c, 4, "h100")
    assert "gathered" in gpu.phases["train step"] and "gathered" not in tpu.phases["train step"]
    assert "reshard" in tpu.phases and "reshard" not in gpu.phases
    sample = tpu.phases["reshard"]["sample-layout params (f32)"]
    assert tpu.phases["reshard"]["reshard all-gather buffers"] == sample
    small = planner.model_config(base_config().model)  # the embedded model: a few MB
    assert tpu_terms.reshard_buffers(small, planner.abstract_mesh({"fsdp": 4})) == 0.0


def test_sample_phase_frees_the_gather_and_fsdp_1_moves_nothing():
    """Catches a sample phase that counts the float32 sample-layout gather beside the KV cache and
    decode temporaries (sampler.prepare rebinds its params to the cast copy, so the gather is
    gone before decoding: E3 on v5p-8 planned at 50.1 GB, not the record's 24.1 GB copy program
    + the train state), a reshard phase on a mesh without FSDP (tensor 4 on v4-8: the layouts
    are the same, nothing moves), a plan on a TPU generation outside the fit that does not say
    it is extrapolated, a v6e or tpu7x plan without the flags that bring its step to its plan
    (collective matmuls off: 1.03x and 1.04x, not 1.53x and 2.13x) or one that sets them
    (model.collective_matmul none) and does not name their ratio first, a plan of a free remat at
    fsdp 8 (E3's compiled step 2.03x to 3.32x its plan) that does not say so, and a preset at
    fsdp 8 left with it."""
    from configs.paper import e3_temperature_1p2
    from ess_jax.memory import planner, tpu_terms

    plan = planner.plan(e3_temperature_1p2.get_config("p3o,v5p-8"), 4, "v5p")
    sample = plan.phases["sample"]
    gather = planner.param_bytes(
        planner.model_config(e3_temperature_1p2.get_config("p3o,v5p-8").model),
        planner.abstract_mesh(plan.mesh),
        "sample",
    )
    copy, decoding = sample["sampler copy (bfloat16)"], sample["kv_cache"] + sample["sampler_tmp"]
    assert sum(sample.values()) == pytest.approx(copy + max(gather, decoding))
    assert gather > decoding  # E3: the cast is the sample phase's peak
    assert plan.peak_phase == "reshard" and plan.peak == pytest.approx(44.25e9, rel=1e-3)
    v4 = planner.plan(e3_temperature_1p2.get_config("p3o,v4-8"), 4, "v4")
    assert v4.mesh["fsdp"] == 1 and "reshard" not in v4.phases
    assert v4.lines()[-1].startswith("extrapolated:")
    v6e = planner.plan(e3_temperature_1p2.get_config("p3o,v6e-8"), 8, "v6e")
    flags = tpu_terms.NO_COLLECTIVE_MATMUL
    assert "E5 on v6e-8's RL step is 1.53x its plan" in v6e.lines()[-1]
    off = "model.collective_matmul none"
    assert f"1.53x its plan, 1.03x with {off} (LIBTPU_INIT_ARGS='{flags}')" in v6e.lines()[-1]
    c7 = e3_temperature_1p2.get_config("p3o,tpu7x-8")
    x7 = planner.plan(c7, 8, "tpu7x").lines()[-1]
    assert f"2.13x its plan, 1.04x with {off} (LIBTPU_INIT_ARGS='{flags}')" in x7
    c7.model.collective_matmul = "none"  # the knob set: its ratio first
    x7 = planner.plan(c7, 8, "tpu7x").lines()[-1]
    assert f"compiled with {off}, E5 on tpu7x-8's RL step is 1.04x its plan (2.13x" in x7
    assert "; E5 on tpu7x-8's is 1.17x with model.scheduler_memory_percent 25" in x7
    assert "; E3 on v6e-8's is 1.26x with model.scheduler_memory_percent 60" in v6e.lines()[-1]
    assert not plan.lines()[-1].startswith("extrapolated:")
    # a free remat at fsdp 8, on any TPU, ends with the compiled steps over their plans; an
    # ordered one (the tpu7x-8 preset's) does not, nor does fsdp 4 (v5p-8)
    for preset, device in (("tpu7x-8", "tpu7x"), ("v5p-8", "v5p")):
        c = e3_temperature_1p2.get_config(f"p3o,{preset}")
        c.mesh.fsdp, c.mesh.data = 8, 1
        assert c.model.remat_ordered == (preset == "tpu7x-8")
        c.model.remat_ordered = False
        last = planner.plan(c, 8, device).lines()[-1]
        assert last.startswith("fsdp 8: the TPU compiler undoes a free remat"), last
        assert "v5p with tpu7x-8's mesh: 3.32x" in last and "model.remat_ordered" in last
        c.model.remat_ordered = True
        assert not planner.plan(c, 8, device).lines()[-1].startswith("fsdp")
    assert not plan.lines()[-1].startswith("fsdp")  # v5p-8: fsdp 4


def test_a_v6e_plan_judges_its_step_at_the_compiled_ratio():
    """Catches a plan on an extrapolated generation whose verdict weighs the planned step only:
    E5's on v6e-8 is planned at 20.3 GB, but compiles to 31.1 GB with libtpu's collective
    matmuls (results/tpu), over the 28.8 a run may use; the verdict must refuse it there, name
    the ratio that decides, accept it with the preset's model.collective_matmul none (21.0 GB
    compiled), and leave a fitted generation's (v5p) verdict to the plan alone."""
    from configs.paper import e5_fp8
    from ess_jax.memory import planner

    c = e5_fp8.get_config("p3o,v6e-8")
    assert c.model.collective_matmul == "none"
    assert planner.plan(c, 8, "v6e").fits
    c.model.collective_matmul = "auto"
    plan = planner.plan(c, 8, "v6e")
    assert plan.peak < plan.usable and not plan.fits
    assert plan.compiled_step == pytest.approx(1.53 * plan.phase_total("train step"))
    verdict = next(x for x in plan.lines() if x.startswith("peak "))
    over = (plan.compiled_step - plan.usable) / 1e9
    assert verdict.endswith(
        f"DOES NOT FIT: {over:.2f} GB over (the train step at 1.53x, as v6e's compiles lay it "
        f"out: {plan.compiled_step / 1e9:.2f} GB)"
    ), verdict
    v5p = planner.plan(e5_fp8.get_config("p3o,v5p-8"), 4, "v5p")
    assert v5p.compiled_step is None and v5p.judged == v5p.peak

"""The TPU compiler's transients, as terms.py counts XLA:CPU's: the same programs laid out by
libtpu's compiler (`compiled.memory_analysis()` of programs compiled for TPU topologies on a
CPU host, ess_jax/memory/tpu.py), each term a shape count times a coefficient (TPU_COEF) and
named after the layout difference it stands for. planner.plan uses these for a TPU device
(a key of presets.CHIPS: v4, v5e, v5p, v6e, tpu7x), terms.py's for CPUs and GPUs.

Where the TPU compiler lays a program out differently from XLA:CPU (measured from its buffer
assignment, `XLA_FLAGS=--xla_dump_to=DIR`: each module's `*memory-usage-report.txt` and the
peak live set in its `*live-range.txt`):
  - the train step: the compiler realises `model.remat` (block inputs of every layer, one
    layer's activations recomputed at a time) and gathers one layer's FSDP weights at a time,
    where XLA:CPU keeps every layer's gathered weights alive (terms.COEF["gathered"]); up to
    fsdp 4 with jax.checkpoint's free remat, from fsdp 8 (FSDP_LARGE) only with
    `model.remat_ordered` (model/remat.py); the coefficients are fitted to free remat's steps
    (ordered ones on v5p compile from 14% below them to 3% above: docs/tpu.md); without
    remat it keeps every layer's residuals (less than XLA:CPU's stash: no attention mask);
  - a decode segment's cache is the segment's own bound, not the whole length; the compiler
    hoists out of the decode loop a relaid-out copy of every layer's q / k / v projections
    (16-bit and quantized weights) or, at 2 or more rows per device, a bfloat16 copy of every
    block matrix (float32 weights: the MXU's default precision rounds float32 operands to
    bfloat16), and reads one layer's bfloat16 cache as float32;
  - two more decode layouts, read off Qwen3-4B's segments on v5p-8 at 1 to 16 rows per device
    (`hoisted_weights`): at one row per device float32 weights get no bfloat16 copy (the k
    and v projections are relaid out in float32 instead); and from LARGE_CACHE_BYTES of one
    layer's keys per device, a quantized sampler's q and o projections are dequantised to
    bfloat16 in buffers of their own (heads whole on the device), and a float32 one-row
    segment copies every layer's keys;
  - tpu7x's compiler (RELAID_WHOLE) relays out every 16-bit weight for a decode segment, the
    embedding table included, not the q / k / v projections only, and makes float32
    weights' bfloat16 copy at one row per device too;
  - with the vocabulary split over "tensor", the sampler's programs hold the whole embedding
    table once (`lookup_table`), but a single prompt's prefill holds none of it without
    FSDP and a 16-bit copy with it (`prefill_lookup`);
  - the train -> sample reshard gathers every param into a buffer of its own and copies it
    into the output: a second full copy of the sample-layout params (above VMEM's size; a
    model smaller than that gathers into VMEM, which memory_analysis does not count).
"""

from __future__ import annotations

import numpy as np

from ess_jax.config.presets import CHIPS
from ess_jax.memory import terms
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.sampling.decode import decode_bounds

# The TPU compiler's bytes per unit of each term (module docstring), fitted to libtpu 0.0.42.1's
# memory_analysis on v5e and v5p topologies only: on v4, v6e and tpu7x they are extrapolated.
TPU_COEF = {
    # train step (model.remat): tools/fit_tpu_terms.py's least-squares fit over the 8 dense
    # einsum "fit" RL steps of results/tpu/ and results/tpu_fit/, rounded to 2 decimals
    "update": 2.75,  # x params shard: gradient accumulator, a micro-batch's gradient, AdamW's
    "stash": 1.78,  # x L r T D b: every layer's block input, and the buffers of its gradient
    "embedding": 2.90,  # x the embedding's float32 bytes (tensor-split): gathered copy, gradient
    "logits": 2.53,  # x r C V 4: an LM-head chunk's float32 logits and their gradient
    # the same term with model.attention_impl "splash": the einsum path's chunk scores ([r, H,
    # C, T] float32, its query chunk the LM head's C) grow with r x C too (x H T against the
    # logits' V: 1.1 at E3's lengths, 3.7 at E5's), so "logits" above carries them at the
    # fitted lengths; splash never writes them. Fitted over the four "fit" splash RL steps
    # with the other dense coefficients fixed (tools/fit_tpu_terms.py)
    "logits_splash": 0.74,
    # mixture of experts: x r T W b, W = terms.ffn_width: one MoE block's dispatched rows (its
    # expert group's rows, X per token, of width F + D on the grouped path); the same fit's one
    # coefficient over three Qwen3-30B-A3B slices (2 layers at 1 and 4 rows per device, 8 at
    # 1), the dense coefficients fixed (the 4- and 6-layer slices and the whole step held out)
    "moe_rows": 4.34,
    # without model.remat: every layer's saved residuals, x XLA:CPU's per-layer stash less its
    # attention mask (terms.layer_stash: the T x T mask term would put E5's 16K-token layers
    # 14% over E3's), and one layer's attention backward at the peak, x XLA:CPU's
    # (terms.attention_bytes); the same fit over the four "fit" steps without remat (E3's
    # first 2, 4 and 8 layers and E5's first 4 on v5p-8), the dense coefficients fixed
    "no_remat_stash": 0.74,
    "no_remat_attention": 0.21,
    # sampler: fitted by hand to the E3 v5p-8 record's sampler programs (their errors there
    # are in sample)
    "prefill_attn": 0.6,  # x uniq KV P C 4: the prefill's float32 attention scores
    "prefill_mlp": 2.3,  # x uniq P F b: the prefill's feed-forward activations
    "draw": 3.0,  # x rows V 4: one token's float32 logits and draw
}
# The TPU generations of the compiles TPU_COEF is fitted to; on the others it is extrapolated.
FITTED = ("v5e", "v5p")
# On the others, held-out RL steps compiled there (results/tpu): the compiler's bytes over the
# planner's. A plan there judges its RL step at the largest of a generation's (`step_ratio`,
# planner.Plan.fits) and prints it. On v6e-8 E3's step is 1.36x at 1 row per device, 1.40x at 2
# and 1.47x at 4, E5's 1.53x at 1 (31.1 GB: within v6e's 32 GB, over the 28.8 a run may use),
# E2's (Qwen2.5-1.5B, 2 rows) 1.01x: no term of the plan's shapes fits both models; on v5p
# with v6e-8's mesh and micro-batches E3's is 0.92x: v6e's own. On tpu7x-8 (fsdp 8,
# model.remat_ordered) E3's step is 1.39x and E5's 2.13x, on v5p with tpu7x-8's mesh E3's
# 0.86x: tpu7x's own. v4's E5 step, 0.87x, is not v4's (on v5p with v4-8's mesh and
# micro-batches: 0.85x), so v4 plans have none.
EXTRAPOLATED_STEPS = {"v6e": ("E5 on v6e-8", 1.53), "tpu7x": ("E5 on tpu7x-8", 2.13)}
# Why tpu7x's steps are over their plans, read off the buffer dumps of E5's first 4 and 8 layers
# on tpu7x (10.85 and 16.87 GB, 1.20x and 1.56x their plans): the compiler turns each FSDP
# all-gather and its projection into a collective matmul, a loop over the weight shards that
# writes into an output buffer of its own (an `AllocateBuffer`), and the latency-hiding scheduler
# allocates every such buffer at the start of the forward, so every layer's q, k, v, gate and up
# outputs are live at once (0.89 GB a layer at E5's 17408 tokens per device: 7.13 GB of the 8
# layers' 12.21 GB live peak). Without collective matmuls (model.collective_matmul "none": these
# libtpu flags as the train programs' compiler_options, or the whole process's LIBTPU_INIT_ARGS)
# the peak is back in one layer's backward and the step is near its plan, the ratio a plan on that
# generation prints (results/tpu; the compiler's time estimates are negative on v6e and tpu7x, so
# what the flags cost in time is unknown). v6e's excess goes the same way (E3's step there
# without them: 0.95x), by another mechanism: its dump holds 7 layers' feed-forward activations
# and bfloat16 pairs of weight shards (the collective matmuls' pieces, by their shapes) in a
# widened backward loop, live peak 20.40 GB against 11.30 without them (docs/tpu.md). TPU_COEF
# is fitted to v5e's and v5p's steps compiled with libtpu's defaults.
NO_COLLECTIVE_MATMUL = " ".join(f"--{k}={v}" for k, v in sharding_lib.NO_COLLECTIVE_MATMUL.items())
SCHEDULER_LIMIT = f"--{sharding_lib.SCHEDULER_MEMORY_LIMIT}"  # =P: P% of the device's HBM
# With the collective matmuls kept and libtpu's scheduler held under a share of HBM
# (model.scheduler_memory_percent; libtpu's own limit is 95): E5's step on tpu7x-8 at 25% of its
# 103.1 GB, 27.46 GB against 49.73; E3's on v6e-8 at 60% of its 32 GB, 23.68 against 26.32 (4.5
# GB over the limit: v6e's widened loop is not the scheduler's alone); the same flop counts
# (results/tpu, `scheduler_limit_P`).
SCHEDULER_LIMITED = {  # the step compiled, the limit (percent), compiled over planned
    "v6e": ("E3 on v6e-8", 60, 1.26), "tpu7x": ("E5 on tpu7x-8", 25, 1.17),
}  # fmt: skip
WITHOUT_COLLECTIVE_MATMUL = {
    "v6e": 1.03,  # E5 on v6e-8: 21.03 GB against 31.11 (E3's: 17.91 against 26.32, 0.95x)
    "tpu7x": 1.04,  # E5 on tpu7x-8: 24.42 GB against 49.73 (E3's: 24.14 against 36.10, 0.93x)
}
# From this FSDP size (8-way weight all-gathers) the compiler undoes jax.checkpoint's remat
# (model.remat without model.remat_ordered): E3's RL step (4 rows per device) with tpu7x-8's
# mesh (fsdp 8) on v5p:2x2x2 grows by 2.5 GB a layer (first 4 layers 17.7 GB, 8 layers 27.6,
# all 36 96.7), with no recompute in its flop count; with the latency-hiding scheduler off
# (LIBTPU_INIT_ARGS=--xla_tpu_enable_latency_hiding_scheduler=false) the 36 layers are 24.8
# GB, and with model.remat_ordered (scheduler on) 25.0 (planner +16.5%; its 8 layers 13.4,
# +17%). The paper presets order the remat from this size (configs/paper/common.py); a plan of
# a free remat here prints the compiled steps over their plans (results/tpu):
FSDP_LARGE = 8
UNORDERED_FSDP_8_STEPS = (
    ("E3 on tpu7x-8", 2.03), ("E5 on tpu7x-8", 3.39), ("E3 on v5p with tpu7x-8's mesh", 3.32),
)  # fmt: skip

# One layer's keys per device (rows x kv heads x head dim x cache positions x bytes) from
# which the compiler lays a decode segment out the second way (module docstring), read off
# Qwen3-4B's decode segments on v5p-8 (results/tpu/e3_*, e5_* with rows, fp8, tensor4_long in
# their names): 25.2 MB compiles the first way, 33.6 MB (= 32 MiB) and more the second, in
# float32 at one row as in bfloat16 at 4 to 16.
LARGE_CACHE_BYTES = 32 * 2**20
# The generations whose compiler lays every 16-bit weight out anew in a decode segment, the
# embedding table included (a second copy of the sample-layout model), and gives float32
# weights their bfloat16 copy at one row per device too (`hoisted_weights`). Read off tpu7x's
# buffer dump of E3's bfloat16 decode512 segment on tpu7x-8 (`*live-range.txt`): its peak
# holds 8.0 GB of relaid weights (251 SparseCore data-format calls and copies: every block
# matrix and the 0.78 GB table), where v5p's relays the q / k / v projections only (1.13 GB);
# E5's float32 eval segments at one row there are 6.6 GB over the k / v relayout (the
# bfloat16 block matrices: 7.27 GB, less that relayout's 0.76).
RELAID_WHOLE = ("tpu7x",)
# Memory that memory_analysis does not count (the cores' VMEM): a reshard of fewer bytes than
# this gathers into it (a 65 MB model: no temporaries), a larger one into HBM (Qwen3-4B).
VMEM_BYTES = 128 * 2**20


def step_ratio(device: str, collective_matmul: str) -> float | None:
    """The compiled-over-planned ratio a plan on `device` judges its RL step at (a key of
    EXTRAPOLATED_STEPS: v6e, tpu7x), under model.collective_matmul; None elsewhere (the
    planner's terms are fitted there, or, on v4, the steps compiled are within them)."""
    if device not in EXTRAPOLATED_STEPS:
        return None
    if collective_matmul == "none" and device in WITHOUT_COLLECTIVE_MATMUL:
        return WITHOUT_COLLECTIVE_MATMUL[device]
    return EXTRAPOLATED_STEPS[device][1]


def compiled_step_ratio(device: str, collective_matmul: str) -> str:
    """What a plan on an extrapolated generation (a key of EXTRAPOLATED_STEPS) says of its RL
    step: the held-out step compiled there over its plan, under model.collective_matmul first,
    the other setting's ratio where both are compiled, and the ratio with libtpu's collective
    matmuls under a lower scheduler memory limit (SCHEDULER_LIMITED) where one is compiled."""
    name, ratio = EXTRAPOLATED_STEPS[device]
    off = WITHOUT_COLLECTIVE_MATMUL.get(device)
    if off is None:
        return f"compiled, {name}'s RL step is {ratio:.2f}x its plan"
    limited = ""
    if device in SCHEDULER_LIMITED:
        step, percent, bounded = SCHEDULER_LIMITED[device]
        limited = f"; {step}'s is {bounded:.2f}x with model.scheduler_memory_percent {percent}"
    if collective_matmul == "none":
        return (
            f"compiled with model.collective_matmul none, {name}'s RL step is {off:.2f}x its "
            f"plan ({ratio:.2f}x with libtpu's collective matmuls){limited}"
        )
    return (
        f"compiled, {name}'s RL step is {ratio:.2f}x its plan, {off:.2f}x with "
        f"model.collective_matmul none (LIBTPU_INIT_ARGS='{NO_COLLECTIVE_MATMUL}'){limited}"
    )


def is_tpu(device: str) -> bool:
    """Whether `device` (a key of presets.HBM) is a TPU generation."""
    return device in CHIPS


def cache_bytes(cfg, mesh, rows: int, length: int, kv_cache: str = "compute") -> float:
    """Per-device bytes of the KV cache of `rows` sequences at `length` positions, as the TPU
    lays each entry out: of its two minor dimensions (head dim, positions) the compiler puts
    minor the one that pads least, padded to 128 lanes, the other to the sublane tile (8 rows
    of 32 bits: 16 of bfloat16). The `tiny` preset's bfloat16 prefill (heads of 64, 272
    positions: docs/tpu.md) outputs every entry positions-minor, 384 lanes, 1.41x its elements;
    at the paper arms' widths (heads of 128, positions a multiple of 128) nothing pads."""
    b = terms.kv_bytes_per_element(cfg, kv_cache)
    code = 1 if kv_cache == "fp8" else int(b)  # an fp8 code's byte; its scale is in `b`
    n_kv = terms.axis_split(cfg.num_kv_heads, mesh, "tensor")
    sub = 8 * 4 // min(code, 4)

    def pad(n: int, m: int) -> int:
        return -(-n // m) * m

    kd = cfg.head_dim
    entry = min(pad(kd, 128) * pad(length, sub), pad(kd, sub) * pad(length, 128))
    return terms.batch_split(rows, mesh) * 2 * cfg.num_layers * n_kv * entry * b


def reshard_buffers(cfg, mesh) -> float:
    """Per-device bytes of the train -> sample reshard's temporaries: each param gathered into
    a buffer of its own, then copied into the output (module docstring), when FSDP shards
    them (else nothing moves) and they do not fit VMEM."""
    if mesh.shape["fsdp"] == 1:  # the two layouts differ in the FSDP sharding only
        return 0.0
    full = terms.param_bytes(cfg, mesh, "sample")
    return float(full) if full > VMEM_BYTES else 0.0


def hoisted_weights(
    cfg, mesh, precision: str, rows: float, positions: int, kv_cache: str, device: str = "v5p"
) -> float:
    """Per-device bytes of the weights (and cache) the TPU compiler copies in a decode segment
    of `rows` rows per device and `positions` cache positions on `device` (module docstring):
      - float32 weights, 2 or more rows: a bfloat16 copy of every block matrix, hoisted out of
        the loop; one row: no copy (the products read float32), every layer's k and v
        projections relaid out in float32 instead and, with a large cache (`large_cache`),
        a second copy of every layer's keys; on RELAID_WHOLE's generations the bfloat16 copy
        at one row too, with that key copy;
      - 16-bit weights: every layer's q / k / v projections relaid out; on RELAID_WHOLE's
        generations every param (the block matrices and the embedding table);
      - quantized formats: the same, and with a large cache and the heads whole on each device
        (tensor 1) every layer's q and o projections dequantised to bfloat16 in buffers of
        their own (with the heads split over tensor 4 the compiler makes none)."""
    h = terms.axis_split(cfg.num_heads, mesh, "tensor")
    n_kv = terms.axis_split(cfg.num_kv_heads, mesh, "tensor")
    d, k, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    keys = rows * n_kv * k * positions * terms.kv_bytes_per_element(cfg, kv_cache)  # a layer's
    whole = device in RELAID_WHOLE
    bf16 = np.dtype("bfloat16")
    if precision == "float32":
        key_copy = layers * keys if large_cache(keys) else 0.0
        if rows >= 2:
            return float(terms.block_bytes(cfg, mesh, bf16, "sample"))
        if whole:
            return terms.block_bytes(cfg, mesh, bf16, "sample") + key_copy
        return layers * d * 2 * n_kv * k * 4 + key_copy
    relaid = layers * d * (h + 2 * n_kv) * k * 2
    if precision in ("bfloat16", "float16"):
        return float(terms.param_bytes(cfg, mesh, "sample", bf16) if whole else relaid)
    dequantised = large_cache(keys) and h == cfg.num_heads  # the heads whole on the device
    return relaid + (layers * 2 * d * h * k * 2 if dequantised else 0.0)


def large_cache(key_bytes: float) -> bool:
    """Whether one layer's keys, per device, are large enough (LARGE_CACHE_BYTES) for the
    TPU compiler's second decode layout (module docstring)."""
    return key_bytes >= LARGE_CACHE_BYTES


def sampler_terms(
    cfg,
    mesh,
    prompts: int,
    samples: int,
    prompt_len: int,
    new_tokens: int,
    precision: str,
    kv_cache: str = "compute",
    bound: int | None = None,
    device: str = "v5p",
) -> dict[str, float]:
    """terms.sampler_terms on a TPU (`device`, a TPU generation), per device: `kv_cache` at
    the decode segment's `bound` (default: the last, new_tokens), `prefill_cache` the
    prefill's output (the first segment's), `prefill` and `decode` the temporaries of the
    prefill and of that segment. `cfg.dtype` is the sampler's compute dtype."""
    bound = new_tokens if bound is None else bound
    rows, uniq = prompts * samples, terms.batch_split(prompts, mesh)
    n_kv = terms.axis_split(cfg.num_kv_heads, mesh, "tensor")
    f = terms.ffn_width(cfg, mesh, prompts)
    v = cfg.vocab_size
    c = terms.prefill_query_chunk(cfg, prompt_len)
    k = TPU_COEF
    b = np.dtype(cfg.compute_dtype).itemsize
    s = prompt_len + bound
    per_device = terms.batch_split(rows, mesh)
    draw = k["draw"] * per_device * v * 4
    prefill = (
        k["prefill_attn"] * uniq * n_kv * prompt_len * c * 4
        + k["prefill_mlp"] * uniq * prompt_len * f * b
    )
    lookup = lookup_table(cfg, mesh, precision)
    hoisted = hoisted_weights(cfg, mesh, precision, per_device, s, kv_cache, device)
    decode = draw + hoisted + lookup
    if terms.kv_bytes_per_element(cfg, kv_cache) < 4:  # one layer's K and V read as float32
        decode += 2 * per_device * n_kv * s * cfg.head_dim * 4
    return {
        "kv_cache": cache_bytes(cfg, mesh, rows, s, kv_cache),
        "prefill_cache": cache_bytes(
            cfg, mesh, rows, prompt_len + decode_bounds(new_tokens)[0], kv_cache
        ),  # fmt: skip
        "prefill": prefill + draw + (prefill_lookup(cfg, mesh, lookup) if prompts == 1 else lookup),
        "decode": decode,
    }


def prefill_lookup(cfg, mesh, table: float) -> float:
    """Per-device bytes of the embedding table (`table`, lookup_table's) that the prefill of a
    single prompt holds: none without FSDP, else a 16-bit copy (lookup_table's docstring)."""
    if mesh.shape["fsdp"] == 1:
        return 0.0
    return min(table, float(cfg.vocab_size * cfg.hidden_size * 2))


def lookup_table(cfg, mesh, precision: str) -> float:
    """Per-device bytes of the whole embedding table that the sampler's programs hold when the
    sample layout splits its vocabulary over "tensor" (the token lookup reads any row): one
    copy in the sampler's weight dtype (16 bits, float32 for float32 weights). Measured on
    the E7 arm on v5p-64 (tensor 2; results/tpu): without this term every sampler program of
    the policy (Qwen3-4B, 0.78 GB in bfloat16), of the external model (Qwen3-8B, 1.24 GB) and
    of eval (float32, 1.56 GB) was under the compiler by about this much, 8-15%. The
    prefill of a single prompt differs (`prefill_lookup`): without FSDP it holds none of the
    table (Qwen3-4B with tensor 4 on v4-8 and v5p-8: 0.12 to 0.19 GB of temporaries), with
    FSDP a 16-bit copy (float32 eval on v5e-16 and with fsdp 2 x tensor 2 on v5p-8: 0.87 and
    0.85 GB of temporaries, the bfloat16 table 0.78; a bfloat16 sampler's 0.77)."""
    t = mesh.shape["tensor"]
    if t == 1 or cfg.vocab_size % t:
        return 0.0
    return float(cfg.vocab_size * cfg.hidden_size * (4 if precision == "float32" else 2))


def free_remat_note(cfg, mesh) -> str | None:
    """A plan's warning where the TPU compiler undoes `cfg`'s remat (FSDP_LARGE): a step with
    model.remat but not model.remat_ordered at fsdp 8 or more; None elsewhere."""
    fsdp = mesh.shape["fsdp"]
    if not cfg.remat or cfg.remat_ordered or fsdp < FSDP_LARGE:
        return None
    ratios = ", ".join(f"{name}: {r:.2f}x" for name, r in UNORDERED_FSDP_8_STEPS)
    return (
        f"fsdp {fsdp}: the TPU compiler undoes a free remat from fsdp {FSDP_LARGE} (compiled RL "
        f"steps over their plans: {ratios}); set model.remat_ordered (docs/tpu.md)"
    )


def models_step(cfg) -> bool:
    """Whether `train_terms` counts `cfg`'s RL step with the TPU terms: without LoRA (every
    paper arm, with `model.remat` or without); with LoRA (QLoRA) the step is not measured on
    TPU and XLA:CPU's terms (terms.train_terms) plan it."""
    return not cfg.lora_rank


def train_terms(cfg, mesh, rows: int, seq_len: int, full_kl_models=0, scored_len=None) -> dict:
    """terms.train_terms on a TPU (same arguments), per device. With `model.remat` (every
    paper arm): the gradient state, the block inputs of every layer (the compiler's remat:
    no layer's gathered weights or activations outlive its backward), one LM-head chunk's
    logits and, with tied embeddings, the shared table gathered with its float32 gradient
    (the lookup's and the LM head's, whole: an untied model's Qwen3-4B widths compile 2.4 GB
    of temporaries below the tied one's, results/tpu_fit/, with more arguments); on a
    mixture-of-experts model one MoE block's dispatched rows (its expert group's rows, r x T
    x terms.ffn_width x the compute dtype's bytes: on the Qwen3-30B-A3B slices the step is
    14.3 GB at 1 row per device and 44.1 at 4, docs/memory.md). One layer's recomputed
    attention and feed-forward activations are at the peak too (a [r, H, C, T] float32 score
    buffer and its gradient in Qwen3-4B's), yet take no weight of their own in the fit: the
    other terms' coefficients absorb them and the allocator's fragmentation (memory_analysis's
    temporaries with the arguments exceed the live peak by 26-76% in docs/tpu.md's four
    dumps). With splash attention no layer writes those scores: the LM head's term takes its
    own coefficient, fitted to the splash steps (TPU_COEF's "logits_splash").
    Without remat the step keeps every layer's residuals to its backward, and its peak is in
    the layers' backward (E3's first 2 layers on v5p-8: the saved residuals and one query
    chunk's recomputed attention live, the LM head's logits freed): XLA:CPU's per-layer stash
    and attention backward, each at its TPU coefficient, in place of the block inputs and the
    logits. With LoRA (QLoRA) the step is not measured on TPU: terms.train_terms (XLA:CPU's)."""
    if not models_step(cfg):
        return terms.train_terms(cfg, mesh, rows, seq_len, full_kl_models, scored_len)
    r, t = terms.batch_split(rows, mesh), seq_len
    s = seq_len if scored_len is None else scored_len
    b = np.dtype(cfg.compute_dtype).itemsize
    v = terms.axis_split(cfg.vocab_size, mesh, "tensor")
    c_head = cfg.logits_chunk if 0 < cfg.logits_chunk < s else s  # the LM head's chunk
    d, embedding = cfg.hidden_size, terms.embedding_bytes(cfg, mesh, np.float32)
    k = TPU_COEF
    out = {"update": k["update"] * terms.trained_bytes(cfg, mesh)}
    if cfg.remat:
        out["activations (remat: block inputs)"] = k["stash"] * cfg.num_layers * r * t * d * b
    else:  # every layer's residuals, and one layer's attention backward (docstring)
        stash = cfg.num_layers * terms.layer_stash(cfg, mesh, rows, t, mask=False)
        out["activations (no remat: every layer's)"] = k["no_remat_stash"] * stash
        attention = terms.attention_bytes(cfg, mesh, rows, t)
        out["attention (one layer's backward)"] = k["no_remat_attention"] * attention
    if cfg.tie_embeddings:  # the shared table's float32 gradient, whole (docstring)
        out["embedding (gathered, its gradient)"] = k["embedding"] * embedding
    if cfg.remat:
        head = "logits_splash" if cfg.attention_impl == "splash" else "logits"  # (TPU_COEF)
        out["logits"] = k[head] * r * c_head * v * 4
    if cfg.num_experts:  # one MoE block's dispatched rows (its expert group's); dense: none
        dispatched = r * t * terms.ffn_width(cfg, mesh, rows) * b
        out["dispatched rows (one MoE block)"] = k["moe_rows"] * dispatched
    if full_kl_models:  # as terms.train_terms counts it
        out["full KL re-score"] = terms.COEF["full_kl"] * full_kl_models * r * c_head * v * 4
    return out

"""The scoring pass's transients (rl/steps.score_fn): the forward-only pass that scores a rollout
batch under the params before the first update (pi_prox: the dual anchor, decoupled PPO, TIS)
or under the reference model (objective.beta_kl), in the train step's strided row chunks.
XLA:CPU's (CPUs and GPUs) and the TPU compiler's, each a shape count times a coefficient.

What one chunk holds beyond the params and the batch, per device:
  - the weights in the compute dtype: with FSDP the gathered blocks; on one device a cast copy
    where the compute dtype is not the params' float32 (XLA:CPU). The TPU compiler casts every
    layer's shard of the block matrices to 16 bits once, before the chunk loop (the train
    layout, not gathered: one layer is gathered at a time inside it), and keeps the embedding
    table gathered in 16 bits;
  - one layer's attention scores: a query chunk's float32 [r, H, C, T] (model.logits_chunk,
    a `lax.map` over the chunks), else the largest causal block's (layers.causal_blocks); none
    with splash attention on a TPU, whose kernel never writes them;
  - the LM head's float32 logits of one chunk of positions (model.logits_chunk), else of every
    response position. On a TPU a layer's scores and the logits are never live together: the
    larger counts.

Measured on E3's scoring pass (Qwen3-4B, 4 rows of 5120 tokens per device and chunk) for v5p-8:
memory_analysis gives 12.58 GB, the heap the compiler lays the pass out in: the float32 params
(4.03), the bfloat16 copy of the block shards (1.82), the gathered bfloat16 table (0.78), two
[4, 32, 1024, 5120] float32 score buffers (5.37) and one layer's feed-forward activations; the
dump's live peak, 9.59 GB, in a layer's attention, holds one of the two score buffers. The TPU
terms count the heap's buffers, each at 1.

With train.pack_rows the run scores packed rows (packed.score_fn); the planner plans, and
tools/compile_tpu.py compiles, the padded pass.
"""

from __future__ import annotations

import numpy as np

from ess_jax.memory import terms, tpu_terms
from ess_jax.model import layers

# XLA:CPU's bytes per unit (memory-minimising scheduler): a least-squares fit of the pass's
# temporaries over nine shapes of a 4-layer model (1 and 8 devices, float32 and bfloat16, with
# and without logits_chunk); tests/test_plan_memory.py checks other shapes within 25%
CPU_COEF = {
    "logits": 0.80,  # x r C V 4 (C: logits_chunk, else the response positions)
    # x terms.attention_bytes, the fit's basis: the train step's attention temporaries, their
    # own COEF included (attn_chunk_tmp or attn_tmp)
    "attention": 0.68,
    "weights": 0.64,  # x the model in the compute dtype, gathered (FSDP) or cast
}
# The TPU compiler's: read off the buffer dumps of scoring passes on v5p-8, v5e-16 and v6e-8
# (`XLA_FLAGS=--xla_dump_to`: E3's and E5's Qwen3-4B, E2's Qwen2.5-1.5B), each buffer counted
# whole (docs/tpu.md: the scoring pass)
TPU_COEF = {
    "logits": 1.0,  # x r C V 4: the LM head chunk's float32 logits
    "feed_forward": 1.0,  # x r T F b: one layer's feed-forward activations
    # x r H C T 4: a query chunk's float32 scores; two buffers live where more than one row per
    # device goes through a query-chunk loop of at most TWO_BUFFER_MAX_CHUNKS trips (E3 at 5, 6,
    # 7 and 8 chunks: two; at 9 and E5's 17: one; at one row per device: one). Unchunked: one
    # buffer of the largest causal block's scores
    "attention": 2.0,
    "attention_long": 1.0,
    # x the block shards in 16 bits: the collective matmuls' pieces (pairs of every
    # block matrix's shard, the feed-forward ones twice, and a cast copy of o and down), on a
    # mesh with fsdp > 2 and tensor > 1 (3.0x on E3's v6e-8 dump, 3.06x on its v5e-16; none
    # at fsdp 2 x tensor 4, E2 on v5e-8)
    "collective_pieces": 3.0,
}
TWO_BUFFER_MAX_CHUNKS = 8


def score_terms(cfg, mesh, rows: int, seq_len: int, scored_len: int, tpu: bool = False) -> dict:
    """Bytes of each transient of the scoring pass on a chunk of `rows` sequences of `seq_len`
    tokens, `scored_len` of them scored (the responses), per device: the TPU compiler's with
    `tpu`, XLA:CPU's else. The params, the batch and the output log-probs are the caller's."""
    r = terms.batch_split(rows, mesh)
    v = terms.axis_split(cfg.vocab_size, mesh, "tensor")
    c_head = cfg.logits_chunk if 0 < cfg.logits_chunk < scored_len else scored_len
    compute = cfg.compute_dtype
    if not tpu:
        k = CPU_COEF
        cast = mesh.shape["fsdp"] > 1 or np.dtype(compute) != np.float32
        weights = terms.param_bytes(cfg, mesh, "sample", compute) if cast else 0.0
        return {
            "weights (compute dtype)": k["weights"] * weights,
            "attention (one layer's scores)": k["attention"]
            * terms.attention_bytes(cfg, mesh, rows, seq_len),
            "logits (one chunk)": k["logits"] * r * c_head * v * 4,
        }
    k = TPU_COEF
    # float32 compute casts too: the MXU's default precision rounds float32 operands to bfloat16
    # (the `tiny` preset's SmolLM2-135M: bfloat16 copies of its float32 shards)
    copy = np.dtype("bfloat16") if np.dtype(compute) == np.float32 else compute
    ffn = terms.ffn_width(cfg, mesh, rows) * np.dtype(compute).itemsize
    out = {
        "blocks (16-bit copy of the shards)": float(terms.block_bytes(cfg, mesh, copy)),
        "embedding (gathered, 16-bit)": float(terms.embedding_bytes(cfg, mesh, copy)),
        "feed-forward (one layer's)": k["feed_forward"] * r * seq_len * ffn,
    }
    # a layer's attention scores and the LM head's logits are not live at once: the larger
    head = k["logits"] * r * c_head * v * 4
    scores = 0.0
    if cfg.attention_impl != "splash":  # the kernel writes no scores
        h, c = terms.axis_split(cfg.num_heads, mesh, "tensor"), cfg.logits_chunk
        if 0 < c < seq_len:  # a lax.map over the query chunks
            two_buffers = r > 1 and -(-seq_len // c) <= TWO_BUFFER_MAX_CHUNKS
            coef = k["attention" if two_buffers else "attention_long"]
            scores = coef * r * h * c * seq_len * 4
        else:  # the causal blocks, one at a time
            block = max((z - a) * keys for a, z, keys in layers.causal_blocks(seq_len))
            scores = k["attention_long"] * r * h * block * 4
    if scores > head:
        out["attention (a query chunk's scores)"] = scores
    else:
        out["logits (one chunk)"] = head
    pieces = mesh.shape["tensor"] > 1 and mesh.shape["fsdp"] > 2
    if pieces and cfg.collective_matmul != "none":
        blocks = out["blocks (16-bit copy of the shards)"]
        out["collective-matmul pieces"] = k["collective_pieces"] * blocks
    return out


def device_score_terms(device: str, *args) -> dict:
    """score_terms on `device` (a key of presets.HBM): the TPU compiler's on a TPU."""
    return score_terms(*args, tpu=tpu_terms.is_tpu(device))

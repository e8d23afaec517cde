"""The per-device byte counts behind planner.py's plan: params, their sampler copy and AdamW
state in a layout on a (possibly abstract) mesh, and the transients of one train step
(`train_terms`) and one sampler call (`sampler_terms`), each a shape count times a coefficient
fitted to XLA's `compiled.memory_analysis()` on CPU (COEF; planner.py's docstring says how they
are checked).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from ess_jax.model import decoder as model_lib
from ess_jax.model import layers, lora, quant
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.sampling.decode import decode_bounds

# XLA's bytes per unit of each term (module docstring): fitted to `compiled.memory_analysis()`
# of the train step and the sampler on CPU (memory-minimising scheduler), float32 and bfloat16.
COEF = {
    # train step
    "update": 3.04,  # x params shard: gradients, clipped gradients, new params and moments
    "gathered": 2.57,  # x block weights in compute dtype: FSDP all-gathers, unsharded grads
    "stash_D": 10.23,  # x L r T D b: residual stream, norms, attention output per layer
    "stash_F": 4.42,  # x L r T F b: gate, up, silu(gate), product per layer
    "stash_mask": 0.53,  # x L r T T 4: attention mask per layer
    "stash_A": 1.02,  # x L r H T T 4: attention probabilities per layer (unchunked)
    "attn_tmp": 1.84,  # x r H T T 4: one layer's attention backward (unchunked)
    "attn_chunk_tmp": 3.46,  # x r H C T 4: chunked attention (recomputed per chunk)
    "logits": 1.21,  # x r T V 4: logits and their gradient (unchunked)
    "logits_chunk": 0.45,  # x r C V 4 (chunked)
    "full_kl": 1.5,  # x r C V 4 per behaviour model: kl_estimator "full"'s re-score (1.0-2.0)
    # x L r T (summed input widths of the targeted matmuls): model.lora.dropout's masks and
    # dropped inputs kept for the backward, bytes per element whatever the dtype (8.4 in float32
    # on 1 device, 8.3 in bfloat16 on 8: the random bits and the mask are 32-bit either way)
    "lora_dropout": 8.4,
    # sampler
    "draw": 9.47,  # x rows V 4: one token's draw (logits, noise, log-softmax, ...)
    "dequant": 1.34,  # x block weights in bfloat16 (a quantized sampler format)
    "prefill_cache": 0.91,  # x the unique prompts' cache (before repeating it n times)
    "prefill_attn": 1.9,  # x uniq H C S 4: prefill attention scores
    "decode_attn": 3.19,  # x rows H S 4: one decode step's attention scores
}


def tree_bytes(abstract, shardings) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs placed with `shardings` (int4
    packed, half a byte: as XLA's compiled memory analysis counts a jnp.int4 argument)."""
    return int(
        sum(
            math.prod(s.shard_shape(x.shape)) * quant.code_bytes(x.dtype)
            for x, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings))
        )
    )


@functools.lru_cache(maxsize=256)
def param_shards(cfg, mesh, mode: str) -> tuple[tuple[str | None, int, tuple, np.dtype], ...]:
    """(name, ndim, per-device shard shape, dtype) of every param, in the `train` or `sample`
    layout: what the byte counts below read. Cached: a plan asks for the same model's layouts
    dozens of times, and mapping ~400 params' logical axes onto the mesh on each ask takes
    about half of docs/paper_scale.md's 530 plans (24 of 45 s on a 2-core CPU host)."""
    flat = jax.tree_util.tree_leaves_with_path(model_lib.abstract_params(cfg))
    shardings = jax.tree.leaves(model_lib.param_shardings(cfg, mesh, mode))
    return tuple(
        (getattr(path[-1], "key", None), x.ndim, tuple(s.shard_shape(x.shape)), x.dtype)
        for (path, x), s in zip(flat, shardings)
    )


def param_bytes(cfg, mesh, mode: str, dtype=None) -> int:
    """Per-device bytes of the params in the `train` or `sample` layout (float32 masters, or
    `dtype`: the sampler's bfloat16 copy, the gathered compute-dtype weights)."""
    return int(
        sum(
            math.prod(shard) * quant.code_bytes(x_dtype if dtype is None else dtype)
            for _, _, shard, x_dtype in param_shards(cfg, mesh, mode)
        )
    )


def sampler_copy_bytes(cfg, mesh, precision: str) -> int:
    """Per-device bytes of the sampler's low-precision copy (precision.prepare_params): matrices
    in 16 bits, or the block matrices as their format's codes (fp8 and int8 1 byte, int4 half a
    byte, packed) with float32 scales, one per output channel or per tensor; norm vectors stay
    float32. float32 samples from the params themselves: no copy."""
    from ess_jax.sampling.precision import FORMATS, INPUT_AXES

    fmt = FORMATS[precision]
    if precision == "float32":
        return 0
    total = 0.0
    for name, ndim, shard, _ in param_shards(cfg, mesh, "sample"):
        elems = math.prod(shard)
        if ndim < 2:
            total += 4 * elems
        elif fmt.codes is not None and name in INPUT_AXES:
            # the scales keep the matrix's output axes' shards, whole over its input axes
            per_scale = math.prod(shard[i] for i in INPUT_AXES[name])
            scales = elems / per_scale if fmt.per_channel else 1
            total += elems * fmt.code_bytes + 4 * scales
        else:
            total += 2 * elems
    return int(total)


def kv_bytes_per_element(cfg, kv_cache: str = "compute") -> float:
    """Bytes of one cached key or value element: the compute dtype's, bfloat16's, or fp8's one
    byte plus its share of the float32 scale per token and kv head (model/kv_cache.py)."""
    if kv_cache == "fp8":
        return 1 + 4 / cfg.head_dim
    return np.dtype(cfg.compute_dtype if kv_cache == "compute" else kv_cache).itemsize


def embedding_bytes(cfg, mesh, dtype) -> int:
    """Per-device bytes of the embedding and LM head in the sample layout, in `dtype`."""
    return named_bytes(cfg, mesh, dtype, "sample", ("embed", "lm_head"))


def block_bytes(cfg, mesh, dtype, mode: str = "train") -> int:
    """Per-device bytes of the seven block matrices of every layer in `dtype`, in the `train`
    or `sample` layout."""
    return named_bytes(cfg, mesh, dtype, mode, quant.INPUT_AXES)


def named_bytes(cfg, mesh, dtype, mode: str, names) -> int:
    """Per-device bytes, in `dtype` and the `mode` layout, of the params whose name is in
    `names`."""
    b = quant.code_bytes(dtype)
    return int(
        sum(
            math.prod(shard) * b
            for name, _, shard, _ in param_shards(cfg, mesh, mode)
            if name in names
        )
    )


def trainable(cfg, tree):
    """The part of a params-shaped tree the optimizer updates: all of it, or with LoRA
    (cfg.lora_rank > 0) the adapters (model/lora.py `split`)."""
    return lora.split(tree)[1] if cfg.lora_rank else tree


def adapter_bytes(cfg, mesh) -> int:
    """Per-device bytes of the LoRA adapters (float32, train layout); 0 without LoRA."""
    if not cfg.lora_rank:
        return 0
    shardings = model_lib.param_shardings(cfg, mesh, "train")
    return tree_bytes(trainable(cfg, model_lib.abstract_params(cfg)), trainable(cfg, shardings))


def trained_bytes(cfg, mesh) -> int:
    """Per-device bytes of what the optimizer updates (the params, or the LoRA adapters)."""
    return adapter_bytes(cfg, mesh) if cfg.lora_rank else param_bytes(cfg, mesh, "train")


def optimizer_bytes(cfg, mesh, optim: dict) -> int:
    """Per-device bytes of the AdamW state of `config.optim`: moments take their param's
    layout (as steps.init_state places them), scalars are replicated. With LoRA: the
    adapters' state only."""
    return _optimizer_bytes(cfg, mesh, tuple(sorted(optim.items())))


@functools.lru_cache(maxsize=256)
def _optimizer_bytes(cfg, mesh, items: tuple) -> int:
    # cached as param_shards is: mapping the state onto the layout is most of a plan's time
    from ess_jax.rl.optim import make_optimizer

    tx = make_optimizer({**dict(items), "total_steps": 1})
    opt = optimizer_shapes(cfg, items)
    rep = NamedSharding(mesh, jax.sharding.PartitionSpec())
    opt_sh = optax.tree_map_params(
        tx,
        lambda _, s: s,
        opt,
        trainable(cfg, model_lib.param_shardings(cfg, mesh, "train")),
        transform_non_params=lambda _: rep,
    )
    return tree_bytes(opt, opt_sh)


@functools.lru_cache(maxsize=32)
def optimizer_shapes(cfg, optim_items: tuple):
    """The optimizer state's ShapeDtypeStructs (tracing tx.init is the slow part: cached)."""
    from ess_jax.rl.optim import make_optimizer

    tx = make_optimizer({**dict(optim_items), "total_steps": 1})
    return jax.eval_shape(tx.init, trainable(cfg, model_lib.abstract_params(cfg)))


def axis_split(n: int, mesh, axis: str) -> int:
    """n split over a mesh axis when it divides (sharding.logical_to_spec replicates else)."""
    k = mesh.shape[axis]
    return n // k if n % k == 0 else n


def batch_split(n: int, mesh) -> float:
    """n rows split over the batch's mesh axes (sharding.BATCH: data x fsdp x expert) when
    they divide, else whole."""
    k = sharding_lib.batch_ranks(mesh.shape)
    return n / k if n % k == 0 else float(n)


def ffn_width(cfg, mesh, rows: int | None = None) -> int:
    """Per-device feed-forward activations per token of the widest block: a dense MLP's
    intermediate_size (split over "tensor"), or on a mixture-of-experts model whichever is
    larger of that and its expert path's: the dense path (model/moe.py: every expert on every
    token, [B, T, E, F] activations) its experts on this device times their width (E over
    "expert", F over "tensor"); the grouped path (model/grouped.py: each token's X experts,
    [B T X, F] activations and its [B T X, D] sorted inputs) X times (F + D). Either path
    works on its expert group's rows, each device's gathered over "expert" (grouped.py's
    dispatch; GSPMD's for the dense path): per row of the device's own, "expert" times that,
    when the `rows` (global; None: any) split over the batch's axes (else each rank holds
    them all, replicated, and computes its experts for them: the width alone)."""
    dense = axis_split(cfg.intermediate_size, mesh, "tensor")
    if not any(cfg.is_sparse(i) for i in range(cfg.num_layers)):
        return dense
    group = mesh.shape.get("expert", 1)  # the rows an expert rank computes, per row of its own
    if rows is not None and batch_split(rows, mesh) == rows:
        group = 1
    if cfg.moe_impl == "grouped":
        per_row = cfg.num_experts_per_tok * (cfg.moe_intermediate_size + cfg.hidden_size)
        return max(dense, group * per_row)
    experts = (
        axis_split(cfg.num_experts, mesh, "expert") if "expert" in mesh.shape else cfg.num_experts
    )
    return max(dense, group * experts * axis_split(cfg.moe_intermediate_size, mesh, "tensor"))


def layer_stash(cfg, mesh, rows: int, seq_len: int, mask: bool = True) -> float:
    """Bytes one layer keeps for its backward on XLA:CPU, per device, for a micro-batch of `rows`
    sequences of `seq_len` tokens: its residual stream, norms and attention output (stash_D),
    its feed-forward activations (stash_F), its attention mask (unless not `mask`) and,
    unchunked, its attention probabilities (COEF)."""
    r, t, b = batch_split(rows, mesh), seq_len, np.dtype(cfg.compute_dtype).itemsize
    k = COEF
    per_layer = k["stash_D"] * r * t * cfg.hidden_size * b
    per_layer += k["stash_F"] * r * t * ffn_width(cfg, mesh, rows) * b
    per_layer += k["stash_mask"] * r * t * t * 4 if mask else 0.0
    if not 0 < cfg.logits_chunk < t:  # unchunked attention: (queries, keys) of each block
        h = axis_split(cfg.num_heads, mesh, "tensor")
        causal = layers.causal_blocks(t)
        per_layer += k["stash_A"] * r * h * sum((z - a) * keys for a, z, keys in causal) * 4
    return per_layer


def attention_bytes(cfg, mesh, rows: int, seq_len: int) -> float:
    """One layer's attention backward temporaries on XLA:CPU, per device: a query chunk's
    float32 scores recomputed (model.logits_chunk), else the largest causal block's."""
    r, t, h = batch_split(rows, mesh), seq_len, axis_split(cfg.num_heads, mesh, "tensor")
    if 0 < cfg.logits_chunk < t:
        return COEF["attn_chunk_tmp"] * r * h * cfg.logits_chunk * t * 4
    causal = layers.causal_blocks(t)
    return COEF["attn_tmp"] * r * h * max((z - a) * n for a, z, n in causal) * 4


def train_terms(cfg, mesh, rows: int, seq_len: int, full_kl_models=0, scored_len=None) -> dict:
    """Bytes of each transient of one train step on a micro-batch of `rows` sequences of
    `seq_len` tokens (activations, gradients and update temporaries), per device.
    `full_kl_models`: behaviour models re-scored in the step (objective.kl_estimator "full":
    1, 2 with an external model); their params are the caller's to count. `scored_len`: the
    positions the LM head runs on (an RL step's responses; default all)."""
    r, t = batch_split(rows, mesh), seq_len
    s = seq_len if scored_len is None else scored_len
    b = np.dtype(cfg.compute_dtype).itemsize
    n_layers, d = cfg.num_layers, cfg.hidden_size
    v = axis_split(cfg.vocab_size, mesh, "tensor")
    c_head = cfg.logits_chunk if 0 < cfg.logits_chunk < s else 0  # the LM head's
    k = COEF
    terms = {"update": k["update"] * trained_bytes(cfg, mesh)}  # LoRA: the adapters
    if mesh.shape["fsdp"] > 1:  # whole (tensor-sharded) weights in compute dtype
        full = param_bytes(cfg, mesh, "sample", cfg.compute_dtype)
        blocks = full - embedding_bytes(cfg, mesh, cfg.compute_dtype)
        terms["gathered"] = k["gathered"] * blocks
    elif cfg.lora_base_precision != "compute":  # QLoRA: XLA dequantizes every block matrix at
        # the step's start and keeps it to the backward (model/quant.py); with FSDP: `gathered`
        terms["dequantized base"] = block_bytes(lora.base_config(cfg), mesh, cfg.compute_dtype)
    per_layer = layer_stash(cfg, mesh, rows, t)
    if cfg.remat:  # block inputs of every layer, one layer's stash while it is recomputed
        terms["activations"] = n_layers * r * t * d * b + per_layer
    else:
        terms["activations"] = n_layers * per_layer
    if cfg.lora_rank and cfg.lora_dropout:  # every layer's, remat or not (docs/memory.md)
        h = axis_split(cfg.num_heads, mesh, "tensor")
        width = {"o": h * cfg.head_dim, "down": ffn_width(cfg, mesh, rows)}  # others: [r, T, D]
        inputs = sum(width.get(n, d) for n in lora.targets_of(cfg, lora.TARGETS))
        terms["LoRA dropout"] = k["lora_dropout"] * n_layers * r * t * inputs
    terms["attention"] = attention_bytes(cfg, mesh, rows, t)
    if c_head:
        terms["logits"] = k["logits_chunk"] * r * c_head * v * 4
    else:
        terms["logits"] = k["logits"] * r * s * v * 4
    if full_kl_models:  # a float32 forward per behaviour model, its LM head like the policy's
        terms["full KL re-score"] = k["full_kl"] * full_kl_models * r * (c_head or s) * v * 4
    return terms


def prefill_query_chunk(cfg, prompt_len: int) -> int:
    """The queries the prefill's attention scores at once: model.logits_chunk when it splits
    the prompt, else the largest of layers.causal_blocks' query blocks."""
    c = cfg.logits_chunk
    if not 0 < c < prompt_len:
        c = max(z - a for a, z, _ in layers.causal_blocks(prompt_len))
    return c


def sampler_terms(
    cfg,
    mesh,
    prompts: int,
    samples: int,
    prompt_len: int,
    new_tokens: int,
    precision: str,
    kv_cache: str = "compute",
) -> dict[str, float]:
    """Bytes of one sampler call (sampler.sample) on `prompts` prompts x `samples` samples, per
    device: the decode state's KV cache, and the transients of the prefill and of one decode
    step. `cfg.dtype` is the sampler's compute dtype, `kv_cache` the cache's precision
    (`kv_bytes_per_element`); `prompt_len` the bucketed prompt width. The prefill allocates
    the cache at the first decode segment's length; the decode state's is the whole length by
    the last segment (decode.Decode grows it a layer at a time, so beside it at most one layer
    of the shorter cache is alive: not counted)."""
    b = kv_bytes_per_element(cfg, kv_cache)
    s = prompt_len + new_tokens
    n_kv = axis_split(cfg.num_kv_heads, mesh, "tensor")
    h = axis_split(cfg.num_heads, mesh, "tensor")
    rows, uniq = batch_split(prompts * samples, mesh), batch_split(prompts, mesh)
    per_pos = 2 * cfg.num_layers * n_kv * cfg.head_dim * b  # K and V of every layer
    per_row = per_pos * s
    prefill_row = per_pos * (prompt_len + decode_bounds(new_tokens)[0])
    c = prefill_query_chunk(cfg, prompt_len)
    k = COEF
    draw = k["draw"] * rows * cfg.vocab_size * 4  # float32 logits, noise, log-softmax ...
    shared = draw
    if precision not in ("float32", "bfloat16", "float16"):  # block matrices dequantised to
        # bfloat16 inside every forward
        blocks = param_bytes(cfg, mesh, "sample") - embedding_bytes(cfg, mesh, jnp.float32)
        shared += k["dequant"] * blocks / 2
    return {
        "kv_cache": rows * per_row,
        "prefill": shared
        + k["prefill_cache"] * uniq * prefill_row
        + k["prefill_attn"] * uniq * h * c * prompt_len * 4,  # attends over the prompt only
        "decode": shared + k["decode_attn"] * rows * h * s * 4,
    }

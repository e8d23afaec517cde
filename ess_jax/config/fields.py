"""Every field of the experiment config, declared once: one frozen record per section (the
objective's in objective_fields.py), each field with its default, its domain and its meaning
(`knobs.knob`). `ConfigFields` is the whole config; defaults.base_config builds the ConfigDict
from it, and schema.check checks a config against it.

Every off-policy knob of docs/method.md is off by default: rollout.temperature=1, top_k=0,
top_p=1, precision=float32, lag=0, external_fraction=0, train.updates_per_batch=1.

The tables derived from the records: `RECORDS` (path -> `knobs.Field`), `DOMAINS` (every
numeric field's `Domain`), `CHOICES` (the fixed-choice string fields' values), `FREE_STRINGS`
(the string fields without a fixed set, with what checks each) and `FREE_FORM` (the mappings
whose keys a config chooses).
"""

from __future__ import annotations

import dataclasses

from ess_jax.config.domains import (
    ADVANTAGE_MODES,
    ASYNC_ROLES,
    ATTENTION_IMPLS,
    COLLECTIVE_MATMULS,
    DECODE_ATTENTIONS,
    FLAG,
    KV_CACHE_PRECISIONS,
    LORA_BASE_PRECISIONS,
    LR_SCHEDULES,
    MESH_AXIS,
    MODEL_DTYPES,
    MOE_IMPLS,
    NONNEG,
    POSITIVE,
    PRECISIONS,
    ROUTING_REPLAYS,
    TRAIN_MODES,
    UNIT,
    UNIT_OPEN_HI,
    Choice,
    Domain,
    Free,
    FreeForm,
    ints,
)
from ess_jax.config.knobs import fields, knob, section
from ess_jax.config.objective_fields import ObjectiveFields

frozen = dataclasses.dataclass(frozen=True)


@frozen
class MeshFields:
    """mesh: the device mesh ("data", "fsdp", "tensor", "expert"); -1: the remaining devices."""

    data: int = knob(1, MESH_AXIS, "data-parallel ranks (each its own rows of the batch)")
    fsdp: int = knob(-1, MESH_AXIS, "ranks sharding the params and optimizer state (FSDP)")
    tensor: int = knob(1, MESH_AXIS, "ranks sharding each matmul (tensor parallel)")
    expert: int = knob(
        1, MESH_AXIS, "ranks splitting each MoE layer's experts, and the batch outside MoE blocks"
    )


@frozen
class LoraFields:
    """model.lora: LoRA adapters x W + (alpha / rank) x A B on the block matmuls (model/lora.py).

    rank 0 is full fine-tuning; rank > 0 freezes the base and trains the adapters on the
    `targets` matmuls, in the SFT warm start too."""

    rank: int = knob(0, ints(0), "the adapters' rank; 0: no adapters, full fine-tuning")
    alpha: float = knob(16.0, POSITIVE, "the adapters' scale is alpha / rank")
    # > 0 makes the trainer's log-probs a noisy copy of the sampler's: an on-policy ratio is no
    # longer 1
    dropout: float = knob(
        0.0, UNIT_OPEN_HI, "dropout on the adapters' inputs, in the trainer's forwards only"
    )
    targets: str = knob(
        "q,k,v,o,gate,up,down",
        Free("comma-separated LORA_TARGETS (schema.check)"),
        "the matmuls that get adapters, comma-separated (any of the seven)",
    )
    # QLoRA (model/quant.py): int8 / int4 store the seven block matrices as codes with
    # per-output-channel scales, dequantized inside the forward; needs rank > 0
    base_precision: str = knob(
        "compute", Choice(LORA_BASE_PRECISIONS), "the frozen base's storage: compute | int8 | int4"
    )


@frozen
class ModelFields:
    """model: the policy network, its numerics and, for the embedded model, its shape."""

    source: str = knob(
        "embedded",
        Free("embedded | smollm2 | a Hugging Face directory or .gguf file (validate)"),
        "the policy: embedded | smollm2 | path to an HF dir or a .gguf file",
    )
    dtype: str = knob(
        "float32", Choice(MODEL_DTYPES), "the trainer's compute dtype (params: float32 masters)"
    )
    logits_chunk: int = knob(
        0, ints(0), "> 0: full-sequence forwards do the LM head and attention in chunks of this"
    )
    remat: bool = knob(False, FLAG, "recompute each block in the backward pass (long sequences)")
    # model/remat.py: from fsdp 8 the TPU compiler otherwise undoes remat (docs/tpu.md)
    remat_ordered: bool = knob(
        False, FLAG, "with remat: run the backward layer by layer (recompute after the cotangent)"
    )
    # TPU only (parallel/sharding.py compiler_options): "none" keeps the RL / SFT steps' and the
    # scoring passes' FSDP gathers apart from their matmuls (the compiled steps both ways:
    # docs/tpu.md, memory/tpu_terms.py)
    collective_matmul: str = knob(
        "auto", Choice(COLLECTIVE_MATMULS), "TPU: libtpu's collective matmuls (auto) or none"
    )
    # the same programs: libtpu's latency-hiding scheduler aims to hold their live buffers under
    # this share of HBM (95 by default; the compiled steps at lower limits: docs/tpu.md)
    scheduler_memory_percent: int = knob(
        0, ints(0, hi=100), "TPU: the train programs' scheduler memory limit, % of HBM; 0: libtpu's"
    )
    # einsum | cudnn (NVIDIA GPU, bf16) | xla | splash (TPU, float32 / bf16; training and
    # scoring forwards only)
    attention_impl: str = knob(
        "einsum", Choice(ATTENTION_IMPLS), "attention of training forwards and the prefill"
    )
    # dense | blockwise (any backend; the same numbers to float32 rounding)
    decode_attention: str = knob(
        "dense",
        Choice(DECODE_ATTENTIONS),
        "sampler decode steps: whole cache (dense) or its filled blocks only (blockwise)",
    )
    decode_block: int = knob(
        256, ints(1), "decode_attention blockwise: positions per block of the KV cache"
    )
    # a mixture-of-experts source (Qwen3-MoE) only; validate refuses them on a dense model
    routing_replay: str = knob(
        "none",
        Choice(ROUTING_REPLAYS),
        "MoE: the trainer's experts: its own top-k (none) or those the sampler recorded (sampler)",
    )
    moe_aux_loss_coef: float = knob(
        0.0, NONNEG, "MoE: weight of the router's load-balancing loss in the RL and SFT losses"
    )
    # dense (any backend) | grouped (megablox's grouped matmul: TPU; model/grouped.py)
    moe_impl: str = knob(
        "dense", Choice(MOE_IMPLS), "MoE: every expert on every token (dense) or each token's top-k"
    )
    # the embedded model only: a char-level Llama-style decoder trained from scratch
    hidden_size: int = knob(64, ints(1), "embedded model: the width D")
    intermediate_size: int = knob(192, ints(1), "embedded model: the MLP width")
    num_layers: int = knob(2, ints(1), "embedded model: decoder blocks")
    num_heads: int = knob(4, ints(1), "embedded model: query heads")
    num_kv_heads: int = knob(2, ints(1), "embedded model: key / value heads (divides num_heads)")
    head_dim: int = knob(16, ints(1), "embedded model: the head dimension")
    tie_embeddings: bool = knob(True, FLAG, "embedded model: the LM head is the embedding")
    rope_theta: float = knob(10000.0, POSITIVE, "embedded model: RoPE's base frequency")
    init_seed: int = knob(0, ints(0), "embedded model: the seed of its initial params")
    # the embedded model as a Qwen3-MoE (q/k norms, every layer sparse) when num_experts > 0
    num_experts: int = knob(0, ints(0), "embedded model: experts per layer; 0: dense MLPs")
    num_experts_per_tok: int = knob(2, ints(1), "embedded model: top-k experts per token")
    moe_intermediate_size: int = knob(64, ints(1), "embedded model: an expert's MLP width")
    norm_topk_prob: bool = knob(True, FLAG, "embedded model: renormalise the top-k weights")
    lora: LoraFields = section(LoraFields)


@frozen
class TaskFields:
    """task: the prompts and their verifiable reward."""

    name: str = knob(
        "addition",
        Free("a synthetic task or local dataset of rl/experiment.py (validate)"),
        "addition | sort | countdown | gsm8k | deepscaler | math",
    )
    reward: str = knob(
        "addition", Free("a reward of ess_jax/rewards (validate)"), "the reward function's name"
    )
    difficulty: dict = knob(
        {},
        FreeForm("the task's own dials, checked by building the task (validate)"),
        "the synthetic tasks' dials, e.g. {'digits': 2}",
    )
    manual_dir: str = knob(
        "",
        Free("a directory (validate, for the local datasets)"),
        "the local files of gsm8k / deepscaler / math",
    )
    # set it when manual_dir is read-only
    cache_dir: str = knob(
        "",
        Free("a directory ('': beside manual_dir)"),
        "where the tfds build of those files goes ('': <manual_dir>/_tfds)",
    )
    test_split: str = knob(
        "test", Free("a split of the task's files"), "the held-out split eval draws from"
    )
    num_train: int = knob(0, ints(0), "training examples used; 0: all")
    num_test: int = knob(0, ints(0), "held-out examples loaded; 0: all")


@frozen
class DataFields:
    """data: how prompts are batched."""

    prompts_per_step: int = knob(16, ints(1), "prompts per RL step (x rollout.group_size rows)")
    buckets: tuple[int, ...] = knob(
        (16, 32, 64, 128, 256, 512), ints(1), "the widths prompts are left-padded up to"
    )
    # False: a prompt longer than the largest bucket stops the run at startup, naming it
    drop_long_prompts: bool = knob(
        False, FLAG, "leave out prompts over the largest bucket (train and held-out), logged"
    )


@frozen
class RolloutFields:
    """rollout: the sampler and pi_b, and the advantages of what it draws."""

    group_size: int = knob(8, ints(1), "G samples per prompt")
    max_new_tokens: int = knob(16, ints(1), "T, the response length")
    temperature: float = knob(1.0, NONNEG, "the sampler's temperature; 0: greedy")
    top_k: int = knob(0, ints(0), "keep the k likeliest tokens; 0: off")
    top_p: float = knob(1.0, Domain(lo=0.0, hi=1.0, lo_open=True), "nucleus mass kept; 1: off")
    # ess_jax/sampling/precision.py says what each format quantizes
    precision: str = knob("float32", Choice(PRECISIONS), "the sampler's weights and compute")
    lag: int = knob(0, ints(0), "sample with the policy `lag` versions old (sync loop)")
    external_fraction: float = knob(
        0.0, UNIT_OPEN_HI, "the share of each group drawn by another model"
    )
    external_checkpoint: str = knob(
        "",
        Free("as model.source (validate, with external_fraction > 0)"),
        "the other model (as model.source)",
    )
    external_precision: str = knob(
        "float32", Choice(PRECISIONS), "the other model's sampler format"
    )
    # fp8: float8_e4m3fn, one float32 scale per token and kv head (model/kv_cache.py)
    kv_cache_precision: str = knob(
        "compute", Choice(KV_CACHE_PRECISIONS), "the sampler's KV cache: compute | bfloat16 | fp8"
    )
    stop_ids: tuple[int, ...] = knob(
        (), ints(0), "token ids that end a response; (): the tokenizer's EOS and chat end tokens"
    )
    advantage_mode: str = knob(
        "grpo", Choice(ADVANTAGE_MODES), "group-relative advantages: grpo | drgrpo | rloo"
    )
    dynamic_sampling: bool = knob(False, FLAG, "DAPO: drop groups whose rewards are all equal")
    # 0 masks the dropped groups out (ess_jax/rl/dynamic_sampling.py)
    max_resample_rounds: int = knob(
        0, ints(0), "dynamic_sampling: refill dropped groups from up to this many fresh rounds"
    )
    sample_microbatches: int = knob(1, ints(1), "sample the rollout batch in this many calls")
    overlong_buffer: int = knob(0, ints(0), "DAPO's soft overlong penalty buffer (tokens); 0: off")
    # train.mode "async" only (ess_jax/rl/actor_learner.py): the sampler waits, never drops
    max_lag: int = knob(
        1, ints(0), "async: the most steps between the version that drew a batch and its step"
    )
    # ess_jax/rl/pacing.py: lowers the lag budget while the running step ESS is under it, and
    # raises it (up to max_lag) above
    target_ess: float = knob(0.0, UNIT_OPEN_HI, "async: the ESS the lag budget is paced to; 0: off")


@frozen
class OptimFields:
    """optim: the AdamW optimizer of the RL steps and its learning-rate schedule (rl/optim.py)."""

    lr: float = knob(1e-5, POSITIVE, "the learning rate after warmup")
    warmup_steps: int = knob(0, ints(0), "linear warmup from 0 over this many updates")
    schedule: str = knob(
        "constant",
        Choice(LR_SCHEDULES),
        "after warmup: constant, or cosine to lr * final_lr_fraction",
    )
    final_lr_fraction: float = knob(1.0, UNIT, "cosine: the last update's lr / lr")
    b1: float = knob(0.9, UNIT_OPEN_HI, "Adam's first-moment decay")
    b2: float = knob(0.999, UNIT_OPEN_HI, "Adam's second-moment decay")
    weight_decay: float = knob(0.0, NONNEG, "AdamW's decoupled weight decay")
    max_grad_norm: float = knob(1.0, NONNEG, "global gradient-norm clip; 0: no clipping")


@frozen
class TrainFields:
    """train: the RL loop, its checkpoints and the sync or async schedule."""

    steps: int = knob(100, ints(0), "RL steps (rollout batches)")
    updates_per_batch: int = knob(1, ints(1), "> 1: several optimizer steps per rollout batch")
    num_microbatches: int = knob(1, ints(1), "micro-batches per optimizer step")
    checkpoint_every: int = knob(50, ints(1), "save a checkpoint every this many steps")
    keep_checkpoints: int = knob(2, ints(1), "the newest checkpoints kept")
    # an SFT warm start shared by many RL runs (model.source=<workdir>/hf), or an external model
    export_hf: bool = knob(
        False, FLAG, "write the final params and tokenizer as an HF checkpoint to <workdir>/hf"
    )
    # newer ones are moved aside, never deleted; False: stop with the error
    restore_fallback: bool = knob(
        True, FLAG, "resume from the newest checkpoint that reads back, with a warning"
    )
    # sync: sample then train on every device in turn; async: a sampler thread on a rollout
    # mesh and the trainer on a train mesh at once (ess_jax/rl/actor_learner.py)
    mode: str = knob("sync", Choice(TRAIN_MODES), "sync | async")
    async_rollout_devices: int = knob(
        0, ints(0), "async: devices of the rollout mesh (0: half); the train mesh has the rest"
    )
    async_rollout_tensor: int = knob(1, ints(1), "async: the rollout mesh's tensor axis")
    sync_every: int = knob(1, ints(1), "async: push the trainer's params every k RL steps")
    # both: the sampler thread and the trainer in this process; trainer / sampler: this
    # program is one group of a two-program run (ess_jax/rl/groups.py; main's --role sets it)
    async_role: str = knob("both", Choice(ASYNC_ROLES), "async: both | trainer | sampler")
    async_address: str = knob(
        "",
        Free("host:port, schema.check (async roles)"),
        "async roles: the trainer group's host:port, where the sampler group connects",
    )
    # the trainer's and the scoring passes' forwards on packed rows, not one padded row per
    # sequence (ess_jax/rl/packed.py); the same numbers to float32 rounding
    pack_rows: bool = knob(False, FLAG, "pack the sequences end to end into fixed-length rows")
    pack_length: int = knob(
        0, ints(0), "train.pack_rows: the packed rows' length; 0: prompt width + max_new_tokens"
    )
    # "rows": train.num_microbatches micro-batches of B / M rows each, packed cell by cell;
    # "tokens": micro-batches cut by a token budget, one packed row of pack_length per device
    # each, as many as the update's sequences need (data/packing.regroup)
    pack_microbatches: str = knob(
        "rows", Choice(("rows", "tokens")), "train.pack_rows: micro-batches by rows | tokens"
    )


@frozen
class SftFields:
    """sft: the supervised warm start on demonstrations before RL (rl/sft.py)."""

    steps: int = knob(0, ints(0), "SFT steps before RL; 0: none")
    batch_size: int = knob(64, ints(1), "demonstrations per SFT step")
    lr: float = knob(3e-3, POSITIVE, "the SFT learning rate (cosine to a tenth)")
    warmup_steps: int = knob(20, ints(0), "SFT linear warmup steps")
    seq_len: int = knob(32, ints(1), "prompt + demonstration + eos, right-padded to this")
    demo_noise: float = knob(0.0, UNIT, "share of demonstrations with one wrong digit")


@frozen
class EvalFields:
    """eval: the held-out evaluation (rl/heldout.py)."""

    every: int = knob(25, ints(0), "evaluate every this many steps; 0: no eval")
    num_examples: int = knob(128, ints(0), "held-out examples; 0: the whole split")
    batch_size: int = knob(32, ints(1), "prompts per eval batch")
    k: int = knob(4, ints(1), "samples per prompt (pass@k)")
    temperature: float = knob(1.0, NONNEG, "eval's sampling temperature; 0: greedy")
    max_new_tokens: int = knob(16, ints(1), "eval's response length")
    # float32 scores the policy itself; a lower one holds the sampler's copy in that format
    # (with model.lora the merge writes it straight in) and the eval numbers then include the
    # format's rounding (docs/configs.md; docs/memory.md: 8B LoRA on one GPU)
    precision: str = knob("float32", Choice(PRECISIONS), "eval's sampler format")
    # bfloat16 / fp8 shrink the cache of long evals; the eval numbers then include its rounding
    kv_cache_precision: str = knob(
        "compute", Choice(KV_CACHE_PRECISIONS), "eval's KV cache: compute | bfloat16 | fp8"
    )


@frozen
class ConfigFields:
    """The experiment config: every section, in the order base_config lists them."""

    seed: int = knob(0, ints(0), "the run's seed (prompt order, sampling, SFT demonstrations)")
    mesh: MeshFields = section(MeshFields)
    model: ModelFields = section(ModelFields)
    task: TaskFields = section(TaskFields)
    data: DataFields = section(DataFields)
    rollout: RolloutFields = section(RolloutFields)
    objective: ObjectiveFields = section(ObjectiveFields)
    optim: OptimFields = section(OptimFields)
    train: TrainFields = section(TrainFields)
    sft: SftFields = section(SftFields)
    eval: EvalFields = section(EvalFields)


RECORDS = fields(ConfigFields)
DOMAINS = {p: r.domain for p, r in RECORDS.items() if isinstance(r.domain, Domain)}
CHOICES = {p: r.domain.values for p, r in RECORDS.items() if isinstance(r.domain, Choice)}
FREE_STRINGS = {p: r.domain.checked_by for p, r in RECORDS.items() if isinstance(r.domain, Free)}
FREE_FORM = tuple(p for p, r in RECORDS.items() if isinstance(r.domain, FreeForm))

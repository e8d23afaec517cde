"""ModelConfig: the decoder's shapes, numerics and options in one frozen (hashable) record, the
key of the cached builders in decoder.py, sampling/sampler.py and rl/lora_policy.py.
`decoder.Decoder` is built from it; io/weights.py and io/gguf_llama.py read one from a
checkpoint's config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from ess_jax.config.domains import (
    ATTENTION_IMPLS,
    COLLECTIVE_MATMULS,
    DECODE_ATTENTIONS,
    LORA_BASE_PRECISIONS,
    MOE_IMPLS,
    ROUTING_REPLAYS,
)
from ess_jax.model import lora


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    hidden_size: int = 64  # D
    intermediate_size: int = 128  # F
    num_layers: int = 2  # L
    num_heads: int = 4  # H
    num_kv_heads: int = 2  # N
    head_dim: int = 16  # K
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # e.g. llama3 scaling, as items
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    max_position_embeddings: int = 4096
    dtype: str = "float32"  # compute dtype: float32 | bfloat16
    family: str = "llama"  # llama | qwen2 | qwen3 | qwen3_moe
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # > 0: full-sequence forwards (the trainer's log-probs, the sampler's prefill) compute the
    # LM head and the attention scores this many positions at a time, so neither [B, T, V]
    # logits nor [B, H, T, S] scores exist at once; 0: all at once
    logits_chunk: int = 0
    # recompute each block in the backward pass (keeps only the [B, T, D] block inputs)
    remat: bool = False
    # with remat: each layer's recompute waits for its output cotangent, and its input
    # cotangent for its weight gradient (remat.py); else jax.checkpoint, which XLA may reorder
    remat_ordered: bool = False
    # the train mesh's programs (RL / SFT step, scoring passes) on a TPU: libtpu's collective
    # matmuls as its compiler chooses ("auto") or none ("none": parallel/sharding.py
    # compiler_options); no effect on other backends
    collective_matmul: str = "auto"
    # the same programs on a TPU: > 0, the percentage of the device's HBM under which libtpu's
    # latency-hiding scheduler keeps their live buffers (parallel/sharding.py); 0: libtpu's own
    scheduler_memory_percent: int = 0
    # attention of the several-query forwards (training, the prefill; decode steps take
    # `decode_attention`'s one-query path): "einsum" (layers.attention, any backend), "cudnn"
    # (jax.nn.dot_product_attention's fused kernel: NVIDIA GPUs, bf16), "xla" (jax's
    # reference path of the same call; layers.fused_attention) or "splash" (jax's Pallas
    # splash kernel: TPUs, float32 / bf16; the trainer's and scorer's forwards only, the
    # prefill stays einsum; splash.py)
    attention_impl: str = "einsum"
    # attention of the sampler's decode steps (one query per row against the KV cache): "dense"
    # (layers.decode_attention over the segment's whole cache) or "blockwise" (blockwise_decode:
    # only the blocks of `decode_block` positions up to the step's own; the same numbers to
    # float32 rounding)
    decode_attention: str = "dense"
    decode_block: int = 256
    # the inputs of the seven block matmuls (q, k, v, o, gate, up, down) rounded through
    # float8_e4m3fn with a per-token scale (layers.fp8_activation): the sampler's "fp8_act"
    activation_fp8: bool = False
    # LoRA adapters on the block matmuls (lora.py): rank 0 = none; each targeted weight W
    # computes x W + (lora_alpha / lora_rank) x A B
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = lora.TARGETS
    # dropout on each adapter's input, x A -> dropout(x) A (PEFT's lora_dropout), in the forwards
    # that get per-row dropout keys: the trainer's differentiated ones (lora.py `project`)
    lora_dropout: float = 0.0
    # the block matrices' storage (quant.py): "compute" = the param dtype; "int8" / "int4" =
    # codes with per-output-channel scales, dequantized inside the forward (QLoRA: lora_rank > 0)
    lora_base_precision: str = "compute"
    # mixture of experts (moe.py, the Qwen3-MoE family): 0 experts = every block a dense MLP.
    # Layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers
    # (transformers' Qwen3MoeDecoderLayer); a sparse layer routes each token to its
    # num_experts_per_tok experts of width moe_intermediate_size, a dense one keeps the
    # intermediate_size MLP. norm_topk_prob: the top-k probabilities renormalised to sum to 1
    num_experts: int = 0  # E
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # the trainer's use of an MoE model (rl/steps.py): "sampler" replays the routing the
    # sampler recorded in its forwards of a rollout batch (moe.route); moe_aux_loss_coef > 0
    # adds that times the router's load-balancing loss (moe.router_loss) to the RL and SFT
    # losses (transformers' router_aux_loss_coef)
    routing_replay: str = "none"
    moe_aux_loss_coef: float = 0.0
    # the experts' computation (moe.py): "dense" (every expert on every token, any backend) or
    # "grouped" (each token's top-k experts only, megablox's grouped matmul: TPUs; grouped.py)
    moe_impl: str = "dense"

    def __post_init__(self):
        if self.num_experts:
            self._check_experts()
        if self.lora_base_precision not in LORA_BASE_PRECISIONS:
            raise ValueError(
                f"ModelConfig.lora_base_precision: unknown {self.lora_base_precision!r}; "
                f"one of {', '.join(LORA_BASE_PRECISIONS)}"
            )
        if self.lora_base_precision != "compute" and not self.lora_rank:
            raise ValueError(
                f"ModelConfig.lora_base_precision {self.lora_base_precision!r} quantizes LoRA's "
                "frozen base: needs lora_rank > 0"
            )
        if not 0.0 <= self.lora_dropout < 1.0 or (self.lora_dropout and not self.lora_rank):
            raise ValueError(
                f"ModelConfig.lora_dropout {self.lora_dropout}: must be in [0, 1), and 0 "
                "without adapters (lora_rank 0)"
            )
        if self.routing_replay not in ROUTING_REPLAYS:
            raise ValueError(
                f"ModelConfig.routing_replay: unknown {self.routing_replay!r}; "
                f"one of {', '.join(ROUTING_REPLAYS)}"
            )
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(
                f"ModelConfig.moe_impl: unknown {self.moe_impl!r}; one of {', '.join(MOE_IMPLS)}"
            )
        if self.collective_matmul not in COLLECTIVE_MATMULS:
            raise ValueError(
                f"ModelConfig.collective_matmul: unknown {self.collective_matmul!r}; "
                f"one of {', '.join(COLLECTIVE_MATMULS)}"
            )
        if not 0 <= self.scheduler_memory_percent <= 100:
            raise ValueError(
                f"ModelConfig.scheduler_memory_percent {self.scheduler_memory_percent}: must be "
                "in [0, 100] (0: libtpu's own limit)"
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"ModelConfig.attention_impl: unknown {self.attention_impl!r}; "
                f"one of {', '.join(ATTENTION_IMPLS)}"
            )

        if self.decode_attention not in DECODE_ATTENTIONS:
            raise ValueError(
                f"ModelConfig.decode_attention: unknown {self.decode_attention!r}; "
                f"one of {', '.join(DECODE_ATTENTIONS)}"
            )
        if self.decode_block < 1:
            raise ValueError(f"ModelConfig.decode_block {self.decode_block}: must be >= 1")

    def _check_experts(self):
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"ModelConfig.num_experts_per_tok {self.num_experts_per_tok}: must be in "
                f"[1, num_experts = {self.num_experts}]"
            )
        if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
            raise ValueError(
                f"ModelConfig: moe_intermediate_size {self.moe_intermediate_size} and "
                f"decoder_sparse_step {self.decoder_sparse_step} must be >= 1 with experts"
            )
        if self.lora_rank:
            raise ValueError(
                "ModelConfig: LoRA adapters (lora_rank > 0) on a mixture-of-experts model "
                "(num_experts > 0) are not supported"
            )

    def is_sparse(self, layer: int) -> bool:
        """Whether block `layer` is a mixture of experts (moe.py) rather than a dense MLP."""
        return (
            self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
            and layer not in self.mlp_only_layers
        )

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)

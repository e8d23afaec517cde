"""A decoder block's self-attention: the q / k / v / o projections (Qwen2's biases, Qwen3's
per-head q / k RMSNorm), RoPE, the KV cache's write and read, and the attention
implementation each forward takes (`ModelConfig.attention_impl`, `decode_attention`).

Axis alphabet as in decoder.py: B batch, T queries, S keys, D model width, H query heads, N kv
heads, K head dim; GQA groups the H query heads by their kv head.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from ess_jax.model import kv_cache, lora, param_init, splash
from ess_jax.model.blockwise_decode import decode_step_attention
from ess_jax.model.config import ModelConfig
from ess_jax.model.layers import (
    apply_rope,
    attention,
    fused_attention,
    matmul_input,
    rms_norm,
    rope_inv_freq,
)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, n, k = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if h % n:
            raise ValueError(f"num_heads={h} must be a multiple of num_kv_heads={n}")
        s = 1.0 / math.sqrt(d)
        self.q = param_init.matrix(cfg, rngs, "q", (d, h, k), ("embed", "heads", "head_dim"), s)
        self.k = param_init.matrix(cfg, rngs, "k", (d, n, k), ("embed", "kv_heads", "head_dim"), s)
        self.v = param_init.matrix(cfg, rngs, "v", (d, n, k), ("embed", "kv_heads", "head_dim"), s)
        o_axes, o_scale = ("heads", "head_dim", "embed"), 1.0 / math.sqrt(h * k)
        self.o = param_init.matrix(cfg, rngs, "o", (h, k, d), o_axes, o_scale)
        if cfg.qkv_bias:
            self.q_bias = param_init.zeros((h, k), ("heads", "head_dim"))
            self.k_bias = param_init.zeros((n, k), ("kv_heads", "head_dim"))
            self.v_bias = param_init.zeros((n, k), ("kv_heads", "head_dim"))
        if cfg.qk_norm:
            self.q_norm = param_init.ones((k,), ("norm",))
            self.k_norm = param_init.ones((k,), ("norm",))
        self.lora = lora.make_adapters(cfg, lora.ATTENTION_TARGETS)

    def __call__(
        self,
        cfg,
        x_BxTxD,
        positions_BxT,
        kv_mask_BxS,
        cache,
        cache_index,
        attend_len,
        lora_keys=None,
    ):
        dt = cfg.compute_dtype
        x_BxTxD = matmul_input(x_BxTxD, cfg.activation_fp8)
        q = lora.project(cfg, self, "q", x_BxTxD, keys=lora_keys)
        k = lora.project(cfg, self, "k", x_BxTxD, keys=lora_keys)
        v = lora.project(cfg, self, "v", x_BxTxD, keys=lora_keys)
        if cfg.qkv_bias:
            q, k, v = (
                q + self.q_bias[...].astype(dt),
                k + self.k_bias[...].astype(dt),
                v + self.v_bias[...].astype(dt),
            )
        if cfg.qk_norm:
            q = rms_norm(q, self.q_norm[...], cfg.rms_norm_eps)
            k = rms_norm(k, self.k_norm[...], cfg.rms_norm_eps)
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, dict(cfg.rope_scaling or ()))
        q, k = apply_rope(q, positions_BxT, inv_freq), apply_rope(k, positions_BxT, inv_freq)

        t = x_BxTxD.shape[1]
        # Keys/values as [B, N, S, K]: the layout the score einsum reads without a transpose
        # (the KV cache stores keys as [B, N, K, S] instead: kv_cache).
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        b, _, h, kd = q.shape
        n = k.shape[1]
        q = q.reshape(b, t, n, h // n, kd)  # GQA: group query heads by their kv head
        # static when the queries are key positions offset .. offset + t - 1 (causal blocks)
        offset = cache_index if isinstance(cache_index, int) else None
        if cache is None:  # full-sequence forward: keys are this call's tokens
            k_all, v_all, new_cache, query_idx, offset = k, v, None, jnp.arange(t), 0
        else:  # write this call's keys into the cache (keys transposed: kv_cache), in place
            new_cache = kv_cache.write(cache, k, v, cache_index)
            query_idx = cache_index + jnp.arange(t)
            if t == 1:  # a decode step
                out = decode_step_attention(
                    cfg, q[:, 0], new_cache, kv_mask_BxS, query_idx[0], attend_len
                )
                out = matmul_input(out.reshape(b, 1, h, kd), cfg.activation_fp8, 2)
                return lora.project(cfg, self, "o", out, n_in=2), new_cache
            k_all, v_all = kv_cache.read(new_cache, dt)
            if attend_len is not None:  # attend over the filled prefix of the cache only
                k_all, v_all = k_all[..., :attend_len], v_all[:, :, :attend_len]
                kv_mask_BxS = kv_mask_BxS[:, :attend_len]
            k_all = k_all.transpose(0, 1, 3, 2)  # several queries (the prefill): [B, N, S, K]

        if cfg.attention_impl == "splash" and cache is None and t > 1 and splash.takes(dt):
            # the trainer's and the scorer's forwards (queries = keys 0 .. t - 1); the
            # sampler's prefill keeps the einsum path. Segments: pads 0, real tokens 1
            out = splash.splash_attention(q, k_all, v_all, kv_mask_BxS.astype(jnp.int32))
        elif t > 1 and (
            cfg.attention_impl == "xla"
            # the cuDNN path is bfloat16 only: float32 forwards (a float32 sampler) use einsum
            or (cfg.attention_impl == "cudnn" and dt == jnp.bfloat16)
        ):
            causal = offset == 0 and t == k_all.shape[2]  # queries = key positions 0 .. t - 1
            out = fused_attention(
                q, k_all, v_all, kv_mask_BxS, query_idx, cfg.attention_impl, causal
            )
        else:
            out = attention(q, k_all, v_all, kv_mask_BxS, query_idx, cfg.logits_chunk, offset)
        out = matmul_input(out.reshape(b, t, h, kd), cfg.activation_fp8, 2)
        return lora.project(cfg, self, "o", out, n_in=2, keys=lora_keys), new_cache

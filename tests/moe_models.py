"""The tiny mixture-of-experts model and the float64 load-balancing loss that tests/test_moe.py,
test_routing_replay.py and test_moe_grouped.py share (not a test module: no tests here)."""

import jax
import jax.numpy as jnp
import numpy as np
from conftest import tiny_model_cfg

from ess_jax.model import decoder as model


def tiny_moe():
    """(cfg, params): a tiny random Qwen3-MoE, float32: 3 layers (layer 1 dense: sparse layers 0
    and 2), width 32, 8 experts of width 16, top-2 renormalised, peaked routers (numpy init,
    every path non-trivial)."""
    cfg = tiny_model_cfg(
        intermediate_size=48,
        num_layers=3,
        qk_norm=True,
        family="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=True,
        mlp_only_layers=(1,),
        max_position_embeddings=64,
        pad_token_id=0,
    )
    rng = np.random.default_rng(0)

    def init(path, x):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            return jnp.asarray(1 + 0.1 * rng.standard_normal(x.shape), jnp.float32)
        scale = 1.0 if "embed" in name else 3.0 if "router" in name else 1.5
        fan_in = x.shape[-2] if x.ndim > 2 else x.shape[0]
        return jnp.asarray(scale * rng.standard_normal(x.shape) / np.sqrt(fan_in), jnp.float32)

    return cfg, jax.tree_util.tree_map_with_path(init, model.abstract_params(cfg))


def np_load_balancing(logits, top_k, mask=None):
    """float64 transformers' load_balancing_loss_func: logits [L, N, E], mask [N]."""
    logits = np.asarray(logits, np.float64)
    e = logits.shape[-1]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    w = np.ones(logits.shape[1]) if mask is None else np.asarray(mask, np.float64)
    counts, probs = np.zeros(e), np.zeros(e)
    for layer in p:
        top = np.argsort(-layer, axis=-1, kind="stable")[:, :top_k]
        for n in range(layer.shape[0]):
            counts[top[n]] += w[n]
        probs += (layer * w[:, None]).sum(0)
    rows = logits.shape[0] * w.sum()
    return e * np.sum((counts / rows) * (probs / rows))

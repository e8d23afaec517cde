"""The mixture-of-experts feed-forward block of the Qwen3-MoE family, and the router's auxiliary
load-balancing loss.

Axis alphabet as in decoder.py, plus E experts, X the experts a token is routed to (top-k,
`num_experts_per_tok`) and F an expert's width (`moe_intermediate_size`).

Routing follows transformers' Qwen3MoeTopKRouter: router logits x W_r ([D, E], in the compute
dtype), softmax over the experts in float32, the top-k probabilities, divided by their sum
when `norm_topk_prob`, then cast back to the compute dtype. Each expert is a SwiGLU,
down(silu(x gate) * (x up)), and a token's output is the sum of its X experts' outputs, each
times its routing weight. There is no capacity limit and no token dropping: every token gets
its X experts, whatever the others do, so the block is a function of each token alone.

The experts' computation here is the dense path: every expert runs on every token, and the
routing weights enter as a [B, T, E] combine matrix that is zero off each token's top-k. It is
exact (a non-selected expert's output is multiplied by 0 and adds 0, and its weights get a zero
gradient from that token), has no data-dependent shapes (jit-able, differentiable, the same
program for any routing) and shards over the experts with GSPMD alone: with the expert stacks
split over the `expert` mesh axis (also a batch axis: parallel/sharding.py) GSPMD places the
contraction over the experts and its collectives itself. Its cost is E / X times the routed
flops and a [B, T, E, F] activation: the path for CPU tests and small models. The weights of
all experts are stacked, expert axis first ([E, D, F] and [E, F, D], logical axis "expert"),
the layout grouped-matmul kernels read. The combine matrix multiplies the SwiGLU activation
before the down projection, so the down projection and the sum over experts are one contraction
over (E, F) and no [B, T, E, D] tensor exists. transformers weighs each expert's output after
its down projection instead: the same function, with other rounding points in bfloat16 (and,
with fp8 activations, a scale per token where transformers' would be per token and expert); the
parity tests compare float32 logits.

Routing replay (R3, arXiv 2510.11370): `route` takes a token's experts from a recorded
routing instead of its own top-k where one is given (`replay_BxTxX`, NOT_RECORDED = -1: the
block's own top-k). The routing weights are still the block's own softmax probabilities, read at
the recorded experts (and renormalised under `norm_topk_prob`), so the router keeps its
gradient: only the discrete choice is replayed, as Megatron's router replay, verl's R3 and
MaxText do. Where the recorded experts are the block's own top-k, the replayed block is the
same function, bit for bit.

`load_balancing_loss` is transformers' `load_balancing_loss_func` (the Switch Transformer's
auxiliary loss) on the router logits of the sparse layers; `router_loss` applies it to a
forward's `Routed` record (model.moe_aux_loss_coef in the RL and SFT losses).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ess_jax.model import grouped, param_init
from ess_jax.model.config import ModelConfig
from ess_jax.model.layers import dense, matmul_input

# The MoE block's parameters are `router` and the expert stacks `expert_gate` / `expert_up` /
# `expert_down`, named apart from the dense MLP's gate / up / down so that code keyed on a
# matrix's name (quant.INPUT_AXES) reads their own layout.
# a routing entry with no recorded experts: the block routes that token by its own top-k
NOT_RECORDED = -1
# the batch key of a recorded routing [B, L, Ls, X] in the trainer's forwards (rl/update.py
# puts a rollout's there under model.routing_replay "sampler")
ROUTING = "routing"


class Routed(NamedTuple):
    """What the sparse layers of one forward chose, stacked in layer order (Ls = the number of
    sparse layers, `sparse_layers`): `experts` [B, T, Ls, X] int32 (the replayed ones where a
    replay was given) and the router `logits` [Ls, B, T, E] in the compute dtype."""

    experts: jax.Array
    logits: jax.Array


def sparse_layers(cfg: ModelConfig) -> tuple[int, ...]:
    """The indices of the sparse (mixture-of-experts) layers, in order: axis Ls of a routing."""
    return tuple(i for i in range(cfg.num_layers) if cfg.is_sparse(i))


def routing_shape(cfg: ModelConfig) -> tuple[int, int]:
    """(Ls, X): a token's recorded routing, its top-k experts in each sparse layer; (0, 0) for
    a dense model."""
    return len(sparse_layers(cfg)), cfg.num_experts_per_tok if cfg.num_experts else 0


def route(
    cfg: ModelConfig, logits_BxTxE: jax.Array, replay_BxTxX: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """(weights_BxTxX in the logits' dtype, experts_BxTxX int32): each token's top-k experts
    and their routing weights, as transformers' Qwen3MoeTopKRouter computes them. With
    `replay_BxTxX`, a token whose entry is recorded (not NOT_RECORDED) takes those experts, and
    its weights are this router's probabilities at them."""
    probs = jax.nn.softmax(logits_BxTxE.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if replay_BxTxX is not None:
        recorded = replay_BxTxX[..., :1] != NOT_RECORDED
        experts = jnp.where(recorded, replay_BxTxX.astype(jnp.int32), experts)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights.astype(logits_BxTxE.dtype), experts


def topk_differs(own_BxTxLsxX: jax.Array, recorded_BxTxLsxX: jax.Array) -> jax.Array:
    """[B, T, Ls] bool: where a recorded routing's expert set at a token and sparse layer is not
    `own`'s (the order within a top-k does not count); False where nothing was recorded."""
    own = jnp.sort(own_BxTxLsxX, axis=-1)
    recorded = jnp.sort(recorded_BxTxLsxX, axis=-1)
    return (own != recorded).any(-1) & (recorded_BxTxLsxX[..., 0] != NOT_RECORDED)


def combine_matrix(weights_BxTxX: jax.Array, experts_BxTxX: jax.Array, e: int) -> jax.Array:
    """[B, T, E]: each token's routing weight at its experts, 0 elsewhere (exact: the top-k
    experts are distinct, so each entry is one weight or a sum of zeros)."""
    one_hot = jax.nn.one_hot(experts_BxTxX, e, dtype=weights_BxTxX.dtype)
    return (one_hot * weights_BxTxX[..., None]).sum(-2)


class MoE(nnx.Module):
    """Router [D, E] and E SwiGLU experts, stacked: gate and up [E, D, F], down [E, F, D]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        # the router is small ([D, E]) and every rank needs all of it: not split over experts
        self.router = param_init.normal(rngs, (d, e), ("embed", None), 1.0 / math.sqrt(d))
        in_axes, out_axes = ("expert", "embed", "mlp"), ("expert", "mlp", "embed")
        self.expert_gate = param_init.normal(rngs, (e, d, f), in_axes, 1.0 / math.sqrt(d))
        self.expert_up = param_init.normal(rngs, (e, d, f), in_axes, 1.0 / math.sqrt(d))
        self.expert_down = param_init.normal(rngs, (e, f, d), out_axes, 1.0 / math.sqrt(f))

    def router_logits(self, cfg, x_BxTxD: jax.Array) -> jax.Array:
        """[B, T, E] in the compute dtype, of the block's normed input x."""
        return self._logits(cfg, matmul_input(x_BxTxD, cfg.activation_fp8))

    def _logits(self, cfg, x_BxTxD: jax.Array) -> jax.Array:
        return dense(x_BxTxD, self.router[...].astype(cfg.compute_dtype))

    def __call__(self, cfg, x_BxTxD, lora_keys=None, replay_BxTxX=None):
        """The block's output [B, T, D] in the compute dtype and what it routed: (experts
        [B, T, X] int32, router logits [B, T, E]). `replay_BxTxX`: recorded experts (`route`);
        `lora_keys` unused (ModelConfig refuses adapters on an MoE model)."""
        dt = cfg.compute_dtype
        x_BxTxD = matmul_input(x_BxTxD, cfg.activation_fp8)  # rounded once, for every matmul
        logits_BxTxE = self._logits(cfg, x_BxTxD)
        weights, experts = route(cfg, logits_BxTxE, replay_BxTxX)
        stacks = (self.expert_gate[...], self.expert_up[...], self.expert_down[...])
        if cfg.moe_impl == "grouped":  # each token's X experts only (grouped.py)
            stacks = tuple(w.astype(dt) for w in stacks)
            out = grouped.expert_ffn(x_BxTxD, weights, experts, *stacks, cfg.activation_fp8)
            return out, (experts, logits_BxTxE)
        c_BxTxE = combine_matrix(weights, experts, cfg.num_experts)
        g = jnp.einsum("btd,edf->btef", x_BxTxD, self.expert_gate[...].astype(dt))
        u = jnp.einsum("btd,edf->btef", x_BxTxD, self.expert_up[...].astype(dt))
        h_BxTxExF = matmul_input(jax.nn.silu(g) * u, cfg.activation_fp8)
        # combine before the down projection: one contraction over (E, F)
        out = dense(h_BxTxExF * c_BxTxE[..., None], self.expert_down[...].astype(dt), 2)
        return out, (experts, logits_BxTxE)


def load_balancing_loss(
    logits_LxNxE: jax.Array, top_k: int, mask_N: jax.Array | None = None
) -> jax.Array:
    """transformers' `load_balancing_loss_func`: E * sum_e f_e P_e over the sparse layers'
    router logits (L layers, N tokens each), float32. f_e: the share of (layer, token) rows
    whose top-k holds expert e (a row counts once per expert it picks, so sum_e f_e = top_k);
    P_e: the mean softmax probability of expert e; both averaged over every layer's tokens
    together, tokens weighted by `mask_N` (1: a real token; None: all). A uniform router
    gives top_k."""
    e = logits_LxNxE.shape[-1]
    probs = jax.nn.softmax(logits_LxNxE.astype(jnp.float32), axis=-1)
    _, experts = jax.lax.top_k(probs, top_k)
    picked_LxNxE = jax.nn.one_hot(experts, e, dtype=jnp.float32).sum(-2)
    w_N = jnp.ones(probs.shape[1], jnp.float32) if mask_N is None else mask_N.astype(jnp.float32)
    rows = probs.shape[0] * w_N.sum()
    f_E = jnp.einsum("lne,n->e", picked_LxNxE, w_N) / rows
    p_E = jnp.einsum("lne,n->e", probs, w_N) / rows
    return e * jnp.sum(f_E * p_E)


def router_loss(cfg: ModelConfig, routed: Routed, mask_BxT: jax.Array) -> jax.Array:
    """`load_balancing_loss` of a forward's router logits over its real tokens (`mask_BxT`,
    prompt and response: transformers weighs the tokens by the attention mask), float32."""
    logits_LsxBxTxE = routed.logits
    ls, b, t, e = logits_LsxBxTxE.shape
    mask_N = mask_BxT.reshape(b * t)
    return load_balancing_loss(
        logits_LsxBxTxE.reshape(ls, b * t, e), cfg.num_experts_per_tok, mask_N
    )

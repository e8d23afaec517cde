"""The jitted steps beside the RL update: TrainState and its sharded init, the SFT step, the
teacher-forced log-prob function and scoring pass (proximal / reference log-probs), and each
row's LoRA dropout key. The RL update itself is `ess_jax.rl.update`; `train.Run` builds and
calls them; nothing here holds run state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from ess_jax.model import lora, moe, scoring
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.rl import optim, packed


@struct.dataclass
class TrainState:
    params: dict
    opt_state: optax.OptState
    step: jax.Array  # optimizer updates applied
    nonfinite: jax.Array  # consecutive skipped (non-finite) updates
    # model.lora: the frozen base params (`params` are the adapters, lora.split); never an
    # optimizer parameter, never differentiated, not checkpointed (Run reloads model.source)
    frozen: dict | None = None


def init_state(params, tx, mesh, frozen=None) -> tuple[TrainState, TrainState]:
    """The state and its shardings. Optimizer moments take their param's layout (a bare
    `jit(tx.init)` would leave them, and optax's `count`, on one device); scalars replicate."""
    rep = sharding_lib.replicated(mesh)
    opt_sh = optax.tree_map_params(
        tx,
        lambda _, p: p.sharding,
        jax.eval_shape(tx.init, params),
        params,
        transform_non_params=lambda _: rep,
    )
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
    # Counters from host zeros: jax.device_put of a device array (jnp.int32(0)) onto a mesh of
    # several processes with one device each gives an array whose shard lists both devices,
    # which orbax's save then refuses ("input arrays must have one shard each").
    zero = lambda: sharding_lib.put_host_array(np.zeros((), np.int32), rep)  # noqa: E731
    state = TrainState(params, opt_state, zero(), zero(), frozen)
    return state, jax.tree.map(lambda x: x.sharding, state)


def with_dropout_keys(cfg, batch, seed: int, step, batch_sh, phase: int = lora.RL_DROPOUT):
    """`batch` with each row's LoRA dropout key (lora.DROPOUT_KEYS) for update `step` of
    `phase` when cfg.lora_dropout > 0, rows sharded as the batch's; else `batch` itself. The
    keys travel with their rows through the shuffle and the micro-batch split: a row's masks do
    not depend on num_microbatches or the ESS scope. `batch_sh` None: no sharding constraint."""
    if not cfg.lora_dropout:
        return batch
    keys = lora.dropout_keys(seed, step, batch["tokens"].shape[0], phase)
    if batch_sh is not None:
        keys = jax.lax.with_sharding_constraint(keys, batch_sh)
    return {**batch, lora.DROPOUT_KEYS: keys}


def make_sft_step(cfg, tx, state_sh, batch_sh, seed: int = 0):
    """Cross-entropy on demonstrations (completion tokens only), plus cfg.moe_aux_loss_coef
    times the router's load-balancing loss (its metric "router_loss") when that is > 0; with
    cfg.lora_dropout the adapters' dropout keys come from `seed` and the update count."""
    aux = cfg.moe_aux_loss_coef > 0

    def step(state, batch):
        batch = with_dropout_keys(cfg, batch, seed, state.step, batch_sh, lora.SFT_DROPOUT)

        def loss_fn(params):
            params = lora.join(state.frozen, params)
            keys = batch.get(lora.DROPOUT_KEYS)
            logp, extras = scoring.token_logprobs_and_extras(
                cfg, params, batch["tokens"], dropout_keys=keys, router_loss=aux
            )
            m = batch["loss_mask"].astype(jnp.float32)
            loss = -jnp.sum(logp * m) / jnp.maximum(m.sum(), 1.0)
            return loss + cfg.moe_aux_loss_coef * extras.get("router_loss", 0.0), extras

        (loss, extras), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        state, grad_norm, _ = optim.apply_update(state, tx, loss, grads)
        return state, {"loss": loss, "grad_norm": grad_norm, **extras}

    return jax.jit(
        sharding_lib.under_mesh(step, batch_sh.mesh),
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, None),
        donate_argnums=0,
        compiler_options=sharding_lib.compiler_options(cfg, batch_sh.mesh),
    )


def logp_fn_for(cfg, prompt_len: int, entropy: bool = False, router_loss: bool = False):
    """Teacher-forced log-probs of the response tokens (trainer: T=1, float32). With `entropy`,
    (logp, {"entropy": ...}): the full-distribution entropy at each response position, which
    the objectives' entropy bonus uses instead of the -logp proxy (it carries the gradient).
    With `router_loss`, (logp, {"router_loss": ...}): the MoE router's load-balancing loss of
    the same forward (a scalar; the update adds cfg.moe_aux_loss_coef times it to the loss).
    Rows of `mb` with dropout keys (lora.DROPOUT_KEYS: the RL update's) get LoRA dropout; rows
    with a recorded routing (moe.ROUTING, under cfg.routing_replay "sampler") replay it. A
    micro-batch that carries its packed rows (train.pack_rows, refused with routing replay and
    the router loss) is scored on them (`packed.token_logprobs`), the padded rows otherwise."""

    def logp_fn(params, mb):
        if packed.is_packed(mb):
            out = packed.token_logprobs(cfg, params, mb, prompt_len, entropy)
            return out if not entropy else (out[0], {"entropy": out[1]})
        logp, extras = scoring.token_logprobs_and_extras(
            cfg,
            params,
            mb["tokens"],
            mb["attn_mask"],
            entropy,
            start=prompt_len,
            dropout_keys=mb.get(lora.DROPOUT_KEYS),
            routing_BxTxLxX=mb.get(moe.ROUTING),
            router_loss=router_loss,
        )
        return (logp, extras) if extras else logp

    return logp_fn


@functools.lru_cache(maxsize=16)
def score_fn(cfg, prompt_len, mesh, num_chunks: int):
    """Teacher-forced response log-probs under some params (proximal / reference policy), in
    `num_chunks` strided row chunks (the train step's micro-batch size: a whole rollout batch
    at once would hold every sequence's activations); a batch's recorded routing (moe.ROUTING) is
    replayed."""
    logp_fn = logp_fn_for(cfg, prompt_len)

    def split(x):  # strided, as accumulate's micro-batches: every chunk has rows on every device
        return x.reshape(x.shape[0] // num_chunks, num_chunks, *x.shape[1:]).swapaxes(0, 1)

    def score(params, batch):
        inputs = {k: split(batch[k]) for k in ("tokens", "attn_mask", moe.ROUTING) if k in batch}
        logp = jax.lax.map(lambda mb: logp_fn(params, mb), inputs)
        return logp.swapaxes(0, 1).reshape(-1, logp.shape[-1])

    options = sharding_lib.compiler_options(cfg, mesh)
    return jax.jit(sharding_lib.under_mesh(score, mesh), compiler_options=options)


@functools.lru_cache(maxsize=16)
def routing_flip_fn(cfg, prompt_len: int, mesh, num_chunks: int):
    """(params, batch) -> [B, T, Ls] bool: where the batch's recorded routing (moe.ROUTING, the
    sampler's) of a response token in a sparse layer is not the top-k these params route it to
    themselves (moe.topk_differs), in `score_fn`'s strided row chunks."""

    def own(params, mb):
        _, _, routed = scoring.scored_hidden_routed(cfg, params, mb["tokens"], mb["attn_mask"], 1)
        return moe.topk_differs(routed.experts, mb[moe.ROUTING])[:, prompt_len:]

    def split(x):
        return x.reshape(x.shape[0] // num_chunks, num_chunks, *x.shape[1:]).swapaxes(0, 1)

    def flips(params, batch):
        inputs = {k: split(batch[k]) for k in ("tokens", "attn_mask", moe.ROUTING)}
        out = jax.lax.map(lambda mb: own(params, mb), inputs)
        return out.swapaxes(0, 1).reshape(-1, *out.shape[2:])

    options = sharding_lib.compiler_options(cfg, mesh)
    return jax.jit(sharding_lib.under_mesh(flips, mesh), compiler_options=options)

"""Teacher-forced log-probs of given tokens under a model: what the trainer differentiates, what
the old-logp pass and the checks against the sampler's recorded log-probs read.

Axis alphabet: B rows, T sequence length (prompt + response), R scored positions (T - start),
C a chunk of R, D model width, V vocab.

  token_logprobs(cfg, params, tokens_BxT, mask_BxT, return_entropy, start, dropout_keys,
                 routing_BxTxLxX)
      -> logp_BxR, or (logp_BxR, entropy_BxR) with return_entropy
  token_logprobs_and_extras(..., router_loss) -> (logp_BxR, {entropy, router_loss})
  packed_token_logprobs(cfg, params, packed, index_BxR, valid_BxR, return_entropy)
      -> the same, computed on packed rows (data/packing.py) and read back with `unpack`

On a mixture-of-experts model a recorded routing ([B, T, Ls, X] int32, the sampler's:
sampling/decode.py) makes the sparse layers use those experts (routing replay, model/moe.py).

Only the scored positions go through the LM head: with `start` = the prompt width, an RL step
spends no vocabulary-sized matmul, softmax or backward on prompt positions (whose log-probs it
would drop). With `cfg.logits_chunk` > 0 the [B, R, V] logits never exist at once: the LM head
runs `logits_chunk` positions at a time, each chunk recomputed in the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from ess_jax.model import decoder as model_lib
from ess_jax.model import lora, moe


def logprobs_from_logits(logits_BxTxV: jax.Array, tokens_BxT: jax.Array) -> jax.Array:
    """log softmax(logits)[token] at each position, float32 in float32 out."""
    logz = jax.nn.logsumexp(logits_BxTxV, axis=-1)
    picked = jnp.take_along_axis(logits_BxTxV, tokens_BxT[..., None], axis=-1)[..., 0]
    return picked - logz


def entropy_from_logits(logits_BxTxV: jax.Array) -> jax.Array:
    """Per-token entropy H(softmax(logits)) in float32 -> [B, T]."""
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    p_BxTxV = jnp.exp(logp_BxTxV)
    return -jnp.where(p_BxTxV > 0, p_BxTxV * logp_BxTxV, 0.0).sum(-1)


def over_time(fn: Callable, chunk: int, *xs_BxTx_):
    """fn on [B, C, ...] slices of its [B, T, ...] arguments, `chunk` positions at a time (each
    recomputed in the backward pass); outputs ([B, C] trees) merged back to [B, T]. chunk <= 0
    or >= T: one call."""
    t = xs_BxTx_[0].shape[1]
    if chunk <= 0 or t <= chunk:
        return fn(*xs_BxTx_)
    pad = -t % chunk

    def split(a):
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(a.shape[0], -1, chunk, *a.shape[2:]), 1, 0)

    out = jax.lax.map(lambda a: jax.checkpoint(fn)(*a), tuple(split(x) for x in xs_BxTx_))
    return jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1).reshape(a.shape[1], -1)[:, :t], out)


def scored_hidden(
    cfg, params, tokens_BxT, mask_BxT, start: int, dropout_keys=None, routing_BxTxLxX=None
):
    """(bound module, hidden states [B, T - start, D]): the final hidden states that predict
    tokens[:, start:] (position t - 1 predicts token t; start >= 1), for the LM head.
    `dropout_keys` ([B, key words] key data, lora.dropout_keys; None: none): LoRA dropout.
    `routing_BxTxLxX` (int32, aligned with the tokens; None: none): a recorded routing the
    sparse layers replay (model/moe.py `route`)."""
    module, x, _ = scored_hidden_routed(
        cfg, params, tokens_BxT, mask_BxT, start, dropout_keys, routing_BxTxLxX
    )
    return module, x


def scored_hidden_routed(
    cfg, params, tokens_BxT, mask_BxT, start: int, dropout_keys=None, routing_BxTxLxX=None
):
    """`scored_hidden` and the forward's `moe.Routed` record (None for a dense model)."""
    module = model_lib.bind(cfg, params)
    positions = model_lib.positions_from_mask(mask_BxT)
    keys = lora.wrap_keys(dropout_keys)
    x, _, routed = module.hidden_routed(
        cfg, tokens_BxT, positions, mask_BxT, lora_keys=keys, routing=routing_BxTxLxX
    )
    return module, x[:, start - 1 : -1], routed


def token_logprobs(
    cfg: model_lib.ModelConfig,
    params: model_lib.Params,
    tokens_BxT: jax.Array,
    mask_BxT: jax.Array | None = None,
    return_entropy: bool = False,
    start: int = 0,
    dropout_keys: jax.Array | None = None,
    routing_BxTxLxX: jax.Array | None = None,
):
    """log pi(tokens[t] | tokens[<t]) for t in [start, T), float32, aligned with
    tokens[:, start:] (so [B, T] at the default start 0).

    Position 0 (no context) and masked positions get 0. With `return_entropy`, also the
    full-distribution entropy of the prediction of each scored token. `start` (static) is where
    the scored tokens begin, e.g. the prompt width of an RL batch. `dropout_keys` (per-row key
    data, model/lora.py `dropout_keys`) turn on the adapters' dropout (cfg.lora_dropout).
    `routing_BxTxLxX` (aligned with the tokens) is a recorded routing to replay.
    """
    args = (mask_BxT, return_entropy, start, dropout_keys, routing_BxTxLxX)
    logp, extras = token_logprobs_and_extras(cfg, params, tokens_BxT, *args)
    return (logp, extras["entropy"]) if return_entropy else logp


def token_logprobs_and_extras(
    cfg, params, tokens_BxT, mask_BxT=None, return_entropy=False, start=0, dropout_keys=None,
    routing_BxTxLxX=None, router_loss: bool = False,
) -> tuple[jax.Array, dict]:  # fmt: skip
    """`token_logprobs`'s log-probs (its arguments) and a dict of extras: "entropy"
    [B, T - start] with `return_entropy`; with `router_loss`, "router_loss", the load-balancing
    loss of the same forward's router logits over its real tokens (moe.router_loss; 0 for a
    dense model)."""
    t = tokens_BxT.shape[1]
    if not 0 <= start < t:
        raise ValueError(f"start {start}: must be in [0, {t}) for sequences of length {t}")
    if mask_BxT is None:
        mask_BxT = jnp.ones(tokens_BxT.shape, bool)
    mask_BxT = mask_BxT.astype(bool)
    first = max(start, 1)  # the first token that has a context
    module, x_BxRxD, routed = scored_hidden_routed(
        cfg, params, tokens_BxT, mask_BxT, first, dropout_keys, routing_BxTxLxX
    )
    targets_BxR = tokens_BxT[:, first:]

    def score(x_BxCxD, tgt_BxC):
        logits = module.logits(cfg, x_BxCxD)
        lp = logprobs_from_logits(logits, tgt_BxC)
        return lp, (entropy_from_logits(logits) if return_entropy else jnp.zeros_like(lp))

    lp, ent = over_time(score, cfg.logits_chunk, x_BxRxD, targets_BxR)
    valid = mask_BxT[:, first:]
    no_context = ((0, 0), (first - start, 0))  # start 0: position 0's zero column
    logp = jnp.pad(jnp.where(valid, lp, 0.0), no_context)
    extras = {}
    if return_entropy:
        extras["entropy"] = jnp.pad(jnp.where(valid, ent, 0.0), no_context)
    if router_loss:
        extras["router_loss"] = (
            jnp.zeros((), jnp.float32) if routed is None else moe.router_loss(cfg, routed, mask_BxT)
        )
    return logp, extras


def packed_position_logprobs(
    cfg: model_lib.ModelConfig,
    params: model_lib.Params,
    tokens_RxS: jax.Array,
    segments_RxS: jax.Array,
    positions_RxS: jax.Array,
    return_entropy: bool = False,
):
    """log pi(tokens[c] | its segment's tokens before c) at every position c of packed rows
    (data/packing.py: segment ids, 0 on pads; positions restarting per segment), float32
    [R, S]; column 0 and the pads get 0 (a segment's first column holds the previous segment's
    prediction: no packed response position reads it). The forward attends within segments
    only (`decoder.Decoder.hidden` with segment ids). With `return_entropy`, also each
    prediction's full-distribution entropy."""
    module = model_lib.bind(cfg, params)
    segments_RxS = segments_RxS.astype(jnp.int32)
    x, _ = module.hidden(cfg, tokens_RxS, positions_RxS, segments_RxS)

    def score(x_RxCxD, tgt_RxC):
        logits = module.logits(cfg, x_RxCxD)
        lp = logprobs_from_logits(logits, tgt_RxC)
        return lp, (entropy_from_logits(logits) if return_entropy else jnp.zeros_like(lp))

    lp, ent = over_time(score, cfg.logits_chunk, x[:, :-1], tokens_RxS[:, 1:])
    real = segments_RxS[:, 1:] != 0
    lp, ent = (jnp.pad(jnp.where(real, a, 0.0), ((0, 0), (1, 0))) for a in (lp, ent))
    return (lp, ent) if return_entropy else lp


def unpack(x_RxS: jax.Array, index_BxT: jax.Array, valid_BxT: jax.Array) -> jax.Array:
    """Per-position values of packed rows read back into the padded batch's [B, T] grid:
    x.flat[index] where valid, else 0 (data/packing.PackedRows.index)."""
    return jnp.where(valid_BxT, x_RxS.reshape(-1)[index_BxT], 0.0)


def packed_token_logprobs(
    cfg: model_lib.ModelConfig,
    params: model_lib.Params,
    packed: dict,
    index_BxT: jax.Array,
    valid_BxT: jax.Array,
    return_entropy: bool = False,
):
    """`token_logprobs` of a padded batch's response positions, computed on its packed rows
    (`packed`: "tokens", "segments", "positions" [R, S]) and read back by `index_BxT` (where
    `valid_BxT`, the padded rows' real response tokens; 0 elsewhere, as token_logprobs gives).
    Same numbers as token_logprobs(..., start=P) to float32 rounding, and the same gradient."""
    out = packed_position_logprobs(
        cfg, params, packed["tokens"], packed["segments"], packed["positions"], return_entropy
    )
    if not return_entropy:
        return unpack(out, index_BxT, valid_BxT)
    return tuple(unpack(a, index_BxT, valid_BxT) for a in out)

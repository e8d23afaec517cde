"""pi_b's whole distribution at every sampled position, for the exact KL: the sampler's decode
path replayed on the tokens it drew.

Axis alphabet: Bp prompts, B rows (Bp x n samples), P bucketed prompt width, T response
length, V vocab, S KV-cache length.

The sampler records log pi_b of the drawn token only. The exact KL needs pi_b over the vocabulary,
computed as the sampler computed it: in its precision, through its decode path (the prefill over
the prompt, then one cached forward per token, the cache grown at the same `decode_bounds`). A
teacher-forced full forward at the sampler's precision is not that distribution: in bfloat16 the
two differ per token by about as much as bfloat16 differs from float32 (config/schema.py
check_full_kl), which is the `trainer=bfloat16` knob of the mismatch command. So `replay` runs the
programs of sampling/decode.py again with the drawn tokens forced, in the same order and shapes
(the prompts' prefill once, repeated n times), and reads at each position:

  picked   log pi_b(y_t) of the replay: equal to the recorded `behaviour_logp` when the replay
           is the sampler's computation (measure.py reports the largest difference, `replay_err`)
  kl_fwd   KL(pi_b || pi_theta) = sum_v pi_b(v) (log pi_b(v) - log pi_theta(v)), over pi_b's
           support (pi_b is 0 outside it after top-k / top-p)
  kl_rev   KL(pi_theta || pi_b); with a truncated pi_b, pi_theta conditioned on pi_b's support
           (`objectives/kl.py:kl_on_support`), since the unconditioned one is +inf
against `trainer_logp`, the trainer's float32 log-softmax at the same positions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ess_jax.model import decoder as model_lib
from ess_jax.model import kv_cache as cache_lib
from ess_jax.model.scoring import scored_hidden
from ess_jax.objectives.kl import kl_on_support
from ess_jax.sampling import precision as precision_lib
from ess_jax.sampling.decode import Static, decode_bounds
from ess_jax.sampling.rescore import Behaviour, behaviour_logprobs


def trainer_log_softmax(cfg, params, sequences_BxL, mask_BxL, prompt_len: int, routing=None):
    """The trainer's log pi_theta over the vocabulary at each response position, [B, T, V]
    float32: `scoring.token_logprobs`'s forward (`scored_hidden`, the LM head) unreduced;
    `routing` ([B, L, Ls, X]; None: none): a recorded MoE routing the forward replays."""
    mask = mask_BxL.astype(bool)
    module, x = scored_hidden(cfg, params, sequences_BxL, mask, prompt_len, None, routing)
    return jax.nn.log_softmax(module.logits(cfg, x).astype(jnp.float32), axis=-1)


def _column(logits_BxV, tok_B, trainer_BxV, behaviour: Behaviour):
    """(picked, kl_fwd, kl_rev) [B] at one position (see the module docstring)."""
    logq, keep = behaviour_logprobs(logits_BxV[:, None], behaviour)
    logq, keep = logq[:, 0], keep[:, 0]
    picked = jnp.take_along_axis(logq, tok_B[:, None], axis=-1)[:, 0]
    q = jnp.where(keep, jnp.exp(logq), 0.0)
    kl_fwd = jnp.sum(jnp.where(keep, q * (logq - trainer_BxV), 0.0), axis=-1)
    kl_rev = kl_on_support(trainer_BxV[:, None], logq[:, None], keep[:, None])[:, 0]
    return picked, kl_fwd, kl_rev


@functools.partial(jax.jit, static_argnames=("cfg", "n", "behaviour", "kv_cache"))
def replay(
    params,
    prompts_BpxP,
    mask_BpxP,
    tokens_BxT,
    longest,
    trainer_logp_BxTxV,
    *,
    cfg,
    n,
    behaviour,
    kv_cache="compute",
):
    """(picked, kl_fwd, kl_rev) [B, T] float32: the decode path of `sampling/decode.py` with the
    drawn `tokens` forced, up to the `longest` response (a traced int: the sampler stops there
    too; later columns stay 0). `params`: the sampler's copy (`precision.prepare_params`), `cfg`
    its compute dtype (`precision.sample_config`), `kv_cache` the KV cache's precision
    (`decode.Static.init_cache`); positions after a row's stop token are computed and ignored
    by the caller."""
    params = precision_lib.dequantize(params)
    bp, p = prompts_BpxP.shape
    b, t = tokens_BxT.shape
    kv_mask = jnp.concatenate([mask_BpxP, jnp.ones((bp, t), bool)], axis=1)
    positions = model_lib.positions_from_mask(mask_BpxP)
    module = model_lib.bind(cfg, params)
    bounds = decode_bounds(t)
    st = Static(
        t, n, greedy=False, top_k=0, use_top_p=False, stop_ids=(), pad_id=0, kv_cache=kv_cache
    )
    cache = st.init_cache(cfg, bp, p + bounds[0])
    x, cache = module.hidden(cfg, prompts_BpxP, positions, kv_mask, cache, 0, attend_len=p)
    logits = module.logits(cfg, x[:, -1:])[:, -1]
    rep = functools.partial(jnp.repeat, repeats=n, axis=0)  # sample j of prompt i: row i*n+j
    logits, cache, kv_mask = rep(logits), jax.tree.map(rep, cache), rep(kv_mask)
    pos = rep(positions[:, -1]) + 1

    out = jnp.zeros((3, b, t), jnp.float32)
    first = _column(
        logits.astype(jnp.float32), tokens_BxT[:, 0], trainer_logp_BxTxV[:, 0], behaviour
    )
    out = out.at[:, :, 0].set(jnp.stack(first))

    def body(step, carry, length):
        out, cache, pos = carry
        prev = jax.lax.dynamic_index_in_dim(tokens_BxT, step - 1, axis=1, keepdims=True)
        logits, cache = model_lib.forward(
            cfg, params, prev, pos[:, None], kv_mask[:, :length], cache, p + step - 1
        )
        tok = jax.lax.dynamic_index_in_dim(tokens_BxT, step, axis=1, keepdims=False)
        tr = jax.lax.dynamic_index_in_dim(trainer_logp_BxTxV, step, axis=1, keepdims=False)
        col = jnp.stack(_column(logits[:, 0].astype(jnp.float32), tok, tr, behaviour))
        out = jax.lax.dynamic_update_index_in_dim(out, col, step, axis=2)
        return out, cache, pos + 1

    start = 1
    for bound in bounds:
        if cache_lib.cache_length(cache[0]) < p + bound:
            cache = [cache_lib.grow_layer(layer, p + bound) for layer in cache]
        if bound > start:
            step_fn = functools.partial(body, length=p + bound)
            stop = jnp.minimum(bound, longest)
            out, cache, pos = jax.lax.fori_loop(start, stop, step_fn, (out, cache, pos))
        start = bound
    return out[0], out[1], out[2]

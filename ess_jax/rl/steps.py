"""The jitted steps: TrainState and its sharded init, the SFT step, the RL step (one optimizer
update with the configured objective), and the teacher-forced scoring pass (proximal /
reference log-probs). `train.Run` builds and calls them; nothing here holds run state.

The RL step has no objective-specific branches: the objective comes from the registry and
`objectives.scopes.step_loss_and_grad` handles micro-batching with the ESS scope of the config. Only
its log-prob function differs with objective.kl_estimator "full": `rescore.logp_fn_for` also
re-scores pi_b's whole distribution, from behaviour params the step takes as an argument.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from ess_jax import objectives as obj_lib
from ess_jax.model import lora, scoring
from ess_jax.objectives import scopes
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.rl import rollout as rollout_lib
from ess_jax.sampling import rescore


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


def _apply_update(state: TrainState, tx, loss, grads, lr_scale=None):
    """Optimizer update, skipped (state kept, counter bumped) if loss or grads are not finite.

    `lr_scale` (a scalar; None: no factor, the update as tx gives it) multiplies the update tx
    returns, i.e. the learning rate of this one step (for AdamW the decoupled weight decay too,
    which optax multiplies by the lr): an objective's metric "lr_scale" (vcpo). Adam divides a
    factor on the gradient out, so the loss cannot carry it."""
    grad_norm = optax.global_norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    grads = jax.tree.map(lambda g: jnp.where(ok, g, 0.0), grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    if lr_scale is not None:
        updates = jax.tree.map(lambda u: u * jnp.asarray(lr_scale, u.dtype), updates)
    ok = ok & jnp.isfinite(optax.global_norm(updates))  # e.g. a NaN learning rate
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    new = TrainState(
        keep(params, state.params),
        keep(opt_state, state.opt_state),
        state.step + ok.astype(jnp.int32),
        jnp.where(ok, 0, state.nonfinite + 1),
        state.frozen,
    )
    return new, grad_norm, ok


def _over_base(logp_fn, frozen):
    """`logp_fn` of the adapters alone: the frozen base joined in, outside the differentiated
    argument (its gradient is never formed)."""
    return lambda adapters, mb: logp_fn(lora.join(frozen, adapters), mb)


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
    """Cross-entropy on demonstrations (completion tokens only); with cfg.lora_dropout the
    adapters' dropout keys come from `seed` and the update count."""

    def step(state, batch):
        batch = with_dropout_keys(cfg, batch, seed, state.step, batch_sh, lora.SFT_DROPOUT)

        def loss_fn(params):
            params = lora.join(state.frozen, params)
            keys = batch.get(lora.DROPOUT_KEYS)
            logp = scoring.token_logprobs(cfg, params, batch["tokens"], dropout_keys=keys)
            m = batch["loss_mask"].astype(jnp.float32)
            return -jnp.sum(logp * m) / jnp.maximum(m.sum(), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        state, grad_norm, _ = _apply_update(state, tx, loss, grads)
        return state, {"loss": loss, "grad_norm": grad_norm}

    return jax.jit(
        sharding_lib.under_mesh(step, batch_sh.mesh),
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, None),
        donate_argnums=0,
    )


def logp_fn_for(cfg, prompt_len: int, entropy: bool = False):
    """Teacher-forced log-probs of the response tokens (trainer: T=1, float32). With `entropy`,
    (logp, {"entropy": ...}): the full-distribution entropy at each response position, which
    the objectives' entropy bonus uses instead of the -logp proxy (it carries the gradient).
    Rows of `mb` with dropout keys (lora.DROPOUT_KEYS: the RL step's) get LoRA dropout."""

    def logp_fn(params, mb):
        out = scoring.token_logprobs(
            cfg,
            params,
            mb["tokens"],
            mb["attn_mask"],
            entropy,
            start=prompt_len,
            dropout_keys=mb.get(lora.DROPOUT_KEYS),
        )
        return out if not entropy else (out[0], {"entropy": out[1]})

    return logp_fn


class FullKL(NamedTuple):
    """What a step with objective.kl_estimator "full" re-scores pi_b with (`full_kl_inputs`)."""

    behaviour: rescore.Behaviour
    params: dict  # {"policy"?: ..., "external"?: ...}: the step's third argument
    shardings: dict

    @property
    def key(self) -> tuple:
        """What the compiled step depends on."""
        return self.behaviour, tuple(self.params)


def make_rl_step(
    cfg,
    tx,
    objective_cfg,
    num_microbatches,
    prompt_len,
    state_sh,
    batch_sh,
    full: FullKL | None = None,
    seed: int = 0,
    group_size: int | None = None,
):
    """One optimizer update on a rollout (mini-)batch with the configured objective.

    With `full` (objective.kl_estimator "full") the step takes a third argument, `full.params`,
    the behaviour params that pi_b's whole distribution is re-scored with; without "policy"
    among them, pi_b is the current policy (the params the sampler held: lag 0, one update).
    In the micro-batch ESS scopes with several micro-batches the rows are shuffled within each
    device's block before the split (`scopes.shuffle_rows`), by a permutation drawn from `seed`
    and the update count `state.step`: fixed per update, so a rerun or a resume repeats it.
    `group_size` (rollout.group_size) reaches an objective's batch pass (vcpo's per-group
    baseline); a metric "lr_scale" of the objective scales this update (`_apply_update`).
    With cfg.lora_dropout > 0 the policy's differentiated forwards drop adapter inputs, each
    row by its key from `seed` and `state.step` (`with_dropout_keys`); the proximal and
    reference log-probs (`score_fn`) and the re-scored pi_b are dropout-free."""
    entropy = objective_cfg.beta_ent != 0
    shuffled = objective_cfg.ess_scope in scopes.SHUFFLED_SCOPES and num_microbatches > 1
    row_blocks = math.prod(batch_sh.mesh.shape[a] for a in sharding_lib.BATCH)

    def update(state, batch, logp_fn):
        if state.frozen is not None:  # LoRA: the gradient of the adapters only
            logp_fn = _over_base(logp_fn, state.frozen)
        batch = with_dropout_keys(cfg, batch, seed, state.step, batch_sh)
        key = jax.random.fold_in(jax.random.key(seed), state.step) if shuffled else None
        loss, grads, metrics = scopes.step_loss_and_grad(
            logp_fn,
            state.params,
            batch,
            objective_cfg,
            num_microbatches,
            key,
            row_blocks,
            group_size=group_size,
        )
        state, grad_norm, ok = _apply_update(state, tx, loss, grads, metrics.get("lr_scale"))
        return state, {**metrics, "grad_norm": grad_norm, "skipped": 1 - ok.astype(jnp.int32)}

    if full is None:
        logp_fn, in_sh = logp_fn_for(cfg, prompt_len, entropy=entropy), (state_sh, batch_sh)

        def step(state, batch):
            return update(state, batch, logp_fn)

    else:

        def step(state, batch, bparams):
            bparams = {"policy": state.params, **bparams}
            bparams["policy"] = lora.join(state.frozen, bparams["policy"])
            fn = rescore.logp_fn_for(cfg, prompt_len, full.behaviour, bparams, entropy)
            return update(state, batch, fn)

        in_sh = (state_sh, batch_sh, full.shardings)
    return jax.jit(
        sharding_lib.under_mesh(step, batch_sh.mesh),
        in_shardings=in_sh,
        out_shardings=(state_sh, None),
        donate_argnums=0,
    )


def full_kl_inputs(
    objective_cfg, rcfg, params_b, lag: int, updates_per_batch: int, external, policy_sh
) -> FullKL | None:
    """None unless objective.kl_estimator is "full"; else what the step re-scores pi_b with.

    The params the sampler held: none (the current ones) with lag 0 and one update per batch;
    else its history version, copied with lag 0 (the history then holds the train params' own
    buffers, which the first update donates): one more copy of the params for the step."""
    if objective_cfg.kl_estimator != obj_lib.FULL_KL:
        return None
    bparams, bsh = {}, {}
    if lag or updates_per_batch > 1:
        policy = sharding_lib.reshard(params_b, policy_sh)
        bparams["policy"] = policy if lag else jax.tree.map(jnp.copy, policy)
        bsh["policy"] = policy_sh
    ext_cfg = None
    if external is not None and float(rcfg.external_fraction) > 0:
        ext_cfg, bparams["external"] = external.cfg, external.params
        bsh["external"] = jax.tree.map(lambda x: x.sharding, external.params)
    return FullKL(rescore.Behaviour.from_rollout(rcfg, ext_cfg), bparams, bsh)


@functools.lru_cache(maxsize=16)
def score_fn(cfg, prompt_len, mesh, num_chunks: int):
    """Teacher-forced response log-probs under some params (proximal / reference policy), in
    `num_chunks` strided row chunks (the train step's micro-batch size: a whole rollout batch
    at once would hold every sequence's activations)."""
    logp_fn = logp_fn_for(cfg, prompt_len)

    def split(x):  # strided, as accumulate's micro-batches: every chunk has rows on every device
        return x.reshape(x.shape[0] // num_chunks, num_chunks, *x.shape[1:]).swapaxes(0, 1)

    def score(params, batch):
        inputs = {k: split(batch[k]) for k in ("tokens", "attn_mask")}
        logp = jax.lax.map(lambda mb: logp_fn(params, mb), inputs)
        return logp.swapaxes(0, 1).reshape(-1, logp.shape[-1])

    return jax.jit(sharding_lib.under_mesh(score, mesh))


def rollout_to_batch(r: rollout_lib.Rollout, full: FullKL | None = None) -> dict:
    """The train step's arrays; with `full`, also policy_version [B, 1] (which model drew each
    row; rank 2 like every batch array: the step shards them all with one spec)."""
    batch = {
        "tokens": r.tokens,
        "attn_mask": r.attn_mask,
        "mask": r.loss_mask,
        "behaviour_logp": r.behaviour_logp,
        "advantages": r.advantages,
    }
    if full is not None:
        batch["policy_version"] = r.policy_version[:, None]
    return batch

"""The RL update, top to bottom: a rollout batch -> pi_prox / reference scores -> U optimizer
updates, each over M micro-batches (the ESS statistics pass, the gradient, the optimizer) ->
the metrics. `trainer.Trainer.learn` calls `Learner.learn` once per RL step.

Axis alphabet (ARCHITECTURE.md): B rows of the rollout batch (prompts x G), U updates per batch
(train.updates_per_batch) of B' = B / U rows, M micro-batches per update (train.num_microbatches)
of b = B' / M rows, P prompt width, T response length, L = P + T.

`Learner.learn(state, rollout, params_b, ref_params)`, on the host:
  1 batch     `rollout_to_batch`, sharded over rows (sharding.BATCH): tokens int32 [B, L],
              attn_mask bool [B, L], mask float32 [B, T] (the loss mask), behaviour_logp and
              advantages float32 [B, T]; with objective.kl_estimator "full" policy_version
              int32 [B, 1] and pi_b's params (`full_kl.FullKL.inputs`)
  2 scores    `steps.score_fn`, teacher-forced in M U strided row chunks before any update:
              prox_logp [B, T] (objectives that read pi_prox), ref_logp [B, T] (beta_kl > 0)
  3 updates   for u < U: rows [u B', (u + 1) B') -> `update_step`, compiled once per
              `StepKey` (the prompt width P, the full-KL form), the state donated
  4 metrics   each metric's mean over the U updates, ess_min, the first update's mismatch

`update_step(state, rows [B', ...], behaviour_params?)`, jitted:
  logp_fn     `steps.logp_fn_for`: scoring.token_logprobs -> logp float32 [b, T] (+ entropy
              [b, T] with beta_ent); under the full KL `FullKL.logp_fn` adds kl_full and
              rescored_behaviour_logp [b, T]; with LoRA the frozen base joined outside the
              differentiated adapters
  keys        each row's LoRA dropout key (`steps.with_dropout_keys`); in the micro-batch
              scopes with M > 1 the row shuffle's key fold_in(key(seed), state.step)
  gradient    `step_loss_and_grad` (below): loss, gradient, metrics
  optimizer   `optim.apply_update`: clip + AdamW, times an objective's lr_scale (vcpo); a
              non-finite update keeps the old state and bumps TrainState.nonfinite

`step_loss_and_grad(logp_fn, params, rows, config, M, key, row_blocks, group_size)`:
  split       `scopes.rows_and_shared`: row arrays [B', ...] and shared scalars
  batch pass  (vcpo) `accumulate.seq_grad_sq`: per-row ||grad sum_t logp_t||^2 [B'] and logp
              [B', T] (b rows vmapped, M micro-batches mapped) -> the objective's `batch_pass`
              adds opob_advantages [B', T], lr_scale and ess_seq
  M == 1      one value_and_grad of the objective's loss on all B' rows
  M > 1       `scopes.shuffle_rows` (micro-batch scopes), strided micro-batches [M, b, ...];
              `accumulate.SCOPES[ess_scope]`: "step" with a loss that reads the ESS first runs
              the ESS statistics pass (a no-grad forward scan -> ess, ess_prox, num_tokens,
              num_seqs of all B' rows; from M = 3 the last micro-batch's forward is kept for its
              gradient), then a lax.scan of value_and_grad over the micro-batches sums float32
              gradients; `scopes.combine_metrics` over M
  metrics     + `core.mismatch_metrics` of all B' rows' log-probs
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ess_jax import objectives as obj_lib
from ess_jax.model import lora, moe
from ess_jax.model.config import ModelConfig
from ess_jax.objectives import scopes
from ess_jax.objectives.core import merge_microbatches
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.rl import accumulate, optim, packed, steps
from ess_jax.rl import rollout as rollout_lib
from ess_jax.rl.full_kl import FullKL


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """What every update of a run shares."""

    model: ModelConfig
    objective: obj_lib.ObjectiveConfig
    tx: optax.GradientTransformation
    num_microbatches: int = 1  # M
    seed: int = 0  # the row shuffle's and LoRA dropout's keys, with the update count
    group_size: int | None = None  # rollout.group_size: an objective's batch pass (vcpo)
    pack_length: int | None = None  # train.pack_rows: train.pack_length (0: P + T); None: off
    pack_by_tokens: bool = False  # train.pack_microbatches "tokens": M set per update


class StepKey(NamedTuple):
    """What one compiled update depends on beyond the run's UpdateConfig: one program per
    prompt width (data.buckets), full-KL form and, with micro-batches by tokens, micro-batch
    count (the rows' count follows from it)."""

    prompt_len: int  # P
    full_kl: FullKL | None = None  # objective.kl_estimator "full": how pi_b is re-scored
    num_microbatches: int | None = None  # M of this update; None: UpdateConfig's


class Learner:
    """A run's RL updates: their UpdateConfig, the train mesh and shardings, the full-KL form
    (None unless objective.kl_estimator "full"), and `compiled`, the jitted update per StepKey."""

    def __init__(
        self,
        ucfg: UpdateConfig,
        mesh,
        state_sh,
        updates_per_batch: int = 1,
        full_kl: FullKL | None = None,
        external=None,
    ):
        self.ucfg, self.mesh, self.state_sh = ucfg, mesh, state_sh
        self.batch_sh = sharding_lib.batch_sharding(mesh)
        self.updates_per_batch, self.full_kl, self.external = updates_per_batch, full_kl, external
        self.compiled: dict[StepKey, Callable] = {}

    def learn(
        self,
        state: steps.TrainState,
        rollout: rollout_lib.Rollout,
        params_b,
        ref_params=None,
        on_update: Callable[[steps.TrainState], None] | None = None,
    ) -> tuple[steps.TrainState, dict]:
        """U updates on a rollout drawn with params `params_b` (pi_b); the new state and the
        metrics of the batch. `ref_params`: the reference policy of beta_kl, if any.
        `on_update(state)` follows each update (Run keeps the newest state: a Ctrl-C between
        updates saves it)."""
        ucfg, mesh, full = self.ucfg, self.mesh, self.full_kl
        n_upd = self.updates_per_batch
        per = rollout.num_sequences // n_upd  # B'

        # 1 the batch, and pi_b's params for the full KL (copied before any update donates)
        behaviour = full.inputs(params_b, self.state_sh.params, self.external) if full else None
        replay = ucfg.model.routing_replay == "sampler"
        batch = sharding_lib.shard_batch(rollout_to_batch(rollout, full, replay), mesh)

        # 2 pi_prox and the reference: teacher-forced, before any update
        score, scored = self._scorer(rollout, batch)
        if obj_lib.needs_prox(ucfg.objective):
            batch["prox_logp"] = score(lora.join(state.frozen, state.params), scored)
        flip = self._routing_flip(state, rollout, batch)  # before any update
        if ref_params is not None:  # the reference routes every token itself
            own = {k: v for k, v in scored.items() if k != moe.ROUTING}
            batch["ref_logp"] = score(lora.join(state.frozen, ref_params), own)

        # 3 U updates, each on its own B' rows
        key = StepKey(rollout.prompt_len, full)
        extra = (behaviour.params,) if behaviour else ()
        tokens, mask = rollout.tokens, rollout.attn_mask
        upd_metrics = []
        for u in range(n_upd):
            rows = jax.tree.map(lambda x, u=u: x[u * per : (u + 1) * per], batch)
            pad, key_u = {}, key
            if ucfg.pack_length is not None:  # packed as this update will split its rows
                host = [np.asarray(x)[u * per : (u + 1) * per] for x in (tokens, mask)]
                if ucfg.pack_by_tokens:
                    rows, pad, m = self._token_microbatches(rows, *host, rollout.prompt_len)
                    key_u = key._replace(num_microbatches=m)
                else:
                    rows, pad = self._packed_rows(rows, *host, rollout.prompt_len, int(state.step))
            update = self._update_fn(key_u, behaviour)
            state, metrics = update(state, sharding_lib.shard_batch(rows, mesh), *extra)
            if on_update is not None:
                on_update(state)
            upd_metrics.append({**jax.device_get(metrics), **pad})

        # 4 the metrics: means over the updates
        row = {k: float(np.mean([mu[k] for mu in upd_metrics])) for k in upd_metrics[0]}
        row["ess_min"] = float(np.min([mu["ess"] for mu in upd_metrics]))
        # the mismatch metrics of the batch's first update, where pi_theta is the policy that
        # sampled (with rollout.lag 0): pure train/sampler mismatch, not the updates' drift
        row.update({k: float(upd_metrics[0][k]) for k in obj_lib.MISMATCH_KEYS})
        if flip is not None:
            row["routing_flip"] = flip
        return state, row

    def _update_fn(self, key: StepKey, behaviour):
        """The compiled update of `key` (compiled on first use)."""
        if key not in self.compiled:
            shardings = behaviour.shardings if behaviour else None
            self.compiled[key] = make_rl_step(
                self.ucfg, key, self.state_sh, self.batch_sh, shardings
            )
        return self.compiled[key]

    def _row_blocks(self) -> int:
        return sharding_lib.batch_ranks(self.mesh.shape)

    def _routing_flip(self, state, rollout, batch) -> float | None:
        """`routing_flip` of an MoE rollout (None without a recorded routing): the share of the
        sampler's top-k that the trainer's own router, with `state`'s params, does not pick
        (`steps.routing_flip_fn` on the padded batch, `routing_flip_share`)."""
        if rollout.routing is None:
            return None
        chunks = self.ucfg.num_microbatches * self.updates_per_batch
        fn = steps.routing_flip_fn(self.ucfg.model, rollout.prompt_len, self.mesh, chunks)
        routed = batch
        if moe.ROUTING not in batch:
            routing = sharding_lib.shard_batch({moe.ROUTING: rollout.routing}, self.mesh)
            routed = {**batch, **routing}
        return routing_flip_share(fn(lora.join(state.frozen, state.params), routed), rollout)

    def _scorer(self, rollout, batch):
        """The scoring pass and what it reads: the padded batch, or with train.pack_rows the
        batch packed in the pass's M U chunks (`packed.score_fn`)."""
        ucfg, p = self.ucfg, rollout.prompt_len
        chunks = ucfg.num_microbatches * self.updates_per_batch
        if ucfg.pack_length is None:
            return steps.score_fn(ucfg.model, p, self.mesh, chunks), batch
        mask = np.asarray(rollout.attn_mask)
        rows = packed.pack(rollout.tokens, mask, p, ucfg.pack_length, chunks, self._row_blocks())
        arrays = sharding_lib.shard_batch(packed.score_arrays(rows, mask), self.mesh)
        return packed.score_fn(ucfg.model, p, self.mesh, chunks), arrays

    def _packed_rows(self, rows, tokens, mask, prompt_len: int, step: int):
        """An update's rows with their packed rows (`packed.update_arrays`; `tokens`, `mask`:
        its padded rows on the host), packed by the micro-batches and devices `update_step` at
        optimizer step `step` splits them into, and the pad shares of the packed and the
        padded rows."""
        ucfg, m, blocks = self.ucfg, self.ucfg.num_microbatches, self._row_blocks()
        order = packed.row_order(ucfg.seed, step, ucfg.objective, m, tokens.shape[0], blocks)
        pk = packed.pack(tokens, mask, prompt_len, ucfg.pack_length, m, blocks, order)
        return {**rows, **packed.update_arrays(pk)}, packed.pad_shares(pk, mask)

    def _token_microbatches(self, rows, tokens, mask, prompt_len: int):
        """train.pack_microbatches "tokens": an update's rows regrouped into micro-batches of
        one packed row per device (`packed.regroup`), with their packed rows; the pad shares
        and the micro-batch count M. Only the "step" ESS scope runs it (config/schema.py):
        its loss, gradient and metrics do not depend on which rows share a micro-batch."""
        blocks = self._row_blocks()
        rg, pk = packed.regroup(tokens, mask, prompt_len, self.ucfg.pack_length, blocks)
        rows = packed.regroup_rows(rows, rg, self.mesh)
        return {**rows, **packed.update_arrays(pk)}, packed.pad_shares(pk, mask), rg.num_micro


def routing_flip_share(differs_BxTxLs, r: rollout_lib.Rollout) -> float:
    """The share of (response token, sparse layer) pairs, over the trained tokens the sampler
    routed (each row's last token it never feeds back, and external rows, have no record),
    whose recorded top-k is not the trainer's own (metric `routing_flip`)."""
    differs = np.asarray(jax.device_get(differs_BxTxLs))
    recorded = np.asarray(r.routing)[:, r.prompt_len :, :, 0] != moe.NOT_RECORDED
    counted = recorded & (np.asarray(r.loss_mask) > 0)[..., None]
    return float(differs[counted].mean()) if counted.any() else 0.0


def rollout_to_batch(
    r: rollout_lib.Rollout, full: FullKL | None = None, routing: bool = False
) -> dict:
    """The update's arrays; with `full`, also the column its re-score reads; with `routing`
    (model.routing_replay "sampler"), the rollout's recorded routing, if it has one."""
    batch = {
        "tokens": r.tokens,
        "attn_mask": r.attn_mask,
        "mask": r.loss_mask,
        "behaviour_logp": r.behaviour_logp,
        "advantages": r.advantages,
    }
    if full is not None:
        batch.update(full.batch_rows(r))
    if routing and r.routing is not None:
        batch[moe.ROUTING] = r.routing
    return batch


def make_rl_step(ucfg: UpdateConfig, key: StepKey, state_sh, batch_sh, behaviour_sh=None):
    """`update_step` for `key`, jitted: (state, rows[, behaviour_params]) -> (state, metrics),
    the state donated. With key.full_kl the update takes the behaviour params
    (`FullKL.inputs`), sharded as `behaviour_sh`."""
    step = functools.partial(update_step, ucfg, key, batch_sh)
    step.__name__ = "update_step"  # compile logs name jit(update_step)
    in_sh = (state_sh, batch_sh) if key.full_kl is None else (state_sh, batch_sh, behaviour_sh)
    return jax.jit(
        sharding_lib.under_mesh(step, batch_sh.mesh),
        in_shardings=in_sh,
        out_shardings=(state_sh, None),
        donate_argnums=0,
        compiler_options=sharding_lib.compiler_options(ucfg.model, batch_sh.mesh),
    )


def update_step(ucfg: UpdateConfig, key: StepKey, batch_sh, state, rows, behaviour_params=None):
    """One optimizer update on rows [B', ...] with the configured objective.

    The rows of a micro-batch scope with M > 1 are shuffled within each device's block before
    the split (`scopes.shuffle_rows`), by a permutation drawn from the seed and the update count
    `state.step`: fixed per update, so a rerun or a resume repeats it. With model.lora.dropout
    the policy's differentiated forwards drop adapter inputs, each row by its key from the seed
    and `state.step` (`steps.with_dropout_keys`); the proximal and reference log-probs
    (`steps.score_fn`) and the re-scored pi_b are dropout-free."""
    ocfg, m = ucfg.objective, key.num_microbatches or ucfg.num_microbatches
    entropy = ocfg.beta_ent != 0
    # the log-prob function the gradient differentiates
    router = ucfg.model.moe_aux_loss_coef > 0
    if key.full_kl is None:
        logp_fn = steps.logp_fn_for(ucfg.model, key.prompt_len, entropy, router)
    else:  # pi_b's whole distribution re-scored beside it
        logp_fn = key.full_kl.logp_fn(ucfg.model, key.prompt_len, state, behaviour_params, entropy)
    if state.frozen is not None:  # LoRA: the gradient of the adapters only
        logp_fn = _over_base(logp_fn, state.frozen)

    # each row's LoRA dropout key and the row shuffle's key: from the seed and the update count
    rows = steps.with_dropout_keys(ucfg.model, rows, ucfg.seed, state.step, batch_sh)
    shuffle = None
    if scopes.shuffled(ocfg, m):
        shuffle = jax.random.fold_in(jax.random.key(ucfg.seed), state.step)
    row_blocks = sharding_lib.batch_ranks(batch_sh.mesh.shape)

    # micro-batches, the ESS statistics pass and the gradient
    loss, grads, metrics = step_loss_and_grad(
        logp_fn,
        state.params,
        rows,
        ocfg,
        m,
        shuffle,
        row_blocks,
        group_size=ucfg.group_size,
        router_coef=ucfg.model.moe_aux_loss_coef,
    )

    # the optimizer
    state, grad_norm, ok = optim.apply_update(state, ucfg.tx, loss, grads, metrics.get("lr_scale"))
    return state, {**metrics, "grad_norm": grad_norm, "skipped": 1 - ok.astype(jnp.int32)}


def step_loss_and_grad(
    logp_fn: accumulate.LogpFn,
    params: Any,
    batch: obj_lib.Batch,
    config: obj_lib.ObjectiveConfig,
    num_microbatches: int = 1,
    key: jax.Array | None = None,
    row_blocks: int = 1,
    group_size: int | None = None,
    router_coef: float = 0.0,
) -> tuple[jax.Array, Any, obj_lib.Metrics]:
    """Loss, gradient and metrics of one optimizer batch, accumulated over micro-batches.

    `logp_fn(params, micro_batch)` returns logp_BxT (float32), or (logp_BxT, extras) whose
    extras (e.g. "entropy" [B, T]) are added to the micro-batch. Arrays of `batch` with a
    leading batch axis are split; scalars are shared, and caller-supplied step statistics
    (ess, ess_prox, num_tokens, num_seqs) win where the scope keeps them (KEPT_STATISTICS).
    ObjectiveConfig.ess_scope picks the scope's pass (`accumulate.SCOPES`). `key` (a PRNG key;
    None: no shuffle) and `row_blocks` (the batch's shards along its rows) shuffle the rows
    before the split in the micro-batch scopes with M > 1 (`scopes.shuffle_rows`).
    An objective whose record has a `batch_pass` (vcpo) first gets the per-row gradient norms
    of the whole batch, in rollout row order (`group_size` consecutive rows per prompt); its
    rows and scalars join the batch. The metrics include `core.mismatch_metrics` of the whole
    batch (one sort of its B x T log-ratios: the micro-batches' log-probs are kept for it).
    A "router_loss" extra of `logp_fn` joins the loss times `router_coef` (`Accumulator`).
    """
    m = num_microbatches
    batch_size = batch["mask"].shape[0]
    if m < 1 or batch_size % m:
        raise ValueError(f"batch size {batch_size} is not divisible by num_microbatches={m}")
    batch, packed_rows = packed.split(batch)  # train.pack_rows: joins after the shuffle
    rows, shared = scopes.rows_and_shared(batch, config)
    objective = obj_lib.get_objective(config.name)
    acc = accumulate.Accumulator(logp_fn, objective, config, params, router_coef, m)
    if objective.batch_pass is not None:
        sq_B, logp_BxT = accumulate.seq_grad_sq(logp_fn, jax.lax.stop_gradient(params), rows, m)
        added_rows, added_shared = objective.batch_pass(sq_B, logp_BxT, rows, config, group_size)
        rows, shared = {**rows, **added_rows}, {**shared, **added_shared}
    if m == 1:  # one micro-batch: the objective's own statistics are the step's
        (loss, (metrics, logp)), grads = acc.grad_fn(params, {**rows, **packed_rows, **shared})
        return loss, grads, {**metrics, **obj_lib.mismatch_metrics(logp, rows)}
    if key is not None and config.ess_scope in scopes.SHUFFLED_SCOPES:
        rows = scopes.shuffle_rows(rows, key, row_blocks)
    rows = {**rows, **packed_rows}  # split strided as the rows: micro-batch k's packed rows
    loss, grads, metrics, logp_M = accumulate.SCOPES[config.ess_scope](acc, rows, shared, m)
    return loss, grads, {**metrics, **obj_lib.mismatch_metrics(merge_microbatches(logp_M), rows)}


def _over_base(logp_fn, frozen):
    """`logp_fn` of the adapters alone: the frozen base joined in, outside the differentiated
    argument (its gradient is never formed)."""
    return lambda adapters, mb: logp_fn(lora.join(frozen, adapters), mb)

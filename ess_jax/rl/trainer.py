"""The learner side of a run: `Trainer`, the one interface both loops train through.

A `Trainer` holds what a step changes and a checkpoint keeps: the train state (params,
optimizer, step), the policy history (the versions a rollout may be drawn by,
`rollout.ParamHistory`), the reference params of the KL-to-reference term, and the data
position (the prompt batcher). The synchronous loop and the actor-learner
(`actor_learner.SyncLoop`, `actor_learner.ActorLearner`) call the same four methods:

    trainer.behaviour()                   # (version, params) to draw the next batch with
    trainer.begin_step(data_after=...)    # where a Ctrl-C rewinds to; the batch's data position
    trainer.learn(step, rollout, ...)     # the updates on one batch (`update.Learner`): a row
    trainer.state.params                  # the newest policy (the actor-learner pushes it)

`Run` (rl/train.py) builds the trainer, writes its `checkpoint_tree` / `checkpoint_meta` and
`restore`s them, and asks `interrupted_step` what a Ctrl-C may save.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from ess_jax.config.schema import UserError
from ess_jax.model import lora
from ess_jax.rl import rollout as rollout_lib
from ess_jax.rl import update as update_lib

MAX_NONFINITE_IN_A_ROW = 3


class NonFiniteError(UserError, RuntimeError): ...


class Trainer:
    """The train state, the policy history, the reference params and the data position; `learn`
    trains on one batch. `state_sh`: the state's shardings (a restore's abstract tree)."""

    def __init__(
        self,
        state,
        state_sh,
        learner: update_lib.Learner,
        history: rollout_lib.ParamHistory,
        batcher,
        lr_schedule,
        beta_kl: float,
    ):
        self.state, self.state_sh, self.learner = state, state_sh, learner
        self.history, self.batcher, self.lr_schedule = history, batcher, lr_schedule
        self.beta_kl = beta_kl  # > 0: the run keeps reference params (set once, after SFT)
        self.ref_params = None
        self.step_start = None  # (data position, optimizer step) while a step runs

    # ------------------------------------------------------------------ the loops' side
    def behaviour(self) -> tuple[int, object, object]:
        """(version, params, sampler params) of the policy the next batch is drawn by: the
        oldest version the lag keeps; `sampler params` joins model.lora's frozen base."""
        version, params = self.history.behaviour()
        return version, params, lora.join(self.state.frozen, params)

    def begin_step(self, data_after: dict | None = None) -> None:
        """Marks a step's start (a Ctrl-C before its first update rewinds to it); `data_after`:
        the data position after the batch it trains on, when another batcher drew it."""
        self.step_start = (self.batcher.state(), int(self.state.step))
        if data_after is not None:
            self.batcher.restore(data_after)

    def learn(self, step, rollout, metrics, version, params_b, t0) -> dict:
        """Updates on a rollout drawn by policy `version` (params `params_b`, None when the
        actor-learner drew it: the learner then scores pi_b's recorded log-probs only); the row.
        `t0`: when the step started (its row's timings)."""
        t_sample = time.perf_counter() - t0
        self.state, row = self.learner.learn(
            self.state, rollout, params_b, self.ref_params, on_update=self._hold
        )
        if int(self.state.nonfinite) >= MAX_NONFINITE_IN_A_ROW:
            raise NonFiniteError(
                f"{int(self.state.nonfinite)} updates in a row had a non-finite loss or gradient "
                f"(step {step}); the last good state is kept. Lower optim.lr or check the data."
            )
        # train layout (FSDP-sharded): the sampler gathers a version only while it samples
        self.history.push(step + 1, self.state.params)
        self.step_start = None
        elapsed = time.perf_counter() - t0
        row.update(metrics)
        row.update(
            step=step,
            policy_lag=step - version,
            lr=float(self.lr_schedule(int(self.state.step))),
            tokens_per_s=float(rollout.loss_mask.sum()) / elapsed,
            sample_s=t_sample,
            step_s=elapsed,
        )
        return row

    def _hold(self, state) -> None:
        """The newest state, after each update of a batch (`interrupted_step` reads it)."""
        self.state = state

    def keep_reference(self) -> None:
        """objective.beta_kl > 0: the current params become the KL term's reference."""
        if self.beta_kl > 0:
            self.ref_params = jax.tree.map(jnp.copy, self.state.params)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_tree(self) -> dict:
        return {
            "state": self.state.replace(frozen=None),  # model.lora: the base is model.source
            "history": [p for _, p in self.history.state()],
            **({"ref": self.ref_params} if self.ref_params is not None else {}),
        }

    def checkpoint_meta(self) -> dict:
        return {
            "data": self.batcher.state(),
            "history_versions": [v for v, _ in self.history.state()],
        }

    def abstract_tree(self, n_history: int) -> dict:
        """`checkpoint_tree`'s shapes, dtypes and shardings, with `n_history` versions."""
        as_abstract = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        unfrozen = self.state.replace(frozen=None), self.state_sh.replace(frozen=None)
        state = jax.tree.map(as_abstract, *unfrozen)
        hist_one = jax.tree.map(as_abstract, self.state.params, self.state_sh.params)
        tree = {"state": state, "history": [hist_one] * n_history}
        if self.beta_kl > 0:
            tree["ref"] = jax.tree.map(as_abstract, self.state.params, self.state_sh.params)
        return tree

    def restore(self, tree: dict, meta: dict) -> None:
        self.state = tree["state"].replace(frozen=self.state.frozen)
        self.ref_params = tree.get("ref")
        self.history.restore(list(zip(meta["history_versions"], tree["history"])))
        self.batcher.restore(meta["data"])

    def interrupted_step(self, step: int) -> int | None:
        """Ctrl-C or SIGTERM during or between steps: the step whose checkpoint saves what can
        be saved without losing or corrupting anything; None: keep the last periodic one.

        Between steps the state is the newest policy version's. Before the step's first update
        (sampling takes most of a step) it is the step's start state: rewind the data iterator
        and the resume is exact. After it, the update has donated buffers the policy history
        may share (lag 0, same layouts): save the updated state as step + 1 (that step's row is
        not written). During it, the old state is gone."""
        started = self.step_start
        if any(x.is_deleted() for x in jax.tree.leaves(self.state)):
            return None
        if started is None:
            return self.history.state()[-1][0]
        if int(self.state.step) != started[1]:
            self.history.push(step + 1, jax.tree.map(jnp.copy, self.state.params))
            return step + 1
        self.batcher.restore(started[0])
        return step

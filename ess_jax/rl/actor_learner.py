"""train.mode "async": the sampler and the trainer run at the same time on disjoint devices.

    rollout mesh (SAMPLE_RULES)                           train mesh (TRAIN_RULES)
    Sampler thread: batch k with the last params  ---->  main thread: step k on batch k
         ^          bounded queue of `Batch`es                      |
         +---- params version s, every train.sync_every steps ------+
               jax.device_put to the rollout mesh's sample layout (device to device)

The devices split in two meshes (`device_split.meshes`): the first async_rollout_devices devices
(default half) form the rollout mesh, (data, 1, async_rollout_tensor), whose params are in the
sample layout (embed replicated, tensor-sharded); the rest form the train mesh, shaped by `mesh`
as in the sync loop. At the start of each step s that is a multiple of train.sync_every (once
step s - 1's row is written) the trainer copies its params with one `jax.device_put` onto the
rollout mesh's NamedShardings (no host round trip) and hands them to the sampler as version s
(the number of steps trained). With model.lora a push copies the adapters alone: the rollout
mesh gets its own copy of the frozen base once, when the sampler starts, and the sampler draws
from base + adapters there (`lora_policy.sampler_params`: merged once per batch).

The sampler draws through a `RolloutEngine` (sampling/engine.py), as the sync loop does: before
each batch it pushes the version it drew with (`update_params`), after it `release`s it. The
engine is `Run.engine` when one was given, else the in-JAX sampler on the rollout mesh
(`rollout.policy_engine`); the external model's rows come from its own engine there.

Thread, not asynchronous dispatch alone: one collection is not one device program. It decodes
in up to 4 jitted segments, brings the tokens to the host (rewards are Python functions of the
text), reads the next prompts, and with DAPO resampling decides on the host whether to draw
again. Each of those host reads blocks the Python thread that issued it, so in one thread the
trainer's dispatch would wait behind the sampler's reads and the reverse. In a host thread of
its own the sampler blocks only itself; XLA releases the GIL while it runs, so the two meshes
compute at once, and only the Python parts (rewards, batching) share the interpreter.

Staleness. Batch k is the one step k trains on; it is drawn with version v and every row
records v (`Rollout.policy_version`). The sampler starts batch k only when k - v <= the lag
budget, else it waits for a newer push: it never drops a row. The budget is rollout.max_lag,
or less under ESS pacing (rollout.target_ess, `pacing.LagController`). The queue holds at
most max_lag + 1 batches (the budget already bounds it so; the bound is a safeguard).

Checkpoints hold the trainer's state and the data position after the last batch it trained
on. The queue's contents are dropped: on resume the sampler restarts from that position with
the restored params, so the same prompts come back, with the same sampling keys
(fold_in(key(seed), 1), k), drawn by the restored (newest) policy: no prompt is lost or
trained on twice, and the re-drawn batches have lag 0. The ESS pacing's state (budget and
running ESS) is in the checkpoint's metadata and restored with it.

Failure and signals. An exception in the sampler thread is raised in the trainer at its next
wait as `SamplerError` from the original (its traceback is the cause). Ctrl-C and SIGTERM reach
the main thread (the waits for a batch are `preemption.interruptible`): the checkpoint is
written as in the sync loop (`Run.save_on_interrupt`; the sampler reads none of what it saves),
then the sampler is told to stop and joined.

One process only: the sampler's programs run on a subset of the devices, and under JAX's
multi-controller model every process must launch each program that spans its devices, in the
same order; two threads per host issuing programs on two meshes at their own pace cannot keep
that order across hosts (device_split.check refuses the combination; docs/running.md).

Peers read for the design (no code taken): verl's one-step-off-policy recipe (a rollout
worker group one step ahead of the trainer, weights pushed by NCCL broadcast) and tunix's
separate rollout and trainer meshes with a weight sync between them.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import traceback
from typing import Any

import jax
import numpy as np

from ess_jax.model import decoder as model_lib
from ess_jax.model import lora
from ess_jax.rl import preemption
from ess_jax.rl import rollout as rollout_lib
from ess_jax.rl.collect import Collector
from ess_jax.rl.pacing import LagController
from ess_jax.rl.trainer import Trainer
from ess_jax.sampling.engine import JaxEngine, RolloutEngine

POLL_S = 0.1  # how often a wait looks at the other side (stop flag, crashed thread)


class SamplerError(RuntimeError):
    """The sampler thread raised; the original exception is the cause."""


def make_pacer(config) -> LagController | None:
    """train.mode "async": the lag budget's controller (`pacing`), which `Run` keeps in its
    checkpoints' metadata and restores on resume; None for the sync loop."""
    if config.train.get("mode", "sync") != "async":
        return None
    every = int(config.train.sync_every)
    return LagController(int(config.rollout.max_lag), every - 1, config.rollout.target_ess)


@dataclasses.dataclass
class Batch:
    """One rollout batch in the queue: the step `index` that trains on it."""

    index: int
    version: int  # the params version that drew its policy rows (Rollout.policy_version)
    rollout: rollout_lib.Rollout
    metrics: dict
    data_after: dict  # the batcher's position after its prompts (a checkpoint's data)
    draw_s: float


class Sampler:
    """The host thread that fills the queue (module docstring): each batch drawn by `engine`
    (`external`: the external model's engine) through `collector`, the sync loop's collection.
    `publish` hands it params, `set_budget` the lag budget; `next_batch` is the trainer's side."""

    def __init__(
        self,
        collector: Collector,
        batcher,
        engine: RolloutEngine,
        external: RolloutEngine | None,
        frozen,
        params,
        version,
        start,
        budget,
        capacity,
    ):
        self._collector, self._batcher, self._budget = collector, batcher, budget
        self._engine, self._external = engine, external
        self._frozen = frozen  # model.lora: the base on the rollout mesh (`params`: adapters)
        self._version, self._params = version, params
        self._queue: queue.Queue[Batch] = queue.Queue(maxsize=capacity)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._main, args=(start,), name="ess_jax-sampler", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ trainer side
    def publish(self, version: int, params) -> None:
        with self._cond:
            self._version, self._params = version, params
            self._cond.notify_all()

    def set_budget(self, budget: int) -> None:
        with self._cond:
            self._budget = budget
            self._cond.notify_all()

    def depth(self) -> int:
        return self._queue.qsize()

    def next_batch(self) -> Batch:
        """The next batch; SamplerError at once if the thread died (never a hang)."""
        while True:
            try:
                return self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if self.error is not None:
                    raise SamplerError(f"the sampler thread failed: {self.error!r}") from (
                        self.error
                    )
                if not self._thread.is_alive():
                    raise SamplerError("the sampler thread stopped") from None

    def stop(self, timeout: float = 600.0, wait: bool = True) -> None:
        """Tell the thread to stop and (`wait`) wait for it (a collection in flight finishes
        first)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if wait and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logging.error("the sampler thread did not stop within %.0f s", timeout)

    # ------------------------------------------------------------------ sampler side
    def _main(self, k: int) -> None:
        try:
            while not self._stop.is_set():
                got = self.params_for(k)
                if got is None:
                    return
                batch = self._collect(k, *got)
                while not self._stop.is_set():
                    try:
                        self._queue.put(batch, timeout=POLL_S)
                        break
                    except queue.Full:
                        continue
                k += 1
        except BaseException as e:
            logging.error("sampler thread failed:\n%s", traceback.format_exc())
            self.error = e

    def params_for(self, k: int):
        """(version, params) once batch k may be drawn (k - version <= budget); None on stop.
        Called by the thread before each batch: a sampler group of several processes decides
        here which version every process draws with (sampler_group.GroupSampler)."""
        with self._cond:
            while k - self._version > self._budget:
                if self._stop.is_set():
                    return None
                self._cond.wait(POLL_S)
            return None if self._stop.is_set() else (self._version, self._params)

    def _collect(self, k: int, version: int, params) -> Batch:
        """Batch k, drawn by the engine with `params` pushed as `version` for it."""
        t0 = time.perf_counter()
        rollout, metrics = self._collector.collect(
            self._engine,
            self._batcher,
            k,
            version,
            lora.join(self._frozen, params),
            external=self._external,
        )
        data = self._batcher.state()
        return Batch(k, version, rollout, metrics, data, time.perf_counter() - t0)


class SyncLoop:
    """train.mode "sync": each step draws its batch with the behaviour version, then trains on
    it; nothing runs between steps."""

    def __init__(
        self,
        trainer: Trainer,
        collector: Collector,
        engine: RolloutEngine,
        external: RolloutEngine | None,
    ):
        self.trainer, self.collector = trainer, collector
        self.engine, self.external = engine, external

    def start(self, start: int) -> None:
        pass

    def stop(self, failure: BaseException | None = None) -> None:
        pass

    def step(self, step: int) -> dict:
        t0, trainer = time.perf_counter(), self.trainer
        trainer.begin_step()
        version, params_b, sampler_params = trainer.behaviour()
        with preemption.interruptible():  # a signal: the step is redone from its start state
            rollout, metrics = self.collector.collect(
                self.engine, trainer.batcher, step, version, sampler_params, self.external
            )
        return trainer.learn(step, rollout, metrics, version, params_b, t0)


class LocalLink:
    """The actor-learner's link to its sampler in this process: the `Sampler` thread on the
    rollout mesh, params pushed by `jax.device_put` (device to device). rl/groups.py
    `RemoteLink` is the same link to a sampler group in another program.

    `engine`: the policy's engine on the rollout mesh (None: the in-JAX sampler there);
    `external`: the external model's engine in the train layout (None without one), copied to
    the rollout mesh when the sampler starts."""

    def __init__(
        self,
        trainer: Trainer,
        collector: Collector,
        model_cfg,
        rollout_mesh,
        engine: RolloutEngine | None,
        external: JaxEngine | None,
        max_lag: int,
    ):
        self.trainer, self.collector, self.model_cfg = trainer, collector, model_cfg
        self.rollout_mesh, self.engine, self.external = rollout_mesh, engine, external
        self.rollout_sh = model_lib.param_shardings(model_cfg, rollout_mesh, "sample")
        self.frozen_sh = None  # model.lora: the base's shardings; rollout_sh the adapters'
        if trainer.state.frozen is not None:
            self.frozen_sh, self.rollout_sh = lora.split(self.rollout_sh)
        self.max_lag = int(max_lag)
        self.sampler: Sampler | None = None

    def push(self, version: int) -> float:
        """The trainer's params (model.lora: the adapters alone) on the rollout mesh's sample
        layout, handed to the sampler as `version`; the seconds the copy took."""
        return self._push(version)[1]

    def _push(self, version: int) -> tuple[Any, float]:
        t0 = time.perf_counter()
        params = jax.block_until_ready(jax.device_put(self.trainer.state.params, self.rollout_sh))
        if self.sampler is not None:
            self.sampler.publish(version, params)
        return params, time.perf_counter() - t0

    def start(self, start: int, budget: int) -> None:
        """The sampler thread from batch `start` with the params of version `start`."""
        rcfg = self.collector.rollout_cfg
        external = None
        if self.external is not None:  # a copy on the rollout mesh for the whole run
            e = self.external
            sh = model_lib.param_shardings(e.cfg, self.rollout_mesh, "sample")
            external = rollout_lib.external_engine(e.cfg, jax.device_put(e.params, sh), rcfg)
        frozen = None  # model.lora: the frozen base, copied to the rollout mesh once
        if self.frozen_sh is not None:
            frozen = jax.device_put(self.trainer.state.frozen, self.frozen_sh)
        engine = self.engine
        if engine is None:  # the in-JAX sampler on the rollout mesh
            engine = rollout_lib.policy_engine(self.model_cfg, rcfg)
        params, _ = self._push(start)
        self.sampler = Sampler(
            self.collector,
            self.trainer.batcher.fork(),
            engine,
            external,
            frozen=frozen,
            params=params,
            version=start,  # the version of those params
            start=start,  # the first batch to draw
            budget=budget,
            capacity=self.max_lag + 1,
        )

    def next_batch(self) -> Batch:
        return self.sampler.next_batch()

    def set_budget(self, budget: int) -> None:
        self.sampler.set_budget(budget)

    def depth(self) -> int:
        return self.sampler.depth()

    def stop(self, failure: BaseException | None = None) -> None:
        if self.sampler is not None:
            self.sampler.stop()


class ActorLearner:
    """train.mode "async": the steps of `Run._run`, each fed by a sampler through `link`
    (`LocalLink`: a thread of this process; groups.RemoteLink: a sampler group in another
    program).

    Two data positions: the sampler's own batcher (`PromptBatcher.fork`, or the sampler
    group's) reads ahead, and the trainer's batcher is moved to each batch's `data_after` as
    the trainer takes it, so a checkpoint (`Run.save`, `Run.save_on_interrupt`) holds the
    position of the batches trained on and the queue is dropped (module docstring).
    `pacer`: the lag budget's controller, which the run checkpoints and restores."""

    def __init__(self, trainer: Trainer, link, pacer: LagController, sync_every: int):
        self.trainer, self.link, self.pacer = trainer, link, pacer
        self.every = int(sync_every)
        self.first = 0  # the step the sampler started at (its params were pushed then)

    def start(self, start: int) -> None:
        """The sampler from batch `start` with the params of version `start`."""
        self.first = start
        self.link.start(start, self.pacer.budget)

    def stop(self, failure: BaseException | None = None) -> None:
        """Stops the sampler; `failure`: what ended the run, if it failed (a sampler group in
        another program is told)."""
        self.link.stop(failure)

    def step(self, step: int) -> dict:
        """Push the params when a push is due (as version `step`, every sync_every steps),
        wait for batch `step`, train on it; its metrics row. The push waits for the start of
        the next step, when the row of the last one is written: a Ctrl-C during the push finds
        that step whole, and the checkpoint it writes skips no row."""
        due = step > self.first and step % self.every == 0
        push_s = self.link.push(step) if due else 0.0
        trainer, t0 = self.trainer, time.perf_counter()
        with preemption.interruptible():  # waiting touches nothing of the train state
            batch = self.link.next_batch()
        if batch.index != step:
            raise RuntimeError(f"the sampler sent batch {batch.index} for step {step}")
        depth = self.link.depth()
        trainer.begin_step(data_after=batch.data_after)  # Ctrl-C rewinds to the start
        row = trainer.learn(step, batch.rollout, batch.metrics, batch.version, None, t0)
        budget = self.pacer.update(float(row["ess"]))  # at once: a Ctrl-C saves step + 1 with it
        versions = np.asarray(batch.rollout.policy_version)
        lags = step - versions[versions >= 0]  # the external model's rows (-1) have no lag
        self.link.set_budget(budget)
        row.update(
            lag_mean=float(lags.mean()) if lags.size else 0.0,
            lag_max=int(lags.max()) if lags.size else 0,
            lag_budget=budget,
            queue_depth=depth,
            draw_s=batch.draw_s,
            push_s=push_s,
        )
        return row

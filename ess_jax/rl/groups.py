"""train.mode "async" as two programs: a trainer group and a sampler group, each its own JAX
cluster on its own devices (`--role=trainer`, `--role=sampler`: the same command otherwise).

    trainer group (--role=trainer)                       sampler group (--role=sampler)
    Run, ActorLearner, RemoteLink (this module)          sampler_group.serve: Sampler, engine
      listens on train.async_address  <---- rows -----   Drawn(batch k, drawn by version v)
      transfer server: await_pull(uuid, params) ------>  pull(uuid) shard by shard
      Start / Params(v, uuid) / Budget / Stop  -------> (control, on the rows channel)

Why two programs. Under JAX's multi-controller model every process of a cluster launches each
program that spans its devices, in the same order; a sampler and a trainer stepping at their
own pace on one cluster cannot keep that order across hosts, so the one-process actor-learner
(actor_learner.py) refuses several processes. Here each side is its own cluster
(`jax.distributed` initialised per group, from the usual JAX_COORDINATOR_ADDRESS variables or
the scheduler's) and the two meet outside JAX's collectives on two channels:

- Params, trainer -> sampler: `jax.experimental.transfer`. The trainer registers a copy of its
  trained params (model.lora: the adapters; the sampler group keeps its own frozen base) in
  the train layout (a copy because the next update donates the state's buffers) with
  its transfer server under a fresh uuid and announces the version; the sampler pulls every
  array with the same shardings over its own devices (the exchange layout, `exchange_mesh`:
  `config.mesh`'s shape when both groups have as many devices, so the trainer offers its own
  layout; else fully sharded over the first min(trainer's, sampler's) devices of each group,
  which the trainer's copy is resharded to), so each device receives exactly its shard and no
  byte goes through one host, then moves the params to its
  sample layout on its own devices (`jax.device_put`, device to device) where the engine casts
  them to the sampler's precision. The trainer keeps one offer out at a time: a version pushed
  while the last one is not pulled yet waits (replacing any older waiting one) until the
  sampler says it pulled, so a sync holds at most two params copies on the trainer (offered,
  waiting) and one pulled copy on the sampler (the planner counts them: memory/planner.py).
- Rows and control: `multiprocessing.connection` (a socket with pickled messages and an
  HMAC handshake, from the standard library). A batch is host data already (numpy, rewards are
  Python), a few MB at most; the handshake's key is a digest of the config (role and address
  left out), so a sampler started with another config is refused at connect, not after.

Staleness and pacing are the one-process actor-learner's: the trainer holds the lag budget
(`pacing.LagController`, in its checkpoints) and sends it after every step; the sampler
draws batch k only with a version v such that k - v <= budget. Every row records its version.

Faults. The sampler group holds no state: the trainer's `Start` message says which batch to
draw next, from which data position, with which version and budget. So
- the sampler group dies (kill -9): the trainer sees the channel close, logs one line and
  waits for a sampler group to connect; the restarted one gets `Start` at the first batch not
  yet trained on, from the trainer's data position: the batches in flight are drawn again, by
  a version within the budget, none lost, none trained on twice;
- the trainer dies (kill -9, mid-push or not): the sampler sees the channel close and exits
  with one line (exit 2); rerunning both commands resumes the trainer from its checkpoint
  (rl/train.py) and the sampler from the trainer's `Start`: the lag after a resume is measured
  against the restored step (the versions are the trainer's step counts), never against the
  dead run's;
- SIGTERM or Ctrl-C: the trainer checkpoints and exits as in every mode, telling the sampler
  to stop (it exits 0; a trainer that fails tells it why, and it exits 2); the sampler group
  stopped so exits at once (it has nothing to save) and the trainer waits for it as after a
  kill.

Several processes per group. Each group may span hosts: process 0 of each holds the channel,
the others follow its decisions (group_channel.py: the coordination service's key-value store
for the decisions, one XLA broadcast for a batch), and process k of the sampler group pulls
its shards from process k of the trainer group, so such groups must match in process and
device count (refused at connect with one line otherwise). tests/test_groups.py runs 2 + 2
processes against the one-process actor-learner.
"""

from __future__ import annotations

import collections
import logging
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener
from typing import Any

import jax
import jax.numpy as jnp

from ess_jax.parallel import hosts
from ess_jax.rl import preemption
from ess_jax.rl.actor_learner import Batch
from ess_jax.rl.group_channel import (
    HELLO_TIMEOUT_S,
    Budget,
    Drawn,
    Hello,
    Params,
    Pulled,
    Start,
    Stop,
    address,
    exchange_abstract,
    exchange_mesh,
    follow,
    handshake_key,
    leads,
    local_address,
    pull_deadline,
    same_shape,
    share_object,
    transfer_server,
)
from ess_jax.rl.trainer import Trainer


class RemoteLink:
    """The trainer's link to a sampler group in another program: what `ActorLearner` drives
    (start, push, next_batch, set_budget, depth, stop), as `actor_learner.LocalLink` does for
    the sampler thread of one process. Batches that have arrived wait in `inbox` (`depth`).

    Process 0 holds the channel; every process of the trainer group holds a transfer server
    and the same offers (its shards of them), and follows process 0's events (`_event`: a
    pull finished, a sampler group joined, a batch arrived) at the point process 0 takes them,
    so that all launch the same copies and reshards in the same order."""

    def __init__(self, trainer: Trainer, config, model_cfg):
        self.trainer, self.config, self.model_cfg = trainer, config, model_cfg
        self.exchange_sh = None  # the connected group's exchange layout; None: the train one
        host, port = address(config)
        self.listener = Listener((host, port), authkey=handshake_key(config)) if leads() else None
        self.server = transfer_server(local_address(host))
        self.servers = hosts.gather("groups.transfer", self.server.address())
        self.conn: Connection | None = None
        self.uuid = 0
        self.newest: tuple[int, Any] = (0, None)  # (version, params copy) of the last push
        self.offered: tuple[int, Any] | None = None  # (uuid, copy) offered, not yet pulled
        self.waiting: tuple[int, Any] | None = None  # (version, copy) pushed meanwhile
        self.inbox: collections.deque[Batch] = collections.deque()
        self.budget = 0
        self.next_index = 0  # the batch the trainer takes next

    def start(self, start: int, budget: int) -> None:
        self.next_index, self.budget = start, budget
        self.push(start)
        if not leads():
            event = self._event()
            assert event[0] == "accept", event
            self._accepted(event[1], None)
            return
        logging.warning("waiting for the sampler group at %s:%d", *self.listener.address)
        with preemption.interruptible():
            self._accept()

    def push(self, version: int) -> float:
        """A copy of the trainer's params as `version`: offered now, or once the sampler has
        pulled the last offer; the seconds the copy took (the sampler's pull is its own)."""
        t0 = time.perf_counter()
        params = jax.block_until_ready(jax.tree.map(jnp.copy, self.trainer.state.params))
        self.newest = (version, params)
        if self.offered is None:
            self._offer(version, params)
        else:
            self.waiting = (version, params)
        return time.perf_counter() - t0

    def next_batch(self) -> Batch:
        if not leads():
            return self._follow_to_batch()
        while True:
            try:
                if self.conn is None:
                    raise EOFError
                while self.conn.poll(0):  # everything that has arrived
                    self._handle(self.conn.recv())
                if self.inbox:
                    batch = self.inbox.popleft()
                    self._event("batch")
                    share_object(batch)
                    self.next_index = batch.index + 1
                    return batch
                self._handle(self.conn.recv())
            except (EOFError, OSError):
                logging.warning(
                    "the sampler group left; waiting for one to connect to %s:%d (batch %d)",
                    *self.listener.address,
                    self.next_index,
                )
                self._accept()

    def set_budget(self, budget: int) -> None:
        self.budget = budget
        self._send(Budget(budget))

    def depth(self) -> int:
        return len(self.inbox)  # process 0's (the others hold none; only process 0 logs rows)

    def stop(self, failure: BaseException | None = None) -> None:
        if failure is None:
            self._send(Stop("the trainer stopped"))
        else:
            self._send(Stop(f"the trainer failed: {failure!r:.200}", ok=False))
        self._close()
        if self.listener is not None:
            self.listener.close()

    # ------------------------------------------------------------------ offers
    def _offer(self, version: int, params) -> None:
        """`params` offered for one pull under a fresh uuid (a uuid is pulled once) and
        announced, when a sampler group is connected (process 0's word, on every process)."""
        if not follow("offer", self.conn is not None):
            return
        self.offered = self._register(params)
        self._send(Params(version, self.offered[0]))

    def _register(self, params) -> tuple[int, Any]:
        """(uuid, the offered arrays): `params`, or their copy in the connected group's
        exchange layout (kept with the offer until pulled)."""
        self.uuid += 1
        if self.exchange_sh is not None:
            params = jax.device_put(params, self.exchange_sh)
        self.server.await_pull(self.uuid, params, timeout=pull_deadline())
        return self.uuid, params

    def _pulled(self) -> None:
        """The sampler group pulled the offer: the version pushed meanwhile, if any, is next."""
        self.offered = None
        if self.waiting is not None:
            (version, params), self.waiting = self.waiting, None
            self._offer(version, params)

    # ------------------------------------------------------------------ process 0's events
    def _event(self, *event):
        """Process 0's `event` on every process of the group (the others pass none)."""
        return tuple(follow("event", list(event) if leads() else None))

    def _follow_to_batch(self) -> Batch:
        """A process other than 0: process 0's events until the batch it takes next."""
        while True:
            event = self._event()
            if event[0] == "pulled":
                self._pulled()
            elif event[0] == "accept":
                self._accepted(event[1], None)
            else:
                batch = share_object(None)
                self.next_index = batch.index + 1
                return batch

    def _handle(self, msg) -> None:
        if isinstance(msg, Drawn):
            self.inbox.append(msg.batch)
        elif isinstance(msg, Pulled) and self.offered and msg.uuid == self.offered[0]:
            self._event("pulled")
            self._pulled()

    # ------------------------------------------------------------------ the channel
    def _send(self, msg) -> None:
        """To the sampler group, if one is connected; a broken channel is closed, and the next
        `next_batch` waits for a new group."""
        if self.conn is None:
            return
        try:
            self.conn.send(msg)
        except OSError:
            self._close()

    def _close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except OSError:
                pass
        self.conn = None

    def _accept(self) -> None:
        """Waits for a sampler group and starts it at the first batch not trained on, from the
        trainer's data position, with the newest version (registered anew: the group that left
        may have pulled its uuid). What the group that left drew and sent is drawn again."""
        self._close()
        while self.conn is None:
            try:
                conn = self.listener.accept()
            except (AuthenticationError, OSError, EOFError) as e:  # another config
                logging.error("refused a sampler group (%s): is it the same config?", e)
                continue
            try:
                hello = conn.recv() if conn.poll(HELLO_TIMEOUT_S) else None
            except Exception:  # gone, or not a message of this protocol (unpickling failed)
                hello = None
            if not (
                isinstance(hello, Hello)
                and all(isinstance(n, int) and n >= 1 for n in (hello.devices, hello.processes))
            ):
                logging.error("refused a sampler group that did not say its device count")
                conn.close()
                continue
            if (why := same_shape(hello.devices, hello.processes)) is not None:
                logging.error("refused a sampler group: %s", why)
                self._refuse(conn, why)
                continue
            self._event("accept", hello.devices)
            self._accepted(hello.devices, conn)

    def _refuse(self, conn: Connection, why: str) -> None:
        try:
            conn.send(Stop(why, ok=False))
        except OSError:
            pass
        conn.close()

    def _accepted(self, peer_devices: int, conn: Connection | None) -> None:
        """A sampler group of `peer_devices` joined (`conn`: process 0's channel to it): the
        newest version offered to it in its exchange layout, on every process of the group."""
        self.inbox.clear()
        self.offered = self.waiting = None
        self._exchange(peer_devices)
        version, params = self.newest
        uuid, offered = self._register(params)
        self.offered = (uuid, offered)
        if conn is None:  # not process 0
            return
        data = self.trainer.batcher.state()
        start = Start(
            self.next_index, data, version, uuid, self.budget, self.servers, jax.device_count()
        )
        try:
            conn.send(start)
        except OSError:  # gone already: the next next_batch waits for another group
            conn.close()
            return
        self.conn = conn

    def _exchange(self, peer_devices: int) -> None:
        """The exchange layout for a sampler group of `peer_devices` (None: the train layout)."""
        self.exchange_sh = None
        if peer_devices != jax.device_count():
            mesh = exchange_mesh(self.config, jax.device_count(), peer_devices)
            abstract = exchange_abstract(self.model_cfg, mesh)
            self.exchange_sh = jax.tree.map(lambda x: x.sharding, abstract)

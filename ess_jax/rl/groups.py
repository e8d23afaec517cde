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

One process per group is what runs and is tested here; several processes per group are
refused at start with one line (each process would pair with its peer by index, and the
sampler group would need to agree on each batch's version by a broadcast: not built yet).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import hashlib
import json
import logging
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener
from typing import Any

import jax
import jax.numpy as jnp

from ess_jax.config.schema import UserError
from ess_jax.model import decoder as model_lib
from ess_jax.model import lora
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.rl import preemption
from ess_jax.rl.actor_learner import Batch
from ess_jax.rl.trainer import Trainer

ROLE_FIELDS = ("async_role", "async_address")  # left out of the handshake's key
# A registered copy not pulled within this time is dropped by the transfer server (it has no
# cancel): it bounds what a sampler group that died before pulling leaves on the trainer.
PULL_WINDOW_S = 600.0
HELLO_TIMEOUT_S = 60.0  # how long a connected sampler group may take to say its device count


class GroupError(UserError, RuntimeError):
    """The other group is gone or speaks another config."""


# ---------------------------------------------------------------------- messages
@dataclasses.dataclass
class Start:
    """Trainer -> sampler, on connect: draw from batch `batch` on, from data position `data`,
    with the params of `version` (pulled under `uuid`) and lag budget `budget`."""

    batch: int
    data: dict
    version: int
    uuid: int
    budget: int
    transfer: str  # the trainer's transfer server address
    devices: int  # the trainer group's devices (with the sampler's: the exchange layout)


@dataclasses.dataclass
class Hello:
    """Sampler -> trainer, on connect: the sampler group's device count."""

    devices: int


@dataclasses.dataclass
class Params:
    version: int
    uuid: int


@dataclasses.dataclass
class Budget:
    value: int


@dataclasses.dataclass
class Stop:
    reason: str
    ok: bool = True  # False: the trainer failed (the sampler group exits 2)


@dataclasses.dataclass
class Pulled:
    uuid: int
    seconds: float


@dataclasses.dataclass
class Drawn:
    batch: Batch


def handshake_key(config) -> bytes:
    """The channel's HMAC key: a digest of the config without the role fields."""
    d = config.to_dict()
    d["train"] = {k: v for k, v in d["train"].items() if k not in ROLE_FIELDS}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).digest()


def address(config) -> tuple[str, int]:
    """train.async_address as (host, port)."""
    host, _, port = str(config.train.async_address).rpartition(":")
    return host or "127.0.0.1", int(port)


def pull_deadline() -> datetime.datetime:
    """When an offer made (or a pull started) now lapses: PULL_WINDOW_S from now."""
    return datetime.datetime.now() + datetime.timedelta(seconds=PULL_WINDOW_S)


def transfer_server(host: str):
    """This process's `jax.experimental.transfer` server, on `host` (port picked by the OS)."""
    from jax.experimental import transfer

    return transfer.start_transfer_server(jax.devices()[0].client, f"{host}:0", [f"{host}:0"])


def exchange_mesh(config, devices: int, peer_devices: int):
    """The mesh the params cross on, over this group's devices (module docstring): config.mesh
    when both groups have `devices`, else "fsdp" over the first min of the two counts."""
    if devices == peer_devices:
        return sharding_lib.make_mesh(dict(config.mesh))
    e = min(devices, peer_devices)
    return sharding_lib.make_mesh({"fsdp": e}, jax.devices()[:e])


def exchange_abstract(model_cfg, mesh):
    """The params as the trainer offers them over `mesh` (`exchange_mesh`): ShapeDtypeStructs in
    the train layout, what the sampler pulls into (model.lora: the adapters alone, the
    trainer's trained params)."""
    tree = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        model_lib.abstract_params(model_cfg),
        model_lib.param_shardings(model_cfg, mesh),
    )
    return lora.split(tree)[1] if model_cfg.lora_rank else tree


# ---------------------------------------------------------------------- trainer side
class RemoteLink:
    """The trainer's link to a sampler group in another program: what `ActorLearner` drives
    (start, push, next_batch, set_budget, depth, stop), as `actor_learner.LocalLink` does for
    the sampler thread of one process. Batches that have arrived wait in `inbox` (`depth`)."""

    def __init__(self, trainer: Trainer, config, model_cfg):
        self.trainer, self.config, self.model_cfg = trainer, config, model_cfg
        self.exchange_sh = None  # the connected group's exchange layout; None: the train one
        host, port = address(config)
        self.listener = Listener((host, port), authkey=handshake_key(config))
        self.server = transfer_server(host)
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
        while True:
            try:
                if self.conn is None:
                    raise EOFError
                while self.conn.poll(0):  # everything that has arrived
                    self._handle(self.conn.recv())
                if self.inbox:
                    batch = self.inbox.popleft()
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
        return len(self.inbox)

    def stop(self, failure: BaseException | None = None) -> None:
        if failure is None:
            self._send(Stop("the trainer stopped"))
        else:
            self._send(Stop(f"the trainer failed: {failure!r:.200}", ok=False))
        self._close()
        self.listener.close()

    def _offer(self, version: int, params) -> None:
        """`params` offered for one pull under a fresh uuid (a uuid is pulled once) and
        announced, when a sampler group is connected."""
        if self.conn is None:
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

    def _handle(self, msg) -> None:
        if isinstance(msg, Drawn):
            self.inbox.append(msg.batch)
        elif isinstance(msg, Pulled) and self.offered and msg.uuid == self.offered[0]:
            self.offered = None
            if self.waiting is not None:
                (version, params), self.waiting = self.waiting, None
                self._offer(version, params)

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
        self.inbox.clear()
        self.offered = self.waiting = None
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
            if (
                not isinstance(hello, Hello)
                or not isinstance(hello.devices, int)
                or (hello.devices < 1)
            ):
                logging.error("refused a sampler group that did not say its device count")
                conn.close()
                continue
            self._exchange(hello.devices)
            version, params = self.newest
            uuid, offered = self._register(params)
            data, where = self.trainer.batcher.state(), self.server.address()
            start = Start(
                self.next_index, data, version, uuid, self.budget, where, jax.device_count()
            )
            try:
                conn.send(start)
            except OSError:  # gone already
                conn.close()
                continue
            self.conn, self.offered = conn, (uuid, offered)

    def _exchange(self, peer_devices: int) -> None:
        """The exchange layout for a sampler group of `peer_devices` (None: the train layout)."""
        self.exchange_sh = None
        if peer_devices != jax.device_count():
            mesh = exchange_mesh(self.config, jax.device_count(), peer_devices)
            abstract = exchange_abstract(self.model_cfg, mesh)
            self.exchange_sh = jax.tree.map(lambda x: x.sharding, abstract)

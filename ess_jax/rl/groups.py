"""train.mode "async" as two programs: a trainer group and a sampler group, each its own JAX
cluster on its own devices (`--role=trainer`, `--role=sampler`: the same command otherwise).

    trainer group (--role=trainer)                       sampler group (--role=sampler)
    Run, ActorLearner, RemoteLink                        serve: Sampler thread, engine
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
  params (the train layout; the copy because the next update donates the state's buffers) with
  its transfer server under a fresh uuid and announces the version; the sampler pulls every
  array with the same shardings over its own devices (the exchange layout: `config.mesh`'s
  shape over the sampler's devices, which the transfer needs shard for shard), so each device
  receives exactly its shard and no byte goes through one host, then moves the params to its
  sample layout on its own devices (`jax.device_put`, device to device) where the engine casts
  them to the sampler's precision. The trainer drops the copy when the sampler says it pulled
  it: the extra memory of a sync is one params copy on each side (planner: `sync_bytes`).
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
  with one line (exit 1); rerunning both commands resumes the trainer from its checkpoint
  (rl/train.py) and the sampler from the trainer's `Start`: the lag after a resume is measured
  against the restored step (the versions are the trainer's step counts), never against the
  dead run's;
- SIGTERM or Ctrl-C: the trainer checkpoints and exits as in every mode, telling the sampler
  to stop (it exits 0); the sampler group stopped so exits at once (it has nothing to save) and
  the trainer waits for it as after a kill.

One process per group is what runs and is tested here; several processes per group are
refused at start with one line (each process would pair with its peer by index, and the
sampler group would need to agree on each batch's version by a broadcast: not built yet).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import jax
import jax.numpy as jnp
from tqdm import tqdm

from ess_jax.config.schema import UserError
from ess_jax.model import decoder as model_lib
from ess_jax.rl import preemption
from ess_jax.rl.actor_learner import Batch, Sampler, SamplerError
from ess_jax.rl.collect import Collector
from ess_jax.rl.trainer import Trainer

ROLE_FIELDS = ("async_role", "async_address")  # left out of the handshake's key
CONNECT_TIMEOUT_S = 600.0  # the sampler group waits this long for the trainer group to listen
# A registered copy not pulled within this time is dropped by the transfer server (it has no
# cancel): it bounds what a sampler group that died before pulling leaves on the trainer.
PULL_WINDOW_S = 600.0


class GroupError(UserError, RuntimeError):
    """The other group is gone or speaks another config."""


# ---------------------------------------------------------------------- messages
@dataclasses.dataclass
class Start:
    """Trainer -> sampler, on connect: draw from batch `batch` on, from data position `data`,
    with the params announced next (`version`, pulled under `uuid`) and lag budget `budget`."""

    batch: int
    data: dict
    version: int
    uuid: int
    budget: int
    transfer: str  # the trainer's transfer server address
    devices: int  # the trainer group's devices: the pull is shard for shard, so the same count


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


@dataclasses.dataclass
class Pulled:
    uuid: int
    seconds: float


@dataclasses.dataclass
class Drawn:
    batch: Batch
    depth: int  # batches queued on the sampler side after this one


def handshake_key(config) -> bytes:
    """The channel's HMAC key: a digest of the config without the role fields."""
    d = config.to_dict()
    d["train"] = {k: v for k, v in d["train"].items() if k not in ROLE_FIELDS}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).digest()


def _address(config) -> tuple[str, int]:
    host, _, port = str(config.train.async_address).rpartition(":")
    return host or "127.0.0.1", int(port)


def transfer_server(host: str):
    """This process's `jax.experimental.transfer` server, on `host` (port picked by the OS)."""
    from jax.experimental import transfer

    return transfer.start_transfer_server(jax.devices()[0].client, f"{host}:0", [f"{host}:0"])


# ---------------------------------------------------------------------- trainer side
class RemoteLink:
    """The trainer's link to a sampler group in another program: what `ActorLearner` drives
    (start, push, next_batch, set_budget, depth, stop), as `actor_learner.LocalLink` does for
    the sampler thread of one process."""

    def __init__(self, trainer: Trainer, config):
        self.trainer = trainer
        self.host, port = _address(config)
        self.listener = Listener((self.host, port), authkey=handshake_key(config))
        self.server = transfer_server(self.host)
        self.conn: Connection | None = None
        self.uuid = 0
        self.pending: dict[int, tuple] = {}  # uuid -> (params copy, deadline) offered for a pull
        self.newest: tuple[int, Any] = (0, None)  # (version, params copy) of the last push
        self.budget = 0
        self.next_index = 0  # the batch the trainer takes next
        self._depth = 0

    def start(self, start: int, budget: int) -> None:
        self.next_index, self.budget = start, budget
        self.push(start)
        logging.warning("waiting for the sampler group at %s:%d", *self.listener.address)
        with preemption.interruptible():
            self._accept()

    def push(self, version: int) -> float:
        """Registers a copy of the trainer's params under a fresh uuid and announces it as
        `version`; the seconds the copy took (the sampler's pull is its own)."""
        t0 = time.perf_counter()
        params = jax.block_until_ready(jax.tree.map(jnp.copy, self.trainer.state.params))
        self.newest = (version, params)
        if self.conn is not None:
            self._send(Params(version, self._register(params)))
        return time.perf_counter() - t0

    def _register(self, params) -> int:
        """`params` offered for one pull under a fresh uuid (a uuid is pulled once)."""
        now = datetime.datetime.now()
        self.pending = {u: p for u, p in self.pending.items() if p[1] > now}  # expired: dropped
        self.uuid += 1
        deadline = now + datetime.timedelta(seconds=PULL_WINDOW_S)
        self.server.await_pull(self.uuid, params, timeout=deadline)
        self.pending[self.uuid] = (params, deadline)
        return self.uuid

    def next_batch(self) -> Batch:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                logging.warning(
                    "the sampler group left; waiting for one to connect to %s:%d (batch %d)",
                    *self.listener.address,
                    self.next_index,
                )
                self._accept()
                continue
            if isinstance(msg, Pulled):
                self.pending.pop(msg.uuid, None)
            elif isinstance(msg, Drawn):
                self._depth, self.next_index = msg.depth, msg.batch.index + 1
                return msg.batch

    def set_budget(self, budget: int) -> None:
        self.budget = budget
        self._send(Budget(budget))

    def depth(self) -> int:
        return self._depth

    def stop(self, reason: str = "the trainer stopped") -> None:
        self._send(Stop(reason))
        if self.conn is not None:
            self.conn.close()
        self.listener.close()

    def _send(self, msg) -> None:
        """To the sampler group, if one is connected; a broken channel is found by the next
        `next_batch`, which waits for a new group."""
        if self.conn is None:
            return
        try:
            self.conn.send(msg)
        except OSError:
            self.conn = None

    def _accept(self) -> None:
        """Waits for a sampler group and starts it at the first batch not trained on, with the
        newest version (registered anew: a group that left may have pulled its uuid)."""
        self.conn = None
        while self.conn is None:
            try:
                conn = self.listener.accept()
            except (AuthenticationError, OSError, EOFError) as e:  # another config
                logging.error("refused a sampler group (%s): is it the same config?", e)
                continue
            version, params = self.newest
            uuid, data = self._register(params), self.trainer.batcher.state()
            address, n = self.server.address(), jax.device_count()
            conn.send(Start(self.next_index, data, version, uuid, self.budget, address, n))
            self.conn = conn


# ---------------------------------------------------------------------- sampler side
class Puller:
    """The sampler group's end of the params channel: pulls a version by uuid into the
    exchange layout, then moves it to the sample layout on this group's devices."""

    def __init__(self, server, address: str, abstract, sample_sh):
        self.conn = server.connect(address)
        self.abstract, self.sample_sh = abstract, sample_sh

    def pull(self, uuid: int):
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=PULL_WINDOW_S)
        pulled = self.conn.pull(uuid, self.abstract, timeout=deadline)
        return jax.block_until_ready(jax.device_put(pulled, self.sample_sh))


def _connect(config) -> Connection:
    """The trainer's channel; retried while the trainer group starts (loads, compiles)."""
    address, t0 = _address(config), time.monotonic()
    while True:
        try:
            return Client(address, authkey=handshake_key(config))
        except ConnectionRefusedError:
            if time.monotonic() - t0 > CONNECT_TIMEOUT_S:
                raise GroupError(
                    f"no trainer group at {address[0]}:{address[1]} after "
                    f"{CONNECT_TIMEOUT_S:.0f} s (train.async_address)"
                ) from None
            time.sleep(1.0)
        except AuthenticationError:
            raise GroupError(
                f"the trainer group at {address[0]}:{address[1]} runs another config "
                "(the two commands must differ in --role only)"
            ) from None


def serve(config) -> str:
    """The sampler group's main (`--role=sampler`): draws batches for the trainer group until
    it says stop (returns its reason) or goes away (GroupError). Writes no files."""
    from ess_jax import rewards as rewards_lib
    from ess_jax.parallel import sharding as sharding_lib
    from ess_jax.rl import experiment
    from ess_jax.rl import rollout as rollout_lib

    sharding_lib.maybe_initialize_distributed()
    experiment.validate(config)
    model_cfg, _, tokenizer = experiment.load_policy(config.model, need_tokenizer=True)
    rollout_cfg = experiment.rollout_config(config, experiment.stop_ids(config, tokenizer))
    train_examples, _ = experiment.load_examples(config.task)
    batcher = experiment.train_batcher(config, train_examples, tokenizer)
    collector = Collector(
        tokenizer,
        rewards_lib.get_reward(config.task.reward),
        rollout_cfg,
        jax.random.key(config.seed),
    )
    exchange = model_lib.param_shardings(model_cfg, sharding_lib.make_mesh(dict(config.mesh)))
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        model_lib.abstract_params(model_cfg),
        exchange,
    )
    rollout_mesh = sharding_lib.make_mesh(
        {"data": -1, "tensor": int(config.train.async_rollout_tensor)}
    )
    sample_sh = model_lib.param_shardings(model_cfg, rollout_mesh, "sample")
    engine = rollout_lib.policy_engine(model_cfg, rollout_cfg)
    external = None
    if float(config.rollout.external_fraction) > 0:
        mcfg = experiment.with_source(config.model, config.rollout.external_checkpoint)
        ecfg, eparams, _ = experiment.load_policy(mcfg, need_tokenizer=False)
        eparams = jax.device_put(eparams, model_lib.param_shardings(ecfg, rollout_mesh, "sample"))
        external = rollout_lib.external_engine(ecfg, eparams, rollout_cfg)

    conn, send_lock = _connect(config), threading.Lock()
    start = conn.recv()
    if start.devices != jax.device_count():
        raise GroupError(
            f"the trainer group has {start.devices} devices, this sampler group "
            f"{jax.device_count()}: the params are pulled shard for shard, so both groups need "
            "the same device count"
        )
    puller = Puller(transfer_server(_address(config)[0]), start.transfer, abstract, sample_sh)
    t0 = time.perf_counter()
    params = puller.pull(start.uuid)
    conn.send(Pulled(start.uuid, time.perf_counter() - t0))
    batcher.restore(start.data)
    sampler = Sampler(
        collector,
        batcher,
        engine,
        external,
        frozen=None,
        params=params,
        version=start.version,
        start=start.batch,
        budget=start.budget,
        capacity=int(config.rollout.max_lag) + 1,
    )
    ended: list[str] = []
    failed: list[BaseException] = []

    def receive() -> None:
        try:
            while True:
                msg = conn.recv()
                if isinstance(msg, Params):
                    t0 = time.perf_counter()
                    sampler.publish(msg.version, puller.pull(msg.uuid))
                    with send_lock:
                        conn.send(Pulled(msg.uuid, time.perf_counter() - t0))
                elif isinstance(msg, Budget):
                    sampler.set_budget(msg.value)
                elif isinstance(msg, Stop):
                    ended.append(msg.reason)
                    break
        except (EOFError, OSError):
            pass  # the trainer group went away
        except Exception as e:  # a pull cut short by the trainer's death, among others
            failed.append(e)
        finally:
            sampler.stop(wait=False)

    receiver = threading.Thread(target=receive, name="ess_jax-groups-receiver", daemon=True)
    receiver.start()
    bar = tqdm(desc="sampled", initial=start.batch, total=int(config.train.steps))
    try:
        while True:
            try:
                batch = sampler.next_batch()
            except SamplerError:
                if sampler.error is not None:
                    raise
                break
            with send_lock:
                conn.send(Drawn(batch, sampler.depth()))
            bar.update(1)
            bar.set_postfix_str(f"batch {batch.index} by version {batch.version}")
    except (EOFError, OSError):
        pass
    finally:
        sampler.stop()
        bar.close()
    if not ended:
        cause = f" ({failed[0]!r:.200})" if failed else ""
        raise GroupError(
            f"the trainer group closed the channel{cause}; rerun both commands to resume from "
            "the trainer's last checkpoint"
        )
    return ended[0]

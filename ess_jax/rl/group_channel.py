"""What the two groups of a two-program async run (rl/groups.py: the design and the trainer's
side; rl/sampler_group.py: the sampler's) say to each other, and how each group's processes
agree on what its process 0 heard.

Between the groups: the messages on the rows-and-control channel (`multiprocessing.connection`,
pickled, behind an HMAC handshake keyed by the config), the transfer servers that move the
params, and the exchange layout the params cross in. Process k of one group pulls from
process k of the other (`Start.transfer[k]`), so a group of several processes needs a peer
group of as many processes and devices (`same_shape`): then the exchange layout is config.mesh
on both sides, over device lists of the same structure, and each process's addressable shards
of it are its peer's. Groups of one process each may differ in device count.

Within a group: only process 0 holds the channel. The other processes must still launch the
same programs in the same order (JAX's multi-controller model), so every decision that
depends on what process 0 heard (a batch arrived, a pull finished, a sampler group joined) is
published to them through the coordination service's key-value store (`parallel.hosts`), at
the point where process 0 takes it; the data that goes with it (a batch, a few MB) follows in
one XLA broadcast (`share_bytes`), which every process reaches at the same point.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import pickle
import socket

import jax
import numpy as np

from ess_jax.config.schema import UserError
from ess_jax.model import decoder as model_lib
from ess_jax.model import lora
from ess_jax.parallel import hosts
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.rl.actor_learner import Batch

ROLE_FIELDS = ("async_role", "async_address")  # left out of the handshake's key
# A registered copy not pulled within this time is dropped by the transfer server (it has no
# cancel): it bounds what a sampler group that died before pulling leaves on the trainer.
PULL_WINDOW_S = 600.0
HELLO_TIMEOUT_S = 60.0  # how long a connected sampler group may take to say its device count
# How long a process other than 0 waits for its process 0's next decision: as long as process 0
# may wait for the other group (a sampler group restarted by hand, a trainer that checkpoints).
FOLLOW_TIMEOUT_MS = 7 * 24 * 3600 * 1000


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
    transfer: list[str]  # the trainer processes' transfer server addresses, in process order
    devices: int  # the trainer group's devices (with the sampler's: the exchange layout)


@dataclasses.dataclass
class Hello:
    """Sampler -> trainer, on connect: the sampler group's device and process counts."""

    devices: int
    processes: int = 1


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


# ---------------------------------------------------------------------- the channel
def handshake_key(config) -> bytes:
    """The channel's HMAC key: a digest of the config without the role fields."""
    d = config.to_dict()
    d["train"] = {k: v for k, v in d["train"].items() if k not in ROLE_FIELDS}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).digest()


def address(config) -> tuple[str, int]:
    """train.async_address as (host, port)."""
    host, _, port = str(config.train.async_address).rpartition(":")
    return host or "127.0.0.1", int(port)


def same_shape(devices: int, processes: int) -> str | None:
    """Why a peer group of `devices` over `processes` cannot exchange params with this one
    (module docstring), or None when it can."""
    mine = (jax.device_count(), jax.process_count())
    if (processes > 1 or mine[1] > 1) and (devices, processes) != mine:
        return (
            f"a group of several processes exchanges params with a group of as many processes "
            f"and devices: this group has {mine[0]} devices over {mine[1]} processes, the other "
            f"{devices} over {processes}"
        )
    return None


# ---------------------------------------------------------------------- the params
def pull_deadline() -> datetime.datetime:
    """When an offer made (or a pull started) now lapses: PULL_WINDOW_S from now."""
    return datetime.datetime.now() + datetime.timedelta(seconds=PULL_WINDOW_S)


def local_address(peer_host: str) -> str:
    """This host's address on the interface that reaches `peer_host` (a UDP socket's route; no
    packet is sent): where this process's transfer server binds, so that pulls reach it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer_host, 9))
        return s.getsockname()[0]


def transfer_server(host: str):
    """This process's `jax.experimental.transfer` server, on `host` (port picked by the OS)."""
    from jax.experimental import transfer

    return transfer.start_transfer_server(jax.devices()[0].client, f"{host}:0", [f"{host}:0"])


def exchange_mesh(config, devices: int, peer_devices: int):
    """The mesh the params cross on, over this group's devices (module docstring): config.mesh
    when both groups have `devices`, else "fsdp" over the first min of the two counts (groups
    of one process each: `same_shape`)."""
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


# ---------------------------------------------------------------------- within a group
def leads() -> bool:
    """Whether this process is its group's process 0 (the one that holds the channel)."""
    return jax.process_index() == 0


def follow(name: str, value=None):
    """Process 0's `value` (JSON-able) on every process of the group, waiting as long as process
    0 may wait for the other group (FOLLOW_TIMEOUT_MS)."""
    return hosts.from_process0(f"groups.{name}", value, FOLLOW_TIMEOUT_MS)


def share_bytes(payload: bytes | None) -> bytes:
    """Process 0's `payload` on every process: its length through `follow`, its bytes in one
    XLA broadcast (every process calls this at the same point)."""
    if jax.process_count() == 1:
        return payload
    from jax.experimental import multihost_utils

    n = follow("bytes", len(payload) if leads() else None)
    data = np.frombuffer(payload, np.uint8) if leads() else np.zeros(n, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(data)).tobytes()


def share_object(obj):
    """Process 0's picklable `obj` on every process (`share_bytes`)."""
    return pickle.loads(share_bytes(pickle.dumps(obj) if leads() else None))

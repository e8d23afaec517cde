"""The sampler group of the two-program async run (`--role=sampler`; rl/groups.py has the
design and the trainer's side): `serve` draws batches for the trainer group until it says stop.

One process, three threads: the main thread sends each batch the `Sampler` thread
(actor_learner.py) draws, as a `Drawn` message; the receiver thread reads the trainer's
messages, pulls each announced version (`Puller`: shard for shard into the exchange layout,
then to the sample layout on this group's devices) and hands it to the sampler, and passes on
the lag budget. Both threads send under one lock; no send blocks the other thread's reads for
long, since the main thread stops drawing once it has sent the run's last batch.

The group keeps no state: what it draws, from where and with which version is the trainer's
`Start` message. It reads the policy's checkpoint for its config and tokenizer onto its own
devices (the train layout over them, then dropped: the params it samples with are pulled).
With model.lora the trainer trains and offers the adapters alone: the group derives the frozen
base from the same checkpoint (`lora_policy.attach`, as the trainer does: a function of
model.source alone), keeps it on its rollout mesh for the whole run, and pulls only the
adapters, which the sampler joins to it (actor_learner.Sampler's `frozen`).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection

import jax
from tqdm import tqdm

from ess_jax import rewards as rewards_lib
from ess_jax.model import decoder as model_lib
from ess_jax.model import lora
from ess_jax.parallel import sharding as sharding_lib
from ess_jax.rl import experiment, lora_policy
from ess_jax.rl import rollout as rollout_lib
from ess_jax.rl.actor_learner import Sampler, SamplerError
from ess_jax.rl.collect import Collector
from ess_jax.rl.groups import (
    Budget,
    Drawn,
    GroupError,
    Hello,
    Params,
    Pulled,
    Stop,
    address,
    exchange_abstract,
    exchange_mesh,
    handshake_key,
    pull_deadline,
    transfer_server,
)

CONNECT_TIMEOUT_S = 600.0  # how long the group waits for the trainer group to listen


class Puller:
    """The sampler group's end of the params channel: pulls a version by uuid into the
    exchange layout (`abstract`: groups.exchange_abstract over groups.exchange_mesh), then
    moves it to `sample_sh` on this group's devices."""

    def __init__(self, server, peer: str, abstract, sample_sh):
        self.conn = server.connect(peer)
        self.abstract, self.sample_sh = abstract, sample_sh

    def pull(self, uuid: int):
        pulled = self.conn.pull(uuid, self.abstract, timeout=pull_deadline())
        return jax.block_until_ready(jax.device_put(pulled, self.sample_sh))


def connect(config) -> Connection:
    """The trainer's channel; retried while the trainer group starts (loads, compiles)."""
    where, t0 = address(config), time.monotonic()
    while True:
        try:
            return Client(where, authkey=handshake_key(config))
        except ConnectionRefusedError:
            if time.monotonic() - t0 > CONNECT_TIMEOUT_S:
                raise GroupError(
                    f"no trainer group at {where[0]}:{where[1]} after "
                    f"{CONNECT_TIMEOUT_S:.0f} s (train.async_address)"
                ) from None
            time.sleep(1.0)
        except AuthenticationError:
            raise GroupError(
                f"the trainer group at {where[0]}:{where[1]} runs another config "
                "(the two commands must differ in --role only)"
            ) from None


def local_host(conn: Connection) -> str:
    """This host's address on the interface that reaches the trainer (the transfer server
    binds there: the trainer's pulls come back through it)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as s:
        return s.getsockname()[0]


def serve(config) -> tuple[str, bool]:
    """Draws batches for the trainer group until it says stop: (its reason, whether it ended
    well). GroupError if the trainer group goes away or runs another config. Writes no files."""
    sharding_lib.maybe_initialize_distributed()
    experiment.validate(config)
    load_mesh = sharding_lib.make_mesh({"fsdp": -1})  # the checkpoint, sharded over every device
    model_cfg, loaded, tokenizer = experiment.load_policy(config.model, load_mesh)
    # model.lora: the frozen base from the checkpoint, as the trainer derives it
    model_cfg, frozen, _ = lora_policy.attach(config.model, model_cfg, loaded, load_mesh)
    del loaded
    rollout_cfg = experiment.rollout_config(config, experiment.stop_ids(config, tokenizer))
    train_examples, _ = experiment.load_examples(config.task)
    batcher = experiment.train_batcher(config, train_examples, tokenizer)
    reward_fn = rewards_lib.get_reward(config.task.reward)
    collector = Collector(tokenizer, reward_fn, rollout_cfg, jax.random.key(config.seed))
    tensor = int(config.train.async_rollout_tensor)
    rollout_mesh = sharding_lib.make_mesh({"data": -1, "tensor": tensor})
    sample_sh = model_lib.param_shardings(model_cfg, rollout_mesh, "sample")
    if frozen is not None:  # the base on the rollout mesh once; the pulls are the adapters'
        frozen_sh, sample_sh = lora.split(sample_sh)
        frozen = jax.block_until_ready(jax.device_put(frozen, frozen_sh))
    engine = rollout_lib.policy_engine(model_cfg, rollout_cfg)
    external = None
    if float(config.rollout.external_fraction) > 0:
        mcfg = experiment.with_source(config.model, config.rollout.external_checkpoint)
        ecfg, eparams, _ = experiment.load_policy(mcfg, rollout_mesh, need_tokenizer=False)
        eparams = jax.device_put(eparams, model_lib.param_shardings(ecfg, rollout_mesh, "sample"))
        external = rollout_lib.external_engine(ecfg, eparams, rollout_cfg)

    conn = connect(config)
    try:
        conn.send(Hello(jax.device_count()))
        start = conn.recv()
        mesh = exchange_mesh(config, jax.device_count(), start.devices)
        abstract = exchange_abstract(model_cfg, mesh)
        puller = Puller(transfer_server(local_host(conn)), start.transfer, abstract, sample_sh)
        t0 = time.perf_counter()
        params = puller.pull(start.uuid)
        conn.send(Pulled(start.uuid, time.perf_counter() - t0))
    except (EOFError, OSError, jax.errors.JaxRuntimeError) as e:
        raise GroupError(
            f"the trainer group went away while this sampler group started ({e!r:.200}); "
            "rerun both commands"
        ) from None
    batcher.restore(start.data)
    sampler = Sampler(
        collector,
        batcher,
        engine,
        external,
        frozen=frozen,
        params=params,
        version=start.version,
        start=start.batch,
        budget=start.budget,
        capacity=int(config.rollout.max_lag) + 1,
    )
    return _run(config, conn, puller, sampler, start.batch)


def _run(config, conn: Connection, puller: Puller, sampler: Sampler, first: int):
    """The receiver thread and the send loop of `serve`."""
    send_lock, ended, failed = threading.Lock(), [], []

    def send(msg) -> None:
        with send_lock:
            conn.send(msg)

    def receive() -> None:
        try:
            while True:
                msg = conn.recv()
                if isinstance(msg, Params):
                    t0 = time.perf_counter()
                    sampler.publish(msg.version, puller.pull(msg.uuid))
                    try:
                        send(Pulled(msg.uuid, time.perf_counter() - t0))
                    except OSError:
                        pass  # the trainer is gone: the next recv says so
                elif isinstance(msg, Budget):
                    sampler.set_budget(msg.value)
                elif isinstance(msg, Stop):
                    ended.append(msg)
                    break
        except (EOFError, OSError):
            pass  # the trainer group went away
        except Exception as e:  # a pull cut short by the trainer's death, among others
            failed.append(e)
        finally:
            sampler.stop(wait=False)

    receiver = threading.Thread(target=receive, name="ess_jax-groups-receiver", daemon=True)
    receiver.start()
    last = int(config.train.steps) - 1  # the trainer's last batch: nothing is drawn past it
    bar = tqdm(desc="sampled", initial=first, total=last + 1)
    try:
        while True:
            try:
                batch = sampler.next_batch()
            except SamplerError:
                if sampler.error is not None:
                    raise
                break
            send(Drawn(batch))
            bar.update(1)
            bar.set_postfix_str(f"batch {batch.index} by version {batch.version}")
            if batch.index >= last:
                sampler.stop(wait=False)  # then wait for the trainer's Stop
                break
    except (EOFError, OSError):
        pass
    finally:
        sampler.stop()
        bar.close()
    receiver.join()
    if not ended:
        cause = f" ({failed[0]!r:.200})" if failed else ""
        raise GroupError(
            f"the trainer group closed the channel{cause}; rerun both commands to resume from "
            "the trainer's last checkpoint"
        )
    return ended[0].reason, ended[0].ok

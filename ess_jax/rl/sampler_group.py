"""The sampler group of the two-program async run (`--role=sampler`; rl/groups.py has the
design and the trainer's side): `serve` draws batches for the trainer group until it says stop.

Process 0 of the group holds the channel, in two threads besides the sampler's: the main thread
sends each batch the `GroupSampler` thread draws, as a `Drawn` message; the receiver thread
reads the trainer's messages: each announced version (`Params`) is handed to the sampler, the
lag budget too. Every process runs a `GroupSampler` thread, and before each batch process 0
says which version draws it (group_channel.follow); each process pulls that version, when new,
at that point (`Puller`: its shards from its peer trainer process, into the exchange layout,
then to the sample layout on this group's devices), so all launch the pulls' reshards and the
draws in one order. The pull therefore sits between two draws, where the async cost model puts
it (rl/async_cost.py). Sends go under one lock; the main thread stops drawing once it has sent
the run's last batch.

The group keeps no state: what it draws, from where and with which version is the trainer's
`Start` message. It reads the policy's checkpoint for its config and tokenizer onto its own
devices (the train layout over them, then dropped: the params it samples with are pulled).
With model.lora the trainer trains and offers the adapters alone: the group derives the frozen
base from the same checkpoint (`lora_policy.attach`, as the trainer does: a function of
model.source alone), keeps it on its rollout mesh for the whole run, and pulls only the
adapters, which the sampler joins to it (actor_learner.Sampler's `frozen`).
"""

from __future__ import annotations

import dataclasses
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
from ess_jax.rl import group_channel as channel
from ess_jax.rl import rollout as rollout_lib
from ess_jax.rl.actor_learner import Sampler, SamplerError
from ess_jax.rl.collect import Collector

CONNECT_TIMEOUT_S = 600.0  # how long the group waits for the trainer group to listen


class Puller:
    """The sampler group's end of the params channel: pulls a version by uuid into the
    exchange layout (`abstract`: group_channel.exchange_abstract over channel.exchange_mesh), then
    moves it to `sample_sh` on this group's devices."""

    def __init__(self, server, peer: str, abstract, sample_sh):
        self.conn = server.connect(peer)
        self.abstract, self.sample_sh = abstract, sample_sh

    def pull(self, uuid: int):
        pulled = self.conn.pull(uuid, self.abstract, timeout=channel.pull_deadline())
        return jax.block_until_ready(jax.device_put(pulled, self.sample_sh))


class GroupSampler(Sampler):
    """actor_learner.Sampler whose version for each batch is process 0's word (`publish` hands
    process 0 a version's uuid, not its params) and pulled by every process when it is new
    (module docstring); `on_pulled(Pulled)` tells the trainer (process 0). Draws nothing past
    batch `last`, the trainer's last."""

    def __init__(self, puller: Puller, on_pulled, last: int, uuid: int, params, **kwargs):
        self.puller, self.on_pulled, self.last = puller, on_pulled, last
        self.pulled = (uuid, params)  # before the thread starts (Sampler.__init__ starts it)
        super().__init__(params=uuid, **kwargs)

    def params_for(self, k: int):
        got = super().params_for(k) if channel.leads() and k <= self.last else None
        got = channel.follow("draw", None if got is None else list(got))
        if got is None:
            return None
        version, uuid = got
        if uuid != self.pulled[0]:
            t0 = time.perf_counter()
            self.pulled = (uuid, self.puller.pull(uuid))
            if channel.leads():
                self.on_pulled(channel.Pulled(uuid, time.perf_counter() - t0))
        return version, self.pulled[1]


def connect(config) -> Connection:
    """The trainer's channel; retried while the trainer group starts (loads, compiles)."""
    where, t0 = channel.address(config), time.monotonic()
    while True:
        try:
            return Client(where, authkey=channel.handshake_key(config))
        except ConnectionRefusedError:
            if time.monotonic() - t0 > CONNECT_TIMEOUT_S:
                raise channel.GroupError(
                    f"no trainer group at {where[0]}:{where[1]} after "
                    f"{CONNECT_TIMEOUT_S:.0f} s (train.async_address)"
                ) from None
            time.sleep(1.0)
        except AuthenticationError:
            raise channel.GroupError(
                f"the trainer group at {where[0]}:{where[1]} runs another config "
                "(the two commands must differ in --role only)"
            ) from None


def join(config) -> tuple[Connection | None, channel.Start]:
    """(process 0's channel to the trainer group, its `Start`) on every process of the group;
    GroupError on every process when process 0 could not join."""
    conn, got = None, None
    if channel.leads():
        gone = "the trainer group went away while this sampler group started"
        try:
            conn = connect(config)
            conn.send(channel.Hello(jax.device_count(), jax.process_count()))
            msg = conn.recv()
            if isinstance(msg, channel.Start):
                got = dataclasses.asdict(msg)
            else:
                got = {"error": f"the trainer group refused this sampler group: {msg.reason}"}
        except channel.GroupError as e:
            got = {"error": str(e)}
        except (EOFError, OSError) as e:
            got = {"error": f"{gone} ({e!r:.200}); rerun both commands"}
    got = channel.follow("start", got)
    if "error" in got:
        raise channel.GroupError(got["error"])
    return conn, channel.Start(**got)


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

    conn, start = join(config)
    send_lock = threading.Lock()

    def send(msg) -> None:
        with send_lock:
            conn.send(msg)

    try:
        mesh = channel.exchange_mesh(config, jax.device_count(), start.devices)
        abstract = channel.exchange_abstract(model_cfg, mesh)
        peer = start.transfer[jax.process_index()]  # process k pulls from trainer process k
        server = channel.transfer_server(channel.local_address(peer.rpartition(":")[0]))
        puller = Puller(server, peer, abstract, sample_sh)
        t0 = time.perf_counter()
        params = puller.pull(start.uuid)
        if channel.leads():
            send(channel.Pulled(start.uuid, time.perf_counter() - t0))
    except (EOFError, OSError, jax.errors.JaxRuntimeError) as e:
        raise channel.GroupError(
            f"the trainer group went away while this sampler group started ({e!r:.200}); "
            "rerun both commands"
        ) from None
    batcher.restore(start.data)
    last = int(config.train.steps) - 1  # the trainer's last batch: nothing is drawn past it

    def on_pulled(msg: channel.Pulled) -> None:
        try:
            send(msg)
        except OSError:
            pass  # the trainer is gone: the receiver's next recv says so

    sampler = GroupSampler(
        puller,
        on_pulled,
        last,
        start.uuid,
        params,
        collector=collector,
        batcher=batcher,
        engine=engine,
        external=external,
        frozen=frozen,
        version=start.version,
        start=start.batch,
        budget=start.budget,
        capacity=int(config.rollout.max_lag) + 1,
    )
    if not channel.leads():
        return _follow(sampler)
    try:
        outcome = _run(conn, send, sampler, start.batch, last)
    except BaseException as e:
        channel.follow("end", {"reason": f"process 0 failed: {e!r:.200}", "ok": False})
        raise
    channel.follow("end", outcome)
    if "error" in outcome:
        raise channel.GroupError(outcome["error"])
    return outcome["reason"], outcome["ok"]


def _follow(sampler: GroupSampler) -> tuple[str, bool]:
    """A process other than 0: draws what process 0 says until it says stop, sends nothing."""
    try:
        while True:
            sampler.next_batch()
    except SamplerError:
        if sampler.error is not None:
            raise
    finally:
        sampler.stop()
    outcome = channel.follow("end")
    if "error" in outcome:
        raise channel.GroupError(outcome["error"])
    return outcome["reason"], outcome["ok"]


def _run(conn: Connection, send, sampler: GroupSampler, first: int, last: int) -> dict:
    """Process 0's receiver thread and send loop of `serve`: how it ended, {"reason", "ok"}
    (the trainer's channel.Stop) or {"error"}."""
    ended, failed = [], []

    def receive() -> None:
        try:
            while True:
                msg = conn.recv()
                if isinstance(msg, channel.Params):
                    sampler.publish(msg.version, msg.uuid)  # pulled before the batch it draws
                elif isinstance(msg, channel.Budget):
                    sampler.set_budget(msg.value)
                elif isinstance(msg, channel.Stop):
                    ended.append(msg)
                    break
        except (EOFError, OSError):
            pass  # the trainer group went away
        except Exception as e:
            failed.append(e)
        finally:
            sampler.stop(wait=False)

    receiver = threading.Thread(target=receive, name="ess_jax-groups-receiver", daemon=True)
    receiver.start()
    bar = tqdm(desc="sampled", initial=first, total=last + 1)
    try:
        while True:
            try:
                batch = sampler.next_batch()
            except SamplerError:
                if sampler.error is not None:  # a pull cut short by the trainer's death, or not
                    failed.append(sampler.error)
                break
            send(channel.Drawn(batch))
            bar.update(1)
            bar.set_postfix_str(f"batch {batch.index} by version {batch.version}")
            if batch.index >= last:
                break  # the sampler draws nothing past it; wait for the trainer's channel.Stop
    except (EOFError, OSError):
        pass
    finally:
        bar.close()
    # a sampler thread that failed with the channel still open: its own error, not the trainer's
    receiver.join(timeout=5.0 if failed else None)
    sampler.stop()
    if failed and receiver.is_alive():
        raise failed[0]
    if not ended:
        cause = f" ({failed[0]!r:.200})" if failed else ""
        return {
            "error": f"the trainer group closed the channel{cause}; rerun both commands to "
            "resume from the trainer's last checkpoint"
        }
    return {"reason": ended[0].reason, "ok": ended[0].ok}

"""train.mode "async" as two programs (ess_jax/rl/groups.py): a trainer group and a sampler
group, one process each with 4 fake CPU devices (or 4 and 2), or two processes each with 2,
against the one-process actor-learner on 8 devices split 4 + 4 (or 6 split 2 + 4), with the
sampler and the trainer killed (kill -9) and stopped (SIGTERM) on the way.

With rollout.max_lag 0 the schedule is deterministic: batch k is drawn by version k, from the
same data position with the same key, on a rollout mesh of the same shape, and trained on a
train mesh of the same shape. So every row of the two-program run must equal the one-process
run's (timings aside), including after a rejoin and resumes: a row lost, trained on twice,
drawn by another version (a version off by one in the pulled params: lag 1, other log-probs and
ESS), or drawn from another data position, changes the rows.

Each process runs tests/multihost_worker.py (`python -m ess_jax.main` with a coin-flip reward
and the planted faults), one XLA thread, its own log, printed on failure; every process is
killed on the way out.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ONE_THREAD, xla_flags

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "multihost_worker.py"
STEPS = 5
OVERRIDES = {
    "sft.steps": 0,
    "data.prompts_per_step": 2,
    "rollout.group_size": 4,
    "rollout.max_new_tokens": 4,
    "task.reward": "coin",
    "train.steps": STEPS,
    "train.checkpoint_every": 2,
    "eval.every": 0,
    "train.mode": "async",
    "rollout.max_lag": 0,
    "optim.lr": 3e-3,
}
TIMEOUT_S = 900
TIMING = ("tokens_per_s", "sample_s", "step_s", "draw_s", "push_s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, name, tmp_path, workdir, devices, *args, env=()):
        self.name, self.log = name, tmp_path / f"{name}.log"
        environ = {
            **os.environ,
            "XLA_FLAGS": xla_flags(devices, ONE_THREAD),
            "JAX_PLATFORMS": "cpu",
            "JAX_DEFAULT_MATMUL_PRECISION": "highest",
            "PYTHONPATH": str(REPO),
            "ESS_JAX_NO_DISTRIBUTED": "1",
            **dict(env),
        }
        # the session's persistent compilation cache (tests/conftest.py) stays on: a rejoined
        # or resumed process loads what its first run compiled (the rejoin test alone: 51 s
        # against 69 s without it)
        cmd = [sys.executable, str(WORKER), "--config=configs/quickstart.py:tiny"]
        cmd += [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
        with open(self.log, "w") as f:
            self.p = subprocess.Popen(
                [*cmd, *args, f"--workdir={workdir}"],
                cwd=REPO,
                env=environ,
                stdout=f,
                stderr=subprocess.STDOUT,
            )

    def tail(self, n=20) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        return f"--- {self.name} (exit {self.p.poll()}):\n" + "\n".join(lines[-n:])

    def wait(self, others=(), timeout=TIMEOUT_S) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} did not finish\n" + "\n".join(o.tail() for o in others))


@pytest.fixture
def procs():
    started: list[Proc] = []
    yield started
    for q in started:
        if q.p.poll() is None:
            q.p.kill()
        q.p.wait()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-process actor-learner on 8 devices split 4 + 4 (started once, shared by the
    tests of equal groups): its process and workdir."""
    tmp = tmp_path_factory.mktemp("reference")
    ref = Proc("reference", tmp, tmp / "ref", 8)
    yield ref, tmp / "ref"
    if ref.p.poll() is None:
        ref.p.kill()
    ref.p.wait()


def _rows(workdir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def test_two_groups_give_the_one_process_rows_through_a_rejoin_and_a_resume(
    tmp_path, procs, reference
):
    """Catches a two-program run whose rows differ from the one-process actor-learner's (a
    version off by one in the pulled params, another data position or key, params not pulled
    shard for shard into the right layout), a trainer that crashes or does not wait when the
    sampler group dies while it trains (its next push finds the channel broken), one that
    restarts the new group at the wrong batch (a row lost or trained on twice), a
    sampler group that hangs or exits 0 when the trainer is killed mid-push, a resume
    that restarts the sampler group from anything but the trainer's checkpoint, a trainer
    that on SIGTERM exits without its checkpoint or without telling the sampler group, and
    one that stops, instead of waiting, when a SIGTERM ends the sampler group."""
    port = _free_port()
    role = lambda r: (f"--role={r}", f"--config.train.async_address=127.0.0.1:{port}")
    ref, ref_dir = reference
    grp = tmp_path / "groups"
    die_push = {"ESS_JAX_TEST_DIE_IN_PUSH": "3"}  # after step 2's row and step-2 checkpoint
    trainer = Proc("trainer", tmp_path, grp, 4, *role("trainer"), env=die_push)
    sampler = Proc("sampler", tmp_path, grp, 4, *role("sampler"),
                   env={"ESS_JAX_TEST_DIE_ON_BUDGET": "1"})  # fmt: skip
    procs += [trainer, sampler]
    # the sampler group dies while the trainer trains on batch 0; a new one rejoins
    assert sampler.wait([trainer, sampler]) == -signal.SIGKILL, sampler.tail()
    rejoined = Proc("sampler-rejoined", tmp_path, grp, 4, *role("sampler"))
    procs.append(rejoined)
    # the trainer dies mid-push of version 3: the sampler group stops with one line
    assert trainer.wait([trainer, rejoined]) == -signal.SIGKILL, trainer.tail()
    assert rejoined.wait([rejoined]) == 2, rejoined.tail()
    last = rejoined.log.read_text().strip().splitlines()[-1]
    assert last.startswith("error: the trainer group closed the channel"), rejoined.tail()
    assert [r["step"] for r in _rows(grp)] == [0, 1, 2], trainer.tail()
    # both commands again: the trainer resumes from its checkpoint (step 2), the sampler from
    # it; SIGTERM to the trainer as batch 2 arrives (it waits interruptibly: step 2's start
    # state is saved, preemption.py), exit 143, the sampler group told to stop
    trainer2 = Proc("trainer-resumed", tmp_path, grp, 4, *role("trainer"),
                    env={"ESS_JAX_TEST_SIGTERM_ON_BATCH": "1"})  # fmt: skip
    sampler2 = Proc("sampler-resumed", tmp_path, grp, 4, *role("sampler"))
    procs += [trainer2, sampler2]
    assert trainer2.wait([trainer2, sampler2]) == 143, trainer2.tail() + sampler2.tail()
    assert "stopped: SIGTERM" in trainer2.log.read_text(), trainer2.tail()
    assert sampler2.wait([sampler2]) == 0, sampler2.tail()
    assert "stopped: the trainer stopped" in sampler2.log.read_text(), sampler2.tail()
    # again, from step 2; SIGTERM to the sampler group once batch 2 is trained on: it ends
    # (nothing to save) and the trainer waits for the next group, which draws batches 3 and 4
    trainer3 = Proc("trainer-resumed-2", tmp_path, grp, 4, *role("trainer"))
    sampler3 = Proc("sampler-resumed-2", tmp_path, grp, 4, *role("sampler"),
                    env={"ESS_JAX_TEST_SIGTERM_ON_BUDGET": "1"})  # fmt: skip
    procs += [trainer3, sampler3]
    assert sampler3.wait([trainer3, sampler3]) == -signal.SIGTERM, sampler3.tail()
    sampler4 = Proc("sampler-resumed-3", tmp_path, grp, 4, *role("sampler"))
    procs.append(sampler4)
    assert trainer3.wait([trainer3, sampler4]) == 0, trainer3.tail() + sampler4.tail()
    assert sampler4.wait([sampler4]) == 0, sampler4.tail()
    assert ref.wait([ref]) == 0, ref.tail()
    want, got = _rows(ref_dir), _rows(grp)
    assert [r["step"] for r in got] == list(range(STEPS))
    for w, g in zip(want, got):
        assert g == w, (w["step"], {k: (w[k], g.get(k)) for k in w if w[k] != g.get(k)})
    assert all(r["policy_lag"] == 0 for r in got)


def test_lora_groups_of_unequal_sizes_give_the_one_process_rows(tmp_path, procs):
    """Catches a LoRA sampler group that samples from a base other than the trainer's (not
    re-derived from model.source, or the adapters joined to nothing), pulls into the whole
    model's layout instead of the adapters', a trainer that offers anything but its trained
    adapters, and groups of different device counts (4 trainer, 2 sampler) whose exchange
    layouts disagree or whose pull is not exact: 2 steps of rank-4 LoRA, rows equal to the
    one-process actor-learner's on 6 devices split 2 (rollout) + 4 (train)."""
    port = _free_port()
    lora = ("--config.model.lora.rank=4", "--config.train.steps=2")
    role = lambda r: (f"--role={r}", f"--config.train.async_address=127.0.0.1:{port}", *lora)
    ref = Proc("reference", tmp_path, tmp_path / "ref", 6, *lora,
               "--config.train.async_rollout_devices=2")  # fmt: skip
    trainer = Proc("trainer", tmp_path, tmp_path / "groups", 4, *role("trainer"))
    sampler = Proc("sampler", tmp_path, tmp_path / "groups", 2, *role("sampler"))
    procs += [ref, trainer, sampler]
    # a sampler group that fails leaves the trainer waiting for another: check it first; about
    # 50 s alone, and a pull that cannot complete (a missing reshard to the exchange layout) hangs
    assert sampler.wait([sampler], timeout=300) == 0, sampler.tail()
    assert trainer.wait([trainer, sampler], timeout=300) == 0, trainer.tail() + sampler.tail()
    assert ref.wait([ref]) == 0, ref.tail()
    want, got = _rows(tmp_path / "ref"), _rows(tmp_path / "groups")
    assert [r["step"] for r in got] == [0, 1]
    for w, g in zip(want, got):
        assert g == w, (w["step"], {k: (w[k], g.get(k)) for k in w if w[k] != g.get(k)})


def _cluster(port: int, index: int) -> dict:
    """The environment of process `index` of a two-process group coordinated on `port`."""
    return {
        "ESS_JAX_NO_DISTRIBUTED": "0",
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAX_NUM_PROCESSES": "2",
        "JAX_PROCESS_ID": str(index),
    }


def test_groups_of_two_processes_each_give_the_one_process_rows(tmp_path, procs, reference):
    """Catches groups of several processes that do not follow their process 0 (a trainer
    process that misses a batch, an offer or a rejoin, a sampler process that draws with
    another version or pulls another's shards: a hang, or other rows), a pull that goes
    through one host instead of process k <- process k, and a batch not broadcast whole:
    2 trainer processes x 2 devices and 2 sampler processes x 2 devices, 4 steps, against the
    one-process actor-learner on 8 devices split 4 + 4. Sampled tokens and rewards exactly;
    losses, ratios and ESS to 1e-5 (the trainer's gradients are summed by gloo across its two
    processes, in another order than one process's all-reduce: tests/test_multihost.py)."""
    port = _free_port()
    role = lambda r: (f"--role={r}", f"--config.train.async_address=127.0.0.1:{port}")
    ref, ref_dir = reference
    grp = tmp_path / "groups"
    for name, coordinator in (("trainer", _free_port()), ("sampler", _free_port())):
        for i in range(2):
            env = _cluster(coordinator, i)
            procs.append(Proc(f"{name}{i}", tmp_path, grp, 2, *role(name), env=env))
    for q in procs:  # about 40 s alone; a process that does not follow its group hangs
        assert q.wait(procs, timeout=300) == 0, "\n".join(p.tail() for p in procs)
    assert ref.wait([ref]) == 0, ref.tail()
    want, got = _rows(ref_dir), _rows(grp)
    assert [r["step"] for r in got] == list(range(STEPS))
    exact = ("step", "reward_mean", "reward_std", "response_len", "frac_groups_solved",
             "policy_lag", "lag_max", "lag_budget")  # fmt: skip
    for w, g in zip(want, got):
        assert set(g) == set(w), w["step"]
        for k in sorted(set(w) - {"queue_depth", "capped_frac"}):
            if k in exact or not isinstance(w[k], float):
                assert g[k] == w[k], (w["step"], k)
            else:
                assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-5), (w["step"], k)
    assert got[1]["grad_norm"] > 0.1  # not vacuous: the coin reward gives something to learn


def test_a_sampler_with_another_config_is_refused_in_one_line(tmp_path, procs):
    """Catches a handshake that lets a sampler group started with another config draw for the
    trainer (its rows would be another experiment's) or fails it with a traceback."""
    port = _free_port()
    address = f"--config.train.async_address=127.0.0.1:{port}"
    trainer = Proc("trainer", tmp_path, tmp_path / "t", 4, "--role=trainer", address)
    sampler = Proc("sampler", tmp_path, tmp_path / "t", 4, "--role=sampler", address,
                   "--config.rollout.temperature=0.7")  # fmt: skip
    procs += [trainer, sampler]
    assert sampler.wait([sampler]) == 2, sampler.tail()
    out = sampler.log.read_text().strip().splitlines()
    assert out[-1].startswith("error: the trainer group at 127.0.0.1"), sampler.tail()
    assert "another config" in out[-1] and "Traceback" not in sampler.log.read_text()
    time.sleep(0.5)
    assert trainer.p.poll() is None  # the trainer keeps waiting for its own sampler group


@pytest.mark.parametrize("peer", [4, 2])
def test_the_planner_counts_the_sync_copies_as_the_layouts_hold_them(peer):
    """Catches a planner that counts the trainer's sync copies in the train layout whatever the
    sampler group's size (with 2 sampler devices the offered copy is resharded to "fsdp" over
    2 devices: twice a train shard on each) or misses the newest copy kept beside the offered
    one: the planner's bytes against the per-device bytes of the arrays RemoteLink holds, the
    newest copy in the train layout over 4 devices and the offer in group_channel's exchange
    layout, on the device holding the most (device 0 is in both)."""
    import jax
    import numpy as np

    from configs import quickstart
    from ess_jax.memory import planner
    from ess_jax.parallel import sharding as sharding_lib
    from ess_jax.rl import group_channel

    config = quickstart.get_config("tiny")
    config.train.mode, config.train.async_role = "async", "trainer"
    cfg = planner.model_config(config.model)
    devices = jax.devices()[:4]
    train_mesh = sharding_lib.make_mesh(dict(config.mesh), devices)
    newest = group_channel.exchange_abstract(cfg, train_mesh)
    # exchange_mesh: the train layout at equal counts, else "fsdp" over jax.devices()[:peer]
    exchange = group_channel.exchange_mesh(config, 4, peer) if peer < 4 else train_mesh
    offered = group_channel.exchange_abstract(cfg, exchange)

    def on_device(tree, device) -> int:
        total = 0
        for x in jax.tree.leaves(tree):
            shards = x.sharding.addressable_devices_indices_map(x.shape)
            if device in shards:
                shape = [len(range(*i.indices(n))) for i, n in zip(shards[device], x.shape)]
                total += int(np.prod(shape)) * x.dtype.itemsize
        return total

    held = max(on_device(newest, d) + on_device(offered, d) for d in devices)
    plan = planner.plan(config, 4, "h100", peer_devices=peer)
    assert plan.phases["train step"]["params sync copies (newest + offered)"] == held
    trained = on_device(newest, devices[0])
    if peer == 4:
        assert held == 2 * trained
    else:  # the offer: 4 shards over 2, twice a train shard (less the replicated norm scales)
        assert 2.95 * trained < held < 3 * trained


def test_the_cost_model_puts_the_pull_on_the_sampler_side_of_the_schedule():
    """Catches a sync term added to the wrong side (or not at all): taking turns (max_lag 0)
    pays sample + train + push + pull per step; with a lag of 2 the pull hides behind the
    trainer unless it exceeds the slack, as the schedule (ess_jax/rl/async_cost.py) says."""
    from ess_jax.rl.async_cost import Terms, simulate

    turns = simulate(Terms(1.0, 2.0, 0.5, sync_every=1, max_lag=0, pull_s=0.25))
    assert turns.step_s == pytest.approx(1.0 + 2.0 + 0.5 + 0.25)
    hidden = simulate(Terms(1.0, 2.0, 0.5, max_lag=2, pull_s=0.25))
    assert hidden.step_s == pytest.approx(2.5)  # trainer-bound: train + push
    slow_pull = simulate(Terms(1.0, 2.0, 0.5, max_lag=0, pull_s=3.0))
    assert slow_pull.step_s == pytest.approx(6.5)


def test_the_sync_bench_pulls_the_params_bit_exact(tmp_path):
    """Catches bench/groups_sync.py broken by a move in rl/groups.py or rl/sampler_group.py
    (its numbers in docs/running.md could not be remade) and a pull that is not the offered
    params bit for bit: one sync of the embedded model between two processes."""
    out = tmp_path / "sync.json"
    cmd = [sys.executable, "-m", "bench.groups_sync", "--model=embedded", "--repeats=1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([*cmd, f"--json={out}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["bit_exact"] is True and result["devices_per_group"] == 4
    assert result["param_bytes"] > 100_000  # the embedded model's float32 params

"""A run's devices: one mesh over all of them for the synchronous loop, or for train.mode
"async" a rollout mesh (the first train.async_rollout_devices devices, default half, shaped
(data, 1, async_rollout_tensor)) and a train mesh (the rest, shaped by `mesh`).

Config validation (experiment.validate) checks the split here, so it needs none of the async
runtime (actor_learner.py: its threads, queue and pacing); `Run` builds its meshes here.
"""

from __future__ import annotations

import jax

from ess_jax.config.schema import fail
from ess_jax.parallel import sharding as sharding_lib


def rollout_device_count(config, num_devices: int) -> int:
    """Devices of the rollout mesh (0 for the sync loop); ConfigError if the split cannot be."""
    t = config.train
    if t.get("mode", "sync") != "async" or t.get("async_role", "both") != "both":
        return 0  # a two-group run: each program's devices are one side's (rl/groups.py)
    if num_devices < 2:
        fail(
            "train.mode",
            f"'async' needs 2 devices or more (one per side), this host has {num_devices}; on "
            "a CPU set XLA_FLAGS=--xla_force_host_platform_device_count=2",
        )
    n = int(t.async_rollout_devices) or num_devices // 2
    if not 0 < n < num_devices:
        fail(
            "train.async_rollout_devices",
            f"{n} leaves no device for the {'trainer' if n else 'sampler'} of {num_devices}",
        )
    if n % int(t.async_rollout_tensor):
        fail("train.async_rollout_tensor", f"{t.async_rollout_tensor} does not divide {n}")
    return n


def check(config) -> None:
    """What the async mode needs of the processes and devices (experiment.validate)."""
    if config.train.get("mode", "sync") != "async":
        return
    if config.train.get("async_role", "both") != "both":
        return  # each group is its own cluster, of one process or several (rl/groups.py)
    if jax.process_count() > 1:
        fail(
            "train.mode",
            f"'async' runs on one process, this run has {jax.process_count()}: the sampler's "
            "and the trainer's programs would be launched in different orders on different "
            "hosts (JAX multi-controller); use 'sync', or the two-program run of "
            "train.async_role (docs/running.md)",
        )
    rollout_device_count(config, jax.device_count())


def meshes(config):
    """(train mesh, rollout mesh or None): the sync loop's one mesh over every device, or the
    async split (first devices: rollout, the rest: train, shaped by config.mesh)."""
    devices = jax.devices()
    n = rollout_device_count(config, len(devices))
    if not n:
        return sharding_lib.make_mesh(dict(config.mesh)), None
    shape = {"data": -1, "tensor": int(config.train.async_rollout_tensor)}
    rollout = sharding_lib.make_mesh(shape, devices=devices[:n])
    return sharding_lib.make_mesh(dict(config.mesh), devices=devices[n:]), rollout

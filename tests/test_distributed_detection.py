"""When a run initialises jax.distributed (`sharding.maybe_initialize_distributed`): explicit
JAX_COORDINATOR_ADDRESS, else jax's own cluster detection with more than one process (plain
Cloud TPU VMs included, which set no TPU_WORKER_ID), never for one process. The environment and
the TPU metadata server are faked; `jax.distributed.initialize` is replaced by a recorder."""

import os

import jax
import pytest
from jax._src.clusters import cloud_tpu_cluster

from ess_jax.parallel import sharding

WATCHED = ("SLURM_", "OMPI_", "TPU_", "MEGASCALE_", "KUBERNETES_", "JAX_", "ESS_JAX_NO_DIST")
SLURM_STEP = {  # srun's variables of a 2-task step
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "node[001-002]",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
}


@pytest.fixture
def calls(monkeypatch):
    """A clean environment (no cluster variables, no TPU) and the initialize calls made."""
    for key in list(os.environ):
        if key.startswith(WATCHED):
            monkeypatch.delenv(key)
    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", False)
    made = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: made.append(kw))
    return made


def _tpu_vm(monkeypatch, workers: int):
    """A GCE TPU VM (tpu-vm create / QueuedResources) as jax sees it: TPU chips on the bus and
    the worker list on the metadata server; no GKE variables."""
    endpoints = ",".join(f"10.0.0.{i}" for i in range(workers))
    meta = {"agent-worker-number": "1", "worker-network-endpoints": endpoints, "tpu-env": ""}
    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", True)
    monkeypatch.setattr(cloud_tpu_cluster, "get_metadata", lambda key: (meta[key], 200))


def test_multi_host_tpu_vm_initialises(calls, monkeypatch):
    """Catches detection by TPU_WORKER_ID (a GKE variable): a v5e-16 started with
    `gcloud ... tpu-vm ssh --worker=all` ran as 4 separate single-host runs."""
    _tpu_vm(monkeypatch, workers=4)
    assert sharding.detected_cluster() == ("GceTpuCluster", 4)
    sharding.maybe_initialize_distributed()
    assert calls == [{}]


@pytest.mark.parametrize("kind", ["single-host TPU VM", "srun of one task", "sbatch shell"])
def test_one_process_does_not_initialise(calls, monkeypatch, kind):
    """Catches initialising for a one-process job: under srun jax then keeps only the device
    numbered SLURM_LOCALID (one GPU of 8); in an sbatch shell (SLURM_JOB_ID alone) jax cannot
    find a coordinator and the run fails."""
    if kind == "single-host TPU VM":
        _tpu_vm(monkeypatch, workers=1)
    elif kind == "srun of one task":
        for k, v in {**SLURM_STEP, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}.items():
            monkeypatch.setenv(k, v)
    else:
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
    sharding.maybe_initialize_distributed()
    assert calls == []


def test_slurm_step_explicit_and_opt_out(calls, monkeypatch):
    """Catches a multi-task srun not initialising, the explicit variables ignored, and
    ESS_JAX_NO_DISTRIBUTED=1 not switching the detection off (tests/test_multihost.py needs it)."""
    for k, v in SLURM_STEP.items():
        monkeypatch.setenv(k, v)
    assert sharding.detected_cluster() == ("SlurmCluster", 2)
    monkeypatch.setenv("ESS_JAX_NO_DISTRIBUTED", "1")
    sharding.maybe_initialize_distributed()
    assert calls == []
    monkeypatch.delenv("ESS_JAX_NO_DISTRIBUTED")
    sharding.maybe_initialize_distributed()
    assert calls == [{}]
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.1.1.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "3")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    sharding.maybe_initialize_distributed()
    assert calls[1] == {"coordinator_address": "10.1.1.1:1234", "num_processes": 3, "process_id": 2}

"""Processes with one device each (one process per GPU under SLURM; the README's multi-host
recipe on one machine): two CPU processes of one device form a 2-device mesh, build the train
state as a run does (`steps.init_state`) and save and restore it with the run's Checkpointer.
The whole loop on such a pod is tests/test_multihost.py's with 4 devices per process; this
checks the one-device case cheaply."""

import os
import socket
import subprocess
import sys
from pathlib import Path

from conftest import xla_flags

REPO = Path(__file__).resolve().parents[1]
WORKER = """
import sys
import jax, numpy as np, optax
from jax.sharding import NamedSharding, PartitionSpec
from ess_jax.io.checkpoint import Checkpointer
from ess_jax.parallel import sharding
from ess_jax.rl import steps
sharding.maybe_initialize_distributed()
mesh = sharding.make_mesh({"fsdp": -1})
assert jax.process_count() == 2 and len(jax.local_devices()) == 1 and mesh.size == 2
w = np.arange(32, dtype=np.float32).reshape(8, 4)
params = {"embed": sharding.put_host_array(w, NamedSharding(mesh, PartitionSpec("fsdp"))),
          "norm": sharding.put_host_array(w[0], sharding.replicated(mesh))}
state, state_sh = steps.init_state(params, optax.adamw(1e-3), mesh)
ckpt = Checkpointer(sys.argv[1], keep=2)
ckpt.save(0, {"state": state}, {"step": 0})
abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        state, state_sh)
step, tree, _ = ckpt.restore({"state": abstract})
assert step == 0 and int(tree["state"].step) == 0
ok = jax.tree.map(lambda a, b: bool(np.array_equal(sharding.to_host(a), sharding.to_host(b))),
                  tree["state"].params, state.params)
assert all(jax.tree.leaves(ok))
print("process", jax.process_index(), "saved and restored")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_train_state_of_one_device_processes_saves_and_restores(tmp_path):
    """Catches the train state's counters made by `jax.device_put` of a device array
    (jnp.int32(0)) onto a mesh of one-device processes: jax builds an array whose shard spans
    both devices and orbax's save fails with "input arrays must have one shard each" (every
    run of such a pod stopped at checkpoint 0)."""
    port, procs = _free_port(), []
    for i in range(2):
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_"))},
            "XLA_FLAGS": xla_flags(1),
            "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": str(REPO),
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(i),
        }
        cmd = [sys.executable, "-c", WORKER, str(tmp_path / "ckpt")]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    try:
        outs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            p.kill()
    for i, (p, out) in enumerate(zip(procs, outs)):
        tail = "\n".join(ln for ln in out.splitlines() if not ln.startswith("[Gloo]"))[-3000:]
        assert p.returncode == 0, f"process {i} exit {p.returncode}:\n{tail}"
        assert f"process {i} saved and restored" in out

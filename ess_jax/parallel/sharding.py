"""Device mesh, logical-axis rules, and the one reshard between train and sample layouts.

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel whose ranks also shard the
parameters and optimizer state), `tensor` (Megatron-style model parallel), `expert` (expert
parallel: a mixture-of-experts layer's experts split over its ranks, model/moe.py; size 1 by
default, and a dense model places nothing on it).

`expert` is a data axis outside the MoE blocks and an expert axis inside them (Megatron's
"allgather" token dispatcher): the batch is split over it (it is in BATCH), so attention, the
dense layers and the LM head compute each row once, and each rank holds E / expert of every
MoE layer's experts (logical axis "expert", in both layouts). In an MoE block the ranks of one
expert group gather their rows (the group's rows: those of one data x fsdp rank), each computes
its own experts for all of them, and the float32 outputs are summed back onto each row's own
rank (model/grouped.py: all-gather in, reduce-scatter out; moe.py's dense path: GSPMD's
collectives for the same contraction). Ranks holding the same rows would repeat every dense
computation "expert" times. Non-expert weights are replicated over it
in both layouts (FSDP shards them over `fsdp` only). A size-1 axis, or one the mesh lacks, is
left out of every PartitionSpec (`logical_to_spec`): with expert = 1 every array is placed by
the other three axes alone. It is the last mesh axis, after `tensor`.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")
BATCH = ("data", "fsdp", "expert")  # the batch is split over every data-parallel axis

# Logical axis -> mesh axis. Train: FSDP shards the `embed` dim of every matrix so params
# and Adam moments are split over the `fsdp` ranks (replicated over `data` and, but for the
# expert stacks, over `expert`). Sample: decode steps are latency bound,
# so weights are only tensor-sharded (no per-step all-gather of FSDP shards).
TRAIN_RULES: dict[str, Any] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "expert": "expert",
    "head_dim": None,
    "norm": None,
    "batch": BATCH,
}
SAMPLE_RULES: dict[str, Any] = {**TRAIN_RULES, "embed": None}


def detected_cluster() -> tuple[str, int] | None:
    """(name, process count) of the cluster environment jax's own auto-detection finds first,
    or None. jax 0.10's `jax._src.clusters` knows Open MPI (OMPI_MCA_orte_hnp_uri), SLURM job
    steps (srun: SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID),
    Cloud TPU VMs (TPU chips on the PCI bus, then GKE's TPU_WORKER_HOSTNAMES /
    TPU_PROCESS_ADDRESSES or the GCE metadata server's worker list) and Kubernetes (with the
    `kubernetes` package); mpi4py only on request, so not here. A detector's warnings (Kubernetes
    without that package) are silenced; one that fails to count its processes is logged and
    counts as no cluster."""
    import warnings

    from jax._src import clusters  # private: jax.distributed.initialize() runs these same tests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for env in clusters.ClusterEnv._cluster_types:
            if env.opt_in_only_method:
                continue
            try:
                if env.is_env_present():
                    return env.__name__, int(env.get_process_count())
            except Exception as e:  # a metadata server or API that does not answer
                logging.warning("%s detected, but its process count is unknown: %s", env, e)
                return None
    return None


def maybe_initialize_distributed() -> None:
    """Multi-host init (TPU pods, GPU clusters) when the environment asks for it. Call it before
    anything that touches devices (jax refuses to initialise after `jax.devices()`).

    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, when set, say it explicitly
    (tests/test_multihost.py runs two CPU processes this way; their collectives go through gloo,
    jax's CPU default). Otherwise jax's own cluster detection (`detected_cluster`) decides: a
    cluster of more than one process initialises; one process (a single-host TPU VM, an srun
    of one task) does not, so that it keeps every local device. ESS_JAX_NO_DISTRIBUTED=1 turns
    the detection off.
    """
    if jax.distributed.is_initialized():
        return
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
        return
    if os.environ.get("ESS_JAX_NO_DISTRIBUTED") == "1":
        return
    found = detected_cluster()
    if found is not None and found[1] > 1:
        logging.info("jax.distributed: %s with %d processes", *found)
        jax.distributed.initialize()


class MeshSizeError(ValueError):
    """A mesh shape whose sizes multiply to another device count than the devices given."""


def mesh_shape(shape: Mapping[str, int] | Sequence[int] | None, num_devices: int) -> dict:
    """{data, fsdp, tensor, expert} sizes for `num_devices`, resolving one -1; ValueError if
    impossible. An axis a mapping leaves out has size 1; a sequence gives the sizes in MESH_AXES
    order, three of them meaning expert = 1.

    `shape=None` puts every device on `fsdp`.
    """
    if shape is None:
        shape = {"fsdp": -1}
    if isinstance(shape, Mapping):
        unknown = set(shape) - set(MESH_AXES)
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; valid: {MESH_AXES}")
        sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
    else:
        sizes = [int(s) for s in shape]
        if len(sizes) == len(MESH_AXES) - 1:
            sizes.append(1)
        if len(sizes) != len(MESH_AXES):
            raise ValueError(
                f"mesh shape needs {len(MESH_AXES)} sizes {MESH_AXES} (or 3, expert = 1), "
                f"got {sizes}"
            )
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {sizes}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ValueError(f"{num_devices} devices do not divide into mesh {sizes}")
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise MeshSizeError(
            f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
            f"have {num_devices}"
        )
    return dict(zip(MESH_AXES, sizes))


def make_mesh(
    shape: Mapping[str, int] | Sequence[int] | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Mesh over MESH_AXES. One size may be -1 (all remaining devices).

    On a TPU slice `jax.make_mesh` lays each mesh axis over whole physical torus axes, and
    refuses a shape that needs one split: the E7 arm's v5p-64 mesh (data 8, fsdp 2, tensor 2)
    on v5p:4x4x2 leaves fsdp and tensor halves of a 4-chip ring. Such a shape is then laid
    out with the physical axes split (mesh_utils' allow_split_physical_axes, as MaxText's
    option of that name): each half-ring's chips are still neighbours on the torus."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = tuple(mesh_shape(shape, len(devices)).values())
    # Auto axes: GSPMD propagation with sharding constraints (jax 0.10 defaults to Explicit).
    auto = (AxisType.Auto,) * len(MESH_AXES)
    try:
        return jax.make_mesh(sizes, MESH_AXES, axis_types=auto, devices=devices)
    except NotImplementedError:  # mesh_utils: no assignment without splitting a torus axis
        grid = mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
        return Mesh(grid, MESH_AXES, axis_types=auto)


def _mesh_axis_size(mesh: Mesh, axis) -> int:
    axes = axis if isinstance(axis, tuple) else (axis,)
    return math.prod(mesh.shape[a] for a in axes if a is not None)


def logical_to_spec(
    logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Mapping[str, Any]
) -> PartitionSpec:
    """PartitionSpec for one array; a dim the mesh axis does not divide is replicated."""
    out, used = [], set()
    for name, dim in zip(logical, shape):
        axis = rules.get(name) if name is not None else None
        if axis is not None:
            axes = axis if isinstance(axis, tuple) else (axis,)
            # never map two dims of one array to the same mesh axis; skip size-1 axes and
            # those a mesh built by hand lacks
            axes = tuple(a for a in axes if a not in used and mesh.shape.get(a, 1) > 1)
            if not axes or dim % _mesh_axis_size(mesh, axes):
                axis = None
            else:
                used.update(axes)
                axis = axes if len(axes) > 1 else axes[0]
        out.append(axis)
    return PartitionSpec(*out)


def tree_shardings(abstract_tree, logical_tree, mesh: Mesh, rules: Mapping[str, Any]):
    """NamedShardings for a tree of arrays (or ShapeDtypeStructs) with logical axis tuples."""
    return jax.tree.map(
        lambda x, names: NamedSharding(mesh, logical_to_spec(names, x.shape, mesh, rules)),
        abstract_tree,
        logical_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def under_mesh(fn, mesh: Mesh):
    """`fn` traced with `mesh` as the context mesh, so the model can constrain its activations
    to batch-sharded rows (model.shard_rows). For functions passed to `jax.jit`; `fn`'s name
    is kept, so compile logs say "jit(step)", not "jit(wrapped)"."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return wrapped


# libtpu's flags that keep each FSDP all-gather (reduce-scatter) apart from the matmul that reads
# (writes) it. By default ("auto") libtpu's compiler fuses the two into a collective matmul, a
# loop over the weight shards writing into an output buffer of its own; on tpu7x the
# latency-hiding scheduler allocates those buffers early, every layer's at once, and on v6e the
# widened backward layer loop holds the matmuls' weight-shard pieces. The compiled steps with and
# without them: memory/tpu_terms.py (WITHOUT_COLLECTIVE_MATMUL), docs/tpu.md. What they save in
# time needs a TPU to measure.
NO_COLLECTIVE_MATMUL = {
    "xla_tpu_all_gather_collective_matmul_mode": "none",
    "xla_tpu_reduce_scatter_collective_matmul_mode": "none",
}

# libtpu's latency-hiding scheduler aims to keep a program's live buffers under this percentage
# of the device's HBM (95 by default) and otherwise schedules for speed: on tpu7x it allocates
# the collective matmuls' output buffers early while it stays under it. The compiled steps at a
# lower limit: memory/tpu_terms.py (SCHEDULER_LIMITED), docs/tpu.md.
SCHEDULER_MEMORY_LIMIT = "xla_tpu_scheduler_percent_shared_memory_limit"


def libtpu_flags(cfg) -> dict[str, Any]:
    """The libtpu flags of the model `cfg`'s train-mesh programs (a ModelConfig: its
    `collective_matmul` and `scheduler_memory_percent`): NO_COLLECTIVE_MATMUL for "none",
    SCHEDULER_MEMORY_LIMIT for a percentage > 0; empty at libtpu's defaults."""
    flags: dict[str, Any] = {}
    if cfg.collective_matmul == "none":
        flags.update(NO_COLLECTIVE_MATMUL)
    if cfg.scheduler_memory_percent:
        flags[SCHEDULER_MEMORY_LIMIT] = int(cfg.scheduler_memory_percent)
    return flags


def compiler_options(cfg, mesh: Mesh) -> dict[str, Any] | None:
    """`jax.jit`'s compiler_options for a train-mesh program of the model `cfg` on `mesh`:
    `libtpu_flags(cfg)` on TPU devices (a real slice or a libtpu topology's), None when there
    are none or off TPU: XLA:CPU and XLA:GPU refuse libtpu's flags ("No such compile
    option"), so elsewhere the settings change nothing."""
    flags = libtpu_flags(cfg)
    return flags if flags and mesh.devices.flat[0].platform == "tpu" else None


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Leading (batch) dim over every data-parallel axis, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def row_axes(mesh, rows: int) -> tuple[str, ...]:
    """The BATCH axes of `mesh` (a Mesh or AbstractMesh) with more than one rank, when their
    product divides `rows`; () when it does not (rows then stay whole on every device) or
    when there are none. Where a traced program splits B rows: the decoder's activations, the
    splash kernel's and the grouped experts' shard_maps."""
    axes = tuple(a for a in BATCH if a in mesh.axis_names and mesh.shape[a] > 1)
    return axes if axes and rows % math.prod(mesh.shape[a] for a in axes) == 0 else ()


def batch_ranks(shape: Mapping[str, int]) -> int:
    """The row blocks a batch splits into: the product of BATCH's sizes in `shape` (a mesh's
    shape, or a config's {axis: size}; an axis it lacks counts 1)."""
    return math.prod(shape.get(a, 1) for a in BATCH)


def shard_batch(batch, mesh: Mesh):
    """device_put every array of a batch with its leading dim split over the data axes.

    With several processes every host holds the same whole numpy batch (the pipeline and the
    rewards are deterministic) and places only the rows of its own devices: no transfer between
    hosts, and none of the cross-host equality check that `jax.device_put` makes of host data.
    """
    n = batch_ranks(mesh.shape)

    def put(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        if x.ndim == 0:
            return put_host_array(x, replicated(mesh))
        if x.shape[0] % n:
            raise ValueError(f"batch dim {x.shape[0]} not divisible by data*fsdp*expert = {n}")
        return put_host_array(x, batch_sharding(mesh, x.ndim))

    return jax.tree.map(put, batch)


def put_host_array(x, sharding: NamedSharding) -> jax.Array:
    """`jax.device_put(x, sharding)`; with several processes a numpy `x` must be the same
    array on every host, and each host places only its own devices' slices of it."""
    if jax.process_count() > 1 and isinstance(x, np.ndarray):
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    return jax.device_put(x, sharding)


def to_host(x) -> np.ndarray:
    """The whole array as numpy on this host; with several processes each holds only its own
    rows, so they are gathered (a collective: every process must call it)."""
    if jax.process_count() == 1:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def reshard(tree, shardings):
    """The single explicit move between layouts (train <-> sample).

    May return the same buffers when a leaf already has its target sharding: copy before
    donating the source if both must stay alive.
    """
    return jax.device_put(tree, shardings)


def check_sharded(params, min_size: int = 2**18) -> list[str]:
    """Names of params with >= min_size elements that are fully replicated on a >1-device mesh.

    Used to catch a rules table that silently leaves large matrices unsharded.
    """
    bad = []
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        sh = getattr(x, "sharding", None)
        if x.size < min_size or sh is None or len(sh.device_set) < 2:
            continue
        if sh.is_fully_replicated:
            bad.append(jax.tree_util.keystr(path))
    if bad:
        logging.warning("large params are replicated: %s", bad)
    return bad

"""Devices and processes: the mesh, the logical-axis rules of the train and sample layouts and
the one reshard between them (sharding.py); agreement between the processes of a multi-host run
(hosts.py)."""

from ess_jax.parallel.sharding import (
    BATCH,
    MESH_AXES,
    SAMPLE_RULES,
    TRAIN_RULES,
    make_mesh,
    maybe_initialize_distributed,
    mesh_shape,
    reshard,
    shard_batch,
    tree_shardings,
)

__all__ = [
    "BATCH",
    "MESH_AXES",
    "SAMPLE_RULES",
    "TRAIN_RULES",
    "make_mesh",
    "maybe_initialize_distributed",
    "mesh_shape",
    "reshard",
    "shard_batch",
    "tree_shardings",
]

"""Pytree bookkeeping for checkpoints: path names, target shardings, saved-vs-requested checks.

Orbax stores dict keys as strings and tuples as lists, so trees are compared by the string
form of each path entry. `place_shardings` fills in the shardings a restore needs;
`check_tree` turns a structure or shape mismatch into one error naming every bad leaf.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec


def _key_str(entry) -> str:
    # Orbax stores dict keys as strings and tuples/namedtuples as lists/dicts, so compare
    # trees by the string form of each path entry (int layer keys 0 -> "0").
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def flat(tree) -> dict[tuple[str, ...], Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(_key_str(k) for k in path): leaf for path, leaf in leaves}


def path_name(path: tuple[str, ...]) -> str:
    return "/".join(path) or "<root>"


def place_shardings(abstract_state):
    """Fill in shardings orbax needs, handling the `jax.jit(tx.init)` trap.

    Scalars (optax `count`, step) without a mesh sharding are replicated on the state's
    mesh: `jax.jit(tx.init)` leaves them on one device and `jax.eval_shape` gives none.
    A non-scalar leaf without a sharding is an error: silently replicating it would undo
    FSDP for e.g. Adam moments. With no mesh anywhere, everything goes to one device.
    """
    leaves = flat(abstract_state)
    mesh = next(
        (
            x.sharding.mesh
            for x in leaves.values()
            if isinstance(getattr(x, "sharding", None), NamedSharding)
        ),
        None,
    )
    if mesh is None:
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    else:
        default = NamedSharding(mesh, PartitionSpec())
        missing = [
            path_name(p)
            for p, x in leaves.items()
            if getattr(x, "sharding", None) is None and len(x.shape) > 0
        ]
        if missing:
            raise ValueError(
                f"abstract_state leaves without a sharding: {missing}. Give every non-scalar "
                "leaf a sharding (e.g. optax.tree_map_params to copy the param shardings "
                "onto the optimizer state)."
            )

    def fix(x):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"abstract_state leaves must be jax.ShapeDtypeStruct, got {type(x)}")
        sh = getattr(x, "sharding", None)
        if sh is None or (len(x.shape) == 0 and not isinstance(sh, NamedSharding)):
            sh = default
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)

    return jax.tree.map(fix, abstract_state)


def _data_shape(x) -> tuple[int, ...]:
    # typed PRNG keys are stored as their uint32 key data: shape + impl key shape
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.eval_shape(jax.random.key_data, x).shape
    return tuple(x.shape)


def check_tree(saved: dict, target: dict, where: str) -> None:
    missing = sorted(path_name(p) for p in saved.keys() - target.keys())
    extra = sorted(path_name(p) for p in target.keys() - saved.keys())
    if missing or extra:
        raise ValueError(
            f"tree structure mismatch with {where}: in checkpoint but not in "
            f"abstract_state: {missing}; in abstract_state but not in "
            f"checkpoint: {extra}"
        )
    bad = [
        f"{path_name(p)}: saved {tuple(saved[p].shape)}, requested {tuple(target[p].shape)}"
        for p in sorted(saved)
        if _data_shape(target[p]) != tuple(saved[p].shape)
    ]
    if bad:
        raise ValueError(f"shape mismatch with {where}: {bad}")

"""Orbax train-state checkpoints: atomic, keep-N, exact resume onto any mesh.

Layout: `<directory>/<step>/state` (the array pytree, OCDBT) and `<directory>/<step>/metadata`
(JSON: data position, config, policy-version history, ...). Orbax writes each step into
`<step>.orbax-checkpoint-tmp-*`, writes `commit_success.txt` and only then renames it, so a
crash mid-save never produces a step that `latest_step` would pick.

    ckpt = Checkpointer(workdir + "/checkpoints", keep=3)
    ckpt.save(step, {"params": p, "opt_state": o, "rng": key_data}, {"data_pos": 17})
    step, state, meta = ckpt.restore(abstract_state)  # ShapeDtypeStructs with shardings

Restore reads only each device's slices, so the target mesh may differ from the saving one.

keep-N is ours, not orbax's: a step is deleted only once `keep` newer steps are verified (saved
and read back, or restored, by this process), so a newer checkpoint that turns out unreadable
never costs an intact older one. `restore_newest_intact` falls back past unreadable steps and
moves them aside to `<step>.unreadable` (never deleted).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint._src.metadata import array_metadata_store  # pinned orbax 0.12.8

from ess_jax.config.schema import UserError
from ess_jax.io.checkpoint_tree import check_tree, flat, place_shardings
from ess_jax.io.orbax_quiet import brief, os_error, quiet_late_read_callbacks, quiet_save_errors
from ess_jax.parallel import hosts

COMMIT_MARKER = "commit_success.txt"  # written by orbax just before the final rename


class CheckpointError(UserError, RuntimeError):
    """A checkpoint step that exists but cannot be read (uncommitted, truncated, corrupted)."""


def _state_handler() -> ocp.PyTreeCheckpointHandler:
    """Orbax's StandardCheckpointHandler, minus replica-parallel saving on CPU.

    Replica-parallel saving splits every replicated shard with an eager `lax.slice` (one
    XLA compile per shape): a win on TPU, pure overhead on CPU where all devices share host
    memory (first save of the tiny test model on 8 fake devices: 12.6 s -> 0.6 s). Orbax
    already turns it off on GPU; `None` keeps its default elsewhere.
    """
    th = ocp.type_handlers
    array = th.ArrayHandler(
        use_replica_parallel=False if jax.default_backend() == "cpu" else None,
        array_metadata_store=array_metadata_store.Store(),
    )  # keeps PRNG key impls
    registry = th.create_type_handler_registry(
        (int, th.ScalarHandler()),
        (float, th.ScalarHandler()),
        (np.number, th.ScalarHandler()),
        (np.ndarray, th.NumpyHandler()),
        (jax.Array, array),
    )
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


class Checkpointer:
    """Train-state checkpoints under one directory; steps are integers, newest wins.

    Saves are synchronous by default (safe on Ctrl-C / preemption: when `save` returns the
    step is committed). `async_save=True` returns once arrays are copied to host; call
    `wait()` (or `close()`) before relying on the step.
    """

    def __init__(
        self,
        directory: str,
        keep: int | None = 3,
        save_interval_steps: int = 1,
        *,
        async_save: bool = False,
    ):
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1 or None (keep all), got {keep}")
        # orbax (tensorstore) needs an absolute path
        self.directory = epath.Path(os.path.abspath(directory))
        self._async = async_save
        self._keep = keep
        self._verified: set[int] = set()  # steps this process saved and read back, or restored
        self._pending: set[int] = set()  # async saves not yet waited for
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # keep-N is `_prune`: it counts verified steps only
            save_interval_steps=save_interval_steps,
            create=False,
            enable_async_checkpointing=async_save,
        )
        self._mngr = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={"state": _state_handler(), "metadata": ocp.JsonCheckpointHandler()},
        )

    # ------------------------------------------------------------------------------ save

    def save(self, step: int, state, metadata: dict, force: bool = False) -> bool:
        """Save `state` (pytree of arrays) and `metadata` (JSON) as `step`; True if saved.

        Skipped (False) when the save interval says so or `step` is not newer than the
        latest step (both unless `force`), or `step` is already committed. JSON turns
        tuples into lists and dict keys into strings.
        """
        step = int(step)
        try:
            json.dumps(metadata)  # fail before anything touches the disk
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"checkpoint metadata for step {step} is not JSON-serialisable: {e}"
            ) from e
        self.directory.mkdir(parents=True, exist_ok=True)  # lazily: restore must not create it
        self._mngr.reload()  # the step list may have changed on disk (another run, cleanup)
        # 0 absent, 1 present, 2 committed; process 0's view, so every process of a multi-host
        # run goes on to orbax's save (a collective) or skips it alike
        local = 2 if self._committed(step) else 1 if step in self._mngr.all_steps() else 0
        on_disk = hosts.from_process0("checkpoint.save", local)
        if on_disk:
            if on_disk == 2:
                logging.info(
                    "checkpoint step %d already in %s; not saving again", step, self.directory
                )
                return False
            raise CheckpointError(
                f"step {step} in {self.directory} exists but is not committed (no "
                f"{COMMIT_MARKER}); remove {self.directory / str(step)} to save it again"
            )
        args = ocp.args.Composite(
            state=ocp.args.PyTreeSave(state), metadata=ocp.args.JsonSave(metadata)
        )
        try:
            with quiet_save_errors():
                saved = self._mngr.save(step, force=force, args=args)
                if saved and not self._async:
                    self._mngr.wait_until_finished()
        except Exception as e:  # disk full, read-only: an OSError naming the step's directory
            code = os_error(e)
            if code is None:
                raise
            raise OSError(code, os.strerror(code), str(self.directory / str(step))) from e
        if saved:
            self._pending.add(step)
            if not self._async:
                self.wait()
        return bool(saved)

    def _prune(self) -> None:
        """Delete each step that has `keep` verified steps newer than it."""
        # Every process reads back, although only process 0's verdict is used: orbax's restore
        # of the metadata JSON (read_metadata) is itself a barrier across processes (gating this
        # on process 0 hung the pod test). Which steps committed is process 0's view too: a host
        # that does not see a marker yet must still enter that barrier, not raise before it.
        pending, self._pending = sorted(self._pending), set()
        committed = hosts.from_process0(
            "checkpoint.prune.committed", [s for s in pending if self._committed(s)]
        )
        for s in sorted(set(pending) - set(committed)):
            logging.error("step %d has no %s: not kept for keep-N", s, COMMIT_MARKER)
        self._verified.update(s for s in committed if self._readable(s))
        if self._keep is None:
            return
        self._mngr.reload()
        doomed = [
            s for s in self._mngr.all_steps() if sum(v > s for v in self._verified) >= self._keep
        ]
        # Process 0 alone decides and deletes: another host may not have seen the new step
        # commit yet when it read it back (orbax's own delete is a barrier that hosts deciding
        # differently reached or not: the pod hung). No host may be listing the directory
        # while a step goes (orbax's listing stats every step it found: FileNotFoundError).
        hosts.barrier("checkpoint.prune.listed")
        if jax.process_index() == 0:
            for step in doomed:
                self._remove(step)
        hosts.barrier("checkpoint.prune.removed")
        self._mngr.reload()

    def _remove(self, step: int) -> None:
        """Delete a step: renamed first (atomic), so no listing finds it half deleted."""
        src = self.directory / str(step)
        dst = self.directory / f".deleting-{step}-{os.getpid()}"
        os.rename(src, dst)
        shutil.rmtree(dst)

    def _readable(self, step: int) -> bool:
        """A cheap read-back of a step just written: commit marker, metadata JSON and the array
        metadata (a full array read is left to restore)."""
        try:
            self._read_metadata(step)
            self._mngr.item_metadata(step)
            return True
        except Exception as e:
            logging.error("step %d does not read back (%s): not kept for keep-N", step, brief(e))
            return False

    # --------------------------------------------------------------------------- inspect

    def _committed(self, step: int) -> bool:
        path = self.directory / str(step)
        return path.is_dir() and (path / COMMIT_MARKER).exists()

    def all_steps(self) -> list[int]:
        """Committed steps on disk, ascending (in-flight tmp dirs and marker-less dirs skipped)."""
        if not self.directory.exists():
            return []
        steps = [int(p.name) for p in self.directory.iterdir() if p.name.isdigit()]
        return sorted(s for s in steps if self._committed(s))

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # --------------------------------------------------------------------------- restore

    def read_metadata(self, step: int) -> dict:
        """The JSON metadata of a committed step, without touching its arrays (a caller can
        build the abstract state from it, e.g. how many policy versions were kept)."""
        return self._read_metadata(self._committed_step(step))

    def saved_tree(self, step: int):
        """The saved train state's tree of array metadata (shapes, dtypes) at a committed
        step, without reading the arrays: what a checkpoint holds (e.g. adapters only)."""
        return self._mngr.item_metadata(self._committed_step(step))["state"]

    def _committed_step(self, step: int) -> int:
        """`step` as an int; FileNotFoundError if it is not a committed checkpoint."""
        step = int(step)
        if not self._committed(step):
            raise FileNotFoundError(f"no committed checkpoint step {step} in {self.directory}")
        return step

    def _read_metadata(self, step: int) -> dict:
        """read_metadata without the local commit check (the caller agreed on it: _prune)."""
        self._mngr.reload()
        path = self.directory / str(step) / "metadata" / "metadata"
        try:
            out = self._mngr.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))
            if not isinstance(out["metadata"], dict):
                raise ValueError(f"not a JSON object: {type(out['metadata']).__name__}")
        except Exception as e:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory}: its metadata file {path} is "
                f"truncated or corrupted ({brief(e)})"
            ) from e
        return out["metadata"]

    def restore_newest_intact(
        self, abstract_fn, fallback: bool = True
    ) -> tuple[int, Any, dict] | None:
        """(step, state, metadata) of the newest committed step that reads back, or None if
        there is none. `abstract_fn(metadata)` gives a step's abstract state.

        An unreadable step raises its CheckpointError unless `fallback`: then a warning, the
        next older step is tried, and once one restores the unreadable ones are moved aside to
        `<step>.unreadable` (so the run may write that step again). If none reads back, the
        newest one's error is raised with nothing on disk changed."""
        bad, first = [], None
        steps = hosts.from_process0("checkpoint.steps", self.all_steps())
        for step in reversed(steps):  # every host tries the same steps
            try:
                out, err = self.restore(abstract_fn(self.read_metadata(step)), step), None
            except CheckpointError as e:
                out, err = None, e
            ok = hosts.on_every_process("checkpoint.restored", err is None)
            if not ok and err is None:  # each host reads only its own shards
                err = CheckpointError(
                    f"checkpoint step {step} in {self.directory} did not read back on another "
                    "process of this run"
                )
            if err is not None:
                if not fallback:
                    older = [s for s in self.all_steps() if s < step]
                    raise CheckpointError(
                        f"{err}; not falling back to older steps {older} "
                        "(train.restore_fallback=False)"
                    ) from err
                logging.warning("%s; trying the previous checkpoint", err)
                bad, first = bad + [step], first or err
                continue
            for s in bad:
                logging.warning("restored step %d; unreadable %s", step, self._set_aside(s))
            self._verified.add(step)
            return out
        if first is not None:
            raise CheckpointError(f"no checkpoint reads back (steps {bad}); newest: {first}")
        return None

    def _set_aside(self, step: int) -> str:
        src = self.directory / str(step)
        dst, n = self.directory / f"{step}.unreadable", 1
        while dst.exists():
            dst, n = self.directory / f"{step}.unreadable.{n}", n + 1
        hosts.barrier("checkpoint.aside.before")  # no host is listing the directory
        if jax.process_index() == 0:
            shutil.move(str(src), str(dst))
        hosts.barrier("checkpoint.aside.after")
        self._mngr.reload()
        return f"step {step} moved to {dst}"

    def restore(
        self, abstract_state, step: int | None = None, *, partial: bool = False
    ) -> tuple[int, Any, dict]:
        """(step, state, metadata) for `step` (default: latest committed).

        `abstract_state`: pytree of jax.ShapeDtypeStruct with `.sharding`; arrays come back
        on those shardings (any mesh). Its tree must match the saved one exactly, or with
        `partial` be a part of it (e.g. {"state": {"params": ...}}: only those arrays are read).
        """
        self.wait()
        if step is None:
            step = self.latest_step()
            if step is None:
                what = "does not exist" if not self.directory.exists() else "has no checkpoints"
                raise FileNotFoundError(f"checkpoint directory {self.directory} {what}")
        step = int(step)
        where = f"checkpoint step {step} in {self.directory}"
        if not (self.directory / str(step)).is_dir():
            raise FileNotFoundError(f"{where} does not exist (committed steps: {self.all_steps()})")
        if not self._committed(step):
            raise CheckpointError(
                f"{where} is not committed (no {COMMIT_MARKER}): an interrupted or partial save"
            )
        target = place_shardings(abstract_state)
        self._mngr.reload()
        try:
            saved = self._mngr.item_metadata(step)["state"]
            saved_tree = getattr(saved, "tree", saved)
        except Exception as e:
            raise CheckpointError(
                f"{where} is truncated or corrupted: cannot read its array metadata ({brief(e)})"
            ) from e
        if saved_tree is None:
            raise CheckpointError(f"{where} is truncated or corrupted: no array metadata")
        saved_flat, target_flat = flat(saved_tree), flat(target)
        if partial:
            saved_flat = {p: x for p, x in saved_flat.items() if p in target_flat}
        check_tree(saved_flat, target_flat, where)
        quiet_late_read_callbacks()
        try:
            restore_args = ocp.checkpoint_utils.construct_restore_args(target)
            out = self._mngr.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        item=target, restore_args=restore_args, partial_restore=partial
                    ),
                    metadata=ocp.args.JsonRestore(),
                ),
            )
            state, metadata = out["state"], out["metadata"]
            jax.block_until_ready(state)
        except Exception as e:
            if "tree structures do not match" in str(e):  # same array paths, other containers
                raise CheckpointError(
                    f"{where} was written with another state layout than this code builds "
                    f"(by another version of ess_jax?): {brief(e)}"
                ) from e
            raise CheckpointError(f"{where} is truncated or corrupted: {brief(e)}") from e
        return step, state, metadata

    # --------------------------------------------------------------------------- lifetime

    def wait(self) -> None:
        """Block until any in-flight (async) save is committed, then apply keep-N."""
        self._mngr.wait_until_finished()
        if self._pending:
            self._prune()

    def close(self) -> None:
        self.wait()
        self._mngr.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""One run per workdir: the lock, the resume config check and the effective config file.

    lock = claim(workdir, config, ckpt, allow=("optim.lr",))  # before any real work
    ...                                                        # restore or start
    write_config(workdir, config)                              # <workdir>/config.json
    lock.release()

`claim` refuses, touching no file, a resume whose config differs from the newest checkpoint's
(or, before the first checkpoint, from config.json) outside the fields of SAFE_ON_RESUME and
`allow`; then it takes `<workdir>/lock`. The lock is an flock (released by the kernel when its
process dies, however it dies) on a file naming the holder's pid and host: a second run on the
workdir is refused at once with that name, and a lock file left by a killed process is taken
over with a warning. The processes of one multi-host run share a workdir and one lock, held by
process 0 (see `claim`).

`write_errors` turns a failed write into the workdir (not a directory, read-only, disk full)
into one WorkdirError line naming the path and the cause; `check_not_past` refuses a resume
whose checkpoint is already past `train.steps`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ess_jax.config import defaults
from ess_jax.config.names import leaves
from ess_jax.config.schema import UserError, check_names
from ess_jax.io.checkpoint import CheckpointError

LOCK_FILE = "lock"
HOLDER_WRITE_WAIT_S = 2.0  # how long a refused process waits for the holder's record
CONFIG_FILE = "config.json"
# Fields a resume may change without --allow_config_change: when to stop, save and evaluate, and
# the mesh (checkpoints restore onto any mesh). A section name covers all its fields.
SAFE_ON_RESUME = (
    "train.steps",
    "train.checkpoint_every",
    "train.export_hf",
    "train.restore_fallback",
    "train.async_address",  # where the two groups meet, not what they compute
    "task.cache_dir",  # where the data's tfds build lives, not what it holds
    "eval",
    "mesh",
)
_ABSENT = "<absent>"


class WorkdirError(UserError):
    """The workdir is in use by another run, or holds a run with another config."""


class WorkdirLock:
    """An exclusive flock on `<workdir>/lock`; the file says who holds it (pid, host)."""

    def __init__(self, workdir: str):
        self.workdir = os.path.abspath(workdir)
        self.path = os.path.join(self.workdir, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> WorkdirLock:
        os.makedirs(self.workdir, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd, wait_s=HOLDER_WRITE_WAIT_S)
                os.close(fd)
                mine = " (this process: close() its other Run)" if _is_me(holder) else ""
                raise WorkdirError(
                    f"workdir {self.workdir} is in use by {_describe(holder)}{mine} (lock file "
                    f"{self.path}); wait for that run to end or use another --workdir"
                ) from None
            try:  # a holder releasing unlinks the file: ours must still be the one on disk
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        stale = _read_holder(fd)
        if stale:
            logging.warning(
                "workdir %s: taking over the lock left by %s, which no longer holds it (killed?)",
                self.workdir,
                _describe(stale),
            )
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Remove the lock file (a clean exit leaves none) and drop the lock."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # while still holding it: see the inode check in acquire
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> WorkdirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int, wait_s: float = 0.0) -> dict | None:
    """Who the lock file says holds it; None if it is empty. With `wait_s`, an empty file is
    read again until then: a holder writes its record just after it takes the flock, and a
    process refused in between would otherwise name "another process"."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            data = os.pread(fd, 4096, 0)
            if data.strip():
                return json.loads(data)
        except (OSError, ValueError):
            return {"pid": "?", "host": "?"}
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


def _is_me(holder: dict | None) -> bool:
    me = (os.getpid(), socket.gethostname())
    return bool(holder) and (holder.get("pid"), holder.get("host")) == me


def _describe(holder: dict | None) -> str:
    if not holder:
        return "another process"
    since = holder.get("since")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if since else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}{when}"


# ---------------------------------------------------------------------------------- config


def _flat(config) -> dict[str, Any]:
    d = config.to_dict() if hasattr(config, "to_dict") else config
    return dict(leaves(json.loads(json.dumps(d))))  # JSON-normal: tuples -> lists


def config_diff(saved: Mapping, current) -> list[tuple[str, Any, Any]]:
    """(field, saved value, current value) for each field that differs. A field the saved
    config lacks (added to the code since) counts only if set away from its default."""
    old, new, base = _flat(saved), _flat(current), _flat(defaults.base_config())
    out = []
    for path in sorted(new):
        if path not in old:
            if path in base and new[path] == base[path]:
                continue
            out.append((path, _ABSENT, new[path]))
        elif old[path] != new[path]:
            out.append((path, old[path], new[path]))
    return out


def _allowed(path: str, allow: Iterable[str]) -> bool:
    return any(path == a or path.startswith(a + ".") for a in allow)


def check_resume(saved: Mapping, config, where: str, allow: Iterable[str] = ()) -> None:
    """WorkdirError listing the fields that differ from `saved` outside SAFE_ON_RESUME and
    `allow` (fields or sections, `section.*` too)."""
    allow = [*SAFE_ON_RESUME, *(a.removesuffix(".*") for a in allow)]
    diffs = config_diff(saved, config)
    show = lambda d: f"{d[0]} ({d[1]!r} -> {d[2]!r})"
    blocked = [d for d in diffs if not _allowed(d[0], allow)]
    if blocked:
        raise WorkdirError(
            f"the config differs from {where} in {len(blocked)} field(s): "
            f"{', '.join(map(show, blocked))}. Resume with the same config, use another "
            f"--workdir, or allow these changes: "
            f"--allow_config_change={','.join(d[0] for d in blocked)}"
        )
    if diffs:
        logging.warning("resuming with changed config fields: %s", ", ".join(map(show, diffs)))
        if any(d[0] == "train.steps" for d in diffs) and config.optim.schedule != "constant":
            logging.warning("train.steps changed: the learning-rate schedule's horizon moves")


def saved_config(workdir: str, ckpt, fallback: bool = True) -> tuple[dict | None, str]:
    """The config of the newest checkpoint whose metadata reads (or of config.json when there is
    no checkpoint) and where it came from; (None, "") for a new workdir."""
    for step in reversed(ckpt.all_steps()):
        try:
            meta = ckpt.read_metadata(step)
        except CheckpointError as e:
            if not fallback:
                raise
            logging.warning("%s; comparing the config with an older checkpoint", e)
            continue
        if "config" in meta:
            return meta["config"], f"the checkpoint's (step {step} in {ckpt.directory})"
    path = os.path.join(workdir, CONFIG_FILE)
    if os.path.exists(path):
        try:
            with open(path) as f:
                return json.load(f), path
        except ValueError as e:
            raise WorkdirError(f"{path} is not valid JSON ({e}); move it away to go on") from e
    return None, ""


def claim(
    workdir: str,
    config,
    ckpt,
    allow: Iterable[str] = (),
    primary: bool = True,
    num_processes: int = 1,
) -> WorkdirLock | None:
    """Refuse a resume with another config, then lock the workdir (on the primary process).
    No file of the workdir is written before both pass.

    The processes of one multi-host run (`num_processes` > 1) share the workdir and hold one
    lock between them: process 0 (`primary`) takes it, and every process learns whether it got
    it (a collective: all must call claim), so a workdir held by another run stops all of them
    with an error rather than leaving the others waiting in their first collective. The others
    hold no lock; they write no file of the workdir but their part of each orbax checkpoint."""
    allow = tuple(allow)
    check_names(config, allow, "--allow_config_change")
    saved, where = saved_config(workdir, ckpt, config.train.restore_fallback)
    if saved is not None:
        check_resume(saved, config, where, allow)
    lock, error = None, None
    if primary:
        try:
            with write_errors(workdir):
                lock = WorkdirLock(workdir).acquire()
        except Exception as e:  # raised below, once the other processes know
            error = e
    if num_processes > 1 and not _process0_says(error is None) and error is None:
        raise WorkdirError(
            f"workdir {os.path.abspath(workdir)}: process 0 of this run could not lock it "
            "(its error names the run that holds it)"
        )
    if error is not None:
        raise error
    return lock


def _process0_says(ok: bool) -> bool:
    """Process 0's `ok`, on every process of a multi-host run."""
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(ok)))


def write_config(workdir: str, config) -> str:
    """The run's effective config as `<workdir>/config.json`, atomically (tmp + rename)."""
    path = os.path.join(workdir, CONFIG_FILE)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(config.to_dict(), f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------------------ write errors

_WRITE_ERRORS = {  # errno -> what to do about it
    errno.ENOSPC: "free space on that disk (or use another --workdir), then rerun the same "
    "command: it resumes from the last checkpoint",
    errno.EDQUOT: "free space under the quota (or use another --workdir), then rerun the same "
    "command: it resumes from the last checkpoint",
    errno.EROFS: "use a --workdir on a writable file system",
    errno.EACCES: "use a --workdir this user may write",
    errno.EPERM: "use a --workdir this user may write",
    errno.ENOTDIR: "a part of that path is a file, not a directory: use another --workdir",
    errno.EEXIST: "that path is a file, not a directory: use another --workdir",
}


def write_error_message(workdir: str, e: OSError) -> str | None:
    """One line for an OSError of writing into `workdir`: the path, the cause, what to do;
    None for other errors and for paths outside the workdir."""
    hint = _WRITE_ERRORS.get(e.errno)
    path = os.path.abspath(os.fspath(e.filename)) if e.filename else None
    if hint is None or (path and os.path.commonpath([path, workdir]) != workdir):
        return None
    if e.errno == errno.EEXIST and not os.path.isfile(path or ""):
        return None
    cause = e.strerror or os.strerror(e.errno)
    return f"workdir {workdir}: {path or 'writing its files'}: {cause} [errno {e.errno}]; {hint}"


@contextlib.contextmanager
def write_errors(workdir: str):
    """OSErrors of writing into `workdir` (see `write_error_message`) raise as WorkdirError."""
    try:
        yield
    except OSError as e:
        msg = write_error_message(os.path.abspath(workdir), e)
        if msg is None:
            raise
        raise WorkdirError(msg) from e


def check_not_past(workdir: str, restored: int | None, steps: int) -> None:
    """Refuse a resume from a checkpoint past `steps` (train.steps): ending there would save that
    state under the smaller step."""
    if restored is not None and restored > steps:
        raise WorkdirError(
            f"workdir {workdir}: its checkpoint is at step {restored}, past train.steps={steps}; "
            f"nothing to do. Set --config.train.steps above {restored} to go on, or use another "
            "--workdir"
        )

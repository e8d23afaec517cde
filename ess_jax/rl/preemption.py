"""SIGTERM, what a TPU VM or SLURM sends before it preempts a job, as Ctrl-C: a checkpoint, then
the exit.

    with preemption.on_sigterm():          # Run.run: from the restore to the end
        with preemption.interruptible():   # sampling, held-out eval
            ...
        preemption.check()                 # the end of each RL step

`Preempted` is a KeyboardInterrupt, so the loop's Ctrl-C path (`Run.save_on_interrupt`) writes
the checkpoint. Where it is raised decides what the checkpoint holds:
- inside `interruptible()`, at once: the step has not touched the train state yet, so its start
  state is saved and the step is redone on resume (exact);
- anywhere else (an update, a metrics row, a checkpoint save) the signal is held and raised by
  the next `check()`, once the step is done: its row is written, its state saved as the next
  step, and a save the signal lands in completes first.
A multi-host run never raises at once: at each `check()` its processes agree (through the
coordination service) whether any of them got the signal, so all stop at the same step end.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

import jax

from ess_jax.parallel import hosts

EXIT_CODE = 128 + signal.SIGTERM  # 143, the shell's code for a process ended by SIGTERM


class Preempted(KeyboardInterrupt):
    """The run got SIGTERM; raised where stopping keeps the checkpoint exact."""

    exit_code = EXIT_CODE


class _State:
    installed = False  # on_sigterm is active
    interruptible = False  # a SIGTERM now raises at once
    pending = False  # a SIGTERM arrived and waits for check()


_state = _State()


def _preempted() -> Preempted:
    return Preempted("SIGTERM: the checkpoint is written")


def _handle(signum, frame) -> None:
    if _state.interruptible and jax.process_count() == 1:
        _state.interruptible = False  # the section's own cleanup runs uninterrupted
        raise _preempted()
    if not _state.pending:
        logging.warning("SIGTERM: stopping at the end of this step, with a checkpoint")
    _state.pending = True


@contextlib.contextmanager
def on_sigterm():
    """SIGTERM handled as above while the block runs (main thread only; elsewhere a no-op).
    A SIGTERM still held at the end (after the last check) is dropped: the run has finished."""
    if _state.installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _handle)
    _state.installed, _state.pending, _state.interruptible = True, False, False
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _state.installed, _state.pending, _state.interruptible = False, False, False


@contextlib.contextmanager
def interruptible():
    """A section a SIGTERM may stop at once (single process); a held one is raised on entry."""
    if _state.pending and jax.process_count() == 1:
        check()
    outer, _state.interruptible = _state.interruptible, _state.installed
    try:
        yield
    finally:
        _state.interruptible = outer


def check() -> None:
    """Raise Preempted if this process (or, multi-host, any process) got SIGTERM. Every process
    of a multi-host run calls it at the same points."""
    if not _state.installed:
        return
    if not hosts.on_every_process("preemption.check", not _state.pending):
        _state.pending = False
        raise _preempted()

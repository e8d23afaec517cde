"""SIGTERM (what a TPU VM or SLURM sends before it preempts a job) and Ctrl-C (SIGINT), each as a
checkpoint, one `stopped:` line, then the exit.

    with preemption.on_stop_signals():     # Run.run: from the restore to the end
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
coordination service) whether any of them got a signal, so all stop at the same step end.

Exit codes: 143 for SIGTERM, 130 for Ctrl-C: 128 + the signal's number, what a shell reports
for a process that signal ended, so a requeue wrapper or a script's `$?` sees a run that did not
finish, and by which signal, as if it had no handler.

Ctrl-C and SIGTERM are handled alike, but the first Ctrl-C gives SIGINT back its default action
(SIG_DFL): a second Ctrl-C while the run stops ends the process at once, whatever its main
thread is doing (a Python handler would wait for a compile or a device call to return), as a
kill -9 would: a save it lands in is not committed, the last committed checkpoint is kept, and
the resume rewrites the rows after it. A second SIGTERM is held like the first (a scheduler
that will not wait sends SIGKILL).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

import jax

from ess_jax.parallel import hosts

EXIT_CODE = 128 + signal.SIGTERM  # 143, the shell's code for a process ended by SIGTERM
CTRL_C_EXIT_CODE = 128 + signal.SIGINT  # 130, the shell's code for a process ended by Ctrl-C
_NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}
_SIGNALS = tuple(_NAMES)


class Preempted(KeyboardInterrupt):
    """The run got SIGTERM or Ctrl-C; raised where stopping keeps the checkpoint exact.
    `exit_code`: 128 + the signal's number."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(f"{_NAMES[signum]}: the checkpoint is written")
        self.signum = signum
        self.exit_code = 128 + signum


class _State:
    installed = False  # on_stop_signals is active
    interruptible = False  # a signal now raises at once
    pending = 0  # the signal that arrived and waits for check(), 0 for none


_state = _State()


def _handle(signum, frame) -> None:
    if signum == signal.SIGINT:  # the next Ctrl-C ends the process at once
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    if _state.interruptible and jax.process_count() == 1:
        _state.interruptible = False  # the section's own cleanup runs uninterrupted
        raise Preempted(signum)
    if not _state.pending:
        again = "; Ctrl-C again quits at once" if signum == signal.SIGINT else ""
        logging.warning(
            "%s: stopping at the end of this step, with a checkpoint%s", _NAMES[signum], again
        )
        _state.pending = signum


@contextlib.contextmanager
def on_stop_signals():
    """SIGTERM and SIGINT handled as above while the block runs (main thread only; elsewhere a
    no-op). A signal still held at the end (after the last check) is dropped: the run has
    finished."""
    if _state.installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _handle) for s in _SIGNALS}
    _state.installed, _state.pending, _state.interruptible = True, 0, False
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _state.installed, _state.pending, _state.interruptible = False, 0, False


@contextlib.contextmanager
def interruptible():
    """A section a signal may stop at once (single process); a held one is raised on entry."""
    if _state.pending and jax.process_count() == 1:
        check()
    outer, _state.interruptible = _state.interruptible, _state.installed
    try:
        yield
    finally:
        _state.interruptible = outer


def check() -> None:
    """Raise Preempted if this process (or, multi-host, any process) got SIGTERM or Ctrl-C.
    Every process of a multi-host run calls it at the same points; one that got no signal
    itself stops as if by SIGTERM (143)."""
    if not _state.installed:
        return
    if not hosts.on_every_process("preemption.check", not _state.pending):
        signum, _state.pending = _state.pending or signal.SIGTERM, 0
        raise Preempted(signum)

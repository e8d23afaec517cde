"""Orbax's error noise, made readable: the root cause of an orbax / tensorstore error in one
line (`brief`), the OS error under a failed write (`os_error`), and filters for the harmless
echoes a failed restore (`quiet_late_read_callbacks`) or a failed save (`quiet_save_errors`)
leaves behind. Used by checkpoint.py.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys


def late_read_echo(e: BaseException | None) -> bool:
    """Whether `e` is one of the two harmless echoes of a failed restore's other reads."""
    if isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
        return True
    msg = "Encountered error while reading array index"
    return e is not None and isinstance(e.__cause__, GeneratorExit) and str(e).startswith(msg)


def quiet_late_read_callbacks() -> None:
    """Install (once) a sys.unraisablehook that silences two known, harmless orbax echoes.

    When one array read of a restore fails, orbax's event loop closes while the step's other
    tensorstore reads are still in flight; each of them then completes into
    `loop.call_soon_threadsafe`, which raises "Event loop is closed" in a tensorstore thread,
    and the default hook prints that traceback, racing the one-line `CheckpointError`
    (2-7 tracebacks per failed restore). The step's abandoned read coroutines echo too: when
    one is closed (garbage-collected) while suspended, orbax wraps the GeneratorExit in
    "Encountered error while reading array index: ..." (a page of TensorStore spec each;
    ~300 of them in one test-suite log). Only those two are dropped (to the debug log);
    everything else goes to the previous hook. It stays installed, since the late callbacks
    may land after `restore` has raised.
    """
    previous = sys.unraisablehook
    if getattr(previous, "ess_jax_quiet", False):
        return

    def hook(unraisable) -> None:
        if late_read_echo(unraisable.exc_value):
            brief = str(unraisable.exc_value).split(". See full TensorStore", 1)[0][:200]
            logging.debug("late tensorstore read after a failed restore: %s", brief)
        else:
            previous(unraisable)

    hook.ess_jax_quiet = True
    sys.unraisablehook = hook


def brief(e: BaseException) -> str:
    """`Type: first line` of the root cause of an orbax / tensorstore error: the outer ones
    run to pages (a whole TensorStore spec), the root names the file and what is wrong."""
    while True:
        inner = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
        if inner is None:
            break
        e = inner
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


_OS_ERROR_CODE = re.compile(r"\[os_error_code='?(\d+)'?\]")  # tensorstore's form


def os_error(e: BaseException) -> int | None:
    """The errno under an orbax / tensorstore error (an OSError in the chain, or tensorstore's
    `[os_error_code='28']`), or None."""
    while e is not None:
        if isinstance(e, OSError) and e.errno:
            return e.errno
        m = _OS_ERROR_CODE.search(str(e))
        if m:
            return int(m.group(1))
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return None


class _SaveErrorEcho(logging.Filter):
    """Drops the error records orbax's save threads and asyncio log for one failed write (each
    thread and each abandoned future logs its own copy, with its traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        text = f"{record.getMessage()} {exc or ''}"
        echo = exc is not None and os_error(exc) is not None or "os_error_code" in text
        if echo:
            logging.getLogger(__name__).debug("orbax save error echo: %s", text[:200])
        return not echo


@contextlib.contextmanager
def quiet_save_errors():
    """While an orbax save runs: its threads' and asyncio's echoes of an OS write error (disk
    full, read-only) are dropped; the caller reports the error itself, in one line."""
    quiet_late_read_callbacks()  # the save's late tensorstore callbacks: "Event loop is closed"
    echo = _SaveErrorEcho()
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
    for lg in loggers:
        lg.addFilter(echo)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(echo)

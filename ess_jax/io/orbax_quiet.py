"""Orbax's error noise, made readable: the root cause of an orbax / tensorstore error in one
line (`brief`), and a filter for the harmless echoes a failed restore leaves behind
(`quiet_late_read_callbacks`). Used by checkpoint.py.
"""

from __future__ import annotations

import logging
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

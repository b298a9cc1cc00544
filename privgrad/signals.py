"""Termination signals handled like Ctrl-C.

Schedulers and CI time-outs stop a process with SIGTERM (a closed terminal sends SIGHUP).
Inside :func:`terminations_as_interrupts` both raise :class:`Terminated`, a
``KeyboardInterrupt``, so every ``except KeyboardInterrupt`` path (the run store marks the
run ``interrupted``; a trainer writes its checkpoint) runs for them exactly as for Ctrl-C.
:func:`deferred_interrupts` holds all three back until a block (one private step) is done;
:func:`interrupt_once` is the handling of a worker process for its whole life, until
:func:`restore_defaults` ends it.
"""

from __future__ import annotations

import contextlib
import signal
import threading

HANDLED = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when the process receives SIGTERM or SIGHUP."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise(signum, frame):
    raise Terminated(signum)


@contextlib.contextmanager
def terminations_as_interrupts():
    """Within the block, SIGTERM and SIGHUP raise :class:`Terminated` (main thread only;
    elsewhere signal handlers cannot be installed and the block runs unchanged)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise) for s in HANDLED}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def deferred_interrupts():
    """Within the block, SIGINT, SIGTERM and SIGHUP are held back and re-sent when it ends,
    so that a step is never cut in half (model updated but not accounted). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {
        s: signal.signal(s, lambda signum, frame: caught.append(signum))
        for s in (signal.SIGINT, *HANDLED)
    }
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)


def interrupt_once() -> None:
    """For a worker process (e.g. one cell of ``privgrad reproduce --jobs N``): the first
    SIGINT, SIGTERM or SIGHUP raises ``KeyboardInterrupt`` (:class:`Terminated` for the last
    two); any later one is ignored, so that a Ctrl-C that reaches both the worker and its
    parent, which then stops the worker too, cannot cut short the cleanup the first began."""

    def first(signum, frame):
        for s in (signal.SIGINT, *HANDLED):
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)

    for s in (signal.SIGINT, *HANDLED):
        signal.signal(s, first)


def restore_defaults() -> None:
    """Ends :func:`interrupt_once` once a worker's cleanup is done: SIGINT raises
    ``KeyboardInterrupt`` again and SIGTERM or SIGHUP end the process (the parent's
    ``terminate()`` then stops it)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for s in HANDLED:
        signal.signal(s, signal.SIG_DFL)

"""How ``kvbm-plugin demo`` ends early: SIGINT and SIGTERM end the run through its clean-up
(engine shut down, temporary directories removed) with status 130 or 143, and so does a reader
that closed the demo's stdout (``demo --duration 20 | head``: status 141). Used by
:mod:`kvbm_plugin.cli.demo` on the CLI's main thread."""

from __future__ import annotations

import errno
import os
import select
import signal
import stat
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class _Signals:
    """SIGINT and SIGTERM end the demo through the same path (the engine shut down, the
    temporary directory removed) instead of killing it where it stands: the handler raises
    KeyboardInterrupt (Ctrl-C, status 130) or SystemExit(143), and a second SIGTERM during that
    clean-up is ignored.

    An exception a handler raises can be swallowed: a signal handled while a finalizer runs
    (a ZMQ socket's ``__del__`` during a garbage collection, a ``weakref.finalize`` callback)
    raises inside it, and Python reports it as "Exception ignored" and goes on. So the signal
    is also remembered, and :meth:`check` raises it again: the demo calls it between engine
    steps, and :func:`signals_end_the_demo` once more when the run returned, normally or with
    an error (which the swallowed signal then replaces)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def handler(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
        if signum == signal.SIGTERM:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self._raise(signum)

    def check(self) -> None:
        """Raise the signal that came, if one did (called where no exception is unwinding)."""
        if self.signum is not None:
            self._raise(self.signum)

    @staticmethod
    def _raise(signum: int) -> None:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)


SIGNALS = _Signals()


@contextmanager
def signals_end_the_demo() -> Iterator[None]:
    """Install :class:`_Signals`'s handler for SIGINT and SIGTERM around the demo; main thread
    only (elsewhere signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    SIGNALS.signum = None
    # A signal the process was started ignoring stays ignored (a shell's background job
    # ignores SIGINT, and Python leaves it so).
    previous = {sig: signal.signal(sig, SIGNALS.handler)
                for sig in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(sig) is not signal.SIG_IGN}
    # A signal's exception swallowed by a finalizer would also be printed, traceback and all,
    # as "Exception ignored in ...": the signal is remembered and raised again by check(), so
    # that report says nothing and is left out (every other unraisable goes on as before).
    default_hook = sys.unraisablehook

    def quiet_signal_exceptions(unraisable: object) -> None:
        exc = getattr(unraisable, "exc_value", None)
        if SIGNALS.signum is not None and isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return
        default_hook(unraisable)  # type: ignore[arg-type]

    sys.unraisablehook = quiet_signal_exceptions
    try:
        yield
        SIGNALS.check()  # a signal whose exception a finalizer swallowed ends it here
    except Exception:
        # The run failed after a signal came whose exception a finalizer swallowed: what
        # failed is the signal's doing (a group signal killed a rank process the demo was
        # waiting on, which then answered nothing), so the signal ends it, not a traceback.
        SIGNALS.check()
        raise
    finally:
        sys.unraisablehook = default_hook
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def load_engine_modules() -> None:
    """Import torch and the simulated engine with SIGINT and SIGTERM held back until the import
    is done: torch's initialisation runs Python callbacks from C++, and a KeyboardInterrupt
    raised inside one aborts the whole process ("terminate called after throwing ...") instead
    of reaching the demo's clean-up. A signal that came meanwhile is acted on right after."""
    if threading.current_thread() is not threading.main_thread():
        import kvbm_plugin.testing.engine  # noqa: F401
        return
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        import torch  # noqa: F401

        import kvbm_plugin.cli.subscribe  # noqa: F401
        import kvbm_plugin.testing.engine  # noqa: F401
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if held:
        signal.raise_signal(held[0])  # now handled by the handler in place (SIGINT: Ctrl-C)


def reader_gone(fd: int) -> bool:
    """Whether ``fd`` is a pipe or socket whose reading end was closed (no write needed:
    ``poll`` reports POLLERR on such a pipe, POLLHUP on such a socket, on Linux and macOS)."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)) or not hasattr(select, "poll"):
        return False
    poller = select.poll()
    poller.register(fd, 0)  # POLLERR and POLLHUP are reported whatever is asked
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


class StdoutWatch:
    """Raises BrokenPipeError once the reader of stdout went away, so that a long run ends
    then (the CLI exits 141, quietly) instead of at its next print. :meth:`check` is called
    between engine steps; it looks at most every ``period_s``."""

    def __init__(self, period_s: float = 0.2) -> None:
        self.period_s = period_s
        self._next = 0.0

    def check(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.period_s
        try:
            fd = sys.stdout.fileno()
        except (AttributeError, OSError, ValueError):  # replaced by a test, or closed
            return
        if reader_gone(fd):
            raise BrokenPipeError(errno.EPIPE, "the reader of stdout went away")


STDOUT = StdoutWatch()

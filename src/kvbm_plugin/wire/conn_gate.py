"""The gate of one capped socket: its connection events, counted, and the hold that follows them.

A :class:`kvbm_plugin.wire.peers.PeerCap` counts the connections its socket accepted since the
owner last read it empty, and past ``max_unread`` holds new ones off: a drop-all filter on the
socket's listening TCP sockets (``wire/sock_filter.py``), so the kernel drops their attempts
until the owner has caught up. Each connection libzmq accepted holds about 60 KiB until the
owner's next turn, so what bounds the process's memory is how soon the hold follows the
accepts. The gate is that count and that hold, and the monitor reading that feeds them:

* the compiled gate (``_gate_c.c``): one C thread per process reads every gate's monitor
  without the GIL and holds the socket off at the accept that crosses ``max_unread``, however
  busy the interpreter is (a Python reader once fell 950 accepts behind on a loaded machine);
* :class:`PyGate`, the same logic in Python, read by the connection-watch thread
  (``wire/conn_watch.py``): where the compiled gate is not built (no C compiler at install
  time) or libzmq cannot be identified (``wire/gil_send.py``'s ``loaded_libzmq``), and in the
  tests, which run both. The switch is not ``DYN_KVBM_NATIVE``: this is not a faster loop
  with a reference but the memory bound itself, so the compiled gate is used wherever built.

Either way the events are queued for the watch thread (``take``), which keeps each cap's books
(the connections it keeps, cuts over its cap). Who calls what: ``PeerCap`` opens its gate
(:func:`open_gate`, its owner's thread) and closes it before the monitor socket closes; the
owner calls ``caught_up``; ``set_hold`` is called from the owner's or the watch thread.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import threading
from typing import Any, Protocol

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvbm_plugin._util.compiled import built
from kvbm_plugin.wire.gil_send import loaded_libzmq
from kvbm_plugin.wire.sock_filter import filter_listener

_gate_c = built("conn_gate")  # None where installed without a C compiler
logger = logging.getLogger(__name__)

EVENTS_PER_CALL = 1024  # monitor events PyGate reads per call (each a few bytes)
RING = 16384  # events queued for the watch thread per gate (the compiled gate's RING too)
MAX_LISTEN = 16  # listening sockets per gate (_gate_c.c's MAX_LISTEN too)
USE_COMPILED = True  # tests set it False to run PyGate

_started: dict[str, Any] = {}  # the compiled gate's thread in this process: {"notify": fd}
_start_lock = threading.Lock()


class Gate(Protocol):
    def take(self) -> tuple[list[tuple[int, int]], int]: ...

    def caught_up(self) -> None: ...

    def set_hold(self, hold: bool) -> bool: ...

    def state(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def _start_compiled() -> int | None:
    """Start the compiled gate's thread (once per process); the read end of the pipe it writes
    after each batch of events, or None where the compiled gate cannot run."""
    if _gate_c is None or not USE_COMPILED:
        return None
    with _start_lock:
        if "notify" in _started:
            return _started["notify"]
        lib = loaded_libzmq()
        if lib is None:
            return None
        try:
            functions = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                         for name in ("zmq_poll", "zmq_recv", "zmq_getsockopt", "zmq_errno")]
        except AttributeError:
            return None
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        os.set_blocking(write_end, False)
        _gate_c.start(*functions, write_end)
        _started["notify"] = read_end
        return read_end


def _forget_in_child() -> None:  # the child of a fork has no gate thread (_gate_c.c's fork)
    _started.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def describe() -> tuple[bool, str]:
    """(compiled, one line) for ``kvbm-plugin doctor``: which gate the capped sockets get."""
    if _gate_c is None:
        return False, ("the Python gate (wire/_gate_c.c was not built: no C compiler at install "
                       "time); a flood is held off only when the interpreter lets its reader "
                       "run (docs/operations.md#security); reinstall with a compiler")
    if loaded_libzmq() is None:
        return False, ("the Python gate: the libzmq pyzmq loaded could not be identified, so "
                       "the compiled gate cannot call it (docs/operations.md#security)")
    return True, "compiled: a C thread holds a flood off at the accept (wire/_gate_c.c)"


def notify_fd() -> int | None:
    """The pipe the compiled gate's thread writes after events (the watch polls it), or None
    while it is not running."""
    return _started.get("notify")


def open_gate(monitor: zmq.Socket, max_unread: int | None, signal_fd: int) -> Gate:
    """The gate of the socket ``monitor`` watches: compiled where it can run, else a
    :class:`PyGate`. ``signal_fd``: the owner's wake-up pipe (written after events)."""
    if _start_compiled() is not None:
        return _gate_c.Gate(monitor, monitor.underlying,
                            -1 if max_unread is None else max_unread, signal_fd)
    compiled, why = describe()
    if not compiled and USE_COMPILED and not _started.get("warned"):
        _started["warned"] = True  # once per process: every capped socket gets the same
        logger.warning("connection gate: %s", why)
    return PyGate(monitor, max_unread, signal_fd)


def is_compiled(gate: Gate) -> bool:
    return not isinstance(gate, PyGate)


class PyGate:
    """The gate in Python: :meth:`pump` reads the monitor on the watch thread (module
    docstring); the rest as the compiled gate's methods, which this mirrors line by line."""

    def __init__(self, monitor: zmq.Socket, max_unread: int | None, signal_fd: int) -> None:
        self.monitor = monitor
        self._max_unread = -1 if max_unread is None else max_unread
        self._signal_fd = signal_fd
        self._lock = threading.Lock()  # everything below: the watch's, the owner's threads
        self._events: collections.deque[tuple[int, int]] = collections.deque()
        self._dropped = 0
        self._accept_events = self._accepts_when_empty = self._holds = self._held_at = 0
        self._holding = False
        self._listening: list[int] = []

    def pump(self) -> bool:
        """Read up to :data:`EVENTS_PER_CALL` events (the watch thread; never blocks); True
        when more may be waiting."""
        for read in range(EVENTS_PER_CALL):
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                if read:
                    self._poke()
                return False
            event = parse_monitor_message(frames)
            with self._lock:
                self._handle(event["event"], int(event["value"]))
        self._poke()
        return True

    def _poke(self) -> None:
        with contextlib.suppress(OSError):  # full: a wake-up is pending already
            os.write(self._signal_fd, b"\0")

    def _handle(self, event: int, value: int) -> None:
        if len(self._events) < RING:
            self._events.append((event, value))
        else:
            self._dropped += 1
        if event == zmq.EVENT_LISTENING:
            if len(self._listening) < MAX_LISTEN and filter_listener(value, self._holding):
                self._listening.append(value)
        elif event == zmq.EVENT_CLOSED:
            if value in self._listening:
                self._listening.remove(value)
        elif event == zmq.EVENT_ACCEPTED:
            self._accept_events += 1
            unread = self._accept_events - self._accepts_when_empty
            if self._max_unread >= 0 and not self._holding and unread > self._max_unread:
                self._set_hold(True)
                self._held_at = unread

    def _set_hold(self, hold: bool) -> bool:
        if hold == self._holding:
            return False
        self._holding = hold
        if hold:
            self._holds += 1
        self._listening = [fd for fd in self._listening if filter_listener(fd, hold)]
        return True

    def take(self) -> tuple[list[tuple[int, int]], int]:
        with self._lock:
            events = list(self._events)
            self._events.clear()
            held_at, self._held_at = self._held_at, 0
        return events, held_at

    def caught_up(self) -> None:
        with self._lock:
            self._accepts_when_empty = self._accept_events
            self._set_hold(False)

    def set_hold(self, hold: bool) -> bool:
        with self._lock:
            return self._set_hold(bool(hold))

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {"accept_events": self._accept_events, "holding": self._holding,
                    "holds": self._holds, "dropped": self._dropped,
                    "listening": tuple(self._listening)}

    def close(self) -> None:
        """Nothing of its own to stop: the watch stops reading the monitor (ConnWatch.remove)."""

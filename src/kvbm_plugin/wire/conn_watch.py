"""One thread per process that keeps the books of every capped socket's connections as they
happen, and holds new connections off a socket whose owner is stuck in one turn inside libzmq.

Why a thread of its own. libzmq's I/O thread accepts connections and takes in what they send
whatever the socket's owner is doing, and an owner's turn can stay inside libzmq for seconds:
a turn of a guarded XPUB's owner reads subscriptions (``wire/guard.py``), and each read lets
libzmq process the socket's commands until its mailbox is empty, attaching new connections,
recording every subscription they sent in the socket's trie (about 40 bytes of trie per byte
of a distinct subscription) and walking the whole trie for each connection that ended
(libzmq 4.3.5 ``src/xpub.cpp``, ``xpipe_terminated``). A churn of short connections refills
that mailbox faster than it empties. An owner that read its own connection events would see
the churn only after such a turn, when every connection of it had been taken in: 98 MiB once
in CI. So the events are read off the owner's thread: by each cap's gate
(:mod:`kvbm_plugin.wire.conn_gate`), which counts the accepts and holds new connections off
(the kernel drops their attempts) while too many arrived since its owner last read the socket
empty, on its own GIL-free thread where compiled; and :class:`ConnWatch` takes the events from
the gates (reading the monitor itself for a Python gate), on a thread that is never inside the
capped socket: each :class:`kvbm_plugin.wire.peers.PeerCap` cuts connections over its cap at
accept, and those its owner does not keep after a hold.

Stuck turns: an owner marks its turns (``PeerCap.turn_started`` / ``turn_ended``: two
attribute writes), and while connections arrive lately (:data:`ARMED_S`) the thread also looks
every :data:`TICK_S`; a turn older than :data:`STUCK_S` makes it call that cap's
``hold_off``: new connections are dropped and the connections the owner does not keep (its
subscribers stay) are cut. With no connection arriving the thread sleeps in ``poll`` until an
event: an idle process has no timer.

Who calls what: a ``PeerCap`` registers itself (:meth:`ConnWatch.add`, on the thread that makes
it) and removes itself before its monitor socket closes (:meth:`ConnWatch.remove`, which
returns once this thread no longer touches that socket); this thread alone takes the gates'
events (``PeerCap.read_events``, which reads a Python gate's monitor first) and the turn marks.
It polls the compiled gates' pipe (``conn_gate.notify_fd``) and the Python gates' monitors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Protocol

import zmq

from kvbm_plugin.wire.conn_gate import notify_fd

logger = logging.getLogger(__name__)

TICK_S = 0.02  # how often the thread looks at the turns while connections arrive
STUCK_S = 0.05  # a turn this old is stuck: hold new connections off
ARMED_S = 5.0  # the thread looks at the turns this long after the last connection arrived


class Watched(Protocol):
    turn_since: float | None  # monotonic start of the owner's turn in progress (None: none)
    refuse_new: bool
    monitor: zmq.Socket | None  # the connection monitor
    poll_socket: zmq.Socket | None  # what this thread polls for it (None: the compiled gate)

    def read_events(self) -> bool: ...

    def let_go(self) -> None: ...

    def hold_off(self, why: str) -> None: ...


class ConnWatch:
    """The process's connection-watch thread (module docstring); started on the first add."""

    def __init__(self) -> None:
        self._fresh()
        # A child forked from a process whose thread ran has no such thread: start anew there
        # (its caps are its parent's, whose sockets a child cannot use anyway).
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._fresh)

    def _fresh(self) -> None:
        self._caps: set[Watched] = set()
        self._lock = threading.Lock()  # _caps, the thread's start
        # The thread's passes over the sockets, counted: remove() waits for the pass in
        # progress to end (a lock would not do: the thread takes it again at once, unfairly).
        self._passes = 0
        self._pass_done = threading.Condition()
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None
        self._armed_until = 0.0
        self.holds = 0  # stuck turns found (new connections held off)

    def add(self, cap: Watched) -> None:
        with self._lock:
            if self._thread is None:
                self._wake_r, self._wake_w = os.pipe()
                os.set_blocking(self._wake_r, False)
                os.set_blocking(self._wake_w, False)
                self._thread = threading.Thread(target=self._run, name="kvbm-conn-watch",
                                                daemon=True)
                self._thread.start()
            self._caps.add(cap)
        self._wake()

    def remove(self, cap: Watched) -> None:
        """Stop reading ``cap``'s monitor; once this returns the thread no longer touches it
        (it waits for the pass in progress, which the wake-up ends)."""
        with self._lock:
            self._caps.discard(cap)
            thread = self._thread
        if thread is None or threading.current_thread() is thread:
            return
        with self._pass_done:
            began = self._passes
            self._wake()
            while self._passes == began and thread.is_alive():
                self._pass_done.wait(0.5)

    def release(self, context: zmq.Context) -> None:
        """Stop reading every monitor of ``context``, here and in the caps' gates (before it is
        destroyed with sockets its owners did not close: a test that failed halfway)."""
        with self._lock:
            caps = [cap for cap in self._caps
                    if cap.monitor is not None and cap.monitor.context is context]
        for cap in caps:
            cap.let_go()

    def arm(self) -> None:
        """A connection arrived (this thread): look at the turns for a while."""
        self._armed_until = time.monotonic() + ARMED_S

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def _run(self) -> None:
        while True:
            try:
                self._pass()
            except Exception:  # never expected; the thread must not die (nobody would read)
                logger.exception("connection watch: a pass failed")
                time.sleep(TICK_S)  # not a busy loop if it keeps failing
            finally:
                with self._pass_done:
                    self._passes += 1
                    self._pass_done.notify_all()

    def _pass(self) -> None:
        """One pass: wait for an event (or the tick while armed) and read what came."""
        with self._lock:
            caps = [cap for cap in self._caps if cap.monitor is not None]
        armed = time.monotonic() < self._armed_until
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        notify = notify_fd()
        if notify is not None:
            poller.register(notify, zmq.POLLIN)
        for cap in caps:
            if cap.poll_socket is not None:
                poller.register(cap.poll_socket, zmq.POLLIN)
        try:
            ready = dict(poller.poll(TICK_S * 1000.0 if armed else None))
        except zmq.ZMQError:  # a monitor closed under us (its context destroyed)
            with self._lock:
                self._caps = {c for c in self._caps
                              if c.monitor is not None and not c.monitor.closed}
            return
        for fd in (self._wake_r, notify):
            if fd is not None and fd in ready:
                with contextlib.suppress(BlockingIOError, OSError):
                    os.read(fd, 4096)
        # The compiled gates' caps are all taken from on every pass, those added since this
        # pass began too: the notify byte just drained may have been for one of them (an
        # empty take is a lock and a list).
        with self._lock:
            compiled = [cap for cap in self._caps
                        if cap.monitor is not None and cap.poll_socket is None]
        for cap in compiled:
            cap.read_events()
        for cap in caps:
            if cap.poll_socket is not None and cap.poll_socket in ready:
                cap.read_events()  # more waiting: the next pass (no poll wait)
        if armed:
            self._look_at_turns(caps)

    def _look_at_turns(self, caps: list[Watched]) -> None:
        now = time.monotonic()
        for cap in caps:
            since = cap.turn_since
            if since is not None and now - since > STUCK_S and not cap.refuse_new:
                cap.hold_off("its owner is stuck in one turn")
                self.holds += 1


WATCH = ConnWatch()

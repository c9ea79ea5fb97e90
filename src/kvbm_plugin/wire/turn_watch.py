"""Hold new connections off a socket whose owner is stuck in one turn inside libzmq.

A turn of a guarded XPUB's owner reads subscriptions (``wire/guard.py``). Each read lets libzmq
process the socket's commands, and it processes them until its mailbox is empty: attaching new
connections, recording every subscription they sent in the socket's trie, and walking the whole
trie for each connection that ended (libzmq 4.3.5 ``src/xpub.cpp``, ``xpipe_terminated``). A
churn of short connections that each send a burst of subscriptions refills the mailbox faster
than that work empties it, so one read never returns (seen: 13 minutes, 1,100 connections, the
heap growing), and the owner never gets to hold new connections off (``PeerCap.refuse_new``)
because that takes a turn.

:class:`TurnWatch` is one daemon thread per process that does it instead: an owner marks its
turns (:meth:`kvbm_plugin.wire.peers.PeerCap.turn_started` / ``turn_ended``: two attribute
writes), and while any watched socket has seen a connection arrive lately the thread looks
every :data:`TICK_S`. A turn older than :data:`STUCK_S` makes it call that socket's
``PeerCap.on_stuck``: the kernel drops new connection attempts, and the connections the owner
does not keep (its subscribers stay) are cut; the owner clears the hold once a turn finds
nothing left to read. With no connection arriving for :data:`ARMED_S` the thread sleeps until
the next one: an idle process has no timer.

Who calls what: ``PeerCap`` registers itself (:meth:`TurnWatch.watch`) and calls
:meth:`TurnWatch.arm` when its owner reads an accepted connection (on the owner's thread);
the watch thread reads the caps' turn marks and sets ``refuse_new``.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Protocol

TICK_S = 0.02  # how often an armed watch looks
STUCK_S = 0.05  # a turn this old is stuck: hold new connections off
ARMED_S = 5.0  # the watch keeps looking this long after the last connection arrived


class Watched(Protocol):
    turn_since: float | None  # monotonic start of the owner's turn in progress (None: none)
    refuse_new: bool

    def on_stuck(self) -> None: ...


class TurnWatch:
    """The process's watch thread (module docstring); started on the first :meth:`arm`."""

    def __init__(self) -> None:
        self._caps: weakref.WeakSet[Watched] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._armed = threading.Event()
        self._armed_until = 0.0
        self._thread: threading.Thread | None = None
        self.holds = 0  # stuck turns found (new connections held off)

    def watch(self, cap: Watched) -> None:
        with self._lock:
            self._caps.add(cap)

    def arm(self) -> None:
        """A connection arrived on a watched socket: look for stuck turns for a while."""
        self._armed_until = time.monotonic() + ARMED_S
        if self._armed.is_set():
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvbm-turn-watch",
                                                daemon=True)
                self._thread.start()
        self._armed.set()

    def _run(self) -> None:
        while True:
            self._armed.wait()
            time.sleep(TICK_S)
            now = time.monotonic()
            with self._lock:
                caps = list(self._caps)
            for cap in caps:
                since = cap.turn_since
                if since is not None and now - since > STUCK_S and not cap.refuse_new:
                    cap.on_stuck()
                    self.holds += 1
            if now > self._armed_until:
                self._armed.clear()
                if time.monotonic() <= self._armed_until:  # armed again meanwhile
                    self._armed.set()


WATCH = TurnWatch()

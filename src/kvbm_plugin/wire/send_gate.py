"""A caller-thread publisher's sends that leave subscriptions to the thread that reads them.

Who calls what: ``ZmqEventPublisher`` with ``sends="caller"`` (wire/publisher.py), under its send
lock: ``publish`` on the caller's thread (TensorRT-LLM's executor thread for the GPU tier) asks
:meth:`SendGate.holds` before each send and :meth:`SendGate.defer` s the batch when it holds;
the service thread, after reading the XPUB's subscriptions, sends what :meth:`SendGate.take`
returns.

Why. libzmq processes a socket's pending commands on every send (throttled to about once a
millisecond), and an ``activate_read`` command moves the subscription messages a connection has
queued (up to its ``ZMQ_RCVHWM``) into the XPUB's own queue, where they stay until the socket's
reader takes them (libzmq 4.3.5 ``src/xpub.cpp``, ``xread_activated``; ``socket_base.cpp``,
``send``). So sends on one thread take in an outsider's subscriptions as fast as they come,
while the thread that reads them may be starved of CPU: a 60 s flood grew the heap by 76 MiB
beside two busy processes (docs/operations.md, "Security and faults").

The gate: one non-blocking OS poll of the XPUB's ``ZMQ_FD``, which is readable while commands
wait for the socket. While it is, or while earlier batches wait, a batch is deferred (already
encoded and kept for replay): the service thread, woken by the same fd, reads the
subscriptions (processing the commands) and then sends it. So libzmq takes subscriptions in
only on the thread that reads them, and what it holds for a connection is what that connection
queued (``ZMQ_RCVHWM`` messages, its receive buffer) plus one turn of the reader, however long
the reader waits for the CPU. Only commands that arrive between the poll and the send (about a
microsecond) are still processed by the caller's send.

What waits here is bounded by ``limit`` batches (the publisher's ``max_queue_size``); beyond it
the oldest deferred batch is lost live (it stays in the replay buffer: a consumer sees the gap
and fills it), counted in :attr:`dropped`.
"""

from __future__ import annotations

import logging
import select
from collections import deque
from typing import Any

from kvbm_plugin._util.ratelimit import RateLimitedLog


class SendGate:
    """Deferred live sends of a caller-thread publisher (see the module docstring).

    Every call is made under the publisher's send lock, except :meth:`defer` by ``publish``
    when the service thread holds that lock (it never waits for it): :meth:`defer` and
    :meth:`take` use only the deque's atomic ``append`` and ``popleft``, so an item deferred
    during a :meth:`take` is either taken or left for the next one, in order."""

    def __init__(self, fd: int, limit: int, owner: str, log: RateLimitedLog) -> None:
        self._owner = owner
        self._log = log
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)
        self._deferred: deque[Any] = deque()
        self._limit = limit
        self.deferred = 0  # batches deferred to the service thread so far
        self.dropped = 0  # deferred batches lost live (past ``limit``)
        self.high_water = 0  # most batches deferred at once

    def holds(self) -> bool:
        """True when this batch must wait for the service thread: batches wait already (seq
        order), or commands wait for the socket (one ``poll`` with timeout 0, no libzmq call)."""
        return bool(self._deferred) or bool(self._poller.poll(0))

    def defer(self, item: tuple[int, Any, Any]) -> None:
        """Keep ``item`` (``(seq, payload, events)``) for the service thread; past the bound,
        the oldest one is lost live (counted, logged rate-limited)."""
        deferred = self._deferred
        deferred.append(item)
        self.deferred += 1
        if len(deferred) > self._limit:
            try:
                seq = deferred.popleft()[0]
            except IndexError:  # taken by the service thread meanwhile
                return
            self.dropped += 1
            self._log.log(logging.WARNING, "deferred-full", "%s: %d batches wait for the "
                          "service thread; batch seq %d lost live (kept for replay)",
                          self._owner, self._limit, seq)
        if len(deferred) > self.high_water:
            self.high_water = len(deferred)

    def take(self) -> list[Any]:
        """Every deferred item, oldest first (the service thread sends them)."""
        out = []
        popleft = self._deferred.popleft
        while True:
            try:
                out.append(popleft())
            except IndexError:
                return out

    def __len__(self) -> int:
        return len(self._deferred)


__all__ = ["SendGate"]

"""Stop listening while a bound socket's reader is behind; listen again once it has caught up.

libzmq keeps every accepted connection, with its session, its pipes (two 16 KiB queues) and
what its kernel buffer holds, until the socket has read every message the connection queued:
a connection whose queue is full (``ZMQ_RCVHWM``) stops being read by libzmq, so it does not
even see its peer leave. An outsider that connects, queues requests and disconnects, faster
than the owning thread reads them, therefore grows the process by about 60 KiB per connection
(a replay ROUTER on a 2-core machine: 300 MiB in 8 s), and a connection cap does not help: a
cut connection is freed only once it has been read to its end.

:class:`ListenBrake` bounds that backlog. It counts the connections accepted since the reader
last found the socket empty; past ``max_behind`` it unbinds the endpoint, which stops new
connections (the kernel refuses them) and ends every existing one (libzmq terminates the
sessions of the listener it closes, and their unread kernel buffers with them). The reader
then drains what the pipes still hold (at most ``ZMQ_RCVHWM`` messages each) and, once the
socket is empty, the brake binds the same endpoint again. Legitimate peers see a dropped
connection and reconnect by themselves (ZMQ does); a replay request in flight is lost and
asked again by its requester's timeout.

So what the socket holds is at most ``max_behind`` + the connection cap connections (plus what
the I/O thread accepts between two reads of the connection monitor), each about 60 KiB plus
``ZMQ_RCVHWM`` messages and its kernel receive buffer.

Who calls what: the thread that owns the socket creates the brake after binding, and calls
:meth:`ListenBrake.after_read` after each turn of reading the socket (with whether the turn
found it empty); while :attr:`ListenBrake.closed` it keeps calling every few milliseconds, so
the endpoint is bound again without waiting for traffic.
"""

from __future__ import annotations

import logging

import zmq

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.wire.peers import PeerCap

logger = logging.getLogger(__name__)

MAX_BEHIND = 128  # connections accepted since the socket was last read empty


class ListenBrake:
    """Unbinds ``sock``'s endpoint while its reader is more than ``max_behind`` connections
    behind, binds it again once the reader found it empty (module docstring)."""

    def __init__(self, owner: str, sock: zmq.Socket, cap: PeerCap,
                 max_behind: int = MAX_BEHIND) -> None:
        self._owner = owner
        self._sock = sock
        self._cap = cap
        self._max_behind = max_behind
        # The endpoint as bound (a port or path chosen at bind time included), to bind again.
        self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._accepts_when_empty = cap.accept_events
        self._log = RateLimitedLog(logger)
        self.closed = False
        self.closures = 0
        self.rebind_failures = 0

    def stats(self) -> dict[str, int]:
        return {"listen_closures": self.closures, "listen_closed": int(self.closed),
                "listen_rebind_failures": self.rebind_failures}

    def after_read(self, empty: bool) -> None:
        """The owner read the socket: ``empty`` if it found nothing left (call after the
        connection monitor's events were read, so the count is current)."""
        if empty:
            self._accepts_when_empty = self._cap.accept_events
            if self.closed:
                self._reopen()
            return
        behind = self._cap.accept_events - self._accepts_when_empty
        if not self.closed and behind > self._max_behind:
            self._close(behind)

    def _close(self, behind: int) -> None:
        try:
            self._sock.unbind(self._endpoint)
        except zmq.ZMQError as exc:  # never expected: the endpoint is ours
            self._log.log(logging.ERROR, "brake-unbind", "%s: cannot stop listening on %s: "
                          "%s", self._owner, self._endpoint, exc)
            return
        self.closed = True
        self.closures += 1
        self._log.log(logging.WARNING, "brake-close", "%s: stopped listening on %s: %d "
                      "connections arrived since its requests were last all read (a flood); "
                      "it listens again once they are", self._owner, self._endpoint, behind)

    def _reopen(self) -> None:
        try:
            self._sock.bind(self._endpoint)
        except zmq.ZMQError as exc:
            # The listener's close is asynchronous (libzmq's I/O thread), so the address can
            # still be in use for a moment: try again at the next turn.
            self.rebind_failures += 1
            self._log.log(logging.WARNING, "brake-rebind", "%s: listening again on %s failed "
                          "(will retry): %s", self._owner, self._endpoint, exc)
            return
        self.closed = False
        self._accepts_when_empty = self._cap.accept_events
        logger.info("%s: listening on %s again", self._owner, self._endpoint)

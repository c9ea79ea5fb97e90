"""Connection events of a subscriber's socket, for noticing that a publisher may have restarted.

A restarted publisher's seq starts at 0 again. A consumer sees that as the seq going back, but
only when the new stream has not yet got past where the old one was: if it has, its next seq
reads as a gap (or as the expected seq) and the old blocks stay while the new stream's first
batches are missed. The connection itself tells more: the publisher's socket closed and a new one
was reached. :class:`ConnectionWatch` reports those events from a ZMQ socket monitor; the
consumer then checks the stream (see ``KvEventConsolidator`` and ``StreamSubscriber``: replay the
last batch it applied and compare the bytes).

Used by the consolidator's ingest thread and by ``StreamSubscriber``'s polling thread: one thread
per watch, like the socket it watches.

A connection must end for any of that to be seen. One whose other end went away without a word
(its host rebooted or was cut off, a firewall or NAT dropped its state) stays open for ever on
a socket that only receives, and for some 15 minutes of TCP retransmissions on one that sends:
a subscriber would wait for a publisher that is back long since, a publisher would keep the
dead subscriber towards its connection cap, a rank's reports would go nowhere.
:func:`heartbeats` sets ZMTP heartbeats (libzmq 4.2 and later) on every socket of ours that
reaches or is reached across hosts: it pings each peer every :data:`HEARTBEAT_IVL_MS` and closes
a connection that sent nothing for :data:`HEARTBEAT_TIMEOUT_MS` after a ping (the peer's libzmq
answers by itself, whatever its application is doing); a connecting socket then connects again.
"""

from __future__ import annotations

import contextlib

import zmq
from zmq.utils.monitor import recv_monitor_message

__all__ = ["LOST", "BACK", "JOINED", "ConnectionWatch", "heartbeats"]

HEARTBEAT_IVL_MS = 5000
HEARTBEAT_TIMEOUT_MS = 15000

LOST = "lost"  # the connection to the publisher closed
BACK = "back"  # a connection was made again after one was lost
# The first handshake with a publisher completed: the subscription is on its way. What the
# publisher sent before it arrived reached no one live; a consumer with a replay endpoint asks
# for it now (a consumer that waited for a later live batch to show the gap would wait forever
# when the stream goes quiet).
JOINED = "joined"


class ConnectionWatch:
    """Connect/disconnect events of one connecting socket (SUB), read without blocking.

    Built right after the socket is created; :attr:`socket` can be registered in a poller.
    :meth:`close` before the watched socket is closed.
    """

    def __init__(self, sock: zmq.Socket) -> None:
        self._watched = sock
        self.socket: zmq.Socket = sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._lost = False
        self.joined = False  # a handshake with a publisher has completed

    def events(self) -> list[str]:
        """The events since the last call, in order: :data:`JOINED` once, at the first
        completed handshake, then :data:`LOST` and :data:`BACK` (the first connection is not
        a BACK; a BACK always follows a LOST)."""
        out: list[str] = []
        while True:
            try:
                message = recv_monitor_message(self.socket, zmq.NOBLOCK)
            except zmq.Again:
                return out
            event = message.get("event")
            if event == zmq.EVENT_DISCONNECTED:
                if not self._lost:
                    self._lost = True
                    out.append(LOST)
            elif event == zmq.EVENT_CONNECTED and self._lost:
                self._lost = False
                out.append(BACK)
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and not self.joined:
                self.joined = True
                out.append(JOINED)

    def close(self) -> None:
        """Stop monitoring and close the monitor socket; idempotent."""
        with contextlib.suppress(zmq.ZMQError):
            self._watched.disable_monitor()
        self.socket.close(linger=0)


def heartbeats(sock: zmq.Socket) -> None:
    """Ping ``sock``'s peers and drop a connection gone silent (module docstring); set
    before it connects or binds, by the thread that owns it."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)

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
:func:`keep_alive` has the kernel end such a connection, on every tcp socket of ours: TCP
keepalive probes after :data:`KEEPALIVE_IDLE_S` without traffic (answered by the peer's kernel,
whatever its ZMQ implementation), and at most :data:`MAXRT_MS` for sent data to be
acknowledged (``TCP_USER_TIMEOUT``); libzmq then closes the connection, and a connecting socket
connects again. Not ZMTP heartbeats: a router's subscriber need not answer a PING (llm-d's
go-zeromq/zmq4 @ 826b120 queues a SUB's frames as read, commands included, ``msgio.go``'s
``qreader.listen``, and answers PING only in ``Conn.RecvMsg``, which that path does not call),
and an idle one would be dropped every time out.
"""

from __future__ import annotations

import contextlib

import zmq
from zmq.utils.monitor import recv_monitor_message

__all__ = ["LOST", "BACK", "JOINED", "ConnectionWatch", "keep_alive"]

KEEPALIVE_IDLE_S = 10  # silent this long: probe
KEEPALIVE_INTVL_S = 5  # between probes
KEEPALIVE_CNT = 3  # unanswered probes before the connection is dropped (about 25 s in all)
# Sent data unacknowledged this long (or unsent behind a peer's zero window: a reader
# stalled that long) and the connection is dropped.
MAXRT_MS = 60_000

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


def keep_alive(sock: zmq.Socket) -> None:
    """Have a silent connection of ``sock`` dropped (module docstring); set before it connects
    or binds, by the thread that owns it (ipc and inproc endpoints ignore it)."""
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTVL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_CNT)
    sock.setsockopt(zmq.TCP_MAXRT, MAXRT_MS)

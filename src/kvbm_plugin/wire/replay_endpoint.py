"""The replay side of a publisher: its ROUTER, what bounds that socket, and the answers.

One :class:`ReplayEndpoint` per ``ZmqEventPublisher`` with a replay endpoint. It owns the ROUTER
and three collaborators: the connection cap (``wire/peers.py``: at most ``max_peers``
connections; while more than ``MAX_BEHIND`` arrived since the reader last found it empty, the
kernel drops new ones, as soon as the connection watch reads them), the listen brake
(``wire/listen_brake.py``: no listening while the reader is behind a flood of connections, for
endpoints the kernel filter does not cover) and the answers (``wire/replay_server.py``: bounded,
incremental, never blocking).

Who calls what: the thread that owns the publisher's sockets (the publisher thread, the service
thread of ``sends="caller"``, or an inline owner's thread) calls :meth:`ReplayEndpoint.open`,
polls :attr:`ReplayEndpoint.router` and :attr:`ReplayEndpoint.signal_fd`, calls
:meth:`ReplayEndpoint.service` when either is readable and every few milliseconds while
:attr:`ReplayEndpoint.busy`, and :meth:`ReplayEndpoint.close` at shutdown. :meth:`stats` is read
from any thread (snapshots).
"""

from __future__ import annotations

import collections

import zmq

from kvbm_plugin.wire.access import Allowlist
from kvbm_plugin.wire.guard import harden_router
from kvbm_plugin.wire.listen_brake import MAX_BEHIND, ListenBrake
from kvbm_plugin.wire.peers import PeerCap
from kvbm_plugin.wire.reconnect import keep_alive
from kvbm_plugin.wire.replay_server import PEER_HWM, ReplayServer


class ReplayEndpoint:
    """A publisher's replay ROUTER with its cap, brake and answers (module docstring)."""

    def __init__(self, owner: str, topic: bytes, *, max_peers: int, stall_s: float,
                 rolled: str) -> None:
        self._name = owner + " replay"
        self._max_peers = max_peers
        self.server = ReplayServer(owner, topic, stall_s=stall_s, rolled=rolled)
        self.router: zmq.Socket | None = None
        self._cap: PeerCap | None = None
        self._brake: ListenBrake | None = None

    def open(self, context: zmq.Context, address: str, allowlist: Allowlist) -> zmq.Socket:
        """Create and bind the ROUTER; on an error the caller calls :meth:`close`."""
        router = self.router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        keep_alive(router)  # a requester gone silent is dropped, not kept towards the cap
        harden_router(router)
        allowlist.configure(router)
        self._cap = PeerCap(self._name, router, self._max_peers, max_unread=MAX_BEHIND)
        # A vanished requester raises EHOSTUNREACH, a full queue EAGAIN, instead of the
        # message being dropped silently.
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # What one requester may have queued: answers are sent bit by bit as it reads.
        router.setsockopt(zmq.SNDHWM, PEER_HWM)
        router.bind(address)
        self._brake = ListenBrake(self._name, router, self._cap)
        return router

    @property
    def signal_fd(self) -> int | None:
        """Readable after connection events on the ROUTER (the connection watch's wake-up),
        polled with it (None before open, after close)."""
        return None if self._cap is None or self._cap.signal_fd < 0 else self._cap.signal_fd

    @property
    def busy(self) -> bool:
        """Answers or stalled peers need timed turns, or the ROUTER waits to listen again."""
        return self.router is not None and (
            self.server.busy or (self._brake is not None and self._brake.closed))

    def service(self, buffer: collections.deque[tuple[int, bytes]], *,
                shared: bool = False) -> None:
        """Take requests, move answers on (non-blocking, bounded); ``shared``: another thread
        appends to ``buffer`` meanwhile."""
        router = self.router
        if router is None:
            return
        if self._cap is not None:
            self._cap.drain()
        empty = self.server.service(router, buffer, shared=shared)
        if empty and self._cap is not None:
            self._cap.caught_up()
        if self._brake is not None:
            self._brake.after_read(empty)

    def close_monitor(self) -> None:
        """Stop the connection monitor (before the ROUTER closes); idempotent."""
        if self._cap is not None:
            self._cap.close()

    def close(self, linger_ms: int = 0) -> None:
        """Close the monitor and the ROUTER; idempotent."""
        self.close_monitor()
        router, self.router = self.router, None
        if router is not None:
            router.close(linger=linger_ms)

    def stats(self) -> dict[str, int]:
        out = self.server.stats()
        for part in (self._cap, self._brake):
            if part is not None:
                out.update({f"replay_{k}": v for k, v in part.stats().items()})
        return out

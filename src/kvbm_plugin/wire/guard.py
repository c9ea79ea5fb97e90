"""Bounds on what outsiders can make our bound ZMQ sockets hold: subscriptions, requests, peers.

Who calls what: the thread that owns a publishing socket (a publisher's own thread, the
consolidator's ingest thread, the shared agent's thread, or under the send lock the service
thread of a publisher that sends on the caller's thread; never TensorRT-LLM's executor thread)
calls :meth:`SubscriptionGuard.configure` before binding and :meth:`SubscriptionGuard.service`
whenever the socket is readable.

Why. A PUB or plain XPUB socket keeps every distinct subscription each connected peer sends, in
a trie (libzmq ``src/xpub.cpp``, ``xread_activated``): 12.5 MiB of distinct subscriptions grew a
leader by over 600 MiB. ``ZMQ_XPUB_MANUAL`` alone does not bound it: libzmq 4.3.5 still records
every subscription of a manual XPUB per connection (``_manual_subscriptions``, so that it can
send the unsubscriptions when the connection goes) and frees them only when the peer cancels
them or disconnects. So the guard:

* makes the socket an XPUB with ``ZMQ_XPUB_MANUAL``: nothing a peer sends takes effect by itself;
* applies (``ZMQ_SUBSCRIBE``/``ZMQ_UNSUBSCRIBE`` on the peer that sent it) only subscriptions
  that can ever match, the prefixes of the socket's topic (``b""`` included), so a SUB that
  subscribes to ``b""``, the topic or any prefix of it (llm-d's ``"kv@"``) receives exactly what
  a PUB would send it, byte for byte;
* tolerates up to ``max_refused`` other distinct subscriptions per connection (a SUB connected to
  several publishers sends each of them all its subscriptions) and cuts the connection at the
  next one (:func:`kvbm_plugin.wire.peers.cut_connection`): libzmq then frees all it held for
  that peer (its termination notices are read here too). The connection is found by the
  ``__fd`` property libzmq attaches to each received message (``src/stream_engine_base.cpp``,
  ``init_properties``), checked against the peer's address;
* sets ``ZMQ_MAXMSGSIZE`` (a longer subscription can never match; libzmq drops that
  connection), a small ``ZMQ_RCVHWM`` and receive buffer (what a connection has in flight), and
  caps the socket's connections (:class:`kvbm_plugin.wire.peers.PeerCap`);
* when a turn leaves subscriptions unread, cuts every connection not yet a subscriber and
  holds new ones off until it has caught up (:meth:`SubscriptionGuard._shed`; the kernel
  drops their attempts, :attr:`kvbm_plugin.wire.peers.PeerCap.refuse_new`): libzmq takes a
  connection's subscriptions in as they arrive, however far behind this reader is, and a
  churn of short connections would otherwise outrun the reader. The connection watch's
  thread does the same, without waiting for this reader's turn, once more than
  :data:`MAX_UNREAD` connections arrived since a turn last found the socket empty, or when a
  turn is stuck in libzmq (``wire/conn_watch.py``).

The bound: at most ``max_peers`` connections, each holding at most the topic's
``len(topic) + 1`` prefixes and ``max_refused`` other subscriptions of at most
:func:`max_subscription_bytes` bytes before it is cut, and after the cut what it had in flight
(its receive buffer, :data:`kvbm_plugin.wire.peers.RCVBUF_BYTES`, and what libzmq had taken in
before this thread read its last subscription: what it sent between its accept and the
reader's next turn), until libzmq closes it. The number of
connections is further limited by the bind address and :mod:`kvbm_plugin.wire.access` (an
allowlist). Every refused subscription and cut connection is counted (:meth:`stats`) and
logged rate-limited.

Replay ROUTERs get :func:`harden_router`: a small ``MAXMSGSIZE`` (a request is 8 bytes) and
``RCVHWM``; :mod:`kvbm_plugin.wire.replay_server` bounds the answers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import zmq

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin._util.saferepr import saferepr
from kvbm_plugin.wire.peers import PeerCap, cut_connection, limit_receive_buffer, peer_address

logger = logging.getLogger(__name__)

SUBSCRIPTION_HWM = 4  # RCVHWM of a guarded XPUB: subscription messages queued per connection
MAX_REFUSED_PER_PEER = 16  # distinct non-matching subscriptions a connection may hold
PER_TURN = 256  # subscription messages read per service call
# Connections that may arrive between two turns that read the socket empty; more is a flood:
# new ones are held off and those not yet subscribers cut (PeerCap.hold_off, on the connection
# watch's thread, so within one of its wake-ups whatever this socket's owner is doing).
MAX_UNREAD = 8
BACKLOG_TURNS = 1  # service calls in a row that find a full turn waiting: a flood (see _shed)
MAX_PEERS = 64  # connections a guarded socket keeps (DYN_KVBM_ZMQ_MAX_PEERS)
REPLAY_REQUEST_BYTES = 64  # MAXMSGSIZE of a replay ROUTER (a request frame is 8 bytes)
REPLAY_RCVHWM = 16  # replay requests queued per requester connection


def max_subscription_bytes(topic: bytes) -> int:
    """``ZMQ_MAXMSGSIZE`` of a guarded XPUB: the longest subscription that can match (the
    topic), plus room for ZMTP 3.1's ``\\x09SUBSCRIBE`` command prefix, and never under 256
    so that a subscriber sending a few other (short) topics is not cut for their length."""
    return max(len(topic), 240) + 16


@dataclass
class _Peer:
    """What one connection (by fd) holds in libzmq: its address, its distinct subscriptions
    (applied or refused), and whether we cut it (what it sent before the cut is still read)."""

    address: object
    applied: set[bytes] = field(default_factory=set)
    refused: set[bytes] = field(default_factory=set)
    cut: bool = False


_MAX_PEERS = 4096  # connections remembered (by fd); the oldest state is forgotten beyond


class SubscriptionGuard:
    """Applies only the subscriptions of a manual XPUB that can match; cuts peers that flood.

    One per guarded socket; used only by the thread that owns the socket (module docstring).
    ``topic``: the first frame of every message the socket sends (``b""`` when messages carry no
    topic frame: then only ``b""`` can be relied on to match, e.g. the announce endpoint).

    ``held`` counts what libzmq holds for connected peers as it does: one per distinct
    (connection, subscription), less each cancellation and each notice libzmq gives when a
    connection goes (one per subscription it held).
    """

    def __init__(self, owner: str, topic: bytes, *, max_refused: int = MAX_REFUSED_PER_PEER,
                 per_turn: int = PER_TURN, max_peers: int = MAX_PEERS) -> None:
        self._owner = owner
        self._max_peers = max_peers
        self._cap: PeerCap | None = None
        self._topic = topic
        self._allowed = frozenset(topic[:i] for i in range(len(topic) + 1))
        self._max_refused = max_refused
        self._per_turn = per_turn
        self._peers: dict[int, _Peer] = {}  # fd -> what that connection holds
        self._log = RateLimitedLog(logger)
        self.applied = 0  # subscriptions applied (prefixes of the topic)
        self.unsubscribed = 0  # cancellations applied
        self.refused = 0  # subscriptions that can never match (or from a cut peer): not applied
        self.peers_cut = 0  # connections cut for holding more than max_refused of those
        self.peers_shed = 0  # connections cut in a backlog, before their turn (_shed)
        self._backlog = 0  # service calls in a row that ran out of budget
        self.departed = 0  # notices read that a connection went (libzmq freed its subscription)
        self.held = 0  # distinct subscriptions libzmq holds for connections (class docstring)
        self.held_high_water = 0

    def configure(self, sock: zmq.Socket) -> None:
        """Set the options (before bind): manual subscriptions, message size, receive HWM and
        buffer, and the connection cap (its monitor: :attr:`sockets`)."""
        sock.setsockopt(zmq.XPUB_MANUAL, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, max_subscription_bytes(self._topic))
        sock.setsockopt(zmq.RCVHWM, SUBSCRIPTION_HWM)
        limit_receive_buffer(sock)
        self._cap = PeerCap(self._owner, sock, self._max_peers, on_gone=self._forget,
                            keep=self._subscribers, max_unread=MAX_UNREAD)

    @property
    def sockets(self) -> list[int]:
        """What the owner polls besides the XPUB itself: the connection watch's wake-up fd
        (readable after connection events; then call :meth:`service`)."""
        cap = self._cap
        return [] if cap is None or cap.signal_fd < 0 else [cap.signal_fd]

    def close(self) -> None:
        """Stop the connection monitor (before the XPUB closes; on the owning thread)."""
        if self._cap is not None:
            self._cap.close()

    def stats(self) -> dict[str, int]:
        return {
            **(self._cap.stats() if self._cap is not None else {}),
            "subscriptions_applied": self.applied,
            "subscriptions_cancelled": self.unsubscribed,
            "subscriptions_refused": self.refused,
            "subscription_peers_cut": self.peers_cut,
            "subscription_peers_shed": self.peers_shed,
            "subscription_departures": self.departed,
            "subscriptions_held": self.held,
            "subscriptions_held_high_water": self.held_high_water,
        }

    def service(self, sock: zmq.Socket) -> bool:
        """Read up to ``per_turn`` subscription messages (never blocks); True when the
        budget ran out, so more may be waiting (call again soon). Called by the owning thread;
        the turn is marked for the connection watch (wire/conn_watch.py)."""
        cap = self._cap
        if cap is None:
            return self._turn(sock, None)
        cap.drain()
        cap.turn_started()
        try:
            return self._turn(sock, cap)
        finally:
            cap.turn_ended()

    def _subscribers(self) -> set[int]:
        """The fds of connections whose subscriptions so far were all applied (any thread: the
        turn watch's reads a snapshot)."""
        return {fd for fd, peer in list(self._peers.items())
                if peer.applied and not peer.refused and not peer.cut}

    def _turn(self, sock: zmq.Socket, cap: PeerCap | None) -> bool:
        for _ in range(self._per_turn):
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._backlog = 0
                if cap is not None:
                    cap.caught_up()
                return False
            self._one(sock, frame)
        self._backlog += 1
        if self._backlog >= BACKLOG_TURNS:
            self._shed()
        return True

    def _shed(self) -> None:
        """A backlog: subscriptions come in faster than this thread reads them. libzmq moves
        every connection's subscriptions into its queue whenever the socket is called, however
        far behind the reader is, so a flooding connection would be cut only once the reader
        got to its messages, while it kept sending. Cut now every connection not yet shown to
        be a subscriber (one whose subscriptions read so far were all applied), and new ones
        at accept until the reader has caught up; a legitimate one cut meanwhile reconnects
        (counted in ``subscription_peers_shed`` and ``connections_refused``)."""
        cap = self._cap
        if cap is None:
            return
        cap.refuse_new = True  # until a turn finds nothing left to read (caught_up)
        for fd, address in cap.connections():
            peer = self._peers.get(fd)
            if peer is not None and peer.address == address and (
                    peer.cut or (peer.applied and not peer.refused)):
                continue
            if peer is None or peer.address != address:
                peer = self._peers[fd] = _Peer(address)
            peer.cut = True
            self.peers_shed += 1
            self._log.log(logging.WARNING, "sub-shed", "%s: subscriptions arrive faster than "
                          "they are read: cut the connection from %s, not yet a subscriber",
                          self._owner, saferepr(address, 80))
            cut_connection(fd, address)

    def _forget(self, fd: int) -> None:
        self._peers.pop(fd, None)

    # ---- internals ------------------------------------------------------------------

    def _one(self, sock: zmq.Socket, frame: zmq.Frame) -> None:
        data = frame.bytes
        if not data or data[0] not in (0, 1):
            return  # not a subscription (an XPUB passes nothing else from a SUB)
        subscribe, body = data[0] == 1, data[1:]
        try:
            fd = int(frame.get("__fd"))
        except (zmq.ZMQError, ValueError, TypeError):
            fd = -1  # no metadata: a departed connection's notice, or an inproc peer
        if fd < 0:
            if not subscribe:
                self.departed += 1
                self.held = max(0, self.held - 1)
            elif body in self._allowed:  # an inproc subscriber (in-process: trusted)
                sock.setsockopt(zmq.SUBSCRIBE, body)
                self.applied += 1
            else:
                self.refused += 1
            return
        try:
            sender_ip: str | None = frame.get("Peer-Address")
        except zmq.ZMQError:
            sender_ip = None
        peer = self._peer(fd, sender_ip)
        allowed = body in self._allowed and (peer is None or not peer.cut)
        if not subscribe:
            if allowed:
                sock.setsockopt(zmq.UNSUBSCRIBE, body)
                self.unsubscribed += 1
            if peer is not None and (body in peer.applied or body in peer.refused):
                peer.applied.discard(body)
                peer.refused.discard(body)
                self.held = max(0, self.held - 1)
            return
        if allowed:
            sock.setsockopt(zmq.SUBSCRIBE, body)  # on the peer that sent it (the last pipe)
            self.applied += 1
        else:
            self.refused += 1
        if peer is None or body in peer.applied or body in peer.refused:
            return  # a repeat: libzmq holds it once
        (peer.applied if allowed else peer.refused).add(body)
        self.held += 1
        if self.held > self.held_high_water:
            self.held_high_water = self.held
        if not peer.cut and len(peer.refused) > self._max_refused:
            self._cut_peer(fd, peer, body)

    def _peer(self, fd: int, sender_ip: str | None) -> _Peer | None:
        """The state of the connection on ``fd``: fresh when the fd now belongs to another
        connection; the last one known there when it is not a connected socket any more.

        None when the message cannot be told apart: it was sent from another IP address than
        the connection now on ``fd`` (its own connection is gone and libzmq gave the fd number
        to a new one while the message still waited here), so it is not held against the new
        one. Such a message is still applied or refused (libzmq applies it to the connection
        that sent it, if that is still there)."""
        address = self._cap.address(fd) if self._cap is not None else None
        if address is None:
            address = peer_address(fd)
        peer = self._peers.get(fd)
        if address is None or (peer is not None and peer.address == address):
            return peer
        if (sender_ip is not None and isinstance(address, tuple) and isinstance(address[0], str)
                and address[0] != sender_ip):
            return None
        if peer is None and len(self._peers) >= _MAX_PEERS:
            self._peers.pop(next(iter(self._peers)))
        peer = self._peers[fd] = _Peer(address)
        return peer

    def _cut_peer(self, fd: int, peer: _Peer, body: bytes) -> None:
        self.peers_cut += 1
        peer.cut = True
        self._log.log(logging.WARNING, "sub-cut", "%s: cut the connection from %s: it sent "
                      "more than %d subscriptions that can never match topic %s (last %s); "
                      "libzmq frees what it held", self._owner, saferepr(peer.address, 80),
                      self._max_refused, saferepr(self._topic, 80), saferepr(body, 60))
        cut_connection(fd, peer.address)


def harden_router(sock: zmq.Socket) -> None:
    """Bound what replay requesters can queue on a ROUTER (before bind): a request larger than
    :data:`REPLAY_REQUEST_BYTES` drops its connection, and each connection queues at most
    :data:`REPLAY_RCVHWM` requests before TCP pushes back."""
    sock.setsockopt(zmq.MAXMSGSIZE, REPLAY_REQUEST_BYTES)
    sock.setsockopt(zmq.RCVHWM, REPLAY_RCVHWM)
    limit_receive_buffer(sock)

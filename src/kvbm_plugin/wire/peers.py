"""How many connections a bound socket of ours keeps, and how one is cut from outside libzmq.

libzmq has no per-connection API on a bound socket: it accepts every connection and reads all
each one sends. :class:`PeerCap` watches a socket's accepted and closed connections through its
monitor (``zmq_socket_monitor``: each event carries the connection's fd) and cuts every
connection beyond ``max_peers``, so what all connections together can hold is ``max_peers``
times what one can, and while its owner is behind (:attr:`PeerCap.refuse_new`) the kernel
drops new connection attempts on a TCP endpoint. :func:`cut_connection` is the cut: it attaches
a socket filter that drops every packet still to come (so the peer can send nothing more; on
Linux ``shutdown(SHUT_RD)`` alone lets a TCP peer go on sending, and libzmq would go on
reading), makes its close a reset (``SO_LINGER`` 0, so no closed socket lingers) and shuts its
reading side; libzmq reads what was already received (at most :data:`RCVBUF_BYTES`, the
socket's receive buffer, which :func:`limit_receive_buffer` sets) and then the end of stream,
closes the fd and frees what it held for that peer.

Who calls what: the thread that owns the socket creates the :class:`PeerCap` (after the socket's
options are set), polls :attr:`PeerCap.signal_fd` with the socket and, when it is readable, calls
:meth:`PeerCap.drain` and takes a turn on the socket (libzmq attaches and frees connections only
inside a call on it); when a read finds the socket empty it calls :meth:`PeerCap.caught_up`, and
it calls :meth:`PeerCap.close` before closing the socket. The connection events are read by the
cap's gate (:mod:`kvbm_plugin.wire.conn_gate`: the count and the hold, on a GIL-free thread where
compiled) and the process's connection-watch thread (:mod:`kvbm_plugin.wire.conn_watch`: the
books), never by the owner: an owner's turn can stay inside libzmq for seconds while
connections keep arriving; both signal the owner through ``signal_fd`` after each batch of
events. The monitor
socket must be read: libzmq's I/O thread waits when its queue is full (``src/socket_base.cpp``,
``monitor_event`` sends blocking), so a monitor nobody reads stalls every socket of the context.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import time
from collections.abc import Callable

import zmq

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin._util.saferepr import saferepr
from kvbm_plugin.wire.conn_gate import PyGate, is_compiled, open_gate
from kvbm_plugin.wire.conn_watch import WATCH
from kvbm_plugin.wire.sock_filter import DROP_ALL, SO_ATTACH_FILTER, borrow

logger = logging.getLogger(__name__)

RCVBUF_BYTES = 4096  # SO_RCVBUF of a guarded socket's connections (Linux doubles it)
_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_LISTENING
           | zmq.EVENT_CLOSED)  # LISTENING, CLOSED: the listening socket's fd


def limit_receive_buffer(sock: zmq.Socket) -> None:
    """Give ``sock``'s connections a small kernel receive buffer (before bind): the bytes a
    peer can have waiting when it is cut. Inbound traffic on our publishing and replay sockets
    is subscriptions and 8-byte requests, so this costs no throughput."""
    sock.setsockopt(zmq.RCVBUF, RCVBUF_BYTES)


def peer_address(fd: int) -> object:
    """The remote address of the stream socket on ``fd`` (read through a duplicate; the fd
    stays libzmq's), or None when it is not a connected stream socket."""
    sock = borrow(fd)
    if sock is None:
        return None
    with sock:
        try:
            return sock.getpeername() or ("local", fd)
        except OSError:
            return None


def _stream_fds() -> list[int]:
    """The process's open file descriptors (Linux: /proc/self/fd; none elsewhere)."""
    try:
        return [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return []


def cut_connection(fd: int, address: object) -> bool:
    """Cut the connection on ``fd`` if it still goes to ``address`` (module docstring); the
    fd stays libzmq's to close. Returns whether it was cut."""
    sock = borrow(fd)
    if sock is None:
        return False
    with sock:
        try:
            if (sock.getpeername() or ("local", fd)) != address:
                return False
            # Closed with a reset, not a FIN: no socket lingers for the peer's answer (which
            # the filter would drop, keeping it, and a later connection on the same ports,
            # waiting).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):  # Linux: drop every packet still to come
                sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, DROP_ALL.fprog)
            sock.shutdown(socket.SHUT_RD)  # libzmq reads the end of stream and closes
        except OSError:
            return False
    return True


class PeerCap:
    """Keeps at most ``max_peers`` connections on ``sock`` (module docstring).

    ``on_gone(fd)`` is called for every connection that closes (so per-connection state can be
    forgotten; on the connection-watch thread). ``max_unread``: while more connections than
    this arrived since the owner last read the socket empty (:meth:`caught_up`), new ones are
    held off (:meth:`hold_off`). ``keep``: the fds of the connections the owner keeps (its
    subscribers); a hold-off cuts the others. Counters: ``accepted``, ``refused`` (cut at
    accept), ``closed``, ``accept_events`` (every accept event, for connections gone before it
    was read too).
    """

    def __init__(self, owner: str, sock: zmq.Socket, max_peers: int,
                 on_gone: Callable[[int], None] | None = None,
                 keep: Callable[[], set[int]] | None = None,
                 max_unread: int | None = None) -> None:
        self._owner = owner
        self._sock = sock
        self._max = max_peers
        self._on_gone = on_gone
        self._keep = keep
        self._live: dict[int, object] = {}  # fd -> peer address (the watch thread's)
        self._log = RateLimitedLog(logger)
        self.accepted = 0
        self.refused = 0
        self.closed = 0
        self.turn_since: float | None = None  # the owner's turn in progress (turn_started)
        self.stuck_cuts = 0  # connections cut by a hold-off (not kept by the owner)
        self.monitor: zmq.Socket | None = sock.get_monitor_socket(_EVENTS)
        # The owner's wake-up: a byte after each batch of connection events (a pipe: the owner
        # polls it with its socket; the gate and the watch thread never block on it).
        self._signal_r, self._signal_w = os.pipe()
        os.set_blocking(self._signal_r, False)
        os.set_blocking(self._signal_w, False)
        # The count of accepts and the hold (wire/conn_gate.py): compiled, it reads the monitor
        # itself; a PyGate is read by the watch thread (poll_socket).
        self._gate = open_gate(self.monitor, max_unread, self._signal_w)
        self.poll_socket: zmq.Socket | None = (
            None if is_compiled(self._gate) else self.monitor)
        WATCH.add(self)

    @property
    def signal_fd(self) -> int:
        """Readable after connection events (the owner polls it; -1 once closed)."""
        return self._signal_r

    def drain(self) -> None:
        """The owner's thread, when :attr:`signal_fd` is readable: take the wake-ups."""
        if self._signal_r >= 0:
            with contextlib.suppress(BlockingIOError, OSError):
                while os.read(self._signal_r, 4096):
                    pass

    def _signal(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # full: a wake-up is pending
            os.write(self._signal_w, b"\0")

    @property
    def accept_events(self) -> int:
        """Every ACCEPTED event, a connection already gone when read included (a peer that
        resets at once still leaves libzmq its queued messages to read:
        wire/listen_brake.py)."""
        return int(self._gate.state()["accept_events"])

    @property
    def pauses(self) -> int:
        """Times new connections were held off."""
        return int(self._gate.state()["holds"])

    @property
    def listening(self) -> tuple[int, ...]:
        """The socket's listening TCP fds (LISTENING events), which a hold filters."""
        return tuple(self._gate.state()["listening"])

    @property
    def refuse_new(self) -> bool:
        """Set while the owner is behind (a flood); cleared once it caught up."""
        return bool(self._gate.state()["holding"])

    @refuse_new.setter
    def refuse_new(self, value: bool) -> None:
        """While set, connections that still get in are cut at accept, and the kernel drops
        new connection attempts on TCP endpoints (a drop-all socket filter on the listening
        socket): libzmq accepts every connection and takes in all it sends before the owner
        can cut it, so a churn of connections would otherwise outrun the owner. Peers retry
        (TCP resends its SYN; ZMQ reconnects) and get in once the filter is gone."""
        self._gate.set_hold(value)

    @property
    def live(self) -> int:
        return len(self._live)

    def address(self, fd: int) -> object:
        """The peer address of the connection kept on ``fd`` (None if none is kept there): no
        system call, so the guard asks this first (libzmq reports a connection's
        DISCONNECTED before it closes the fd, so an fd is never kept under an old address
        once a new connection has it and its events were read)."""
        return self._live.get(fd)

    def connections(self) -> list[tuple[int, object]]:
        """``(fd, peer address)`` of every connection kept now."""
        return list(self._live.items())

    def stats(self) -> dict[str, int]:
        return {"connections_accepted": self.accepted, "connections_refused": self.refused,
                "connections_closed": self.closed, "connections_live": len(self._live),
                "connections_paused": self.pauses, "connections_cut_while_stuck": self.stuck_cuts}

    def turn_started(self) -> None:
        """The owner begins a turn on the socket (its thread)."""
        self.turn_since = time.monotonic()

    def turn_ended(self) -> None:
        self.turn_since = None

    def caught_up(self) -> None:
        """The owner read the socket and found nothing left (its thread): connections are
        let in again and counted from here."""
        self._gate.caught_up()

    def hold_off(self, why: str) -> None:
        """Hold new connections off until :meth:`caught_up`; with ``keep``, also cut every
        connection accepted on this socket's TCP ports that the owner does not keep (found
        among the process's fds: libzmq may have accepted some whose events are not read
        yet). On the watch thread (a flood, a stuck turn) or the owner's."""
        if not self._gate.set_hold(True):
            return
        self._cut_unkept(why)

    def _cut_unkept(self, why: str) -> None:
        self._signal()  # the owner's next turn lifts the hold if it finds the socket read
        self._log.log(logging.WARNING, "peer-hold", "%s: holding new connections off: %s",
                      self._owner, why)
        if self._keep is None:
            return
        keep = self._keep()
        listening = set(self.listening)
        ports = set()
        for fd in listening:
            sock = borrow(fd)
            if sock is not None:
                with sock, contextlib.suppress(OSError):
                    ports.add(sock.getsockname()[1])
        if not ports:
            return
        for fd in _stream_fds():
            if fd in keep or fd in listening:
                continue
            sock = borrow(fd)
            if sock is None:
                continue
            with sock:
                try:
                    if (sock.family not in (socket.AF_INET, socket.AF_INET6)
                            or sock.getsockname()[1] not in ports
                            or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                        continue
                    address = sock.getpeername()
                except OSError:
                    continue
            if cut_connection(fd, address):
                self.stuck_cuts += 1

    def read_events(self) -> bool:
        """Take the connection events the gate read (the watch thread's alone; a PyGate is
        read first) and keep the books: connections kept, cut over the cap, gone; the cuts a
        hold by the gate calls for. True when more may be waiting."""
        gate = self._gate
        more = gate.pump() if isinstance(gate, PyGate) else False
        events, held_at = gate.take()
        if held_at:
            self._cut_unkept(f"{held_at} connections arrived since it was last read empty")
        for event, fd in events:
            if event == zmq.EVENT_ACCEPTED:
                WATCH.arm()
                self._accept(fd)
            elif event == zmq.EVENT_DISCONNECTED and self._live.pop(fd, None):
                self.closed += 1
                if self._on_gone is not None:
                    self._on_gone(fd)
        if events:
            self._signal()
        return more

    def let_go(self) -> None:
        """Stop reading the monitor: once this returns, neither the compiled gate's thread nor
        the watch thread touches it (close; ConnWatch.release)."""
        self._gate.close()
        WATCH.remove(self)

    def close(self) -> None:
        """Stop monitoring and close the monitor socket (the owner, before ``sock`` closes);
        idempotent."""
        monitor = self.monitor
        if monitor is None:
            return
        self.let_go()
        self.monitor = self.poll_socket = None
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        monitor.close(linger=0)
        fds = (self._signal_r, self._signal_w)
        self._signal_r = self._signal_w = -1
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _accept(self, fd: int) -> None:
        address = peer_address(fd)
        if address is None:
            return  # already gone
        self.accepted += 1
        if len(self._live) >= self._max and fd not in self._live:
            self._prune()
        holding = self.refuse_new
        if not holding and (len(self._live) < self._max or fd in self._live):
            self._live[fd] = address
            return
        self.refused += 1
        why = ("its socket is behind with a flood" if holding else
               f"{self._max} connections are open already (the most it keeps)")
        self._log.log(logging.WARNING, "peer-cap", "%s: refused the connection from %s: %s",
                      self._owner, saferepr(address, 80), why)
        cut_connection(fd, address)

    def _prune(self) -> None:
        """Forget connections that are gone though no event said so (at the cap only: one
        ``getpeername`` per connection kept)."""
        for fd, address in list(self._live.items()):
            if peer_address(fd) != address:
                del self._live[fd]
                self.closed += 1
                if self._on_gone is not None:
                    self._on_gone(fd)

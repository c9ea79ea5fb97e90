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
process's connection-watch thread (:mod:`kvbm_plugin.wire.conn_watch`), never by the owner: an
owner's turn can stay inside libzmq for seconds while connections keep arriving; that thread
signals the owner through ``signal_fd`` after each batch of events it read. The monitor
socket must be read: libzmq's I/O thread waits when its queue is full (``src/socket_base.cpp``,
``monitor_event`` sends blocking), so a monitor nobody reads stalls every socket of the context.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin._util.saferepr import saferepr
from kvbm_plugin.wire.conn_watch import WATCH

logger = logging.getLogger(__name__)

RCVBUF_BYTES = 4096  # SO_RCVBUF of a guarded socket's connections (Linux doubles it)
EVENTS_PER_CALL = 1024  # monitor events read per service call (each a few bytes)
_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_LISTENING
           | zmq.EVENT_CLOSED)  # LISTENING, CLOSED: the listening socket's fd
_SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)  # Linux
_SO_DETACH_FILTER = getattr(socket, "SO_DETACH_FILTER", 27)


def limit_receive_buffer(sock: zmq.Socket) -> None:
    """Give ``sock``'s connections a small kernel receive buffer (before bind): the bytes a
    peer can have waiting when it is cut. Inbound traffic on our publishing and replay sockets
    is subscriptions and 8-byte requests, so this costs no throughput."""
    sock.setsockopt(zmq.RCVBUF, RCVBUF_BYTES)


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _DropAll:
    """A one-instruction classic BPF program that drops every packet (``BPF_RET|BPF_K 0``);
    the kernel copies it at attach, the program array stays alive here for the pointer."""

    def __init__(self) -> None:
        self.program = (_Filter * 1)(_Filter(0x06, 0, 0, 0))
        self.fprog = struct.pack("HL", 1, ctypes.addressof(self.program))


_DROP_ALL = _DropAll()


def _borrow(fd: int) -> socket.socket | None:
    """A socket object on a duplicate of ``fd`` (closing it leaves ``fd`` open), or None when
    ``fd`` is not a stream socket (any more)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
    if sock.type != socket.SOCK_STREAM:
        sock.close()
        return None
    return sock


def peer_address(fd: int) -> object:
    """The remote address of the stream socket on ``fd`` (read through a duplicate; the fd
    stays libzmq's), or None when it is not a connected stream socket."""
    sock = _borrow(fd)
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


def _filter_listener(fd: int, drop: bool) -> bool:
    """Attach (``drop``) or detach the drop-all filter on the TCP listening socket on ``fd``
    (through a duplicate; the fd stays libzmq's). Linux runs a listening socket's filter on
    every SYN before the handshake, so nothing is queued for libzmq to accept. False when
    ``fd`` is not a listening TCP socket (an ipc endpoint, or closed meanwhile)."""
    sock = _borrow(fd)
    if sock is None:
        return False
    with sock:
        try:
            if (sock.family not in (socket.AF_INET, socket.AF_INET6)
                    or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                return False
            if drop:
                sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, _DROP_ALL.fprog)
            else:
                with contextlib.suppress(OSError):  # ENOENT: none attached
                    sock.setsockopt(socket.SOL_SOCKET, _SO_DETACH_FILTER, 0)
        except OSError:
            return False
    return True


def cut_connection(fd: int, address: object) -> bool:
    """Cut the connection on ``fd`` if it still goes to ``address`` (module docstring); the
    fd stays libzmq's to close. Returns whether it was cut."""
    sock = _borrow(fd)
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
                sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, _DROP_ALL.fprog)
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
        self._max_unread = max_unread
        self._live: dict[int, object] = {}  # fd -> peer address (the watch thread's)
        self._log = RateLimitedLog(logger)
        self.accepted = 0
        self.refused = 0
        self.closed = 0
        # Every ACCEPTED event, a connection already gone when read included (a peer that
        # resets at once still leaves libzmq its queued messages to read: wire/listen_brake.py).
        self.accept_events = 0
        self._accepts_when_empty = 0  # accept_events when the owner last read it empty
        self._refuse_new = False
        self._hold_lock = threading.Lock()
        self._listening: set[int] = set()  # the socket's listening fds (LISTENING events)
        self.pauses = 0  # times new connections were held off (refuse_new set)
        self.turn_since: float | None = None  # the owner's turn in progress (turn_started)
        self.stuck_cuts = 0  # connections cut by a hold-off (not kept by the owner)
        self.monitor: zmq.Socket | None = sock.get_monitor_socket(_EVENTS)
        # The owner's wake-up: a byte after each batch of connection events (a pipe: the owner
        # polls it with its socket; the watch thread never blocks on it).
        self._signal_r, self._signal_w = os.pipe()
        os.set_blocking(self._signal_r, False)
        os.set_blocking(self._signal_w, False)
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
    def refuse_new(self) -> bool:
        """Set while the owner is behind (a flood); cleared once it caught up."""
        return self._refuse_new

    @refuse_new.setter
    def refuse_new(self, value: bool) -> None:
        """While set, connections that still get in are cut at accept, and the kernel drops
        new connection attempts on TCP endpoints (a drop-all socket filter on the listening
        socket): libzmq accepts every connection and takes in all it sends before the owner
        can cut it, so a churn of connections would otherwise outrun the owner. Peers retry
        (TCP resends its SYN; ZMQ reconnects) and get in once the filter is gone."""
        if value == self._refuse_new:
            return
        with self._hold_lock:  # the owner's thread and the watch thread's both set it
            if value == self._refuse_new:
                return
            self._refuse_new = value
            if value:
                self.pauses += 1
            for fd in list(self._listening):
                if not _filter_listener(fd, value):
                    self._listening.discard(fd)

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
        self._accepts_when_empty = self.accept_events
        self.refuse_new = False

    def hold_off(self, why: str) -> None:
        """Hold new connections off until :meth:`caught_up`; with ``keep``, also cut every
        connection accepted on this socket's TCP ports that the owner does not keep (found
        among the process's fds: libzmq may have accepted some whose events are not read
        yet). On the watch thread (a flood, a stuck turn) or the owner's."""
        if self.refuse_new:
            return
        self.refuse_new = True
        self._signal()  # the owner's next turn lifts the hold if it finds the socket read
        self._log.log(logging.WARNING, "peer-hold", "%s: holding new connections off: %s",
                      self._owner, why)
        if self._keep is None:
            return
        keep = self._keep()
        ports = set()
        for fd in list(self._listening):
            sock = _borrow(fd)
            if sock is not None:
                with sock, contextlib.suppress(OSError):
                    ports.add(sock.getsockname()[1])
        if not ports:
            return
        for fd in _stream_fds():
            if fd in keep or fd in self._listening:
                continue
            sock = _borrow(fd)
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
        """Read up to :data:`EVENTS_PER_CALL` connection events (never blocks; the watch
        thread's alone); True when more may be waiting."""
        monitor = self.monitor
        if monitor is None:
            return False
        for read in range(EVENTS_PER_CALL):
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                if read:
                    self._signal()
                return False
            event = parse_monitor_message(frames)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_LISTENING:
                with self._hold_lock:
                    if _filter_listener(fd, self._refuse_new) or not self._refuse_new:
                        self._listening.add(fd)
            elif event["event"] == zmq.EVENT_CLOSED:  # the listener closed (unbind)
                self._listening.discard(fd)
            elif event["event"] == zmq.EVENT_ACCEPTED:
                self.accept_events += 1
                WATCH.arm()
                self._accept(fd)
                if (self._max_unread is not None and not self.refuse_new
                        and self.accept_events - self._accepts_when_empty > self._max_unread):
                    self.hold_off(f"{self.accept_events - self._accepts_when_empty} "
                                  "connections arrived since it was last read empty")
            elif event["event"] == zmq.EVENT_DISCONNECTED and self._live.pop(fd, None):
                self.closed += 1
                if self._on_gone is not None:
                    self._on_gone(fd)
        self._signal()
        return True

    def close(self) -> None:
        """Stop monitoring and close the monitor socket (the owner, before ``sock`` closes);
        idempotent."""
        monitor = self.monitor
        if monitor is None:
            return
        WATCH.remove(self)  # the watch thread no longer touches the monitor from here
        self.monitor = None
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
        if not self.refuse_new and (len(self._live) < self._max or fd in self._live):
            self._live[fd] = address
            return
        self.refused += 1
        why = ("its socket is behind with a flood" if self.refuse_new else
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

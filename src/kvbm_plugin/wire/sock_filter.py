"""The drop-all socket filter, and borrowing a socket fd that libzmq owns.

A classic BPF program of one instruction that drops every packet: on a TCP listening socket
Linux runs it on every SYN before the handshake (nothing is queued for libzmq to accept); on a
connection it drops every packet still to come (``wire/peers.py``'s ``cut_connection``). Used by
:mod:`kvbm_plugin.wire.peers` and :mod:`kvbm_plugin.wire.conn_gate` (the compiled gate,
``_gate_c.c``, attaches the same program itself). No torch or TensorRT-LLM import.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import struct

SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)  # Linux
SO_DETACH_FILTER = getattr(socket, "SO_DETACH_FILTER", 27)


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _DropAll:
    """A one-instruction classic BPF program that drops every packet (``BPF_RET|BPF_K 0``);
    the kernel copies it at attach, the program array stays alive here for the pointer."""

    def __init__(self) -> None:
        self.program = (_Filter * 1)(_Filter(0x06, 0, 0, 0))
        self.fprog = struct.pack("HL", 1, ctypes.addressof(self.program))


DROP_ALL = _DropAll()


def borrow(fd: int) -> socket.socket | None:
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


def filter_listener(fd: int, drop: bool) -> bool:
    """Attach (``drop``) or detach the drop-all filter on the TCP listening socket on ``fd``
    (through a duplicate; the fd stays libzmq's). Linux runs a listening socket's filter on
    every SYN before the handshake, so nothing is queued for libzmq to accept. False when
    ``fd`` is not a listening TCP socket (an ipc endpoint, or closed meanwhile)."""
    sock = borrow(fd)
    if sock is None:
        return False
    with sock:
        try:
            if (sock.family not in (socket.AF_INET, socket.AF_INET6)
                    or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                return False
            if drop:
                sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, DROP_ALL.fprog)
            else:
                with contextlib.suppress(OSError):  # ENOENT: none attached
                    sock.setsockopt(socket.SOL_SOCKET, SO_DETACH_FILTER, 0)
        except OSError:
            return False
    return True



"""A raw ZMTP 3.0 peer for tests that play an outsider: it sends exactly the frames a test
asks for (subscriptions of any size or number, replay requests), keeps no subscription state of
its own (a SUB or XSUB would hold every subscription it sends) and never reconnects by itself."""

from __future__ import annotations

import contextlib
import socket
import struct


def _greeting() -> bytes:
    # signature, version 3.0, mechanism NULL, as-server 0, filler (ZMTP 3.0, 23/ZMTP)
    return (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
            + b"\x00" + b"\x00" * 31)


def _frame(body: bytes, *, more: bool = False, command: bool = False) -> bytes:
    flags = (0x01 if more else 0) | (0x04 if command else 0)
    if len(body) < 256:
        return bytes((flags, len(body))) + body
    return bytes((flags | 0x02,)) + struct.pack(">Q", len(body)) + body


class RawPeer:
    """One TCP connection to ``host:port`` that completes a NULL handshake as ``socket_type``
    (b"SUB", b"DEALER"; raising OSError if the other side refuses it) and then sends what it
    is told. ``send`` returns False once the other
    side has cut the connection (or stopped reading for ``timeout`` seconds)."""

    def __init__(self, host: str, port: int, socket_type: bytes, timeout: float = 2.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        name = b"Socket-Type"
        ready = (b"\x05READY" + bytes((len(name),)) + name
                 + struct.pack(">I", len(socket_type)) + socket_type)
        self.sock.sendall(_greeting() + _frame(ready, command=True))
        # The other side's greeting and READY first: libzmq takes a frame that arrives before
        # it has sent its own READY for a handshake command, and drops the connection.
        self._read_exactly(64)
        flags = self._read_exactly(1)[0]
        size = (struct.unpack(">Q", self._read_exactly(8))[0] if flags & 0x02
                else self._read_exactly(1)[0])
        if not flags & 0x04 or not self._read_exactly(size).startswith(b"\x05READY"):
            raise OSError("no READY from the other side")
        self.alive = True

    def _read_exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionResetError("closed during the handshake")
            data += chunk
        return data

    def send(self, *frames: bytes) -> bool:
        if not self.alive:
            return False
        data = b"".join(_frame(f, more=i < len(frames) - 1) for i, f in enumerate(frames))
        try:
            self.sock.sendall(data)
        except OSError:  # reset, broken pipe or timeout: cut (or not reading)
            self.alive = False
        return self.alive

    def cut(self, timeout: float = 2.0) -> bool:
        """Whether the other side closed the connection within ``timeout`` seconds."""
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(65536):
                pass
        except TimeoutError:
            return False
        except OSError:
            return True
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

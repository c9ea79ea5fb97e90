"""An outsider's connection churn, run in its own process by the memory-bound tests.

Each connection completes a ZMTP handshake, sends a burst and leaves, again and again, for the
given seconds: ``sub`` (200 distinct 159-byte subscriptions that can never match), ``replay``
(200 replay requests from seq 0), ``push`` (1024 messages of 500 bytes that are no report).
A process of its own, so that it is not slowed by the test's GIL (an in-process flooder let
the owning thread keep up, and hid the backlog these tests are about).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _zmtp import RawPeer  # noqa: E402

_TYPES = {"sub": b"SUB", "replay": b"DEALER", "push": b"PUSH"}


def start(kind: str, port: int, seconds: float) -> subprocess.Popen[bytes]:
    """The churn of ``kind`` against ``127.0.0.1:port`` for ``seconds``, in a new process."""
    if kind not in _TYPES:
        raise ValueError(f"kind={kind!r}: one of {sorted(_TYPES)}")
    return subprocess.Popen([sys.executable, __file__, kind, str(port), str(seconds)])


def _burst(kind: str, n: int) -> list[tuple[bytes, ...]]:
    if kind == "sub":
        return [(b"\x01" + n.to_bytes(4, "big") + i.to_bytes(4, "big") + b"x" * 150,)
                for i in range(200)]
    if kind == "replay":
        return [(b"", (0).to_bytes(8, "big"))] * 200
    return [(b"\x07" * 500,)] * 1024


def main(kind: str, port: int, seconds: float) -> None:
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        with contextlib.suppress(OSError):
            peer = RawPeer("127.0.0.1", port, _TYPES[kind], timeout=0.2)
            for frames in _burst(kind, n):
                if not peer.send(*frames):
                    break
            peer.close()
            n += 1


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))

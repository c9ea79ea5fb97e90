"""Test helpers: an independent decoder (typed msgspec structs from vLLM's field list), free
ports, and a SUB that waits out the slow joiner by polling with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import zmq

from kvbm_plugin.testing import local_server

# --- vLLM wire structs, written from its field list (kv_events.py), strict types ----------


class EventBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int


class KVCacheEvent(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


_decoder = msgspec.msgpack.Decoder(EventBatch)
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1


def decode(payload: bytes) -> EventBatch:
    """Decode and check the wire invariants every consumer relies on."""
    batch = _decoder.decode(payload)
    for ev in batch.events:
        if isinstance(ev, (BlockStored, BlockRemoved)):
            assert all(I64_MIN <= h <= I64_MAX for h in ev.block_hashes)
            assert ev.medium == "GPU" or ev.medium in ("CPU", "DISK")
        if isinstance(ev, BlockStored):
            assert ev.parent_block_hash is None or I64_MIN <= ev.parent_block_hash <= I64_MAX
            assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
    return batch


def free_port() -> int:
    """A free loopback port, never one this test process was handed lately (two taken in a
    row, for publish and replay, must differ)."""
    return local_server.free_port("127.0.0.1")


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.005)  # poll interval, not synchronisation: cond decides
    raise AssertionError(f"timed out waiting for {what}")


def join_sub(ctx: zmq.Context, address: str, probe: Callable[[], object],
             timeout: float = 10.0) -> tuple[zmq.Socket, list[list[bytes]]]:
    """A SUB connected to ``address`` that has received at least one probe message.

    Returns the socket and the probe messages seen (their seqs are consumed).
    """
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(address)
    seen: list[list[bytes]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        probe()
        if sub.poll(20):
            while sub.poll(50):
                seen.append(sub.recv_multipart())
            return sub, seen
    sub.close()
    raise AssertionError(f"SUB never joined {address}")


def recv(sub: zmq.Socket, timeout_ms: int = 5000) -> list[bytes]:
    if not sub.poll(timeout_ms):
        raise AssertionError("no message within deadline")
    return sub.recv_multipart()


def wait_all_sent(stats: Callable[[], dict[str, int]], timeout: float = 10.0) -> int:
    """Wait until a GPU-tier publisher sent (or counted as lost) every batch it accepted, and
    return how many it sent: a batch ``publish`` deferred to the publisher's service thread
    (wire/send_gate.py) is accepted at once and sent moments later. ``stats``: the event
    sink's ``stats`` (``publisher_*`` keys)."""
    deadline = time.monotonic() + timeout
    while True:
        st = stats()
        if st["publisher_batches_accepted"] == (st["publisher_batches_published"]
                                                + st["publisher_lost_batches"]):
            return st["publisher_batches_published"]
        assert time.monotonic() < deadline, f"batches still unsent: {st}"
        time.sleep(0.005)  # poll interval of a deadline-bounded wait, not a synchronisation


def tcp_connections(port: int, side: str) -> dict[int, tuple[object, object]]:
    """This process's connected TCP sockets on ``port``: ``side`` "local" (accepted there)
    or "peer" (connected to it); fd -> (local address, peer address)."""
    import os
    import socket

    from kvbm_plugin.wire.sock_filter import borrow

    found: dict[int, tuple[object, object]] = {}
    for name in os.listdir("/proc/self/fd"):
        sock = borrow(int(name))
        if sock is None:
            continue
        with sock:
            try:
                if sock.family != socket.AF_INET \
                        or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                local, peer = sock.getsockname(), sock.getpeername()
            except OSError:
                continue
        if (local if side == "local" else peer)[1] == port:
            found[int(name)] = (local, peer)
    return found


def silence(fd: int) -> None:
    """Make the TCP connection on ``fd`` hear nothing more (every packet to it dropped, no
    FIN, no reset: as when its peer's host goes away); the fd stays its owner's."""
    import socket

    from kvbm_plugin.wire.sock_filter import DROP_ALL, SO_ATTACH_FILTER, borrow

    sock = borrow(fd)
    assert sock is not None, f"fd {fd} is no stream socket"
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, DROP_ALL.fprog)


def short_keepalive(monkeypatch) -> None:  # noqa: ANN001
    """The sockets made from here drop a silent connection within about 2 s (wire/reconnect.py:
    shipped, about 25 s)."""
    from kvbm_plugin.wire import reconnect

    monkeypatch.setattr(reconnect, "KEEPALIVE_IDLE_S", 1)
    monkeypatch.setattr(reconnect, "KEEPALIVE_INTVL_S", 1)
    monkeypatch.setattr(reconnect, "KEEPALIVE_CNT", 1)
    monkeypatch.setattr(reconnect, "MAXRT_MS", 2000)

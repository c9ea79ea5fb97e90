"""A caller-thread publisher whose subscription reader gets no CPU: the flood stays out of libzmq.

libzmq moves a connection's queued subscriptions into the XPUB's own queue whenever a send
processes the socket's commands, however far behind the thread that reads them is. The GPU-tier
publisher sends on TensorRT-LLM's thread and reads subscriptions on its service thread, so a
starved service thread let a 60 s flood grow the heap by 76 MiB (docs/operations.md). The send
gate (wire/send_gate.py) defers a send while commands wait, to the service thread, which reads
the subscriptions first. Here the service thread is held out of its loop (as a starved thread
is) while an outsider floods and the caller keeps publishing.
"""

from __future__ import annotations

import threading
import time

import zmq
from _kvwire import decode, recv, wait_until
from _zmtp import RawPeer
from test_socket_bounds import TOPIC, _make, _subscriber, heap_in_use

FLOOD = 20_000  # distinct 200-byte subscriptions (none can match): 4 MB


def test_a_starved_service_thread_leaves_the_flood_out_of_libzmq_and_loses_nothing(
        ctx, tcp, publishers, monkeypatch) -> None:  # noqa: ANN001
    fed = threading.Event()  # cleared: the service thread gets no turn (starved)
    fed.set()
    parked = threading.Event()
    poll = zmq.Poller.poll

    def starvable(poller, timeout=None):  # noqa: ANN001, ANN202
        if threading.current_thread().name.startswith("kvbm-zmq-service") \
                and not fed.is_set():
            parked.set()
            fed.wait(60)
        return poll(poller, timeout)

    monkeypatch.setattr(zmq.Poller, "poll", starvable)
    owner = _make("caller", tcp, publishers)
    pub = owner.pub
    sub = _subscriber(ctx, owner, tcp[0].connect, TOPIC.encode())  # joined, seq so far read
    first = pub.stats()["batches_accepted"]

    fed.clear()
    pub._wake()  # the service thread's next poll parks it
    wait_until(parked.is_set, what="the service thread parked")
    before = heap_in_use()
    sent = [0]

    def flood() -> None:
        peer = RawPeer("127.0.0.1", tcp[0].port, b"SUB")
        try:
            for i in range(FLOOD):
                if not peer.send(b"\x01" + i.to_bytes(4, "big") + b"x" * 196):
                    return  # not read for 2 s: held back by TCP, as it should be
                sent[0] += 1
        finally:
            peer.close()

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    published = 0
    deadline = time.monotonic() + 20
    while (flooder.is_alive() or published < 50) and time.monotonic() < deadline:
        owner.publish(published)  # the executor thread keeps publishing meanwhile
        published += 1
        flooder.join(0.001)  # paces the batches like engine iterations
    assert not flooder.is_alive()
    grown = heap_in_use() - before
    stats = pub.stats()
    assert stats["sends_deferred"] > 0
    # Nothing read meanwhile: every subscription libzmq took in is still held (sends made at
    # once took the whole flood in: 72 MiB, ~4 KiB per subscription).
    assert grown < 8 << 20, (grown, sent[0])  # measured 0.2 MiB (Python's arenas: 1 MiB each)

    fed.set()  # the service thread runs again: reads (cuts the flooder), then sends
    last = -1
    got = 0
    while got < published:
        frames = recv(sub)
        seq = int.from_bytes(frames[1], "big")
        assert last < 0 or seq == last + 1  # no gap: every deferred batch went out, in order
        last = seq
        got += seq >= first
    stats = pub.stats()
    assert stats["lost_batches"] == 0 and stats["queue_depth"] == 0


def test_publish_never_waits_for_the_service_threads_turn(ctx, tcp, publishers) -> None:
    """The service thread holds the send lock across a turn, which a flood can make long: the
    caller's thread defers its batches instead of waiting, and they go out in order."""
    owner = _make("caller", tcp, publishers)
    pub = owner.pub
    sub = _subscriber(ctx, owner, tcp[0].connect, TOPIC.encode())
    assert pub._send_lock.acquire(timeout=5)  # as the service thread's turn does
    caller = threading.Thread(target=lambda: [owner.publish(100 + i) for i in range(3)])
    try:
        caller.start()
        caller.join(5.0)
        assert not caller.is_alive(), "publish waited for the send lock"
        assert len(pub._gate) == 3
    finally:
        pub._send_lock.release()
        caller.join(5.0)
    pub._wake()
    got = []
    while len(got) < 3:
        frames = recv(sub)
        events = decode(frames[2]).events
        if events:
            got.append(events[0].block_hashes[0])
    assert got == [100, 101, 102]

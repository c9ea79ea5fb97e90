"""A replay ROUTER flooded with short connections holds a bounded amount (wire/listen_brake.py).

libzmq frees a connection only once the socket has read what it queued, so an outsider who
connects, queues requests and leaves, faster than the owning thread reads, grew a publisher by
about 60 KiB per connection until the brake stopped listening while the reader is behind.
"""

from __future__ import annotations

import socket
import time

import _churn as churn
import zmq
from _kvwire import decode, recv, wait_until
from _zmtp import RawPeer
from test_socket_bounds import TOPIC, _make, _subscriber, heap_in_use

from kvbm_plugin.wire.events import END_SEQ
from kvbm_plugin.wire.listen_brake import MAX_BEHIND


def _answer(ctx: zmq.Context, address: str, owner, timeout: float = 10.0) -> list[int]:
    """A legitimate requester's replay from seq 0: the seqs answered before the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    seqs: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        owner.tick()
        if not dealer.poll(10):
            continue
        frames = dealer.recv_multipart()
        if frames[2] == END_SEQ:
            return seqs
        seqs.append(int.from_bytes(frames[2], "big"))
        decode(frames[3])
    raise AssertionError("the replay was never answered")


def test_a_flood_of_short_replay_connections_holds_a_bounded_amount(ctx, tcp, publishers) -> None:
    """Before the brake: 145 MiB after 4 s of this flood on a 2-core machine, 260 MiB at 8 s."""
    owner = _make("caller", tcp, publishers)
    sub = _subscriber(ctx, owner, tcp[0].connect, TOPIC.encode()[:3])
    before = heap_in_use()
    flooder = churn.start("replay", tcp[1].port, 4)
    peak = published = 0
    try:
        while flooder.poll() is None:
            owner.publish(published)
            published += 1
            peak = max(peak, heap_in_use() - before)
            time.sleep(0.002)  # an engine iteration's pace, not synchronisation
    finally:
        flooder.kill()
        flooder.wait()
    assert peak < 64 << 20, f"the flood grew the heap by {peak >> 20} MiB"  # as the soak
    got = newest = 0
    while got < published:  # the live stream went on
        frames = recv(sub)
        newest = int.from_bytes(frames[1], "big")
        if decode(frames[2]).events:
            got += 1
    stats = owner.pub.stats()
    assert stats["replay_requests"] > 0
    wait_until(lambda: not owner.pub.stats()["replay_listen_closed"], what="listening again")
    # The answers queued for the flooder's requests end once their peers are found gone.
    wait_until(lambda: (lambda st: not st["replay_active"] and not st["replay_waiting"])(
        owner.pub.stats()), what="the flood's answers to end")
    answer = _answer(ctx, tcp[1].connect, owner)
    assert answer[-1] == newest and answer == list(range(answer[0], newest + 1))


def test_a_reader_behind_stops_listening_until_it_has_caught_up(ctx, tcp, publishers) -> None:
    """Deterministic: connections queue requests while the owner does not read; past
    MAX_BEHIND the connection watch holds new ones off (the kernel drops their attempts), at
    the owner's next turns the brake unbinds, the reader drains what is left (which ends every
    connection), the endpoint listens again and a legitimate requester is answered."""
    owner = _make("inline", tcp, publishers)
    for i in range(3):
        owner.publish(i)
    peers = []
    try:
        def paused() -> int:
            return owner.pub.stats()["replay_connections_paused"]

        attempts = 0
        while attempts < MAX_BEHIND + 40 and not paused():
            attempts += 1
            try:
                peer = RawPeer("127.0.0.1", tcp[1].port, b"DEALER", timeout=0.5)
            except OSError:  # cut at accept (64 are kept), or no handshake (held off, or slow)
                continue
            for _ in range(20):
                peer.send(b"", (0).to_bytes(8, "big"))
            peers.append(peer)
        # The watch reads the accepts on its own thread: the hold follows the 129th.
        wait_until(lambda: paused() == 1, what="new connections held off")
        assert attempts > MAX_BEHIND
        # One turn at a time until the brake closes (the monitor's events arrive as libzmq
        # accepts; a turn reads 64 requests, so it cannot have caught up by then).
        wait_until(lambda: (owner.tick(), owner.pub.stats()["replay_listen_closed"])[1],
                   what="the brake to close")
        assert owner.pub.stats()["replay_listen_closures"] == 1

        def refused() -> bool:
            with socket.socket() as probe:
                probe.settimeout(1.0)
                return probe.connect_ex(("127.0.0.1", tcp[1].port)) != 0

        wait_until(refused, what="new connections refused")  # the unbind is asynchronous
        wait_until(lambda: (owner.tick(), not owner.pub.stats()["replay_listen_closed"])[1],
                   what="listening again")
        # Every connection ended with the listener it came in on, once its queue was read.
        assert all(peer.cut(2.0) for peer in peers)
    finally:
        for peer in peers:
            peer.close()
    assert _answer(ctx, tcp[1].connect, owner) == [0, 1, 2]

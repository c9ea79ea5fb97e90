"""Outsiders on our bound sockets: what they send or subscribe is bounded, legitimate
subscribers still get every batch byte for byte, and an allowlist keeps others out.

The outsider is a raw ZMTP peer (``_zmtp.RawPeer``): it holds none of what it sends, so the
test process's memory is the publisher's.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import _churn as churn
import pytest
import zmq
from _heap import heap_in_use, rss  # noqa: F401  (re-exported to the other wire tests)
from _kvwire import decode, free_port, recv, wait_until
from _zmtp import RawPeer

from kvbm_plugin.consolidator_config import (
    ConfigError,
    Endpoint,
    PublisherSettings,
    load_allowlist,
)
from kvbm_plugin.tiers.shared.announce import Announcer
from kvbm_plugin.wire.guard import MAX_REFUSED_PER_PEER, SubscriptionGuard
from kvbm_plugin.wire.publisher import ZmqEventPublisher

TOPIC = "kv@pod-a@model"


def removed(*hashes: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}


class _Owner:
    """Publishes through ``pub`` and, for an inline publisher, services it as its owner does."""

    def __init__(self, pub: ZmqEventPublisher, inline: bool) -> None:
        self.pub = pub
        self.inline = inline

    def publish(self, *hashes: int) -> None:
        assert self.pub.publish([removed(*hashes)] if hashes else [])

    def tick(self) -> None:
        if self.inline:
            self.pub.service_replay()


def _make(mode: str, tcp: tuple[Endpoint, Endpoint], publishers: list[ZmqEventPublisher],
          **settings: Any) -> _Owner:
    kwargs: dict[str, Any] = {"inline": True} if mode == "inline" else {"sends": mode}
    pub = ZmqEventPublisher(PublisherSettings(topic=TOPIC, **settings), tcp[0], tcp[1],
                            **kwargs)
    publishers.append(pub)
    return _Owner(pub, mode == "inline")


def _subscriber(ctx: zmq.Context, owner: _Owner, address: str, prefix: bytes) -> zmq.Socket:
    """A SUB with ``prefix`` that has received a batch (so it is joined)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, prefix)
    sub.connect(address)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        owner.tick()
        owner.publish()
        if sub.poll(20):
            while sub.poll(50):
                sub.recv_multipart()
            return sub
    raise AssertionError(f"SUB with {prefix!r} never joined")


def _flood(port: int, count: int, size: int, between: Callable[[], None]) -> int:
    """Send ``count`` distinct subscriptions of ``size`` bytes, reconnecting whenever the
    publisher cuts the connection; ``between`` runs every 256. Returns the connections used."""
    sent, connections = 0, 0
    deadline = time.monotonic() + 30
    while sent < count and time.monotonic() < deadline:
        try:
            peer = RawPeer("127.0.0.1", port, b"SUB", timeout=0.2)
        except OSError:  # reset at once: a message of an earlier (cut) connection of this
            # address was held against the new one on its reused fd (guard._peer); or no
            # answer: the reader is behind and new connections wait (the owner's turn runs)
            between()
            continue
        connections += 1
        try:
            while sent < count:
                body = sent.to_bytes(4, "big") + b"x" * (size - 4)
                if not peer.send(b"\x01" + body):
                    break
                sent += 1
                if sent % 256 == 0:
                    between()
        finally:
            peer.close()
    assert sent == count, f"only {sent} subscriptions sent in 30 s"
    return connections


@pytest.mark.parametrize("mode", ["caller", "thread", "inline"])
def test_a_subscription_flood_holds_nothing_and_legitimate_subscribers_get_every_batch(
        ctx, tcp, publishers, mode) -> None:
    owner = _make(mode, tcp, publishers)
    pub = owner.pub
    subs = {prefix: _subscriber(ctx, owner, tcp[0].connect, prefix)
            for prefix in (b"", TOPIC.encode(), b"kv@")}
    # A subscriber of another topic gets nothing (as from a PUB) and is not cut for it.
    other = ctx.socket(zmq.SUB)
    other.setsockopt(zmq.LINGER, 0)
    other.setsockopt(zmq.SUBSCRIBE, b"kv@pod-b")
    other.connect(tcp[0].connect)
    seqs: list[int] = []

    def between() -> None:
        owner.tick()
        owner.publish(len(seqs))
        seqs.append(len(seqs))

    _flood(tcp[0].port, 20_000, 200, between)
    for _ in range(20):
        between()
    stats: dict[str, int] = {}

    def settled() -> bool:
        owner.tick()
        stats.update(pub.stats())
        return (stats["subscriptions_held"] <= 4
                and stats["batches_published"] == stats["batches_accepted"])

    wait_until(settled, what=f"the flood's subscriptions freed ({mode})")
    assert stats["subscription_peers_cut"] >= 1
    assert stats["subscriptions_refused"] > MAX_REFUSED_PER_PEER
    # What libzmq held at most: far below what was sent (20 000).
    assert stats["subscriptions_held_high_water"] < 5_000
    # Every batch reached each legitimate subscriber, byte for byte what a PUB sends.
    buffered = dict(pub._buffer)
    for prefix, sub in subs.items():
        got: list[list[bytes]] = []
        while len(got) < len(seqs):
            frames = recv(sub)
            if decode(frames[2]).events:  # not a join probe
                got.append(frames)
        for frames in got:
            seq = int.from_bytes(frames[1], "big")
            assert frames == [TOPIC.encode(), frames[1], buffered[seq]], prefix
        assert [decode(f[2]).events[0].block_hashes for f in got] == [[s] for s in seqs]
    assert not other.poll(50)


def test_the_executor_thread_never_reads_subscriptions(ctx, tcp, publishers) -> None:
    """``sends="caller"``: subscriptions are read by the service thread, never by the thread
    that publishes."""
    owner = _make("caller", tcp, publishers)
    readers: set[str] = set()
    real = owner.pub._guard.service

    def spy(sock: zmq.Socket) -> bool:
        readers.add(threading.current_thread().name)
        return real(sock)

    owner.pub._guard.service = spy  # type: ignore[method-assign]
    _subscriber(ctx, owner, tcp[0].connect, b"")
    _flood(tcp[0].port, 2_000, 100, owner.publish)
    wait_until(lambda: owner.pub.stats()["subscription_peers_cut"] >= 1, what="a cut")
    assert readers == {"kvbm-zmq-service-dp0"}


def test_a_flood_of_20k_distinct_subscriptions_grows_the_process_by_a_bounded_amount(
        ctx, tcp, publishers) -> None:
    """A PUB keeps all of them (about 180 MiB for 20 000 x 250 bytes); the guarded XPUB
    keeps at most what arrives between two services and frees it when it cuts the peer."""
    owner = _make("thread", tcp, publishers)
    sub = _subscriber(ctx, owner, tcp[0].connect, b"")
    before = rss()
    _flood(tcp[0].port, 20_000, 250, owner.publish)
    owner.publish(1)  # the socket has taken in the flood once a later batch is through
    while not decode(recv(sub)[2]).events:
        pass
    grown: list[int] = []
    wait_until(lambda: grown.append(rss() - before) or grown[-1] < 64 << 20, timeout=5.0,
               what="growth under 64 MiB")


def test_an_oversized_subscription_drops_its_connection_before_it_is_held(
        tcp, publishers) -> None:
    owner = _make("thread", tcp, publishers)
    owner.publish()
    peer = RawPeer("127.0.0.1", tcp[0].port, b"SUB")
    try:
        peer.send(b"\x01" + b"y" * 4096)
        assert peer.cut(5.0)  # libzmq's MAXMSGSIZE: the connection goes, nothing is held
    finally:
        peer.close()
    owner.publish()
    stats = owner.pub.stats()
    assert stats["subscriptions_refused"] == 0 and stats["subscriptions_held"] == 0


def test_a_hostile_replay_requester_is_bounded(ctx, tcp, publishers) -> None:
    owner = _make("thread", tcp, publishers)
    for i in range(50):
        owner.publish(i)
    big = RawPeer("127.0.0.1", tcp[1].port, b"DEALER")
    try:
        big.send(b"", b"z" * (1 << 20))  # a request frame of 1 MiB: dropped with its peer
        assert big.cut(5.0)
    finally:
        big.close()
    flood = RawPeer("127.0.0.1", tcp[1].port, b"DEALER")
    try:
        for _ in range(5_000):  # never reads an answer
            if not flood.send(b"", (0).to_bytes(8, "big")):
                break
        sub = _subscriber(ctx, owner, tcp[0].connect, b"")
        owner.publish(99)  # the live stream goes on meanwhile
        frames = recv(sub)
        while not decode(frames[2]).events:
            frames = recv(sub)
        assert decode(frames[2]).events[0].block_hashes == [99]
        stats = owner.pub.stats()
        assert stats["replay_bad_requests"] == 0
        assert stats["replay_active"] <= 4 and stats["replay_waiting"] <= 64
    finally:
        flood.close()


@pytest.mark.parametrize("which", ["publisher", "replay"])
def test_connections_beyond_the_cap_are_cut(tcp, publishers, which) -> None:
    """Idle connections cost memory too: each socket keeps at most ``max_peers``."""
    owner = _make("thread", tcp, publishers, max_peers=3)
    port = tcp[0].port if which == "publisher" else tcp[1].port
    kind = b"SUB" if which == "publisher" else b"DEALER"
    peers: list[RawPeer] = []
    refused_at_handshake = 0
    prefix = "" if which == "publisher" else "replay_"
    try:
        for _ in range(8):
            try:
                peers.append(RawPeer("127.0.0.1", port, kind))
            except OSError:  # cut before its handshake ended
                refused_at_handshake += 1
        wait_until(lambda: owner.pub.stats()[f"{prefix}connections_refused"] == 5,
                   what="5 connections refused")
        assert refused_at_handshake + sum(peer.cut(0.3) for peer in peers) == 5
        assert owner.pub.stats()[f"{prefix}connections_live"] == 3
    finally:
        for peer in peers:
            peer.close()
    # Once they are gone, new ones are kept again.
    wait_until(lambda: owner.pub.stats()[f"{prefix}connections_live"] == 0, what="all gone")
    again = RawPeer("127.0.0.1", port, kind)
    try:
        wait_until(lambda: owner.pub.stats()[f"{prefix}connections_live"] == 1, what="kept")
        assert not again.cut(0.2)
    finally:
        again.close()


def test_the_announce_endpoint_holds_only_what_can_match(ctx) -> None:
    port = free_port()
    announcer = Announcer(f"tcp://127.0.0.1:{port}", [], secret=b"s" * 32, allow=())
    announcer.open()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        wait_until(lambda: (announcer.receive(), announcer.stats()["subscriptions"])[1] >= 1,
                   what="the peer's subscription")
        _flood(port, 5_000, 100, announcer.receive)
        stats: dict[str, int] = {}

        def settled() -> bool:
            announcer.receive()
            stats.update(announcer.stats())
            return stats["subscriptions_held"] <= 1 and stats["subscription_peers_cut"] >= 1

        wait_until(settled, what="the flood freed")
        assert announcer.pub is not None
        announcer.pub.send(b"hello")
        assert recv(sub) == [b"hello"]
    finally:
        announcer.close()


def test_subscriptions_of_an_inproc_peer_apply_without_a_connection_to_cut(ctx) -> None:
    guard = SubscriptionGuard("t", b"kv@a")
    pub = ctx.socket(zmq.XPUB)
    guard.configure(pub)
    pub.bind("inproc://kvbm-guard-inproc")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.SUBSCRIBE, b"other")
    sub.connect("inproc://kvbm-guard-inproc")
    wait_until(lambda: (guard.service(pub), guard.applied)[1] >= 1, what="applied")
    wait_until(lambda: (guard.service(pub), guard.refused)[1] >= 1, what="refused")
    pub.send_multipart([b"kv@a", b"1"])
    assert recv(sub) == [b"kv@a", b"1"]


def test_the_allowlist_admits_only_its_addresses(ctx, tcp, publishers) -> None:
    refused = _make("thread", tcp, publishers, allow=("10.255.255.1",))
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(tcp[0].connect)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # the ZAP handler refuses every handshake
        refused.publish()
        assert not sub.poll(20)
    refused.pub.shutdown(2.0)
    other = (Endpoint("tcp", host="127.0.0.1", port=free_port()), tcp[1])
    admitted = _make("thread", other, publishers, allow=("127.0.0.1",))
    _subscriber(ctx, admitted, other[0].connect, b"")


def test_the_allowlist_variable_takes_ip_addresses_only() -> None:
    assert load_allowlist({}) == ()
    assert load_allowlist({"DYN_KVBM_ZMQ_ALLOW": " 10.0.0.7, ::1 ,"}) == ("10.0.0.7", "::1")
    with pytest.raises(ConfigError,
                       match=r"DYN_KVBM_ZMQ_ALLOW=.*'router\.local' does not appear to be an IP"):
        load_allowlist({"DYN_KVBM_ZMQ_ALLOW": "10.0.0.7,router.local"})


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["caller", "inline"])  # the GPU tier; the consolidated output
def test_soak_an_outsider_on_every_socket_for_60_s(request, ctx, tcp, publishers,
                                                   mode) -> None:  # noqa: ANN001
    """60 s of subscription floods and replay requests on a publisher that keeps publishing,
    from this process and from two others churning connections on both sockets: the memory
    held grows by less than the bound, the stream has no gap. (With the connection watch
    reading the monitors in Python, the peak was 17-46 MiB here but 74 MiB once in a loaded
    clean-clone CI run: the reader needed the GIL, and the replay ROUTER took in 1,081
    connections before it read the 129th accept; the compiled gate, wire/_gate_c.c, holds at
    the accept itself.)"""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("a 60 s soak: run with -m slow")
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        # Its bound is for a publisher alone in its process's heap, measured beside busy
        # processes (docs/operations.md, "Security and faults"); run apart, it measures that.
        pytest.skip("the memory soak runs alone: python -m pytest -m slow -n 0 (as .ci/run)")
    owner = _make(mode, tcp, publishers)
    sub = _subscriber(ctx, owner, tcp[0].connect, TOPIC.encode()[:3])
    before = heap_in_use()
    end = time.monotonic() + 60
    published = peak = 0
    # Besides this process's floods, two outsiders in processes of their own churn connections
    # on both sockets for the whole minute (tests/_churn.py).
    outsiders = [churn.start("sub", tcp[0].port, 60), churn.start("replay", tcp[1].port, 60)]
    request.addfinalizer(lambda: [(p.kill(), p.wait()) for p in outsiders])
    while time.monotonic() < end:
        _flood(tcp[0].port, 2_000, 200, lambda: (owner.tick(), owner.publish()))
        owner.tick()  # an inline owner's turn (the consolidator's loop polls all the time)
        peak = max(peak, heap_in_use() - before)
        with contextlib.suppress(OSError):
            replay = RawPeer("127.0.0.1", tcp[1].port, b"DEALER")
            for _ in range(200):
                replay.send(b"", (0).to_bytes(8, "big"))
            replay.close()
        owner.publish(published)
        published += 1
    got = 0
    last = -1
    while got < published:
        frames = recv(sub)
        seq = int.from_bytes(frames[1], "big")
        assert last < 0 or seq == last + 1  # no gap
        last = seq
        if decode(frames[2]).events:
            got += 1
    held = heap_in_use() - before
    assert held < 64 << 20 and peak < 64 << 20, (held >> 20, peak >> 20, owner.pub.stats())


def test_a_reader_behind_a_flood_cuts_connections_not_yet_subscribers(ctx) -> None:
    """libzmq takes in a connection's subscriptions however far behind the reader is: once a
    turn leaves more to read, every connection not yet a subscriber is cut, and the kernel
    drops new connection attempts until the reader has caught up; a subscriber stays."""
    guard = SubscriptionGuard("t", b"kv@a")
    pub = ctx.socket(zmq.XPUB)
    guard.configure(pub)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(f"tcp://127.0.0.1:{port}")
    wait_until(lambda: (guard.service(pub), guard.applied)[1] >= 1, what="the subscriber")
    flood = RawPeer("127.0.0.1", port, b"SUB")
    idle = RawPeer("127.0.0.1", port, b"SUB")  # connected, nothing read from it yet
    try:
        for i in range(2_000):  # sent while nobody reads: a turn (256) cannot take them all
            flood.send(b"\x01" + b"kv@a" * 2 + i.to_bytes(4, "big"))
        wait_until(lambda: guard.service(pub) and guard.peers_shed >= 1, what="a shed")
        assert idle.cut(2.0)
        with pytest.raises(TimeoutError):  # the reader is behind: no handshake at all
            RawPeer("127.0.0.1", port, b"SUB", timeout=0.5)
        assert guard.stats()["connections_paused"] == 1
    finally:
        flood.close()
        idle.close()
    wait_until(lambda: not guard.service(pub) and guard.stats()["subscriptions_held"] <= 1,
               what="caught up")
    again = RawPeer("127.0.0.1", port, b"SUB")  # kept again
    try:
        again.send(b"\x01kv@")
        wait_until(lambda: (guard.service(pub), guard.applied)[1] >= 2, what="applied")
    finally:
        again.close()
    pub.send_multipart([b"kv@a", b"1"])
    assert recv(sub) == [b"kv@a", b"1"]
    guard.close()

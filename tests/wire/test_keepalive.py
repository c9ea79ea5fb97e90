"""A connection whose other end went away without a word (its host cut off, a firewall's state
dropped) must end, on either side, for the reconnection and replay machinery to see it: every
tcp socket of ours has the kernel probe a silent connection (TCP keepalive, and a bound on
unacknowledged data: wire/reconnect.py). Here one end of a live connection is made to hear
nothing more (every packet to it dropped, no FIN, no reset), with the bounds shortened."""

from __future__ import annotations

import sys
import time

import pytest
import zmq
from _kvwire import short_keepalive, silence, tcp_connections, wait_until

from kvbm_plugin.consolidator_config import PublisherSettings
from kvbm_plugin.wire.events import BlockStored
from kvbm_plugin.wire.publisher import ZmqEventPublisher
from kvbm_plugin.wire.subscriber import StreamSubscriber

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="a Linux socket filter makes the connection silent")


@pytest.fixture(autouse=True)
def _short_keepalive(monkeypatch: pytest.MonkeyPatch) -> None:
    short_keepalive(monkeypatch)


def _store(h: int) -> dict:
    return BlockStored([h], None, [1, 2], 2).to_wire()


def test_a_subscriber_whose_publisher_went_silent_connects_again(tcp, publishers) -> None:  # noqa: ANN001
    """The subscriber's end hears nothing more: its keepalive probes go unanswered, it drops the
    connection and connects again (a reconnection, replayed), and what is published later
    reaches it. Without keepalive it waited on the silent connection for ever."""
    pub = ZmqEventPublisher(PublisherSettings(), tcp[0], tcp[1])
    publishers.append(pub)
    sub = StreamSubscriber(tcp[0].connect, tcp[1].connect)
    try:
        h = 1
        deadline = time.monotonic() + 10
        while (0, h) not in sub.held:  # joined: a batch reached it
            assert time.monotonic() < deadline, "the subscriber never joined"
            h += 1
            pub.publish([_store(h)], 0)
            sub.poll(50)
        (fd,) = tcp_connections(tcp[0].port, "peer")
        silence(fd)
        deadline = time.monotonic() + 20
        while not (sub.stats.reconnects >= 1 and (0, h) in sub.held):
            assert time.monotonic() < deadline, "the subscriber never heard the publisher again"
            h += 1
            pub.publish([_store(h)], 0)
            sub.poll(50)
        assert sub.stats.missing_batches == 0  # those published meanwhile were replayed
    finally:
        sub.close()


def test_a_publisher_drops_a_subscriber_gone_silent(ctx, tcp, publishers) -> None:  # noqa: ANN001
    """The publisher's end of a plain SUB's connection (no keepalive of its own) hears
    nothing more: the publisher's probes go unanswered and it drops the connection, which no
    longer counts towards its cap. Without keepalive it kept it for ever."""
    pub = ZmqEventPublisher(PublisherSettings(), tcp[0])
    publishers.append(pub)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(tcp[0].connect)
    try:
        deadline = time.monotonic() + 10
        while not sub.poll(20):
            assert time.monotonic() < deadline, "the SUB never joined"
            pub.publish([_store(1)], 0)
        ((fd, (_, peer)),) = tcp_connections(tcp[0].port, "local").items()
        silence(fd)
        wait_until(lambda: peer not in [p for _, p in tcp_connections(tcp[0].port,
                                                                      "local").values()],
                   10, "the silent connection dropped by the publisher")
        wait_until(lambda: pub.stats()["connections_closed"] >= 1, 10, "the cap's books")
    finally:
        sub.close(0)


def test_the_replay_sockets_drop_a_silent_connection_too(tcp, publishers) -> None:  # noqa: ANN001
    """A replay DEALER whose connection went silent would send every later request into it,
    and a replay ROUTER would keep a vanished requester towards its cap: both get the same
    bounds (the inline publisher's sockets and the subscriber's are this thread's)."""
    from kvbm_plugin.wire import reconnect

    pub = ZmqEventPublisher(PublisherSettings(), tcp[0], tcp[1], inline=True)
    publishers.append(pub)
    sub = StreamSubscriber(tcp[0].connect, tcp[1].connect)
    try:
        for sock in (pub._replay.router, sub._dealer):  # noqa: SLF001
            assert sock.getsockopt(zmq.TCP_KEEPALIVE) == 1
            assert sock.getsockopt(zmq.TCP_KEEPALIVE_IDLE) == reconnect.KEEPALIVE_IDLE_S
            assert sock.getsockopt(zmq.TCP_MAXRT) == reconnect.MAXRT_MS
    finally:
        sub.close()

"""ZmqEventPublisher: framing, seq continuity and gaps, replay, teardown, rebinding.

Every test runs with the publisher sending on the caller's thread (the default) and with its
publisher thread (``sends="thread"``), unless it names the mode it is about.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import pytest
import zmq
from _kvwire import BlockRemoved, decode, free_port, join_sub, recv, wait_until

from kvbm_plugin.consolidator_config import (
    ConfigError,
    Endpoint,
    PublisherSettings,
    load_consolidator_config,
    parse_endpoint,
)
from kvbm_plugin.wire import publisher as publisher_module
from kvbm_plugin.wire.events import END_SEQ
from kvbm_plugin.wire.publisher import (
    ZmqEventPublisher,
    create_publisher,
    gil_holding_sender,
    parse_replay_request,
)


@pytest.fixture(autouse=True, params=["caller", "thread"])
def sends(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The publisher's default ``sends`` mode for the test."""
    defaults = ZmqEventPublisher.__init__.__kwdefaults__
    assert defaults is not None
    monkeypatch.setitem(defaults, "sends", request.param)
    return str(request.param)


def removed(*hashes: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}


def seq_of(frames: list[bytes]) -> int:
    assert len(frames) == 3
    return int.from_bytes(frames[1], "big")


def test_three_frames_topic_seq_payload(ctx, tcp, publishers) -> None:
    pub = ZmqEventPublisher(PublisherSettings(topic="kv"), tcp[0], data_parallel_rank=3)
    publishers.append(pub)
    sub, seen = join_sub(ctx, tcp[0].connect, lambda: pub.publish([]))
    assert pub.publish([removed(5, -7)], data_parallel_rank=1)
    frames = recv(sub)
    assert frames[0] == b"kv" and len(frames[1]) == 8
    assert seq_of(frames) == seq_of(seen[-1]) + 1
    batch = decode(frames[2])
    assert batch.data_parallel_rank == 1
    assert batch.events == [BlockRemoved(block_hashes=[5, -7], medium="GPU")]
    assert pub.publish([removed(1)])  # default rank
    assert decode(recv(sub)[2]).data_parallel_rank == 3


def test_seq_starts_at_zero_and_is_continuous(ctx, tcp, publishers) -> None:
    pub = ZmqEventPublisher(PublisherSettings(), tcp[0], tcp[1])
    publishers.append(pub)
    sub, seen = join_sub(ctx, tcp[0].connect, lambda: pub.publish([]))
    assert seq_of(seen[0]) == 0 or seq_of(seen[0]) > 0  # probes may be lost before joining
    last = seq_of(seen[-1])
    for i in range(50):
        pub.publish([removed(i)])
    got = [seq_of(recv(sub)) for _ in range(50)]
    assert got == list(range(last + 1, last + 51))
    # replay from 0 proves the first seq was 0 and nothing is missing
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(tcp[1].connect)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    seqs = []
    while True:
        frames = recv(dealer)
        assert frames[0] == b""
        if frames[2] == END_SEQ:
            assert frames[1] == b"" and frames[3] == b""
            break
        seqs.append(int.from_bytes(frames[2], "big"))
    assert seqs == list(range(0, last + 51))


def test_forced_encode_error_is_a_visible_gap(ctx, tcp, publishers, expect_errors) -> None:
    pub = ZmqEventPublisher(PublisherSettings(), tcp[0], tcp[1])
    publishers.append(pub)
    sub, seen = join_sub(ctx, tcp[0].connect, lambda: pub.publish([]))
    base = seq_of(seen[-1])
    pub.publish([removed(1)])
    pub.publish([{"type": "BlockRemoved", "block_hashes": [object()], "medium": "GPU"}])
    pub.publish([removed(3)])
    assert [seq_of(recv(sub)) for _ in range(2)] == [base + 1, base + 3]
    wait_until(lambda: pub.stats()["encode_errors"] == 1, what="encode error counted")
    assert pub.stats()["lost_batches"] == 1
    # the gap stays a gap in a replay of that range, and the reply still ends with END_SEQ
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(tcp[1].connect)
    dealer.send_multipart([b"", (base + 1).to_bytes(8, "big")])
    replayed = []
    while (frames := recv(dealer))[2] != END_SEQ:
        assert len(frames) == 4 and frames[1] == b""
        replayed.append(int.from_bytes(frames[2], "big"))
        decode(frames[3])
    assert replayed == [base + 1, base + 3]
    assert expect_errors.wait_for("cannot be encoded")


def test_queue_full_loses_visibly_and_never_blocks(ctx, tcp, publishers) -> None:
    gate = threading.Event()
    entered = threading.Event()

    def stalled_encoder(obj: Any) -> bytes:
        entered.set()
        gate.wait(10)
        import msgspec
        return msgspec.msgpack.encode(obj)

    pub = ZmqEventPublisher(PublisherSettings(max_queue_size=1), tcp[0], encoder=stalled_encoder,
                            sends="thread")
    publishers.append(pub)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(tcp[0].connect)
    assert pub.publish([removed(0)])  # seq 0: taken by the thread, which stalls in encode
    assert entered.wait(5)
    assert pub.publish([removed(1)])  # seq 1: fills the queue
    results = [pub.publish([removed(i)]) for i in range(2, 6)]  # seqs 2..5: lost, no blocking
    assert results == [False] * 4
    stats = pub.stats()
    assert stats["lost_queue_full"] == 4 and stats["lost_batches"] == 4
    assert stats["queue_high_water"] == 1
    gate.set()
    wait_until(lambda: pub.stats()["queue_depth"] == 0, what="queue drained")
    assert pub.publish([removed(6)])
    wait_until(lambda: pub.stats()["batches_published"] == 3, what="drain")
    # the replay buffer shows the hole: 0, 1, 6
    assert [s for s, _ in list(pub._buffer)] == [0, 1, 6]


class _GoneRouter:
    """A ROUTER whose only requester has gone: every send raises EHOSTUNREACH."""

    def __init__(self) -> None:
        self.requests = [[b"peer", b"", (0).to_bytes(8, "big")]]
        self.sends = 0

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        if not self.requests:
            raise zmq.Again()
        return self.requests.pop()

    def send_multipart(self, frames: Any, flags: int = 0) -> None:
        assert flags & zmq.NOBLOCK, "replay sends must never block"
        self.sends += 1
        raise zmq.ZMQError(zmq.EHOSTUNREACH)


def test_replay_to_vanished_requester_aborts_without_blocking(ctx, tcp, publishers) -> None:
    pub = ZmqEventPublisher(PublisherSettings(), tcp[0], tcp[1])
    publishers.append(pub)
    for i in range(20):
        pub.publish([removed(i)])
    wait_until(lambda: pub.stats()["batches_published"] == 20, what="published")
    gone = _GoneRouter()
    pub._replay.server.service(gone, pub._buffer)  # type: ignore[arg-type]
    assert gone.sends == 1  # stopped at the first failure instead of pushing 20 more
    assert pub.stats()["replay_aborted"] == 1
    # a real requester that disconnects does not disturb the live stream or later requesters
    early = ctx.socket(zmq.DEALER)
    early.connect(tcp[1].connect)
    early.send_multipart([b"", (0).to_bytes(8, "big")])
    early.close(linger=1000)
    sub, _ = join_sub(ctx, tcp[0].connect, lambda: pub.publish([]))
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(tcp[1].connect)
    dealer.send_multipart([(10**9).to_bytes(8, "big")])  # bare DEALER, start past the end
    assert recv(dealer) == [b"", END_SEQ, b""]


def test_malformed_replay_request_counted(ctx, tcp, publishers) -> None:
    pub = ZmqEventPublisher(PublisherSettings(), tcp[0], tcp[1])
    publishers.append(pub)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(tcp[1].connect)
    dealer.send_multipart([b"", b"abc"])
    wait_until(lambda: pub.stats()["replay_bad_requests"] == 1, what="bad request counted")
    assert parse_replay_request([b"id", b"", (7).to_bytes(8, "big")]) == ((b"id", b""), 7)
    assert parse_replay_request([b"id", (7).to_bytes(8, "big")]) == ((b"id",), 7)
    assert parse_replay_request([b"id", b"x", b"y", b"z"]) == (None, None)


def test_replay_buffer_is_bounded(tcp, publishers) -> None:
    pub = ZmqEventPublisher(PublisherSettings(buffer_steps=3), tcp[0], tcp[1])
    publishers.append(pub)
    for i in range(10):
        pub.publish([removed(i)])
    wait_until(lambda: pub.stats()["batches_published"] == 10, what="published")
    assert [s for s, _ in list(pub._buffer)] == [7, 8, 9]


def test_replay_buffer_is_bounded_in_bytes(tcp, publishers) -> None:
    """Past the byte bound the oldest batches leave the replay buffer (the newest always
    stays), and the bytes counted are those of the batches kept."""
    probe = ZmqEventPublisher(PublisherSettings(buffer_bytes=1), tcp[0], None)
    publishers.append(probe)
    probe.publish([removed(0)])
    probe.publish([removed(1)])
    wait_until(lambda: probe.stats()["batches_published"] == 2, what="published")
    assert [s for s, _ in list(probe._buffer)] == [1]  # larger than the bound: kept alone
    one = probe.stats()["replay_bytes_buffered"]
    assert one == len(probe._buffer[0][1]) > 1
    pub = ZmqEventPublisher(PublisherSettings(buffer_bytes=3 * one + one // 2), tcp[1], None)
    publishers.append(pub)
    for i in range(10):
        pub.publish([removed(i)])
    wait_until(lambda: pub.stats()["batches_published"] == 10, what="published")
    kept = list(pub._buffer)
    assert [s for s, _ in kept] == [7, 8, 9]
    assert pub.stats()["replay_bytes_buffered"] == sum(len(p) for _, p in kept) == 3 * one


def test_tcp_host_named_ipc_host(ctx, publishers) -> None:
    port = free_port()
    endpoint = parse_endpoint("X", f"tcp://*:{port}", default_host="ipc-host")
    assert endpoint.scheme == "tcp" and endpoint.host == "ipc-host"
    pub = ZmqEventPublisher(PublisherSettings(), endpoint)
    publishers.append(pub)
    assert pub._bind_addr == f"tcp://*:{port}"
    sub, _ = join_sub(ctx, f"tcp://127.0.0.1:{port}", lambda: pub.publish([]))
    pub.publish([removed(9)])
    assert decode(recv(sub)[2]).events[0].block_hashes == [9]


def test_ipc_endpoint_per_rank(ctx, tmp_path, publishers) -> None:
    base = Endpoint("ipc", address=str(tmp_path / "ev"))
    pub = ZmqEventPublisher(PublisherSettings(), base.for_rank(2), data_parallel_rank=2)
    publishers.append(pub)
    assert base.for_rank(2).bind.endswith("ev_dp2")
    sub, _ = join_sub(ctx, base.for_rank(2).connect, lambda: pub.publish([]))
    pub.publish([removed(4)])
    assert decode(recv(sub)[2]).data_parallel_rank == 2


def test_rebind_after_failed_construction(tcp, publishers) -> None:
    blocker = zmq.Context()
    hold = blocker.socket(zmq.PUB)
    hold.bind(tcp[1].bind)  # the replay port is taken: construction fails after PUB bound
    try:
        with pytest.raises(ConfigError, match="cannot bind"):
            ZmqEventPublisher(PublisherSettings(), tcp[0], tcp[1])
    finally:
        hold.close(linger=0)
        blocker.term()
    # both ports are free again right away
    pub = ZmqEventPublisher(PublisherSettings(), tcp[0], tcp[1])
    publishers.append(pub)


def test_shutdown_drains_is_idempotent_and_frees_the_port(ctx, tcp) -> None:
    pub = ZmqEventPublisher(PublisherSettings(), tcp[0], tcp[1])
    sub, _ = join_sub(ctx, tcp[0].connect, lambda: pub.publish([]))
    for i in range(100):
        pub.publish([removed(i)])
    pub.shutdown(5.0)
    assert pub.stats()["batches_published"] >= 101
    assert pub.stats()["lost_batches"] == 0
    got = 0
    while sub.poll(1000):
        sub.recv_multipart()
        got += 1
        if got >= 100:
            break
    assert got >= 100
    pub.shutdown()  # idempotent
    assert pub.publish([removed(1)]) is False
    assert pub.stats()["lost_closed"] == 1
    again = ZmqEventPublisher(PublisherSettings(), tcp[0], tcp[1])  # rebind right away
    again.shutdown()


@pytest.mark.parametrize("field", ["buffer_steps", "buffer_bytes", "hwm", "max_queue_size"])
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_settings_rejected(tcp, field, value) -> None:
    settings = PublisherSettings(**{field: value})
    with pytest.raises(ConfigError, match=field):
        ZmqEventPublisher(settings, tcp[0])


def test_factory_and_env_defaults(tcp) -> None:
    config = load_consolidator_config({"DYN_KVBM_TRTLLM_ZMQ_PORT": str(tcp[0].port)})
    assert (config.publisher.buffer_steps, config.publisher.hwm,
            config.publisher.max_queue_size, config.publisher.topic) == (10000, 100000, 100000, "")
    pub = create_publisher(config.publisher, config.publish_endpoint(0), None, 0)
    try:
        assert isinstance(pub, ZmqEventPublisher)
    finally:
        pub.shutdown()
    with pytest.raises(ConfigError, match="endpoint"):
        ZmqEventPublisher(PublisherSettings(), None)


def test_gil_holding_sender_frames_equal_pyzmq(ctx) -> None:
    """The GIL-keeping live send puts the same three frames on the wire as pyzmq's send."""
    port = free_port()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    send = gil_holding_sender(pub)
    if sys.platform.startswith("linux"):
        assert send is not None  # pyzmq wheels load libzmq as a shared library on Linux
    if send is None:
        pytest.skip("libzmq not loaded as an identifiable shared library here")
    sub, _ = join_sub(ctx, f"tcp://127.0.0.1:{port}",
                      lambda: pub.send_multipart([b"t", b"\0" * 8, b""]))
    while sub.poll(50):
        sub.recv_multipart()  # drop the remaining probes
    payload = bytes(range(256)) * 100
    send(b"t", (7).to_bytes(8, "big"), payload)
    pub.send_multipart([b"t", (8).to_bytes(8, "big"), b""])
    assert recv(sub) == [b"t", (7).to_bytes(8, "big"), payload]
    assert recv(sub) == [b"t", (8).to_bytes(8, "big"), b""]
    sub.close(0)
    pub.close(0)


def test_publisher_uses_gil_holding_sender(ctx, tcp, publishers) -> None:
    pub = ZmqEventPublisher(PublisherSettings(), tcp[0])
    publishers.append(pub)
    if sys.platform.startswith("linux"):
        assert pub._send_live is not None


# ---- inline mode (the consolidator's output: encode and send on the owner's thread) ----------


def _replay(ctx: zmq.Context, pub: ZmqEventPublisher, address: str, start: int) -> list[int]:
    """Ask for a replay from ``start`` and answer it the way an inline owner does: poll the
    publisher's replay socket, then call ``service_replay`` on this thread."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    router = pub.replay_socket
    assert router is not None
    assert router.poll(5000), "replay request never arrived"
    pub.service_replay()
    seqs = []
    while (frames := recv(dealer))[2] != END_SEQ:
        seqs.append(int.from_bytes(frames[2], "big"))
        decode(frames[3])
    return seqs


def test_inline_publish_sends_on_the_callers_thread(ctx, tcp, publishers) -> None:
    # The process's one connection-watch thread (wire/conn_watch.py) is not the publisher's.
    def threads() -> set[str]:
        return {t.name for t in threading.enumerate()} - {"kvbm-conn-watch"}

    before = threads()
    pub = ZmqEventPublisher(PublisherSettings(), tcp[0], tcp[1], data_parallel_rank=2,
                            inline=True)
    publishers.append(pub)
    assert threads() == before  # no publisher thread
    sub, seen = join_sub(ctx, tcp[0].connect, lambda: pub.publish([]))
    published = pub.stats()["batches_published"]
    assert pub.publish([removed(5, -7)])
    # counted as sent when publish returns: the send happened on this thread
    assert pub.stats()["batches_published"] == published + 1
    frames = recv(sub)
    assert seq_of(frames) == seq_of(seen[-1]) + 1
    batch = decode(frames[2])
    assert batch.data_parallel_rank == 2
    assert batch.events == [BlockRemoved(block_hashes=[5, -7], medium="GPU")]
    assert _replay(ctx, pub, tcp[1].connect, 0) == list(range(seq_of(frames) + 1))


def test_inline_losses_are_visible_gaps(ctx, tcp, publishers, expect_errors) -> None:
    pub = ZmqEventPublisher(PublisherSettings(), tcp[0], tcp[1], inline=True)
    publishers.append(pub)
    assert pub.publish([removed(1)])
    assert pub.publish([{"type": "BlockRemoved", "block_hashes": [object()]}]) is False
    assert pub.publish([removed(3)])
    stats = pub.stats()
    assert stats["encode_errors"] == 1 and stats["lost_batches"] == 1
    assert _replay(ctx, pub, tcp[1].connect, 0) == [0, 2]  # the hole stays a hole
    assert expect_errors.wait_for("cannot be encoded")


def test_inline_bind_failure_and_rebind_after_shutdown(tcp) -> None:
    first = ZmqEventPublisher(PublisherSettings(), tcp[0], tcp[1], inline=True)
    try:
        with pytest.raises(ConfigError, match=f"cannot bind.*{tcp[0].port}"):
            ZmqEventPublisher(PublisherSettings(), tcp[0], inline=True)
    finally:
        first.shutdown(1.0)
    first.shutdown()  # idempotent
    assert first.publish([removed(1)]) is False
    assert first.stats()["lost_closed"] == 1
    again = ZmqEventPublisher(PublisherSettings(), tcp[0], tcp[1], inline=True)  # ports free
    again.shutdown()
    assert again.replay_socket is None


@pytest.mark.parametrize("inline", [False, True])
def test_an_event_that_cannot_be_encoded_is_dropped_alone(ctx, tcp, publishers, inline,
                                                          expect_errors) -> None:
    pub = ZmqEventPublisher(PublisherSettings(), tcp[0], tcp[1], inline=inline)
    publishers.append(pub)
    sub, seen = join_sub(ctx, tcp[0].connect, lambda: pub.publish([]))
    base = seq_of(seen[-1])
    bad = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
           "token_ids": [10**30], "block_size": 1, "lora_id": None, "medium": "GPU",
           "lora_name": None}
    assert pub.publish([removed(1), bad, removed(3)])
    frames = recv(sub)
    assert seq_of(frames) == base + 1
    batch = decode(frames[2])
    assert [e.block_hashes for e in batch.events] == [[1], [3]]
    stats = pub.stats()
    assert stats["events_unencodable"] == 1 and stats["lost_batches"] == 0
    assert stats["events_published"] == 2
    assert expect_errors.wait_for("1 of 3 events cannot be encoded and were dropped")


class _ContendedLock:
    """A lock that says when a second thread has to wait for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waited = threading.Event()

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self.waited.set()
            self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_thread_mode_queues_batches_of_two_callers_in_seq_order(tcp, publishers) -> None:
    """``sends="thread"`` with two publishing threads: the caller that reserved the earlier
    seq is caught between reserving it and queueing the batch while the other publishes; the
    queue, and so the wire, must still hold the seqs in order."""
    pub = ZmqEventPublisher(PublisherSettings(), tcp[0], tcp[1], sends="thread")
    publishers.append(pub)
    lock = pub._send_lock = _ContendedLock()  # type: ignore[assignment]
    queued: list[int] = []
    first_in = threading.Event()
    second_in = threading.Event()
    put = pub._queue.put_nowait

    def put_nowait(item: Any) -> None:
        if threading.current_thread().name == "first":
            first_in.set()
            # Hold here until the second caller either queues (its seq overtaking ours) or
            # waits for us: whichever the publisher allows.
            deadline = time.monotonic() + 10
            while not (second_in.is_set() or lock.waited.is_set()):
                assert time.monotonic() < deadline, "second caller neither queued nor waited"
                second_in.wait(0.005)
        else:
            second_in.set()
        queued.append(item[0])
        put(item)

    pub._queue.put_nowait = put_nowait  # type: ignore[method-assign]
    first = threading.Thread(target=pub.publish, args=([removed(1)],), name="first")
    second = threading.Thread(target=pub.publish, args=([removed(2)],), name="second")
    first.start()
    assert first_in.wait(10)
    second.start()
    first.join(10)
    second.join(10)
    del pub._queue.put_nowait  # shutdown queues its stop marker through the plain method
    assert queued == [0, 1]
    wait_until(lambda: len(pub._buffer) == 2, what="both sent")
    assert [seq for seq, _ in pub._buffer] == [0, 1]


def test_sink_counts_a_batch_the_publisher_thread_lost_as_lost(tcp, publishers,
                                                               expect_errors) -> None:
    from kvbm_plugin.event_sink import KvEventSink

    def broken(obj: Any) -> bytes:
        raise TypeError("cannot encode")

    pub = ZmqEventPublisher(PublisherSettings(), tcp[0], tcp[1], encoder=broken, sends="thread")
    publishers.append(pub)
    sink = KvEventSink(pub, block_size=1)
    sink.ingest([{"event_id": 0, "window_size": 64,
                  "data": {"type": "removed", "block_hashes": [5]}}])
    sink.flush()  # accepted: the loss happens later, on the publisher thread
    wait_until(lambda: pub.stats()["encode_errors"] == 1, what="encode error")
    stats = sink.stats()
    assert stats["batches_lost"] == 1 and stats["batches_published"] == 0
    assert stats["publisher_lost_after_accept"] == 1
    assert sink.dropped_event_count == 1
    assert expect_errors.wait_for("cannot be encoded, lost")


def test_replay_requesters_that_never_read_are_bounded_and_dropped(ctx, tmp_path,
                                                                   publishers) -> None:
    """Non-reading replay requesters get at most a bounded queue each, are dropped once they
    stall, and the live stream goes on meanwhile."""
    pub_ep = parse_endpoint("e", f"ipc://{tmp_path}/pub", default_host="127.0.0.1")
    replay_ep = parse_endpoint("r", f"ipc://{tmp_path}/replay", default_host="127.0.0.1")
    buffered = 2000
    pub = ZmqEventPublisher(PublisherSettings(buffer_steps=buffered), pub_ep, replay_ep,
                            replay_stall_s=0.3)
    publishers.append(pub)
    big = [{"type": "BlockStored", "block_hashes": [i], "parent_block_hash": None,
            "token_ids": list(range(2000)), "block_size": 2000, "lora_id": None,
            "medium": "GPU", "lora_name": None} for i in range(1)]
    for _ in range(buffered):
        pub.publish(big)
    wait_until(lambda: pub.stats()["replay_buffered"] == buffered, what="buffer full")
    peers = []
    for _ in range(6):  # more than may be answered at once: some wait their turn
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 1)
        dealer.connect(replay_ep.connect)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])  # and never read
        peers.append(dealer)
    sub, seen = join_sub(ctx, pub_ep.connect, lambda: pub.publish([]))
    for i in range(20):  # the live stream is not held up by the stalled replays
        pub.publish([removed(i)])
        frames = recv(sub, timeout_ms=5000)
        assert decode(frames[2]).events[0].block_hashes == [i]
    wait_until(lambda: pub.stats()["replay_peers_dropped"] == len(peers), timeout=20.0,
               what="every stalled requester dropped")
    stats = pub.stats()
    assert stats["replay_requests"] == len(peers)
    # What was queued for them is bounded per peer, not the whole buffer each.
    assert stats["replay_batches_sent"] < len(peers) * buffered // 4, stats
    assert stats["replay_active"] == 0 and stats["replay_waiting"] == 0
    # A requester that reads still gets the whole buffer.
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay_ep.connect)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    count = 0
    while (frames := recv(dealer))[2] != END_SEQ:
        count += 1
    assert count >= buffered


class _ScriptedRouter:
    """Requests to hand out; sends recorded, or refused with EAGAIN while ``full``."""

    def __init__(self, requests: list[list[bytes]]) -> None:
        self.requests = requests
        self.sent: list[tuple[bytes, ...]] = []
        self.full = False

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        if not self.requests:
            raise zmq.Again()
        return self.requests.pop(0)

    def send_multipart(self, frames: Any, flags: int = 0) -> None:
        assert flags & zmq.NOBLOCK
        if self.full:
            raise zmq.Again()
        self.sent.append(tuple(frames))


def test_replay_server_caps_answers_in_progress_and_refuses_the_rest() -> None:
    from collections import deque

    from kvbm_plugin.wire.replay_server import ReplayServer

    buffer = deque((seq, b"p%d" % seq) for seq in range(10))
    server = ReplayServer("test", b"", max_active=1, max_waiting=1, batches_per_call=4,
                          stall_s=3600)
    router = _ScriptedRouter([[b"a", b"", (0).to_bytes(8, "big")],
                              [b"b", b"", (5).to_bytes(8, "big")],
                              [b"c", b"", (0).to_bytes(8, "big")]])
    server.service(router, buffer)  # type: ignore[arg-type]
    stats = server.stats()
    assert stats["replay_refused"] == 1 and stats["replay_active"] == 1
    assert stats["replay_waiting"] == 1
    assert [f[0] for f in router.sent] == [b"c"] + [b"a"] * 4  # c: END_SEQ only
    assert router.sent[0][3] == END_SEQ
    for _ in range(10):
        server.service(router, buffer)  # type: ignore[arg-type]
    by_peer = {peer: [f for f in router.sent if f[0] == peer] for peer in (b"a", b"b")}
    assert [int.from_bytes(f[3], "big") for f in by_peer[b"a"][:-1]] == list(range(10))
    assert [int.from_bytes(f[3], "big") for f in by_peer[b"b"][:-1]] == list(range(5, 10))
    assert by_peer[b"a"][-1][3] == END_SEQ and by_peer[b"b"][-1][3] == END_SEQ
    assert not server.busy and server.stats()["replay_batches_sent"] == 15


def test_replay_server_refuses_while_too_many_peers_stopped_reading() -> None:
    from collections import deque

    from kvbm_plugin.wire.replay_server import ReplayServer

    buffer = deque((seq, b"p%d" % seq) for seq in range(10))
    server = ReplayServer("test", b"", max_active=2, max_stalled=1, batches_per_call=4,
                          stall_s=0.0)
    router = _ScriptedRouter([[b"a", b"", (0).to_bytes(8, "big")]])
    router.full = True  # "a" reads nothing
    server.service(router, buffer)  # type: ignore[arg-type]
    wait_until(lambda: (server.service(router, buffer),  # type: ignore[arg-type]
                        server.stats()["replay_stalled_peers"] == 1)[1], what="a stalled")
    router.full = False
    router.requests.append([b"b", b"", (0).to_bytes(8, "big")])
    router.sent.clear()
    server._stalled[(b"a", b"")] = float("inf")  # still stalled: not probed in this call
    server.service(router, buffer)  # type: ignore[arg-type]
    assert server.stats()["replay_refused"] == 1
    assert router.sent == [(b"b", b"", b"", END_SEQ, b"")]
    server._stalled[(b"a", b"")] = 0.0  # probe now: it has room again
    server.service(router, buffer)  # type: ignore[arg-type]
    assert server.stats()["replay_stalled_peers"] == 0
    assert router.sent[-1] == (b"a", b"", b"", END_SEQ, b"")
def _thread_cpu(thread: threading.Thread) -> float:
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def test_idle_thread_sleeps_until_publish_wakes_it(ctx, tcp, publishers) -> None:
    """Idle, the publisher thread sleeps with no timeout (no wake-ups, no CPU); the first batch
    after that wakes it and is sent; a replay request wakes it too."""
    pub = ZmqEventPublisher(PublisherSettings(), tcp[0], tcp[1], sends="thread")
    publishers.append(pub)
    sub, seen = join_sub(ctx, tcp[0].connect, lambda: pub.publish([]))
    wait_until(lambda: pub._asleep, what="publisher thread asleep")
    cpu0 = _thread_cpu(pub._thread)
    threading.Event().wait(0.3)  # the interval under test (the old 1 ms poll used ~10 ms here)
    assert pub._asleep
    assert _thread_cpu(pub._thread) - cpu0 < 0.002
    for round_ in range(3):  # each time from sleep: publish alone must wake it
        wait_until(lambda: pub._asleep, what="publisher thread asleep")
        assert pub.publish([removed(round_)])
        frames = recv(sub)
        assert [ev.block_hashes for ev in decode(frames[2]).events] == [[round_]]
        assert seq_of(frames) == seq_of(seen[-1]) + 1 + round_
    wait_until(lambda: pub._asleep, what="publisher thread asleep")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(tcp[1].connect)
    dealer.send_multipart([(10**9).to_bytes(8, "big")])  # bare DEALER, start past the end
    assert recv(dealer) == [b"", END_SEQ, b""]  # answered while no batch came


def test_shutdown_wakes_a_sleeping_thread_promptly(tcp) -> None:
    pub = ZmqEventPublisher(PublisherSettings(), tcp[0], sends="thread")
    wait_until(lambda: pub._asleep, what="publisher thread asleep")
    t = time.monotonic()
    pub.shutdown(5.0)
    assert not pub._thread.is_alive()
    assert time.monotonic() - t < 2.0  # not the join timeout
    assert pub._wake_r == pub._wake_w == -1


def _threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def test_caller_sends_publish_on_the_callers_thread_and_a_service_thread_answers(
        ctx, tcp, publishers) -> None:
    """``sends="caller"``: no publisher thread; the batch is on the wire when ``publish``
    returns; a service thread (subscriptions, replay) answers from the buffer."""
    before = set(_threads("kvbm-zmq-"))
    pub = ZmqEventPublisher(PublisherSettings(), tcp[0], tcp[1], data_parallel_rank=5,
                            sends="caller")
    publishers.append(pub)
    started = set(_threads("kvbm-zmq-")) - before
    assert [t.name for t in started] == ["kvbm-zmq-service-dp5"]
    sub, seen = join_sub(ctx, tcp[0].connect, lambda: pub.publish([]))
    sent_by: list[str] = []
    real = pub._send_batch

    def spy(*args: Any) -> bool:
        sent_by.append(threading.current_thread().name)
        return real(*args)

    pub._send_batch = spy  # type: ignore[method-assign]
    assert pub.publish([removed(7)])
    assert sent_by == [threading.current_thread().name]
    frames = recv(sub)
    assert [ev.block_hashes for ev in decode(frames[2]).events] == [[7]]
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(tcp[1].connect)
    dealer.send_multipart([seq_of(frames).to_bytes(8, "big")])
    assert recv(dealer)[1:] == frames[1:]
    assert recv(dealer) == [b"", END_SEQ, b""]
    pub.shutdown(2.0)
    assert not (set(_threads("kvbm-zmq-")) - before)
    assert not pub.publish([removed(8)])
    assert pub.stats()["lost_closed"] == 1


def test_caller_sends_without_a_replay_endpoint_start_only_the_service_thread(
        tcp, publishers) -> None:
    """The service thread reads the subscriptions even without a replay endpoint."""
    before = set(_threads("kvbm-zmq-"))
    pub = ZmqEventPublisher(PublisherSettings(), tcp[0], sends="caller")
    publishers.append(pub)
    assert [t.name for t in set(_threads("kvbm-zmq-")) - before] == ["kvbm-zmq-service-dp0"]
    assert pub.publish([removed(1)])
    # Sent at once, or by the service thread when commands waited (wire/send_gate.py).
    wait_until(lambda: pub.stats()["batches_published"] == 1, what="the batch sent")


def test_caller_sends_fall_back_to_the_thread_without_a_gil_holding_send(
        tcp, publishers, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where libzmq cannot be called keeping the GIL, pyzmq's send would let the executor
    thread wait for the GIL: the publisher uses its thread instead."""
    monkeypatch.setattr(publisher_module, "_libzmq_send_functions", lambda: None)
    before = set(_threads("kvbm-zmq-"))
    pub = ZmqEventPublisher(PublisherSettings(), tcp[0], data_parallel_rank=3, sends="caller")
    publishers.append(pub)
    assert [t.name for t in set(_threads("kvbm-zmq-")) - before] == ["kvbm-zmq-publisher-dp3"]
    assert pub.publish([removed(1)])
    wait_until(lambda: pub.stats()["batches_published"] == 1, what="batch sent by the thread")


def test_caller_sends_from_several_threads_keep_seq_and_lose_nothing(ctx, tcp,
                                                                     publishers) -> None:
    """Callers on different threads (the executor thread's flush, tier events from another
    thread): one send at a time, every seq once, every batch delivered."""
    pub = ZmqEventPublisher(PublisherSettings(), tcp[0], sends="caller")
    publishers.append(pub)
    sub, seen = join_sub(ctx, tcp[0].connect, lambda: pub.publish([]))
    first = seq_of(seen[-1]) + 1
    per_thread, n_threads = 300, 4

    def burst(base: int) -> None:
        for i in range(per_thread):
            assert pub.publish([removed(base + i)])

    threads = [threading.Thread(target=burst, args=(k * 1000,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    got = [recv(sub) for _ in range(per_thread * n_threads)]
    assert sorted(seq_of(f) for f in got) == list(range(first, first + per_thread * n_threads))
    hashes = sorted(decode(f[2]).events[0].block_hashes[0] for f in got)
    assert hashes == sorted(k * 1000 + i for k in range(n_threads) for i in range(per_thread))


def test_sends_mode_is_checked(tcp) -> None:
    with pytest.raises(ConfigError, match="sends='later'"):
        ZmqEventPublisher(PublisherSettings(), tcp[0], sends="later")

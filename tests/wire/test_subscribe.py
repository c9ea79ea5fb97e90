"""StreamSubscriber: a router's view of a stream, gap detection and replay; CLI output."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from kvbm_plugin.wire.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_message,
    encode_batch,
    encode_seq,
)
from kvbm_plugin.wire.subscriber import StreamSubscriber, as_json, describe


def _store(h: int, parent: int | None = None) -> BlockStored:
    return BlockStored([h], parent, [1, 2], 2)


def _frames(seq: int, events: list, rank: int = 0) -> list[bytes]:
    return encode_batch(b"", seq, 1.0, events, rank)


def _poll_until(sub: StreamSubscriber, condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        sub.poll(20)


@pytest.fixture
def xpub(ctx: zmq.Context, tmp_path: Path) -> Iterator[tuple[zmq.Socket, str]]:
    sock = ctx.socket(zmq.XPUB)
    endpoint = f"ipc://{tmp_path}/pub"
    sock.bind(endpoint)
    yield sock, endpoint
    sock.close(0)


def _connect(ctx: zmq.Context, xpub: zmq.Socket, endpoint: str,
             replay: str | None = None) -> StreamSubscriber:
    sub = StreamSubscriber(endpoint, replay, context=ctx)
    assert xpub.poll(10_000), "subscription never arrived"
    xpub.recv()  # the subscription message: the SUB is connected, nothing can be missed now
    return sub


def test_view_follows_stores_removes_and_clears(ctx, xpub) -> None:
    pub, endpoint = xpub
    sub = _connect(ctx, pub, endpoint)
    try:
        pub.send_multipart(_frames(0, [_store(1), _store(2, 1)]))
        pub.send_multipart(_frames(1, [BlockRemoved([2])]))
        pub.send_multipart(_frames(2, [_store(2**64 - 1)], rank=1))
        _poll_until(sub, lambda: sub.stats.batches == 3)
        assert sub.held == {(0, 1), (1, -1)}
        pub.send_multipart(_frames(3, [AllBlocksCleared()], rank=1))
        pub.send_multipart(_frames(4, [BlockRemoved([99]), _store(1)]))
        _poll_until(sub, lambda: sub.stats.batches == 5)
        assert sub.held == {(0, 1)}
        assert sub.stats.gaps == 0
        assert sub.stats.unknown_removes == 1 and sub.stats.duplicate_stores == 1
    finally:
        sub.close()


def test_gap_without_replay_counts_missing(ctx, xpub) -> None:
    pub, endpoint = xpub
    sub = _connect(ctx, pub, endpoint)
    try:
        pub.send_multipart(_frames(0, [_store(1)]))
        pub.send_multipart(_frames(3, [_store(2, 7)]))
        _poll_until(sub, lambda: sub.stats.batches == 2)
        assert (sub.stats.gaps, sub.stats.missing_batches) == (1, 2)
        assert sub.stats.orphan_stores == 1
    finally:
        sub.close()


def test_gap_filled_by_replay_and_hole_inside_replay_stays(ctx, xpub, tmp_path) -> None:
    pub, endpoint = xpub
    router = ctx.socket(zmq.ROUTER)
    replay_endpoint = f"ipc://{tmp_path}/replay"
    router.bind(replay_endpoint)
    buffered = {1: _frames(1, [_store(5)]), 3: _frames(3, [_store(6)])}  # seq 2 lost for good
    requests: list[int] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not router.poll(20):
                continue
            client, empty, start = router.recv_multipart()
            requests.append(int.from_bytes(start, "big"))
            for seq in sorted(buffered):
                if seq >= requests[-1]:
                    router.send_multipart([client, empty, *buffered[seq]])
            router.send_multipart([client, empty, b"", END_SEQ, b""])

    server = threading.Thread(target=serve)
    server.start()
    sub = _connect(ctx, pub, endpoint, replay_endpoint)
    try:
        pub.send_multipart(_frames(0, [_store(1)]))
        pub.send_multipart(_frames(4, [_store(7)]))
        _poll_until(sub, lambda: sub.stats.batches >= 3)
        assert requests == [0]  # from the last batch applied (not buffered here: unchecked)
        assert sub.stats.replayed_batches == 1  # seq 1; seq 3 is behind the hole at 2
        assert sub.stats.missing_batches == 2
        assert (0, 5) in sub.held and (0, 6) not in sub.held and (0, 7) in sub.held
    finally:
        stop.set()
        server.join()
        router.close(0)
        sub.close()


def test_malformed_messages_are_counted_not_fatal(ctx, xpub) -> None:
    pub, endpoint = xpub
    sub = _connect(ctx, pub, endpoint)
    try:
        pub.send_multipart([b"", b"\x00" * 8, b"\xc1"])
        pub.send_multipart([b"only-one-frame"])
        pub.send_multipart(_frames(0, [_store(3)]))
        _poll_until(sub, lambda: sub.stats.batches == 1)
        assert sub.stats.malformed == 2 and sub.held == {(0, 3)}
    finally:
        sub.close()


def test_describe_and_json_show_signed_hashes() -> None:
    batch = decode_message(_frames(7, [_store(2**63, 2**64 - 2), BlockRemoved([5]),
                                       AllBlocksCleared()], rank=2))
    lines = describe(batch)
    assert "STORE" in lines[0] and str(-(2**63)) in lines[0] and "parent=-2" in lines[0]
    assert "REMOVE GPU" in lines[1] and "CLEAR" in lines[2]
    assert '"seq": 7' in as_json(batch) and str(-(2**63)) in as_json(batch)


def test_start_seq_replays_what_came_before_subscribing(ctx, xpub, tmp_path) -> None:
    pub, endpoint = xpub
    router = ctx.socket(zmq.ROUTER)
    replay_endpoint = f"ipc://{tmp_path}/replay0"
    router.bind(replay_endpoint)
    requests: list[int] = []

    def serve_once() -> None:
        if router.poll(10_000):
            client, empty, start = router.recv_multipart()
            requests.append(int.from_bytes(start, "big"))
            router.send_multipart([client, empty, *_frames(0, [_store(1)])])
            router.send_multipart([client, empty, b"", END_SEQ, b""])

    server = threading.Thread(target=serve_once)
    server.start()
    sub = StreamSubscriber(endpoint, replay_endpoint, context=ctx, start_seq=0)
    try:
        assert pub.poll(10_000)
        pub.recv()
        pub.send_multipart(_frames(1, [_store(2, 1)]))
        _poll_until(sub, lambda: sub.stats.batches == 2)
        assert requests == [0]
        assert sub.held == {(0, 1), (0, 2)} and sub.stats.orphan_stores == 0
        assert sub.stats.missing_batches == 0
    finally:
        server.join()
        router.close(0)
        sub.close()


class _ReplayServer:
    """A scripted replay ROUTER on its own thread: answers from ``buffer`` (seq -> frames)."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(endpoint)
        self.buffer: dict[int, list[bytes]] = {}
        self.requests: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            client, empty, start = self.router.recv_multipart()
            self.requests.append(int.from_bytes(start, "big"))
            for seq in sorted(self.buffer):
                if seq >= self.requests[-1]:
                    self.router.send_multipart([client, empty, *self.buffer[seq]])
            self.router.send_multipart([client, empty, b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.router.close(0)


def test_a_message_with_a_bad_ts_is_counted_and_the_stream_goes_on(ctx, xpub) -> None:
    pub, endpoint = xpub
    sub = _connect(ctx, pub, endpoint)
    try:
        pub.send_multipart([b"", encode_seq(0), msgpack.packb(["soon", [], 0])])
        pub.send_multipart([b"", encode_seq(1), msgpack.packb([[1, 2], [], 0])])
        pub.send_multipart(_frames(2, [_store(3)]))
        _poll_until(sub, lambda: sub.stats.batches == 1)
        assert sub.stats.malformed == 2 and sub.held == {(0, 3)}
        assert "ts" in (sub.last_malformed or "")
    finally:
        sub.close()


def test_a_restarted_publisher_below_the_old_seq_is_followed(ctx, xpub) -> None:
    pub, endpoint = xpub
    sub = _connect(ctx, pub, endpoint)
    try:
        for seq in range(6):
            pub.send_multipart(_frames(seq, [_store(100 + seq)]))
        _poll_until(sub, lambda: sub.stats.batches == 6)
        delivered = []
        for seq in range(5):  # the restarted publisher: seq from 0 again
            pub.send_multipart(_frames(seq, [_store(200 + seq)]))
        deadline = time.monotonic() + 10.0
        while len(delivered) < 5:
            assert time.monotonic() < deadline, delivered
            delivered.extend(sub.poll(20))
        assert [b.seq for b in delivered] == [0, 1, 2, 3, 4]
        assert sub.held == {(0, 200 + i) for i in range(5)}
        assert sub.stats.restarts == 1
    finally:
        sub.close()


def test_a_restarted_publisher_past_the_old_seq_is_not_taken_for_a_gap(ctx, xpub,
                                                                       tmp_path) -> None:
    pub, endpoint = xpub
    server = _ReplayServer(ctx, f"ipc://{tmp_path}/replay-r")
    sub = _connect(ctx, pub, endpoint, f"ipc://{tmp_path}/replay-r")
    try:
        for seq in range(3):
            pub.send_multipart(_frames(seq, [_store(100 + seq)]))
        _poll_until(sub, lambda: sub.stats.batches == 3)
        # The restarted publisher sent 0..5 before this subscriber saw any of it.
        server.buffer = {seq: _frames(seq, [_store(200 + seq)]) for seq in range(7)}
        pub.send_multipart(server.buffer[6])
        _poll_until(sub, lambda: (0, 206) in sub.held)
        assert server.requests == [2, 0]  # check the last applied batch; then all of it
        assert sub.held == {(0, 200 + i) for i in range(7)}
        assert sub.stats.restarts == 1 and sub.stats.missing_batches == 0
    finally:
        sub.close()
        server.close()


def test_a_restart_at_the_same_seq_is_caught_by_the_reconnection(ctx, tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/pub-r"
    server = _ReplayServer(ctx, f"ipc://{tmp_path}/replay-s")
    pub = ctx.socket(zmq.XPUB)
    pub.bind(endpoint)
    sub = _connect(ctx, pub, endpoint, f"ipc://{tmp_path}/replay-s")
    try:
        old = {seq: _frames(seq, [_store(100 + seq)]) for seq in range(3)}
        server.buffer = dict(old)
        for seq in range(3):
            pub.send_multipart(old[seq])
        _poll_until(sub, lambda: sub.stats.batches == 3)
        pub.close(0)
        server.buffer = {seq: _frames(seq, [_store(200 + seq)]) for seq in range(3)}
        pub = ctx.socket(zmq.XPUB)
        pub.bind(endpoint)
        _poll_until(sub, lambda: sub.stats.restarts == 1)  # polling lets the SUB reconnect
        assert sub.held == {(0, 200), (0, 201), (0, 202)}
        assert sub.stats.reconnects == 1
        assert server.requests == [2, 0]
        assert pub.poll(10_000), "subscription never arrived"
        pub.recv()
        pub.send_multipart(_frames(3, [_store(203)]))
        _poll_until(sub, lambda: (0, 203) in sub.held)
    finally:
        pub.close(0)
        sub.close()
        server.close()


def test_json_output_is_strict_json() -> None:
    frames = [b"", encode_seq(4), msgpack.packb(
        [float("nan"), [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                         "token_ids": [1, 2], "block_size": 2, "lora_id": float("inf"),
                         "medium": "GPU", "lora_name": b"\x00bin"}], 0])]
    text = as_json(decode_message(frames))

    def reject(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    parsed = json.loads(text, parse_constant=reject)
    assert parsed["ts"] is None and parsed["seq"] == 4
    assert parsed["events"][0]["lora_id"] is None
    assert isinstance(parsed["events"][0]["lora_name"], str)


def test_a_reconnection_replay_then_the_same_batches_live_is_no_restart(ctx, tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/pub-d"
    server = _ReplayServer(ctx, f"ipc://{tmp_path}/replay-d")
    pub = ctx.socket(zmq.XPUB)
    pub.bind(endpoint)
    sub = _connect(ctx, pub, endpoint, f"ipc://{tmp_path}/replay-d")
    try:
        stream = {seq: _frames(seq, [_store(100 + seq)]) for seq in range(5)}
        server.buffer = {seq: stream[seq] for seq in range(2)}
        for seq in range(2):
            pub.send_multipart(stream[seq])
        _poll_until(sub, lambda: sub.stats.batches == 2)
        pub.close(0)
        server.buffer = dict(stream)  # the same publisher went on meanwhile
        pub = ctx.socket(zmq.XPUB)
        pub.bind(endpoint)
        _poll_until(sub, lambda: sub.stats.reconnects == 1)
        assert sub.held == {(0, 100 + i) for i in range(5)}
        assert pub.poll(10_000), "subscription never arrived"
        pub.recv()
        for seq in (3, 4):  # also reached the subscriber live: duplicates, not a restart
            pub.send_multipart(stream[seq])
        pub.send_multipart(_frames(5, [_store(105)]))
        _poll_until(sub, lambda: (0, 105) in sub.held)
        assert sub.stats.restarts == 0 and sub.stats.duplicate_stores == 0
        assert sub.held == {(0, 100 + i) for i in range(6)}
    finally:
        pub.close(0)
        sub.close()
        server.close()


def test_replay_answers_without_a_topic_frame_are_understood(ctx, xpub, tmp_path) -> None:
    """vLLM's publisher answers a replay with [seq, payload] (no topic) and ends with
    [END_SEQ, b""]."""
    pub, endpoint = xpub
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{tmp_path}/replay-v")
    sub = _connect(ctx, pub, endpoint, f"ipc://{tmp_path}/replay-v")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not router.poll(20):
                continue
            client, empty, start = router.recv_multipart()
            for seq in range(int.from_bytes(start, "big"), 3):
                router.send_multipart([client, empty, *_frames(seq, [_store(10 + seq)])[1:]])
            router.send_multipart([client, empty, END_SEQ, b""])

    server = threading.Thread(target=serve)
    server.start()
    try:
        pub.send_multipart(_frames(0, [_store(10)]))
        pub.send_multipart(_frames(3, [_store(13)]))
        _poll_until(sub, lambda: sub.stats.batches >= 4)
        assert sub.held == {(0, 10 + i) for i in range(4)}
        assert sub.stats.malformed == 0 and sub.stats.missing_batches == 0
        assert sub.stats.restarts == 0
    finally:
        stop.set()
        server.join()
        sub.close()


def test_subscribe_command_json_is_strict(ctx, xpub, capsys) -> None:
    from kvbm_plugin.cli.subscribe import main_subscribe

    pub, endpoint = xpub
    nan_batch = [b"", encode_seq(0), msgpack.packb([float("nan"), [], 0])]
    stop = threading.Event()

    def keep_sending() -> None:  # until the command (on this test's thread) has one batch
        while not stop.wait(0.02):
            pub.send_multipart(nan_batch)

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    sender = threading.Thread(target=keep_sending)
    sender.start()
    try:
        assert main_subscribe([endpoint, "--json", "--count", "1", "--duration", "10"]) == 0
    finally:
        stop.set()
        sender.join()
        for sig, handler in handlers.items():  # the command installs its own
            signal.signal(sig, handler)
    lines = capsys.readouterr().out.splitlines()
    assert lines, "no batch printed"

    def reject(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    assert json.loads(lines[0], parse_constant=reject)["ts"] is None


def test_a_late_join_without_replay_says_where_it_joined_not_a_gap(ctx, xpub, capsys) -> None:
    from kvbm_plugin.cli.subscribe import join_note

    pub, endpoint = xpub
    sub = _connect(ctx, pub, endpoint)
    try:
        pub.send_multipart(_frames(5, [_store(6, 5)]))  # batches 0..4 went out before we came
        _poll_until(sub, lambda: sub.stats.batches == 1)
        assert sub.stats.gaps == 0 and sub.stats.missing_batches == 0
        assert sub.stats.joined_at_seq == 5 and sub.stats.history_missing == 5
        note = join_note(sub.stats, None)
        assert note is not None and "joined the stream at seq 5" in note
        assert "the 5 batches before it are not here" in note
        assert "--replay ENDPOINT --from-seq 0" in note
    finally:
        sub.close()


def test_a_replayed_join_that_missed_nothing_reports_no_gap(ctx, xpub, tmp_path) -> None:
    pub, endpoint = xpub
    replay_endpoint = f"ipc://{tmp_path}/replay-join"
    server = _ReplayServer(ctx, replay_endpoint)
    server.buffer = {0: _frames(0, [_store(1)]), 1: _frames(1, [_store(2, 1)])}
    sub = StreamSubscriber(endpoint, replay_endpoint, context=ctx, start_seq=0)
    try:
        assert pub.poll(10_000)
        pub.recv()
        pub.send_multipart(_frames(2, [_store(3, 2)]))
        _poll_until(sub, lambda: sub.stats.batches == 3)
        assert sub.stats.gaps == 0 and sub.stats.missing_batches == 0
        assert sub.stats.history_missing == 0 and sub.stats.replayed_batches == 2
        assert sub.held == {(0, 1), (0, 2), (0, 3)}
    finally:
        sub.close()
        server.close()


def test_a_quiet_stream_s_history_arrives_once_connected(ctx, xpub, tmp_path) -> None:
    """Nothing live comes after the join: the history is asked for once the SUB reached the
    publisher, not when a later batch shows the gap (it never would)."""
    _, endpoint = xpub
    replay_endpoint = f"ipc://{tmp_path}/replay-quiet"
    server = _ReplayServer(ctx, replay_endpoint)
    server.buffer = {0: _frames(0, [_store(1)]), 1: _frames(1, [_store(2, 1)])}
    sub = StreamSubscriber(endpoint, replay_endpoint, context=ctx, start_seq=0)
    try:
        _poll_until(sub, lambda: sub.stats.batches == 2)
        assert sub.connected and sub.held == {(0, 1), (0, 2)} and sub.stats.gaps == 0
    finally:
        sub.close()
        server.close()


def test_nothing_at_the_endpoint_is_said_within_seconds(monkeypatch, tmp_path, capsys) -> None:
    from kvbm_plugin.cli import subscribe

    monkeypatch.setattr(subscribe, "NOTHING_THERE_S", 0.3)
    started = time.monotonic()
    assert subscribe.main_subscribe([f"ipc://{tmp_path}/nobody", "--duration", "1"]) == 0
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err
    assert f"nothing answers at ipc://{tmp_path}/nobody" in err

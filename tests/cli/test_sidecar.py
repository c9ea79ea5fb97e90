"""Sidecar against a tiny local fake of trtllm-serve's POST /kv_cache_events."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import zmq
from _kvwire import BlockRemoved, BlockStored, decode, free_port, recv, wait_until

from kvbm_plugin.cli.sidecar import (
    build_sink,
    check_event,
    fetch_events,
    main_sidecar,
    run_sidecar,
)
from kvbm_plugin.consolidator_config import PublisherSettings, load_consolidator_config
from kvbm_plugin.wire.events import encode_payload
from kvbm_plugin.wire.publisher import EventPublisher


class FakeServe:
    """Serves queued event lists; each POST returns and clears what is queued."""

    def __init__(self) -> None:
        self.queue: list[dict[str, Any]] = []
        self.raw: list[bytes] = []  # bodies served as they are, before the queue
        self.lock = threading.Lock()
        self.posts = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                with fake.lock:
                    if fake.raw:
                        body = fake.raw.pop(0)
                    else:
                        body, fake.queue = json.dumps(fake.queue).encode(), []
                    fake.posts += 1
                self.send_response(200 if self.path == "/kv_cache_events" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # shutdown() returns at serve_forever's next poll (0.5 s by default): poll often.
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.01,),
                                       daemon=True)
        self.thread.start()

    def push(self, *events: dict[str, Any]) -> None:
        with self.lock:
            self.queue.extend(events)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve() -> Iterator[FakeServe]:
    fake = FakeServe()
    yield fake
    fake.close()


def stored(h: int, rank: int) -> dict[str, Any]:
    return {"event_id": 1, "window_size": 64, "attention_dp_rank": rank, "data": {
        "type": "stored", "parent_hash": None, "blocks": [{
            "type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35,
            "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                       for t in (1, 2)]}]}}


def _ports(ranks: int = 1) -> dict[str, str]:
    """A sidecar's GPU-tier base port and leader port, free and apart. Drawn one by one, the
    leader's derived ports (the consolidated output at + 1000 + r, announcements at + 2000)
    could land on a GPU-tier port (rank r at base + r), and loading the config refuses the
    collision: seen once in CI, as a ConfigError before the test's subject ran."""
    while True:
        base = free_port()
        if ranks > 1 and base + 1 == free_port():  # keep base and base+1 usable (best effort)
            continue
        leader = free_port()
        gpu = {base + r for r in range(ranks)}
        derived = {leader, leader + 2000, *(leader + 1000 + r for r in range(ranks))}
        if not gpu & derived:
            return {"DYN_KVBM_TRTLLM_ZMQ_PORT": str(base),
                    "DYN_KVBM_LEADER_ZMQ_PUB_PORT": str(leader)}


def test_fetch_events_posts_and_decodes(serve: FakeServe) -> None:
    serve.push(stored(1, 0))
    assert fetch_events(serve.url)[0]["data"]["type"] == "stored"
    assert fetch_events(serve.url) == []  # the endpoint clears what it returned


def test_sidecar_publishes_per_rank(serve: FakeServe, expect_errors) -> None:
    config = load_consolidator_config(_ports(ranks=2), num_ranks=2)
    stop = threading.Event()
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(run_sidecar(
        serve.url, config, block_size=2, interval=0.02, stop_event=stop)), daemon=True)
    thread.start()
    ctx = zmq.Context()
    subs = []
    try:
        for rank in range(2):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(config.publish_endpoint(rank).connect)
            subs.append(sub)
        # slow joiner: keep feeding a store and the removal of a probe block until each SUB
        # hears one (the sidecar's stream is prefix-closed: a removal of a block it never
        # published is not forwarded)
        for rank, sub in enumerate(subs):
            def probe(rank: int = rank, sub: zmq.Socket = sub) -> bool:
                serve.push(stored(7, rank),
                           {"event_id": 0, "window_size": 64, "attention_dp_rank": rank,
                            "data": {"type": "removed", "block_hashes": [7]}})
                if sub.poll(50):
                    while sub.poll(100):
                        sub.recv_multipart()
                    return True
                return False
            wait_until(probe, what=f"rank {rank} SUB joined")
        serve.push(stored((1 << 64) - 1, 1), stored(5, 0),
                   {"event_id": 3, "window_size": 64, "attention_dp_rank": 0,
                    "data": {"type": "removed", "block_hashes": [5]}},
                   {"event_id": 4, "window_size": 64, "attention_dp_rank": 9,
                    "data": {"type": "removed", "block_hashes": [5]}})
        b0 = decode(recv(subs[0])[2])
        b1 = decode(recv(subs[1])[2])
        assert b0.data_parallel_rank == 0 and b1.data_parallel_rank == 1
        assert b0.events == [
            BlockStored(block_hashes=[5], parent_block_hash=None, token_ids=[1, 2], block_size=2,
                        lora_id=None, medium="GPU", lora_name=None),
            BlockRemoved(block_hashes=[5], medium="GPU")]
        assert b1.events == [
            BlockStored(block_hashes=[-1], parent_block_hash=None, token_ids=[1, 2],
                        block_size=2, lora_id=None, medium="GPU", lora_name=None)]
    finally:
        stop.set()
        thread.join(10)
        for sub in subs:
            sub.close()
        ctx.term()
    assert not thread.is_alive()
    assert result["events_outside_ranks"] == 1 and result["polls"] >= 2
    assert result["poll_errors"] == 0
    assert expect_errors.wait_for("attention_dp_rank 9")


class StopAfter(threading.Event):
    """Reports set after ``n`` loop checks: a deterministic number of polls."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def is_set(self) -> bool:
        self.n -= 1
        return self.n < 0


def test_sidecar_counts_http_errors_and_stops() -> None:
    port = free_port()  # nothing listens here
    config = load_consolidator_config(_ports())
    result = run_sidecar(f"http://127.0.0.1:{port}", config, block_size=2, interval=0.001,
                         stop_event=StopAfter(3), http_timeout=0.5)
    assert result["polls"] == 3 and result["poll_errors"] == 3
    assert result["publisher_lost_batches"] == 0


def test_main_sidecar_rejects_bad_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_KVBM_TRTLLM_ZMQ_PORT", str(free_port()))
    with pytest.raises(SystemExit):
        main_sidecar(["--url", "http://x", "--block-size", "0"])
    with pytest.raises(SystemExit):
        main_sidecar(["--block-size", "32"])  # --url missing


def test_sidecar_survives_a_truncated_response() -> None:
    class Truncating(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server API
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.write(b"[]")  # 98 bytes short: the client raises IncompleteRead

        def log_message(self, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Truncating)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    try:
        config = load_consolidator_config(_ports())
        result = run_sidecar(f"http://127.0.0.1:{server.server_address[1]}", config,
                             block_size=2, interval=0.001, stop_event=StopAfter(2),
                             http_timeout=2.0)
        assert result["polls"] == 2 and result["poll_errors"] == 2
    finally:
        server.shutdown()
        server.server_close()


def test_the_sidecar_stream_is_prefix_closed() -> None:
    """trtllm-serve's events go straight to routers: a store under a parent the stream never
    published, and the removal of a block it never published, are dropped (counted)."""
    from kvbm_plugin.wire.publisher import NullEventPublisher

    config = load_consolidator_config({"DYN_KVBM_TRTLLM_ZMQ_PORT": str(free_port())})
    sink = build_sink(config, block_size=2,
                      publisher_factory=lambda settings, *_: NullEventPublisher(settings))
    try:
        orphan = stored(3, 0)
        orphan["data"]["parent_hash"] = 99
        sink.ingest([orphan, {"event_id": 2, "window_size": 64, "attention_dp_rank": 0,
                              "data": {"type": "removed", "block_hashes": [4]}}])
        stats = sink.stats()
        assert stats["orphan_stores_dropped"] == 1 and stats["unknown_removes_suppressed"] == 1
        assert stats["pending_events"] == 0
    finally:
        sink.shutdown(1.0)


class Encoding(EventPublisher):
    """Records what it could encode with the real payload encoder (False: the batch is lost,
    as a publisher that cannot encode it loses it)."""

    def __init__(self) -> None:
        super().__init__(PublisherSettings())
        self.batches: list[list[Any]] = []

    def publish(self, events: Sequence[dict[str, Any]], data_parallel_rank: int | None = None
                ) -> bool:
        try:
            payload = encode_payload(1.0, events, data_parallel_rank or 0)
        except Exception:
            return False
        self.batches.append(decode(payload).events)
        return True

    def shutdown(self, timeout: float = 5.0) -> None:
        return None


def _one_poll(serve: FakeServe) -> tuple[dict[str, Any], Encoding]:
    output = Encoding()
    config = load_consolidator_config(_ports())
    result = run_sidecar(serve.url, config, block_size=2, interval=0.001,
                         stop_event=StopAfter(1),
                         publisher_factory=lambda settings, ep, replay, rank: output)
    return result, output


def test_deeply_nested_json_is_one_malformed_event(serve: FakeServe) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    serve.raw.append(b"[" + json.dumps(stored(1, 0)).encode() + b", " + deep + b', {"a": "]"}, '
                     + json.dumps(stored(2, 0)).encode() + b"]")
    result, output = _one_poll(serve)
    assert result["poll_errors"] == 0 and result["events_malformed"] == 2  # deep, no data
    published = [e.block_hashes for batch in output.batches for e in batch]
    assert published == [[1], [2]]


def test_an_out_of_range_token_id_drops_that_event_only(serve: FakeServe) -> None:
    bad = stored(3, 0)
    bad["data"]["blocks"][0]["tokens"][0]["token_id"] = 10**30
    serve.push(stored(1, 0), bad, stored(2, 0))
    result, output = _one_poll(serve)
    assert result["events_malformed"] == 1
    published = [e.block_hashes for batch in output.batches for e in batch]
    assert published == [[1], [2]]
    assert check_event(bad) is not None and "64 bits" in check_event(bad)
    assert check_event([1]) is not None and check_event(stored(1, 0)) is None


@pytest.mark.parametrize(("status", "gives_up"), [(501, True), (404, True), (503, False)])
def test_sidecar_gives_up_on_a_status_no_retry_can_change(status: int, gives_up: bool) -> None:
    from kvbm_plugin.cli.sidecar import SidecarGaveUp

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server API
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    config = load_consolidator_config(_ports())
    try:
        if gives_up:
            with pytest.raises(SidecarGaveUp, match=f"HTTP {status}"):
                run_sidecar(url, config, block_size=2, interval=0.001,
                            stop_event=StopAfter(50))
        else:  # a server that is starting or restarting: retried
            result = run_sidecar(url, config, block_size=2, interval=0.001,
                                 stop_event=StopAfter(3))
            assert result["polls"] == 3 and result["poll_errors"] == 3
    finally:
        server.shutdown()
        server.server_close()

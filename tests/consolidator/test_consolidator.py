"""KvEventConsolidator: the socket shell (GPU-tier SUBs, replay, resync, registrations, output).

Endpoints are ipc paths in a short temp dir; every wait polls with a deadline. The output is read
back through the output publisher's replay socket from seq 0, so nothing is lost to the slow
joiner, and decoded with the shared codec (independent of the core).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq

from kvbm_plugin.cli.consolidate import main_consolidate
from kvbm_plugin.consolidator.service import KvEventConsolidator
from kvbm_plugin.consolidator_config import (
    EVENTS_ENDPOINT,
    OUTPUT_ENDPOINT,
    OUTPUT_REPLAY_ENDPOINT,
    REPLAY_ENDPOINT,
    ConsolidatorConfig,
    PublisherSettings,
    load_consolidator_config,
)
from kvbm_plugin.wire.events import END_SEQ, EventBatch, decode_message, encode_seq
from kvbm_plugin.wire.publisher import NullEventPublisher, create_publisher

BS = 4
U64 = 1 << 64


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def toks(*blocks: int) -> list[int]:
    """Token ids of consecutive blocks, block b -> [b, b+1000, b+2000, b+3000]."""
    return [b + 1000 * i for b in blocks for i in range(BS)]


def stored(hashes: list[int], parent: int | None, blocks: list[int],
           medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": toks(*blocks), "block_size": BS, "lora_id": None, "medium": medium,
            "lora_name": None}


def removed(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvc", dir="/tmp")  # ipc paths must stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_config(ipc_dir: str, *, num_ranks: int = 1, replay: bool = True,
                mode: str = "dedup") -> ConsolidatorConfig:
    env = {EVENTS_ENDPOINT: f"ipc://{ipc_dir}/ev", OUTPUT_ENDPOINT: f"ipc://{ipc_dir}/out",
           OUTPUT_REPLAY_ENDPOINT: f"ipc://{ipc_dir}/outr",
           "DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE": mode}
    if replay:
        env[REPLAY_ENDPOINT] = f"ipc://{ipc_dir}/rp"
    return load_consolidator_config(env, num_ranks=num_ranks)


@pytest.fixture
def closers() -> Iterator[list[Callable[[], None]]]:
    todo: list[Callable[[], None]] = []
    yield todo
    for close in reversed(todo):
        close()


@pytest.fixture
def start(closers) -> Callable[..., KvEventConsolidator]:
    def _start(config: ConsolidatorConfig, **kwargs: Any) -> KvEventConsolidator:
        consolidator = KvEventConsolidator(config, **kwargs)
        consolidator.start()
        closers.append(lambda: consolidator.shutdown(5.0))
        return consolidator
    return _start


class RawRank:
    """A test-controlled GPU-tier publisher: any seq, any frames, a scripted replay ROUTER.

    XPUB so the test can wait until the consolidator's subscription has arrived.
    """

    def __init__(self, config: ConsolidatorConfig, rank: int, ctx: zmq.Context) -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(config.publish_endpoint(rank).bind)
        replay = config.replay_endpoint(rank)
        self.router = None
        if replay is not None:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(replay.bind)
        self.rank = rank

    def wait_subscribed(self) -> None:
        assert self.pub.poll(10000), "consolidator never subscribed"
        self.pub.recv()

    def frames(self, seq: int, events: list[Any], dp_rank: int | None = None) -> list[bytes]:
        dp = self.rank if dp_rank is None else dp_rank
        return [b"", encode_seq(seq), msgpack.packb([time.time(), events, dp])]

    def send(self, seq: int, events: list[Any], dp_rank: int | None = None) -> list[bytes]:
        frames = self.frames(seq, events, dp_rank)
        self.pub.send_multipart(frames)
        return frames

    def next_replay_request(self, timeout_ms: int = 10000) -> tuple[bytes, int]:
        assert self.router is not None
        assert self.router.poll(timeout_ms), "no replay request arrived"
        frames = self.router.recv_multipart()
        assert frames[1] == b"" and len(frames[2]) == 8, frames
        return frames[0], int.from_bytes(frames[2], "big")

    def answer(self, ident: bytes, batches: list[list[bytes]]) -> None:
        assert self.router is not None
        for frames in batches:
            self.router.send_multipart([ident, b"", *frames])
        self.router.send_multipart([ident, b"", b"", END_SEQ, b""])

    def serve_startup(self) -> None:
        """Answer the catch-up request every consolidator sends at start: nothing buffered."""
        ident, start = self.next_replay_request()
        assert start == 0
        self.answer(ident, [])

    def close(self) -> None:
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)


@pytest.fixture
def raw_rank(closers) -> Callable[[ConsolidatorConfig, int], RawRank]:
    ctx = zmq.Context.instance()

    def _make(config: ConsolidatorConfig, rank: int = 0) -> RawRank:
        raw = RawRank(config, rank, ctx)
        closers.append(raw.close)
        return raw
    return _make


def read_output(config: ConsolidatorConfig, timeout: float = 10.0) -> list[EventBatch]:
    """Every output batch so far, replayed from seq 0 through the output replay socket."""
    assert config.output_replay is not None
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(config.output_replay.connect)
    try:
        dealer.send_multipart([b"", encode_seq(0)])
        batches: list[EventBatch] = []
        deadline = time.monotonic() + timeout
        while True:
            left = int((deadline - time.monotonic()) * 1000)
            assert left > 0 and dealer.poll(left), "output replay did not finish"
            frames = dealer.recv_multipart()
            body = frames[1:]
            if body[1] == END_SEQ:
                break
            batches.append(decode_message(body))
    finally:
        dealer.close(0)
    assert [b.seq for b in batches] == list(range(len(batches))), "output has a seq gap"
    return batches


class Router:
    """What a router holds after replaying the output (u64 hashes per dp rank)."""

    def __init__(self, batches: list[EventBatch]) -> None:
        self.held: dict[int, set[int]] = {}
        self.stores = self.removes = self.clears = 0
        for batch in batches:
            assert batch.data_parallel_rank is not None
            held = self.held.setdefault(batch.data_parallel_rank, set())
            assert len({id(e) for e in batch.events}) == len(batch.events)
            for event in batch.events:
                name = type(event).__name__
                if name == "BlockStored":
                    assert event.parent_block_hash is None or event.parent_block_hash in held
                    for h in event.block_hashes:
                        assert h not in held, "duplicate STORE"
                        held.add(h)
                        self.stores += 1
                elif name == "BlockRemoved":
                    for h in event.block_hashes:
                        assert h in held, "REMOVE of a block not held"
                        held.discard(h)
                        self.removes += 1
                else:
                    held.clear()
                    self.clears += 1


def settled(consolidator: KvEventConsolidator, config: ConsolidatorConfig,
            cond: Callable[[dict[str, int]], bool]) -> Router:
    wait_for(lambda: cond(consolidator.stats()), what="consolidator input")
    assert consolidator.wait_idle(10.0)
    return Router(read_output(config))


def sync_live(pub: Any, consolidator: KvEventConsolidator, timeout: float = 10.0) -> None:
    """Publish empty batches until one arrives live (the subscription has taken effect)."""
    deadline = time.monotonic() + timeout
    while True:
        before = consolidator.stats()["messages_received"]
        pub.publish([])
        try:
            wait_for(lambda b=before: consolidator.stats()["messages_received"] > b, 0.2)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise


# ---------------------------------------------------------------------- end to end


def test_two_ranks_and_tiers_give_one_deduplicated_stream_per_dp_rank(ipc_dir, start, closers):
    config = make_config(ipc_dir, num_ranks=2)
    publishers = []
    for rank in range(2):
        pub = create_publisher(config.publisher, config.publish_endpoint(rank),
                               config.replay_endpoint(rank), rank)
        closers.append(lambda p=pub: p.shutdown(2.0))
        publishers.append(pub)
    # Published before the consolidator exists: recovered by its catch-up replay from seq 0.
    publishers[0].publish([stored([11, 12], None, [1, 2])])
    publishers[1].publish([stored([11], None, [1])])  # same hash and tokens, other dp rank
    wait_for(lambda: all(p.stats()["batches_published"] == 1 for p in publishers))
    consolidator = start(config)
    wait_for(lambda: consolidator.stats()["batches_applied"] == 2)  # the engine's hashes first
    consolidator.register_store("CPU", 0, 11, None, toks(1), BS)
    consolidator.register_store("cpu_tier2", 0, 0xFFFF_FFFF_FFFF_FF12, 11, toks(2), BS)
    router = settled(consolidator, config, lambda s: s["batches_applied"] >= 2
                     and s["registrations"] == 2)
    assert router.held == {0: {11, 12}, 1: {11}}
    assert router.stores == 3
    # The engine evicts both on rank 0: host (11) and disk (12 under the disk's hash) hold them.
    sync_live(publishers[0], consolidator)
    applied = consolidator.stats()["batches_applied"]
    publishers[0].publish([removed([11, 12])])
    router = settled(consolidator, config, lambda s: s["batches_applied"] > applied)
    assert router.held == {0: {11, 12}, 1: {11}} and router.removes == 0
    consolidator.register_remove("DISK", 0, [0xFFFF_FFFF_FFFF_FF12])
    consolidator.register_remove("CPU", 0, [11])
    router = settled(consolidator, config, lambda s: s["registrations"] == 4)
    assert router.held[0] == set() and router.held[1] == {11}
    assert router.removes == 2  # exactly one REMOVE per block
    stats = consolidator.stats()
    assert stats["late_joins"] == 0 and stats["resyncs"] == 0 and stats["malformed"] == 0
    assert stats["replayed_batches"] >= 2


def test_output_batches_keep_the_dp_rank(ipc_dir, start, raw_rank):
    config = make_config(ipc_dir, num_ranks=2, replay=False)
    ranks = [raw_rank(config, r) for r in range(2)]
    consolidator = start(config)
    for raw in ranks:
        raw.wait_subscribed()
    ranks[0].send(0, [stored([1], None, [1])])
    ranks[1].send(0, [stored([2], None, [2])])
    consolidator.register_store("DISK", 1, 3, None, toks(3), BS)
    settled(consolidator, config, lambda s: s["batches_applied"] == 2
            and s["registrations"] == 1)
    batches = read_output(config)
    by_rank: dict[int, set[int]] = {}
    for batch in batches:
        for event in batch.events:
            by_rank.setdefault(batch.data_parallel_rank, set()).update(event.block_hashes)
    assert by_rank == {0: {1}, 1: {2, 3}}


def test_passthrough_mode_forwards_tier_media(ipc_dir, start, raw_rank):
    config = make_config(ipc_dir, replay=False, mode="passthrough")
    raw = raw_rank(config)
    consolidator = start(config)
    raw.wait_subscribed()
    raw.send(0, [stored([1], None, [1])])
    consolidator.register_store("CPU", 0, 1, None, toks(1), BS)
    wait_for(lambda: consolidator.stats()["batches_applied"] == 1
             and consolidator.stats()["registrations"] == 1)
    assert consolidator.wait_idle(10.0)
    media = [e.medium for b in read_output(config) for e in b.events]
    assert sorted(media) == ["CPU", "GPU"]


@pytest.mark.parametrize("mode", ["dedup", "passthrough"])
def test_a_tier_store_names_its_adapter_as_a_router_reads_it(ipc_dir, start, mode):
    config = make_config(ipc_dir, replay=False, mode=mode)
    consolidator = start(config)
    consolidator.register_store("CPU", 0, 1, None, toks(1), BS, lora_id=0)
    consolidator.register_store("CPU", 0, 2, None, toks(1), BS)
    wait_for(lambda: consolidator.stats()["registrations"] == 2)
    assert consolidator.wait_idle(10.0)
    names = {h: (e.lora_id, e.lora_name) for b in read_output(config) for e in b.events
             for h in e.block_hashes}
    assert names == {1: (0, "lora-0"), 2: (None, None)}  # task id 0 is an adapter


# ---------------------------------------------------------------------- gaps


def test_gap_is_filled_by_replay(ipc_dir, start, raw_rank):
    config = make_config(ipc_dir)
    raw = raw_rank(config)
    consolidator = start(config)
    raw.wait_subscribed()
    raw.serve_startup()
    first = raw.send(0, [stored([1], None, [1]), stored([9], None, [9])])
    lost = raw.frames(1, [stored([2], 1, [2]), removed([9])])  # never sent live
    live = raw.send(2, [stored([3], 2, [3])])
    ident, start_seq = raw.next_replay_request()
    assert start_seq == 0  # from the last batch applied: it must come back unchanged
    raw.answer(ident, [first, lost, live])
    router = settled(consolidator, config, lambda s: s["batches_applied"] == 3)
    assert router.held == {0: {1, 2, 3}}
    stats = consolidator.stats()
    assert stats["gaps"] == 1 and stats["replay_requests"] == 2  # catch-up + gap
    assert stats["replayed_batches"] == 2 and stats["resyncs"] == 0
    assert stats["unfillable_gaps"] == 0


def test_gap_without_replay_endpoint_resyncs_the_rank(ipc_dir, start, raw_rank):
    config = make_config(ipc_dir, replay=False)
    raw = raw_rank(config)
    consolidator = start(config)
    raw.wait_subscribed()
    raw.send(0, [stored([1, 2], None, [1, 2])])
    consolidator.register_store("CPU", 0, 1, None, toks(1), BS)
    wait_for(lambda: consolidator.stats()["batches_applied"] == 1
             and consolidator.stats()["registrations"] == 1)
    raw.send(5, [stored([9], None, [9])])  # seq 1..4 lost for good
    router = settled(consolidator, config, lambda s: s["batches_applied"] == 2)
    # Block 2 was held only by the engine: treated as cleared. Block 1 is on the host.
    assert router.held == {0: {1, 9}}
    assert router.removes == 1
    stats = consolidator.stats()
    assert stats["unfillable_gaps"] == 1 and stats["resyncs"] == 1


def test_gap_beyond_the_replay_buffer_resyncs(ipc_dir, start, raw_rank):
    config = make_config(ipc_dir)
    raw = raw_rank(config)
    consolidator = start(config)
    raw.wait_subscribed()
    raw.serve_startup()
    raw.send(0, [stored([1], None, [1])])
    live = raw.send(3, [stored([3], None, [3])])
    ident, start_seq = raw.next_replay_request()
    assert start_seq == 0
    raw.answer(ident, [live])  # the publisher no longer buffers 0, 1 and 2
    router = settled(consolidator, config, lambda s: s["batches_applied"] == 2)
    assert router.held == {0: {3}}
    assert consolidator.stats()["unfillable_gaps"] == 1
    assert consolidator.stats()["resyncs"] == 1


def test_replay_that_never_answers_times_out_into_a_resync(ipc_dir, start, raw_rank):
    config = make_config(ipc_dir)
    raw = raw_rank(config)
    consolidator = start(config, replay_timeout=0.2)
    raw.wait_subscribed()
    raw.serve_startup()
    raw.send(0, [stored([1], None, [1])])
    raw.send(2, [stored([2], None, [2])])
    raw.next_replay_request()  # and never answer
    raw.send(3, [stored([3], 2, [3])])  # held back during the replay, applied after it
    router = settled(consolidator, config, lambda s: s["replay_failures"] == 1
                     and s["batches_applied"] == 3)
    assert router.held == {0: {2, 3}}
    assert consolidator.stats()["resyncs"] == 1


def test_publisher_restart_resyncs_the_rank(ipc_dir, start, raw_rank):
    config = make_config(ipc_dir, replay=False)
    raw = raw_rank(config)
    consolidator = start(config)
    raw.wait_subscribed()
    raw.send(0, [stored([1], None, [1])])
    raw.send(1, [stored([2], None, [2])])
    wait_for(lambda: consolidator.stats()["batches_applied"] == 2)
    raw.send(0, [stored([2], None, [2])])  # a restarted engine: seq back to 0
    router = settled(consolidator, config, lambda s: s["batches_applied"] == 3)
    assert router.held == {0: {2}}
    stats = consolidator.stats()
    assert stats["restarts"] == 1 and stats["resyncs"] == 1


def test_late_start_recovers_the_rank_publishers_buffer(ipc_dir, start, closers):
    """A consolidator that starts late recovers every batch from the rank publisher's buffer."""
    config = make_config(ipc_dir)
    pub = create_publisher(config.publisher, config.publish_endpoint(0),
                           config.replay_endpoint(0), 0)
    closers.append(lambda: pub.shutdown(2.0))
    for i in range(20):
        pub.publish([stored([100 + i], None if i == 0 else 99 + i, [i])])
    wait_for(lambda: pub.stats()["batches_published"] == 20)
    consolidator = start(config)
    wait_for(lambda: consolidator.stats()["batches_applied"] == 20)
    sync_live(pub, consolidator)
    applied = consolidator.stats()["batches_applied"]
    pub.publish([removed([119])])
    router = settled(consolidator, config, lambda s: s["batches_applied"] > applied)
    assert router.held == {0: set(range(100, 119))}


# ---------------------------------------------------------------------- robustness


def test_garbage_frames_never_kill_the_ingest_thread(ipc_dir, start, raw_rank):
    config = make_config(ipc_dir, replay=False)
    raw = raw_rank(config)
    consolidator = start(config)
    raw.wait_subscribed()
    garbage = [
        [b"only-one-frame"],
        [b"", b"1", b"2", b"3", b"4"],
        [b"", encode_seq(0), b"\xc1\xc1 not msgpack"],
        [b"", b"short", msgpack.packb([0.0, [], 0])],
        [b"", encode_seq(0), msgpack.packb({"not": "a batch"})],
        [b"", encode_seq(0), msgpack.packb([0.0, [], "rank"])],
        [b"", encode_seq(0), msgpack.packb([0.0, [], -3])],
    ]
    for frames in garbage:
        raw.pub.send_multipart(frames)
    raw.send(0, [stored([1], None, [1], medium="HBM"),  # unknown medium: dropped, counted
                 "junk", ["BlockStored", [2], None, toks(2), BS, None, "GPU"],
                 {"type": "BlockStored", "block_hashes": [3], "parent_block_hash": None,
                  "token_ids": [1], "block_size": BS}])
    raw.send(1, [removed(["x"]), stored([4], None, [4])])
    router = settled(consolidator, config, lambda s: s["messages_received"] == 9)
    assert router.held == {0: {2, 4}}
    stats = consolidator.stats()
    assert stats["malformed"] == len(garbage) + 3
    assert stats["unknown_medium"] == 1
    assert stats["events_applied"] == 2


def test_an_ext_value_loses_only_its_own_event(ipc_dir, start, raw_rank):
    """A msgpack Timestamp or ExtType in token_ids, lora_id or lora_name is refused at ingest
    (malformed); the other events of the batch reach the output, which encodes."""
    config = make_config(ipc_dir, replay=False)
    raw = raw_rank(config)
    consolidator = start(config)
    raw.wait_subscribed()
    ts, ext = msgpack.Timestamp(1, 2), msgpack.ExtType(5, b"x")
    raw.send(0, [stored([1], None, [1]),
                 {**stored([2], 1, [2]), "token_ids": [2, ts, 2, 2]},
                 {**stored([3], 1, [3]), "lora_id": ts},
                 {**stored([4], 1, [4]), "lora_name": ext},
                 stored([5], 1, [5])])
    raw.send(1, [stored([6], 5, [6]), {**stored([7], 6, [7]), "token_ids": [ext] * BS}])
    router = settled(consolidator, config, lambda s: s["messages_received"] == 2)
    assert router.held == {0: {1, 5, 6}}
    stats = consolidator.stats()
    assert stats["malformed"] == 4
    assert stats["output_lost"] == 0 and stats["events_applied"] == 3


def test_the_output_counts_the_subscriptions_it_took_in(ipc_dir, start):
    """``output_subscriptions``: 0 while no router listens, then one per SUB that subscribed
    (what a deployment, or a test, waits for before the first batch it must not lose)."""
    config = make_config(ipc_dir, replay=False)
    consolidator = start(config)
    assert consolidator.stats()["output_subscriptions"] == 0
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    try:
        sub.connect(config.output.connect)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        wait_for(lambda: consolidator.stats()["output_subscriptions"] == 1,
                 what="the output's subscription")
    finally:
        sub.close(0)


def test_bogus_dp_ranks_are_refused_and_keep_no_state(ipc_dir, start, raw_rank, caplog):
    """A payload naming a dp rank outside 0..max_dp_ranks-1 is dropped, counted and logged
    (rate-limited); no per-rank state is kept for it, however many distinct ranks arrive."""
    from kvbm_plugin.wire.events import MAX_DP_RANKS

    config = make_config(ipc_dir, replay=False)
    raw = raw_rank(config)
    consolidator = start(config)
    raw.wait_subscribed()
    bogus = 300
    with caplog.at_level(logging.WARNING, logger="kvbm_plugin.consolidator.service"):
        for i in range(bogus):
            raw.send(i, [stored([10], None, [1])], dp_rank=MAX_DP_RANKS + i)
        raw.send(bogus, [stored([1], None, [1])], dp_rank=MAX_DP_RANKS - 1)
        raw.send(bogus + 1, [stored([2], None, [2])], dp_rank=0)
        router = settled(consolidator, config,
                         lambda s: s["messages_received"] == bogus + 2)
    assert router.held == {MAX_DP_RANKS - 1: {1}, 0: {2}}
    stats = consolidator.stats()
    assert stats["unknown_dp_ranks_refused"] == bogus
    assert stats["malformed"] == 0 and stats["batches_applied"] == 2
    assert sorted(consolidator._core._ranks) == [0, MAX_DP_RANKS - 1]
    warnings = [r for r in caplog.records if "data_parallel_rank" in r.getMessage()]
    assert 0 < len(warnings) < 10


def test_registrations_from_many_threads(ipc_dir, start, raw_rank):
    config = make_config(ipc_dir, replay=False)
    raw_rank(config)
    consolidator = start(config)
    per_thread = 300

    def tier_thread(t: int) -> None:
        tier = "CPU" if t % 2 else "DISK"
        for i in range(per_thread):
            h = t * 10_000 + i
            consolidator.register_store(tier, t % 2, h, None, toks(h), BS)
            if i % 3 == 0:
                consolidator.register_remove(tier, t % 2, [h])

    threads = [threading.Thread(target=tier_thread, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    consolidator.register_clear("DISK", 0)  # threads 0 and 2 registered dp 0 on DISK
    router = settled(consolidator, config,
                     lambda s: s["registrations"] == 4 * (per_thread + 100) + 1)
    expected = {t * 10_000 + i for t in (1, 3) for i in range(per_thread) if i % 3}
    assert router.held.get(0, set()) == set()
    assert router.held[1] == expected
    assert consolidator.stats()["registration_errors"] == 0


def test_registration_arguments_are_checked_on_the_callers_thread(ipc_dir, start, raw_rank):
    config = make_config(ipc_dir, replay=False)
    raw_rank(config)
    consolidator = start(config)
    with pytest.raises(ValueError, match="HBM"):
        consolidator.register_store("HBM", 0, 1, None, toks(1), BS)
    with pytest.raises(ValueError, match="64-bit"):
        consolidator.register_remove("CPU", 0, [U64])
    # A wrong token count is the tier's bug: counted on the ingest thread, never raised there.
    consolidator.register_store("CPU", 0, 1, None, [1, 2], BS)
    wait_for(lambda: consolidator.stats()["registration_errors"] == 1)
    assert consolidator.wait_idle(5.0)


@pytest.mark.parametrize("mode", ["dedup", "passthrough"])
def test_stores_registered_together_go_out_as_one_by_one(ipc_dir, start, mode):
    """``register_stores`` (the leader's form: one call per batch of reports) publishes what
    the same ``register_store`` calls would, in order, scope included; a bad hash anywhere
    in it raises on the caller's thread and queues none of it; a bad token count drops only
    its own block."""
    config = make_config(ipc_dir, replay=False, mode=mode)
    consolidator = start(config)
    # (checked in bulk: every kind of bad hash, as a block's and as a parent's)
    for bad in (U64, -(1 << 63) - 1, True, 2.0, "3"):
        with pytest.raises(ValueError, match="64-bit"):
            consolidator.register_stores("CPU", 0, [(1, None, toks(1), None, None),
                                                    (2, bad, toks(2), None, None)], BS)
        with pytest.raises(ValueError, match="64-bit"):
            consolidator.register_stores("CPU", 0, [(bad, None, toks(1), None, None),
                                                    (2, 0, toks(2), None, None)], BS)
    consolidator.register_stores("CPU", 0, [
        (1, None, toks(1), None, None), (2, 1, toks(2), 0, None),
        (3, 2, [1, 2], None, None),  # the tier's bug: dropped, counted, not raised
        (4, 1, toks(4), None, ("salt", "s1"))], BS)
    consolidator.register_stores("DISK", 0, [], BS)  # nothing to queue
    wait_for(lambda: consolidator.stats()["registrations"] == 3
             and consolidator.stats()["registration_errors"] == 1)
    assert consolidator.wait_idle(10.0)
    events = [e for b in read_output(config) for e in b.events]
    assert [(e.block_hashes, e.parent_block_hash, e.lora_name, e.extra_keys)
            for e in events] == [([1], None, None, None), ([2], 1, "lora-0", None),
                                 ([4], 1, None, [["salt", "s1"]])]


class RecordingPublisher(NullEventPublisher):
    """An in-test output: keeps every batch; its owner (the test) shuts it down."""

    def __init__(self) -> None:
        super().__init__(PublisherSettings())
        self.batches: list[tuple[int | None, list[Any]]] = []
        self.shut = False

    def publish(self, events: Any, data_parallel_rank: int | None = None) -> bool:
        self.batches.append((data_parallel_rank, list(events)))
        return super().publish(events, data_parallel_rank)

    def shutdown(self, timeout: float = 5.0) -> None:
        self.shut = True


class GatedPublisher(RecordingPublisher):
    """Holds the ingest thread inside its first publish until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()

    def publish(self, events: Any, data_parallel_rank: int | None = None) -> bool:
        self.entered.set()
        assert self.gate.wait(10.0)
        return super().publish(events, data_parallel_rank)


@pytest.mark.parametrize("flush_every", [1, 16])
def test_a_backlog_is_published_in_batches_of_at_most_flush_every_inputs(ipc_dir, raw_rank,
                                                                         flush_every):
    config = make_config(ipc_dir, replay=False)
    raw = raw_rank(config)
    output = GatedPublisher()
    consolidator = KvEventConsolidator(config, publisher=output, flush_every=flush_every)
    consolidator.start()
    try:
        raw.wait_subscribed()
        # A second subscriber of the same stream: once it holds all 40 backlog messages, the
        # consolidator's SUB (same PUB, same transport, subscribed earlier) holds them too.
        raw.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # report the probe's (duplicate) subscription
        probe = zmq.Context.instance().socket(zmq.SUB)
        probe.setsockopt(zmq.LINGER, 0)
        probe.setsockopt(zmq.SUBSCRIBE, b"")
        probe.connect(config.publish_endpoint(0).connect)
        try:
            raw.wait_subscribed()
            raw.send(0, [stored([100], None, [100])], dp_rank=2)
            assert output.entered.wait(10.0)  # the ingest thread now waits in its first publish
            for seq in range(1, 41):  # a backlog of 40 batches queues up meanwhile
                raw.send(seq, [stored([seq], None, [seq])], dp_rank=2)
            seen: list[int] = []

            def probe_saw_backlog() -> bool:
                while probe.poll(0):
                    seen.append(decode_message(probe.recv_multipart()).seq or 0)
                return 40 in seen

            wait_for(probe_saw_backlog)
        finally:
            probe.close(0)
        output.gate.set()
        wait_for(lambda: consolidator.stats()["batches_applied"] == 41)
        assert consolidator.wait_idle(10.0)
    finally:
        output.gate.set()
        consolidator.shutdown(5.0)
    assert all(rank == 2 for rank, _ in output.batches)  # dp rank preserved
    per_batch = [[h for e in events for h in e["block_hashes"]] for _, events in output.batches]
    assert [h for hashes in per_batch for h in hashes] == [100, *range(1, 41)]  # in order
    assert max(len(hashes) for hashes in per_batch) <= flush_every
    if flush_every == 1:
        assert len(per_batch) == 41  # one output batch per input batch
    else:
        assert len(per_batch) < 41


def test_shutdown_applies_what_is_queued_and_leaves_a_passed_publisher(ipc_dir, raw_rank):
    config = make_config(ipc_dir, replay=False)
    raw_rank(config)
    output = RecordingPublisher()
    consolidator = KvEventConsolidator(config, publisher=output)
    consolidator.start()
    for h in range(50):
        consolidator.register_store("DISK", 3, h, None, toks(h), BS)
    consolidator.shutdown(3.0)
    stored = [h for rank, events in output.batches for e in events
              for h in e["block_hashes"] if rank == 3]
    assert stored == list(range(50))
    assert not output.shut  # the caller's publisher stays the caller's


def test_shutdown_is_idempotent_and_bounded(ipc_dir, raw_rank, caplog):
    config = make_config(ipc_dir, replay=False)
    raw_rank(config)
    consolidator = KvEventConsolidator(config)
    consolidator.start()
    with pytest.raises(RuntimeError, match="already started"):
        consolidator.start()
    consolidator.register_store("CPU", 0, 1, None, toks(1), BS)
    began = time.monotonic()
    consolidator.shutdown(3.0)
    consolidator.shutdown(3.0)
    assert time.monotonic() - began < 4.0
    assert consolidator.stats()["registrations"] == 1  # applied before the thread stopped
    with caplog.at_level(logging.WARNING, logger="kvbm_plugin.consolidator.service"):
        consolidator.register_remove("CPU", 0, [1])  # after shutdown: dropped, never raises
    assert consolidator.stats()["registrations_dropped"] == 1
    assert "remove registration after shutdown dropped" in caplog.text
    # The output port is free again.
    again = KvEventConsolidator(config)
    again.start()
    again.shutdown(3.0)


def test_output_is_published_inline_by_the_ingest_thread(ipc_dir, start, raw_rank):
    """The built-in ZMQ output runs in its inline mode: no publisher thread, and the ingest
    thread answers output replays (read_output) between input messages."""
    config = make_config(ipc_dir, replay=False)
    rank = raw_rank(config)
    consolidator = start(config)
    names = [t.name for t in threading.enumerate()]
    assert "kvbm-consolidator" in names
    assert not any(n.startswith("kvbm-zmq-publisher") for n in names)
    rank.wait_subscribed()
    rank.send(0, [stored([1, 2], None, [1, 2])])
    wait_for(lambda: consolidator.stats()["batches_out"] == 1, what="output batch")
    batches = read_output(config)
    assert [h for b in batches for e in b.events for h in e.block_hashes] == [1, 2]


def test_inline_output_of_a_stuck_ingest_thread_is_closed_by_that_thread(ipc_dir, raw_rank,
                                                                          monkeypatch):
    """shutdown() must not close sockets another thread is using: when the ingest thread does not
    stop in time, its inline output stays open until that thread ends and closes it."""
    release = threading.Event()
    looping = threading.Event()

    def stuck_loop(self, *args: Any) -> None:  # ignores the stop flag until released
        looping.set()
        release.wait(10.0)

    monkeypatch.setattr(KvEventConsolidator, "_loop", stuck_loop)
    config = make_config(ipc_dir, replay=False)
    raw_rank(config)
    consolidator = KvEventConsolidator(config)
    consolidator.start()
    try:
        assert looping.wait(5.0)
        output = consolidator._publisher
        consolidator.shutdown(0.2)
        assert consolidator._thread is not None and consolidator._thread.is_alive()
        assert output.replay_socket is not None  # still open: the ingest thread owns it
    finally:
        release.set()
    wait_for(lambda: not consolidator._thread.is_alive(), what="ingest thread end")
    assert output.replay_socket is None  # closed by the ingest thread on its way out
    assert output.publish([]) is False  # and closed for good


def test_another_publisher_kind_comes_from_the_factory(ipc_dir, start, raw_rank):
    env = {EVENTS_ENDPOINT: f"ipc://{ipc_dir}/ev", OUTPUT_ENDPOINT: f"ipc://{ipc_dir}/out",
           "DYN_KVBM_KV_EVENTS_PUBLISHER": "null"}
    config = load_consolidator_config(env)
    rank = raw_rank(config)
    consolidator = start(config)
    rank.wait_subscribed()
    rank.send(0, [stored([1], None, [1])])
    wait_for(lambda: consolidator.stats()["batches_out"] == 1, what="output batch")
    assert isinstance(consolidator._publisher, NullEventPublisher)
    assert consolidator._publisher.stats()["batches_published"] == 1


def test_start_failure_raises_and_leaves_nothing_running(ipc_dir):
    blocker = zmq.Context.instance().socket(zmq.PUB)
    blocker.setsockopt(zmq.LINGER, 0)
    port = blocker.bind_to_random_port("tcp://127.0.0.1")
    try:
        env = {EVENTS_ENDPOINT: f"ipc://{ipc_dir}/ev", OUTPUT_ENDPOINT: f"tcp://127.0.0.1:{port}"}
        consolidator = KvEventConsolidator(load_consolidator_config(env))
        with pytest.raises(Exception, match=str(port)):
            consolidator.start()
        consolidator.shutdown(1.0)  # nothing to do, must not raise
        assert not any(t.name == "kvbm-consolidator" for t in threading.enumerate())
        consolidator.register_store("CPU", 0, 1, None, toks(1), BS)  # dropped, no raise
    finally:
        blocker.close(0)


# ---------------------------------------------------------------------- standalone command


def test_main_consolidate_rejects_bad_settings(capsys):
    with pytest.raises(SystemExit) as info:
        main_consolidate(["--num-ranks", "0"])
    assert info.value.code == 2
    assert "--num-ranks: 0 must be >= 1" in capsys.readouterr().err


def test_consolidate_command_runs_until_sigterm(ipc_dir):
    env = dict(os.environ, DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR="false")
    env.pop(EVENTS_ENDPOINT, None)
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kvbm_plugin.cli.consolidate import "
         "main_consolidate; sys.exit(main_consolidate(sys.argv[1:]))",
         "--num-ranks", "2", "--events-endpoint", f"ipc://{ipc_dir}/ev",
         "--output-endpoint", f"ipc://{ipc_dir}/out"],
        env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 30
        while not any("started" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, lines
            lines.append(proc.stderr.readline())
        assert f"ipc://{ipc_dir}/ev_dp1" in lines[-1]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 143  # 128 + SIGTERM, as every command
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


class RaisingPublisher(RecordingPublisher):
    """Breaks the never-raise contract on its first publish."""

    def __init__(self) -> None:
        super().__init__()
        self.raised = False

    def publish(self, events: Any, data_parallel_rank: int | None = None) -> bool:
        if not self.raised:
            self.raised = True
            raise RuntimeError("transport plugin bug")
        return super().publish(events, data_parallel_rank)


def test_a_raising_publisher_loses_one_batch_counted_and_ingest_goes_on(ipc_dir, raw_rank,
                                                                        expect_errors):
    config = make_config(ipc_dir, replay=False)
    raw_rank(config)
    output = RaisingPublisher()
    consolidator = KvEventConsolidator(config, publisher=output)
    consolidator.start()
    try:
        consolidator.register_store("CPU", 0, 1, None, toks(1), BS)
        wait_for(lambda: consolidator.stats()["output_lost"] == 1)
        consolidator.register_store("CPU", 0, 2, 1, toks(2), BS)
        wait_for(lambda: len(output.batches) == 1)
        assert output.batches[0][1][0]["block_hashes"] == [2]
    finally:
        consolidator.shutdown(5.0)
    assert expect_errors.wait_for("transport plugin bug")


def test_an_unexpected_ingest_error_is_counted_and_ingest_goes_on(ipc_dir, raw_rank,
                                                                  monkeypatch, expect_errors):
    config = make_config(ipc_dir, replay=False)
    raw_rank(config)
    output = RecordingPublisher()
    consolidator = KvEventConsolidator(config, publisher=output)
    original = KvEventConsolidator._drain_registrations
    raised = threading.Event()

    def fails_once(self) -> None:
        if self._queue and not raised.is_set():
            raised.set()
            raise RuntimeError("bug")
        original(self)

    monkeypatch.setattr(KvEventConsolidator, "_drain_registrations", fails_once)
    consolidator.start()
    try:
        consolidator.register_store("CPU", 0, 1, None, toks(1), BS)
        wait_for(lambda: consolidator.stats()["ingest_errors"] == 1)
        wait_for(lambda: len(output.batches) == 1)  # the queued store applied on the retry
        consolidator.register_store("CPU", 0, 2, 1, toks(2), BS)
        wait_for(lambda: len(output.batches) == 2)
    finally:
        consolidator.shutdown(5.0)
    assert expect_errors.wait_for("ingest loop failed")


def test_start_waits_for_the_ingest_thread_with_a_deadline(ipc_dir, monkeypatch):
    release = threading.Event()

    def stuck(self) -> None:  # an ingest thread that never gets its sockets up
        release.wait(10.0)

    monkeypatch.setattr(KvEventConsolidator, "_run", stuck)
    consolidator = KvEventConsolidator(make_config(ipc_dir, replay=False),
                                       publisher=RecordingPublisher(), start_timeout=0.2)
    try:
        began = time.monotonic()
        with pytest.raises(RuntimeError, match="within 0.2s"):
            consolidator.start()
        assert time.monotonic() - began < 5.0
        consolidator.shutdown(1.0)  # stopped already: returns at once
    finally:
        release.set()
    with pytest.raises(ValueError, match="start_timeout=0"):
        KvEventConsolidator(make_config(ipc_dir, replay=False), start_timeout=0)


def test_a_repeating_ingest_error_backs_off_instead_of_spinning(ipc_dir, raw_rank,
                                                                 monkeypatch, expect_errors):
    config = make_config(ipc_dir, replay=False)
    raw_rank(config)
    consolidator = KvEventConsolidator(config, publisher=RecordingPublisher())

    def always_fails(self) -> None:
        if self._queue:
            raise RuntimeError("bug")

    monkeypatch.setattr(KvEventConsolidator, "_drain_registrations", always_fails)
    consolidator.start()
    try:
        consolidator.register_store("CPU", 0, 1, None, toks(1), BS)  # never drained
        wait_for(lambda: consolidator.stats()["ingest_errors"] >= 5)
        # Backing off 2, 4, 8, 16 ms...: a handful by now, not thousands of busy retries.
        assert consolidator.stats()["ingest_errors"] < 50
    finally:
        consolidator._queue.clear()
        consolidator.shutdown(5.0)
    assert expect_errors.wait_for("ingest loop failed")


def _nested_list(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def test_deeply_nested_payloads_are_malformed_and_never_delay_the_next_batch(ipc_dir, start,
                                                                             raw_rank):
    """A 1 KB msgpack list nested 1,000 deep decodes; formatting it into the log must not raise
    (it did, outside the per-message handling, and each one backed the loop off longer)."""
    config = make_config(ipc_dir, replay=False)
    raw = raw_rank(config)
    consolidator = start(config)
    raw.wait_subscribed()
    nested = msgpack.packb(_nested_list(1000))
    assert len(nested) < 1100
    nested_events = msgpack.packb([time.time(), [_nested_list(1000)], 0])
    for seq in range(15):
        raw.pub.send_multipart([b"", encode_seq(seq), nested])
    raw.pub.send_multipart([b"", encode_seq(15), nested_events])
    began = time.monotonic()
    raw.send(16, [stored([1], None, [1])])
    wait_for(lambda: consolidator.stats()["batches_applied"] >= 2, timeout=3.0,
             what="the valid batch after 15 nested payloads")
    assert time.monotonic() - began < 3.0
    stats = consolidator.stats()
    assert stats["malformed"] == 16
    assert stats["ingest_errors"] == 0 and stats["message_errors"] == 0
    assert consolidator._core.visible_hashes(0) == {1}


def test_a_message_that_raises_is_dropped_alone_and_the_back_off_resets(ipc_dir, start,
                                                                        raw_rank, monkeypatch,
                                                                        expect_errors):
    config = make_config(ipc_dir, replay=False)
    raw = raw_rank(config)
    consolidator = start(config)
    raw.wait_subscribed()
    core = consolidator._core
    original = core.apply_events
    calls = {"n": 0}

    def raises_for_the_first_15(dp_rank, events, on_error):
        calls["n"] += 1
        if calls["n"] <= 15:
            raise RuntimeError("a bug met by odd input")
        return original(dp_rank, events, on_error)

    monkeypatch.setattr(core, "apply_events", raises_for_the_first_15)
    for seq in range(15):
        raw.send(seq, [stored([100 + seq], None, [seq])])
    raw.send(15, [stored([1], None, [1])])
    wait_for(lambda: consolidator.stats()["batches_applied"] == 1, timeout=3.0,
             what="the batch after 15 failing ones")
    stats = consolidator.stats()
    assert stats["message_errors"] == 15 and stats["ingest_errors"] == 0
    assert consolidator.loop_failures == 0
    assert expect_errors.wait_for("message dropped, applying it raised RuntimeError")


def test_the_loop_back_off_restarts_after_a_clean_message(ipc_dir, start, raw_rank,
                                                          monkeypatch, expect_errors):
    config = make_config(ipc_dir, replay=False)
    raw = raw_rank(config)
    consolidator = start(config)
    raw.wait_subscribed()
    original = KvEventConsolidator._drain_registrations
    fail = threading.Event()

    def fails_while_set(self) -> None:
        if self._queue and fail.is_set():
            raise RuntimeError("bug")
        original(self)

    monkeypatch.setattr(KvEventConsolidator, "_drain_registrations", fails_while_set)
    raw.send(0, [])
    wait_for(lambda: consolidator.stats()["batches_applied"] == 1)
    fail.set()
    consolidator.register_store("CPU", 0, 5, None, toks(5), BS)  # retried, fails each time
    wait_for(lambda: consolidator.stats()["ingest_errors"] >= 3)
    fail.clear()
    assert consolidator.loop_failures >= 3
    raw.send(1, [stored([1], None, [1])])
    wait_for(lambda: consolidator.stats()["batches_applied"] == 2)
    wait_for(lambda: consolidator.loop_failures == 0, what="back-off reset")
    assert expect_errors.wait_for("ingest loop failed")


def test_a_restarted_publisher_that_got_further_than_the_old_one_is_resynced(ipc_dir, start,
                                                                               closers):
    """The new stream's seq is past the old one's when the consolidator reconnects: that reads
    as a gap, but the replay shows the last applied batch changed, so the rank is resynced and
    the new stream taken from its start (not "replayed" into the old one)."""
    config = make_config(ipc_dir)

    def rank_publisher():
        pub = create_publisher(config.publisher, config.publish_endpoint(0),
                               config.replay_endpoint(0), 0)
        closers.append(lambda: pub.shutdown(2.0))
        return pub

    old = rank_publisher()
    consolidator = start(config)
    sync_live(old, consolidator)
    for i in range(3):
        old.publish([stored([101 + i], None if i == 0 else 100 + i, [i])])
    wait_for(lambda: consolidator._core.visible_hashes(0) == {101, 102, 103})
    old.shutdown(2.0)
    new = rank_publisher()
    expected = set()
    for i in range(8):  # more batches than the old stream had reached
        new.publish([stored([201 + i], None if i == 0 else 200 + i, [10 + i])])
        expected.add(201 + i)
    deadline = time.monotonic() + 15.0
    i = 8
    while consolidator._core.visible_hashes(0) != expected:
        assert time.monotonic() < deadline, (consolidator._core.visible_hashes(0), expected,
                                             consolidator.stats())
        new.publish([stored([201 + i], 200 + i, [10 + i])])  # live traffic goes on
        expected.add(201 + i)
        i += 1
        time.sleep(0.05)  # pacing of the simulated engine, not synchronisation
    stats = consolidator.stats()
    assert stats["restarts"] >= 1 and stats["reconnects"] >= 1
    assert stats["ingest_errors"] == 0 and stats["message_errors"] == 0


def test_a_restarted_publisher_at_the_same_seq_is_caught_by_the_reconnection(ipc_dir, start,
                                                                            raw_rank):
    """The new stream is exactly where the old one was: nothing in the seq shows the restart;
    the reconnection and the replay of the last applied batch do."""
    config = make_config(ipc_dir)
    raw = raw_rank(config)
    consolidator = start(config)
    raw.wait_subscribed()
    raw.serve_startup()
    for i in range(3):
        raw.send(i, [stored([101 + i], None if i == 0 else 100 + i, [i])])
    wait_for(lambda: consolidator.stats()["batches_applied"] == 3)
    raw.close()
    new = raw_rank(config)
    new.wait_subscribed()
    batches = [new.frames(i, [stored([201 + i], None if i == 0 else 200 + i, [10 + i])])
               for i in range(4)]
    ident, start_seq = new.next_replay_request()
    assert start_seq == 2  # the last batch applied, to compare
    new.answer(ident, batches[2:3])
    ident, start_seq = new.next_replay_request()  # the restart was seen: everything
    assert start_seq == 0
    new.answer(ident, batches[:3])
    new.pub.send_multipart(batches[3])
    wait_for(lambda: consolidator._core.visible_hashes(0) == {201, 202, 203, 204},
             what="the new stream only")
    stats = consolidator.stats()
    assert stats["restarts"] == 1 and stats["reconnects"] == 1 and stats["resyncs"] == 1
    assert stats["ingest_errors"] == 0


def _two_batches_applied(config: ConsolidatorConfig, start, raw: RawRank,  # noqa: ANN001
                         ) -> tuple[KvEventConsolidator, list[list[bytes]]]:
    """A consolidator started on ``config`` that applied ``raw``'s batches 0 and 1 (a chain
    of blocks 101, 102), and those batches' frames."""
    consolidator = start(config)
    raw.wait_subscribed()
    raw.serve_startup()
    sent = [raw.send(i, [stored([101 + i], None if i == 0 else 100 + i, [i])])
            for i in range(2)]
    wait_for(lambda: consolidator.stats()["batches_applied"] == 2)
    return consolidator, sent


def test_a_reconnection_to_the_same_publisher_replays_what_was_missed(ipc_dir, start,
                                                                     raw_rank):
    config = make_config(ipc_dir)
    raw = raw_rank(config)
    consolidator, sent = _two_batches_applied(config, start, raw)
    raw.close()
    new = raw_rank(config)  # the same stream, reached again (e.g. a network blip)
    new.wait_subscribed()
    missed = new.frames(2, [stored([103], 102, [2])])
    ident, start_seq = new.next_replay_request()
    assert start_seq == 1
    new.answer(ident, [sent[1], missed])
    wait_for(lambda: consolidator._core.visible_hashes(0) == {101, 102, 103})
    stats = consolidator.stats()
    assert stats["restarts"] == 0 and stats["resyncs"] == 0 and stats["reconnects"] == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux socket filter")
def test_a_rank_stream_gone_silent_is_connected_again_and_replayed(ipc_dir, start, raw_rank,
                                                                   monkeypatch):
    """The consolidator's end of a rank's tcp stream hears nothing more (every packet dropped,
    no FIN, no reset: the rank's host cut off): its keepalive probes go unanswered, it drops the
    connection, connects again and replays what it missed (wire/reconnect.py's keepalive,
    shortened here). Without them it waited on the silent connection for ever."""
    from _kvwire import free_port, short_keepalive, silence, tcp_connections

    short_keepalive(monkeypatch)
    port = free_port()
    config = load_consolidator_config(
        {EVENTS_ENDPOINT: f"tcp://127.0.0.1:{port}", REPLAY_ENDPOINT: f"tcp://127.0.0.1:{free_port()}",
         OUTPUT_ENDPOINT: f"ipc://{ipc_dir}/out", OUTPUT_REPLAY_ENDPOINT: f"ipc://{ipc_dir}/outr"},
        num_ranks=1)
    raw = raw_rank(config)
    consolidator, sent = _two_batches_applied(config, start, raw)
    (fd,) = tcp_connections(port, "peer")
    silence(fd)
    missed = raw.send(2, [stored([103], 102, [2])])  # never heard
    ident, start_seq = raw.next_replay_request()  # connected again: the catch-up
    assert start_seq == 1
    raw.answer(ident, [sent[1], missed])
    wait_for(lambda: consolidator._core.visible_hashes(0) == {101, 102, 103})
    stats = consolidator.stats()
    assert stats["reconnects"] == 1 and stats["restarts"] == 0


def test_output_a_threaded_publisher_loses_later_is_counted_lost(ipc_dir, raw_rank,
                                                                  expect_errors):
    from kvbm_plugin.wire.publisher import ZmqEventPublisher

    config = make_config(ipc_dir, replay=False)
    raw_rank(config)

    def broken(obj: Any) -> bytes:
        raise TypeError("cannot encode")

    output = ZmqEventPublisher(config.publisher, config.output, None, encoder=broken)
    consolidator = KvEventConsolidator(config, publisher=output)
    consolidator.start()
    try:
        consolidator.register_store("CPU", 0, 1, None, toks(1), BS)
        wait_for(lambda: consolidator.stats()["output_lost"] == 1, what="output loss counted")
        assert consolidator.stats()["batches_out"] == 1
        assert expect_errors.wait_for("cannot be encoded, lost")
    finally:
        consolidator.shutdown(5.0)
        output.shutdown(2.0)

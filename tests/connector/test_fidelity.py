"""Behaviour that must hold on the real TensorRT-LLM: cache-salt isolation in every spelling,
LoRA / multimodal keys, hex-string hashes."""

from __future__ import annotations

from typing import Any

import pytest
from _engines import OFF, prompt, tiers

from kvbm_plugin.connector.meta import save_ops
from kvbm_plugin.consolidator.service import SOURCE_ENGINE, SOURCE_TIERS, ConsolidatorCore
from kvbm_plugin.consolidator_config import PublisherSettings
from kvbm_plugin.event_sink import KvEventSink
from kvbm_plugin.naming.names import radix_key_hash
from kvbm_plugin.testing.engine import SimulatedEngine
from kvbm_plugin.testing.fake_trtllm import LlmRequest
from kvbm_plugin.wire.events import to_signed_int64
from kvbm_plugin.wire.identity import cache_salt_id, salt_extra_key
from kvbm_plugin.wire.publisher import EventPublisher

BS = 4





def evict_gpu(engine: SimulatedEngine, count: int = 3) -> None:
    for k in range(count):
        engine.submit(prompt(700 + k, 40), 1)
        engine.run_until_idle()


def offered(engine: SimulatedEngine, request: LlmRequest) -> int:
    """Tokens the leader offers ``request`` from its tiers (then released again)."""
    leader = engine.leader
    n, load_async = leader.get_num_new_matched_tokens(request, 0)
    assert load_async == (n > 0)
    leader.request_finished(request, [])
    return n


# ---------------------------------------------------------------- 1. tenant isolation

SPELLINGS = {
    "cache_salt_id only": lambda rid, toks, salt: LlmRequest(rid, toks,
                                                             cache_salt_id=cache_salt_id(salt)),
    "cache_salt only": lambda rid, toks, salt: LlmRequest(rid, toks, salt),
    "both": lambda rid, toks, salt: LlmRequest(rid, toks, salt,
                                               cache_salt_id=cache_salt_id(salt)),
}


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_a_salted_request_is_never_offered_another_salts_or_unsalted_blocks(
        make_engine, spelling: str) -> None:
    engine = make_engine(num_gpu_blocks=16, env=tiers(host=64))
    shared = prompt(1, 25)  # 6 full blocks
    plain = prompt(2, 25)
    # Stored through the engine: its requests carry the salt as TRT-LLM's C++ request does
    # (cache_salt_id only).
    engine.submit(shared, 1, cache_salt="tenant-a")
    engine.submit(plain, 1)
    engine.run_until_idle()
    evict_gpu(engine)
    assert engine.leader.stats()["saves_committed"] >= 12
    make = SPELLINGS[spelling]
    assert offered(engine, make(901, shared, "tenant-a")) == 24  # the same tenant: reuse
    assert offered(engine, make(902, shared, "tenant-b")) == 0  # another salt
    assert offered(engine, LlmRequest(903, shared)) == 0  # no salt
    assert offered(engine, make(904, plain, "tenant-a")) == 0  # unsalted blocks: the reverse
    assert offered(engine, LlmRequest(905, plain)) == 24
    assert engine.leader.stats()["ops_inflight"] == 0


def test_two_tenants_sharing_a_system_prompt_never_hit_each_others_blocks(make_engine) -> None:
    engine = make_engine(num_gpu_blocks=16, env=tiers(host=8, disk=64))
    system = prompt(3, 16)
    a = engine.submit(system + prompt(4, 9), 1, cache_salt="tenant-a")
    engine.run_until_idle()
    evict_gpu(engine)  # tenant A's blocks now live in host / disk only
    b = engine.submit(system + prompt(5, 9), 1, cache_salt="tenant-b")
    engine.run_until_idle()
    rb = engine.result(b)
    assert (rb.gpu_hit_tokens, rb.host_hit_tokens, rb.disk_hit_tokens) == (0, 0, 0)
    evict_gpu(engine)
    a2 = engine.submit(system + prompt(6, 9), 1, cache_salt="tenant-a")
    engine.run_until_idle()
    ra2 = engine.result(a2)
    assert ra2.host_hit_tokens + ra2.disk_hit_tokens == 16  # the system prompt, own tenant
    assert engine.result(a).kv_mismatches == rb.kv_mismatches == ra2.kv_mismatches == 0


def test_salt_separates_consolidator_identity_and_matches_the_gpu_streams_salt() -> None:
    core = ConsolidatorCore("dedup")
    toks = [1, 2, 3, 4]
    key_a = salt_extra_key(cache_salt_id("tenant-a"))
    # The GPU stream names tenant A's block with its per-block salt; the tier registration
    # of the same block (the leader's) carries the same key: one block.
    core.apply_event(0, {"type": "BlockStored", "block_hashes": [11], "parent_block_hash": None,
                         "token_ids": toks, "block_size": BS, "lora_id": None, "medium": "GPU",
                         "lora_name": None, "extra_keys": [[key_a]]})
    core.store(SOURCE_TIERS, "CPU", 0, [11], None, toks, BS, extra_keys=[(key_a,)])
    assert core.visible_hashes(0) == {11}
    # The same tokens unsalted, or under another salt, are other blocks.
    core.store(SOURCE_TIERS, "CPU", 0, [12], None, toks, BS)
    core.store(SOURCE_TIERS, "CPU", 0, [13], None, toks, BS,
               extra_keys=[(salt_extra_key(cache_salt_id("tenant-b")),)])
    assert core.visible_hashes(0) == {11, 12, 13}
    out = core.take_output()[0]
    assert out[0]["extra_keys"] == [[key_a]]


# ---------------------------------------------------------------- 4. LoRA and multimodal keys

class Recorder(EventPublisher):
    def __init__(self) -> None:
        super().__init__(PublisherSettings())
        self.batches: list[list[dict[str, Any]]] = []

    def publish(self, events: Any, data_parallel_rank: int | None = None) -> bool:
        self.batches.append(list(events))
        return True

    def shutdown(self, timeout: float = 5.0) -> None:
        pass


def stored(h: Any, parent: Any = None, tokens: list[int] | None = None,
           **block_fields: Any) -> dict[str, Any]:
    block = {"type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35,
             "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                        for t in (tokens or [1, 2, 3, 4])], **block_fields}
    return {"event_id": 0, "window_size": 64,
            "data": {"type": "stored", "parent_hash": parent, "blocks": [block]}}


@pytest.mark.parametrize("native", [True, False])
def test_per_block_lora_and_multimodal_keys_reach_the_wire(native: bool) -> None:
    from kvbm_plugin._util import compiled as _compiled

    if native and _compiled.loops("event_sink", {}) is None:
        pytest.skip("compiled loops not built")
    rec = Recorder()
    sink = KvEventSink(rec, block_size=BS, native=native, strict=True)
    mm = [{"type": "mm_key", "hash": "0123456789abcdef0011", "start_offset": 4}]
    digest = [{"type": "mm_key", "hash": "0123456789ABCDEF" * 4, "start_offset": 0}]
    sink.ingest([stored(1, lora_id=7), stored(2, lora_id=8), stored(3, mm_keys=mm),
                 stored(4, cache_salt="tenant-a"), stored(5), stored(6, mm_keys=digest)])
    sink.flush()
    events = rec.batches[0]
    assert [e["block_hashes"] for e in events] == [[1], [2], [3], [4], [5], [6]]
    assert [e["lora_id"] for e in events] == [7, 8, None, None, None, None]
    assert [e["lora_name"] for e in events] == ["lora-7", "lora-8", None, None, None, None]
    # not a 64-hex digest: the offset-tagged pair, which a router does not ignore
    assert events[2]["extra_keys"] == [[["0123456789abcdef0011", 4]]]
    assert events[3]["extra_keys"] == [[salt_extra_key(cache_salt_id("tenant-a"))]]
    assert "extra_keys" not in events[4]
    # a 32-byte digest: Dynamo's marker form, the only 64-hex form its indexer reads as one
    assert events[5]["extra_keys"] == [["0123456789abcdef" + "0" * 48]]


def test_two_adapters_blocks_with_the_same_tokens_are_two_blocks() -> None:
    for native in (None, False):
        core = ConsolidatorCore("dedup", native=native)
        toks = [1, 2, 3, 4]
        for h, lora in ((21, 7), (22, 8), (23, None)):
            core.apply_event(0, {"type": "BlockStored", "block_hashes": [h],
                                 "parent_block_hash": None, "token_ids": toks,
                                 "block_size": BS, "lora_id": lora, "medium": "GPU",
                                 "lora_name": None})
        assert core.visible_hashes(0) == {21, 22, 23}
        # The same adapter's block from a tier is the same block (dedup).
        core.store(SOURCE_TIERS, "CPU", 0, [21], None, toks, BS, lora_id=7)
        assert core.visible_hashes(0) == {21, 22, 23}
        assert core.stats()["stores_out"] == 3
        core.remove(SOURCE_ENGINE, "GPU", 0, [21])
        assert 21 in core.visible_hashes(0)  # still held by the host tier


# ---------------------------------------------------------------- 5. hex-string hashes

@pytest.mark.parametrize("native", [True, False])
def test_hex_string_hashes_map_like_v2_radix_keys(native: bool) -> None:
    from kvbm_plugin._util import compiled as _compiled

    if native and _compiled.loops("event_sink", {}) is None:
        pytest.skip("compiled loops not built")
    rec = Recorder()
    sink = KvEventSink(rec, block_size=BS, native=native, strict=True)
    key1, key2 = bytes(range(1, 33)), bytes(range(200, 232))
    sink.ingest([stored(key1.hex()), stored(key2.hex(), parent=key1.hex()),
                 {"event_id": 1, "window_size": 64,
                  "data": {"type": "removed", "block_hashes": [key2.hex()]}}])
    sink.flush()
    events = rec.batches[0]
    assert events[0]["block_hashes"] == [radix_key_hash(key1), radix_key_hash(key2)]
    assert events[1]["block_hashes"] == [radix_key_hash(key2)]
    assert radix_key_hash(key2) == to_signed_int64(int.from_bytes(key2[:8], "big"))
    with pytest.raises(Exception, match="hex"):
        sink.ingest([stored("xyz")])


# ---------------------------------------------------------------- 2. V2 hooks call each other

class NestingV2EventManager:
    """TRT-LLM's V2 ``KVCacheEventManager`` call structure (``_event_manager.py``): the
    life-cycle hook calls ``add_stored_block_event_from_block``, which calls
    ``add_stored_event`` with a per-block ``KVCacheStoredBlockData`` under the manager's own
    hash (here ``v1_block_key``-like ints, which differ from the radix key's)."""

    def __init__(self) -> None:
        self.stored: list[Any] = []

    def add_stored_event(self, parent_hash: Any, blocks: Any, layer_group_id: Any = None
                         ) -> None:
        self.stored.extend(b.block_hash for b in blocks)

    def add_stored_block_event_from_block(self, block: Any) -> None:
        from types import SimpleNamespace

        data = SimpleNamespace(block_hash=1000 + block.ordinal, tokens=list(block.tokens),
                               mm_keys=[], cache_salt=None)
        parent = None if block.prev.ordinal == -1 else 1000 + block.prev.ordinal
        self.add_stored_event(parent, [data], 0)

    def add_stored_life_cycle_event_from_block(self, block: Any, life_cycle_id: int) -> None:
        self.add_stored_block_event_from_block(block)

    def add_removed_event(self, block_hashes: Any) -> None:
        pass


def test_nested_v2_hooks_publish_each_block_once_and_every_hash_is_removable() -> None:
    from types import SimpleNamespace

    from kvbm_plugin.events.source import attach_event_source

    rec = Recorder()
    sink = KvEventSink(rec, block_size=2, strict=True)
    em = NestingV2EventManager()
    attach_event_source(SimpleNamespace(event_manager=em), sink)
    root = SimpleNamespace(ordinal=-1)
    keys = [bytes([i + 1]) * 32 for i in range(3)]
    prev: Any = root
    blocks = []
    for i, k in enumerate(keys):
        prev = SimpleNamespace(key=k, tokens=[2 * i, 2 * i + 1], prev=prev, ordinal=i)
        blocks.append(prev)
    em.add_stored_life_cycle_event_from_block(blocks[0], 0)
    em.add_stored_block_event_from_block(blocks[1])
    em.add_stored_life_cycle_event_from_block(blocks[2], 0)
    assert em.stored == [1000, 1001, 1002]  # TRT-LLM's own path saw every call
    sink.flush()
    published = [h for e in rec.batches[0] for h in e["block_hashes"]]
    assert published == [radix_key_hash(k) for k in keys]  # once each, one hash per block
    for k in keys:
        em.add_removed_event(k)
    sink.flush()
    assert [h for e in rec.batches[1] for h in e["block_hashes"]] == published
    stats = sink.stats()
    assert stats["blocks_stored"] == 3 and stats["blocks_removed"] == 3
    assert stats["unknown_removes_suppressed"] == 0
    assert not sink._ranks[0].live


# ---------------------------------------------------------------- 3. TRT-LLM's own readers

class BufferedManager:
    """A KVCacheManager with TRT-LLM's buffered event API: one queue, drained by whoever calls
    ``get_latest_events`` (TRT-LLM's own readers and, when draining, the plugin)."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self.calls = 0

    def produce(self, h: int) -> None:
        with self._lock:
            self._events.append(stored(h))

    def get_latest_events(self, timeout_ms: float | None = 0) -> list[dict[str, Any]]:
        with self._lock:
            self.calls += 1
            out, self._events = self._events, []
            return out


class Executor:
    """Holds the manager as PyExecutor does and calls the scheduler from its own frame."""

    def __init__(self, leader: Any, manager: BufferedManager) -> None:
        self.kv_cache_manager = manager
        self.leader = leader

    def iteration(self) -> None:
        from kvbm_plugin.testing.fake_trtllm import SchedulerOutput

        self.leader.build_connector_meta(SchedulerOutput())


def run_with_reader(source: str, n: int = 200) -> tuple[list[int], dict[str, int], Any]:
    """Iterations producing one event each while a "TRT-LLM reader" thread drains the same
    buffer; returns what that reader got, the sink's counters and the leader."""
    import threading
    import time

    from kvbm_plugin.connector_leader import KvbmConnectorLeader
    from kvbm_plugin.testing.fake_trtllm import KvCacheConfig, LlmArgs, ParallelConfig

    env = dict(OFF, DYN_KVBM_KV_EVENTS_SOURCE=source)
    leader = KvbmConnectorLeader(LlmArgs(KvCacheConfig(BS), ParallelConfig(0, 1),
                                         kvbm_plugin_env=env,
                                         kvbm_plugin_group=f"source-{source}"))
    manager = BufferedManager()
    executor = Executor(leader, manager)
    got: list[int] = []
    stop = threading.Event()
    first_call = threading.Event()

    def reader() -> None:  # LLM.get_kv_cache_events / Dynamo's publisher: a polling loop
        while not stop.is_set():
            got.extend(ev["data"]["blocks"][0]["block_hash"]
                       for ev in manager.get_latest_events(0))
            first_call.set()
            stop.wait(0.0005)

    thread = threading.Thread(target=reader, name="trtllm-kv-event-reader")
    thread.start()
    try:
        assert first_call.wait(5)
        executor.iteration()  # the leader attaches to the manager at its first iteration
        deadline = time.monotonic() + 10
        while source != "tap" and leader.event_source.drains and time.monotonic() < deadline:
            stop.wait(0.001)  # auto, drain: the reader's next call (through the tee) is seen
        for h in range(1, n + 1):
            manager.produce(h)
            executor.iteration()
        deadline = time.monotonic() + 10
        while len(got) < n and time.monotonic() < deadline:
            stop.wait(0.005)
    finally:
        stop.set()
        thread.join(5)
    executor.iteration()  # the sink's last batch
    stats = leader.event_sink.stats()
    stats["drains"] = leader.event_source.drains
    leader.shutdown()
    return got, stats, leader


@pytest.mark.parametrize("source", ["tap", "auto", "drain"])
def test_non_draining_source_leaves_trtllm_readers_every_event(source: str, caplog) -> None:  # noqa: ANN001
    """``drain`` too (issue 27, item 6): two drainers would split the stream, so the plugin
    stops draining at the reader's first call, and says so with a warning."""
    got, stats, leader = run_with_reader(source)
    assert got == list(range(1, 201))  # TRT-LLM's own reader: every event, in order
    assert stats["blocks_stored"] == 200  # and the plugin published every one too
    assert leader.event_source.mode == source and not stats["drains"]
    warned = [r for r in caplog.records if "Two drainers split the stream" in r.getMessage()]
    assert len(warned) == (source == "drain")


def test_source_off_attaches_nothing_and_a_bad_value_is_named() -> None:
    from kvbm_plugin.connector_leader import KvbmConnectorLeader
    from kvbm_plugin.consolidator_config import ConfigError
    from kvbm_plugin.testing.fake_trtllm import KvCacheConfig, LlmArgs, ParallelConfig

    leader = KvbmConnectorLeader(LlmArgs(KvCacheConfig(BS), ParallelConfig(0, 1),
                                         kvbm_plugin_env=dict(OFF, DYN_KVBM_KV_EVENTS_SOURCE="off"),
                                         kvbm_plugin_group="source-off"))
    manager = BufferedManager()
    manager.produce(1)
    Executor(leader, manager).iteration()
    assert leader.event_source is None and manager.calls == 0
    leader.shutdown()
    with pytest.raises(ConfigError, match="DYN_KVBM_KV_EVENTS_SOURCE='sometimes'"):
        KvbmConnectorLeader(LlmArgs(KvCacheConfig(BS), ParallelConfig(0, 1),
                                    kvbm_plugin_env=dict(OFF,
                                                         DYN_KVBM_KV_EVENTS_SOURCE="sometimes"),
                                    kvbm_plugin_group="source-bad"))


# ---------------------------------------------------------------- 7. V2 partial acceptance

def stored_prefix(make_engine: Any) -> tuple[SimulatedEngine, list[int]]:
    engine = make_engine(num_gpu_blocks=16, env=tiers(host=12))
    a = prompt(8, 25)  # 6 full blocks offered (24 tokens)
    engine.submit(a, 1)
    engine.run_until_idle()  # ``a``'s blocks are in the host tier (the leader is asked
    return engine, a  # directly below, whatever the GPU pool still holds)


def pins(engine: SimulatedEngine, tokens: list[int]) -> list[int]:
    from kvbm_plugin.tiers.content_keys import block_keys

    host = engine.leader._tiers.host
    return [entry.pins if (entry := host.get(k)) is not None else -1
            for k in block_keys(tokens[:24], BS)]


@pytest.mark.parametrize("how", ["cancel_load", "commit_new_matched_tokens"])
def test_fewer_tokens_honoured_release_pins_and_load_only_what_was_kept(make_engine,
                                                                        how: str) -> None:
    from kvbm_plugin.testing.fake_trtllm import SchedulerOutput

    engine, a = stored_prefix(make_engine)
    leader = engine.leader
    req = LlmRequest(950, a)
    assert leader.get_num_new_matched_tokens(req, 0) == (24, True)
    assert pins(engine, a) == [1] * 6
    if how == "cancel_load":
        leader.cancel_load(req, 8, 24)  # the runtime reserved pages for two blocks only
    else:
        leader.commit_new_matched_tokens(req, 8, True)
    assert pins(engine, a) == [1, 1, 0, 0, 0, 0]
    leader.update_state_after_alloc(req, [40, 41, 42, 43, 44, 45, 46])
    meta = leader.build_connector_meta(SchedulerOutput())
    (load,) = meta.loads
    assert [c.device_block for c in load.copies] == [40, 41]  # no load for dropped blocks
    assert leader.stats()["cancelled_tokens"] == 16


def test_cancel_after_binding_drops_the_copies_before_they_reach_the_workers(make_engine
                                                                             ) -> None:
    from kvbm_plugin.testing.fake_trtllm import SchedulerOutput

    engine, a = stored_prefix(make_engine)
    leader = engine.leader
    req = LlmRequest(951, a)
    assert leader.get_num_new_matched_tokens(req, 0) == (24, True)
    leader.update_state_after_alloc(req, [40, 41, 42, 43, 44, 45, 46])
    leader.cancel_load(req, 0, 8)  # the head was overtaken by the device cache
    assert pins(engine, a) == [0, 0, 1, 1, 1, 1]
    (load,) = leader.build_connector_meta(SchedulerOutput()).loads
    assert [c.device_block for c in load.copies] == [42, 43, 44, 45]
    leader.cancel_load(req, 16, 24)  # too late: already in metadata
    assert leader.stats()["cancels_too_late"] == 1


@pytest.mark.parametrize("end", ["reported", "all_cancelled", "terminated"])
def test_a_run_of_loads_with_blocks_taken_back_lets_every_pin_and_op_go(make_engine,
                                                                        end: str) -> None:
    """A request's host loads are one run of op ids. Blocks taken back after binding (the
    run's first among them) are never reported; the run still ends: when every rank reported
    the rest (a corrupt one forgotten with its descendants, counted), at once when every
    block was taken back, or when the request is terminated before its metadata left."""
    import gc

    from kvbm_plugin.connector.meta import ERR_CORRUPT, OpReport
    from kvbm_plugin.testing.fake_trtllm import SchedulerOutput

    engine, a = stored_prefix(make_engine)
    leader = engine.leader
    ops_before = leader.stats()["ops_inflight"]
    req = LlmRequest(953, a)
    assert leader.get_num_new_matched_tokens(req, 0) == (24, True)
    leader.update_state_after_alloc(req, [40, 41, 42, 43, 44, 45, 46])
    assert leader.stats()["ops_inflight"] == ops_before + 6
    if end == "all_cancelled":
        leader.cancel_load(req, 0, 24)
        assert leader.stats()["ops_inflight"] == ops_before
        assert pins(engine, a) == [0] * 6 and not leader._reqs[953].loads_inflight
        (load,) = leader.build_connector_meta(SchedulerOutput()).loads
        assert load.copies == ()
        return
    leader.cancel_load(req, 0, 8)  # blocks 0 and 1, the run's first op id among them
    assert pins(engine, a) == [0, 0, 1, 1, 1, 1]
    if end == "terminated":
        del req
        gc.collect()
        leader._reap_terminated()
        assert leader.stats()["ops_inflight"] == ops_before
        assert pins(engine, a) == [0] * 6 and 953 not in leader._reqs
        return
    (load,) = leader.build_connector_meta(SchedulerOutput()).loads
    assert [c.device_block for c in load.copies] == [42, 43, 44, 45]
    hub = leader._hub
    for copy in load.copies:
        corrupt = copy.device_block == 44  # block 4: forgotten with block 5
        for rank in range(engine.config.tp_size):
            hub.put(OpReport(copy.op_id, rank, not corrupt,
                             ERR_CORRUPT if corrupt else 0))
    leader._apply_reports()
    stats = leader.stats()
    assert stats["ops_inflight"] == ops_before
    assert stats["loads_failed"] == 1 and stats["corrupt_blocks"] == 1
    assert pins(engine, a) == [0, 0, 0, 0, -1, -1]


@pytest.mark.parametrize("gone", [False, True])
def test_blocks_loaded_from_the_host_tier_are_passed_and_offloaded_again_once_gone(
        make_engine, gone: bool) -> None:
    """The planner passes the blocks a request loaded from the host tier in one step (the
    match touched and pinned them). Where the tail left the tier meanwhile (taken back from
    the load, then dropped), it offloads that tail again from the request's device blocks,
    as a block-by-block walk would: the tier ends holding the whole prompt either way."""
    from kvbm_plugin.testing.fake_trtllm import RequestData, SchedulerOutput
    from kvbm_plugin.tiers.content_keys import block_keys

    engine, a = stored_prefix(make_engine)
    leader = engine.leader
    host = leader._tiers.host
    keys = block_keys(a[:24], BS)
    req = LlmRequest(960, a)
    assert leader.get_num_new_matched_tokens(req, 0) == (24, True)
    ids = [40, 41, 42, 43, 44, 45, 46]
    leader.update_state_after_alloc(req, ids)
    assert leader._reqs[960].host_matched == (0, 6)
    if gone:
        leader.cancel_load(req, 16, 24)  # blocks 4 and 5: computed by the engine instead
        leader._tiers.drop(host, host.get(keys[4]))  # ... and they leave the tier
        assert keys[4] not in host and keys[5] not in host
    meta = leader.build_connector_meta(SchedulerOutput(new_requests=[
        RequestData(960, a, ids, 16 if gone else 24, 9 if gone else 1)]))
    assert [save.key for save in save_ops(meta.saves)] == (keys[4:6] if gone else [])
    assert [save.device_block for save in save_ops(meta.saves)] == (ids[4:6] if gone else [])
    assert leader._reqs[960].host_matched is None


def test_cancelled_blocks_can_be_evicted_by_later_requests(make_engine) -> None:
    engine, a = stored_prefix(make_engine)
    leader = engine.leader
    req = LlmRequest(952, a)
    assert leader.get_num_new_matched_tokens(req, 0) == (24, True)
    leader.cancel_load(req, 0, 24)  # nothing honoured
    leader.update_state_after_alloc(req, [40, 41, 42, 43, 44, 45, 46])
    # A pinned block is never evicted: with the pins gone, new traffic through the 12-slot
    # host tier replaces every block of ``a``.
    for k in range(4):
        engine.submit(prompt(800 + k, 25), 1)
        engine.run_until_idle()
    assert pins(engine, a) == [-1] * 6
    assert leader.stats()["tier_full_skips"] == 0


# ---------------------------------------------------------------- 8. small contract points

class _StridedTorch:
    """``torch`` as the simulated engine sees it, except that its 4-D KV pools are strided
    views (each block contiguous, blocks ``pad`` elements apart), as KVCacheManagerV2's
    ``as_single_pool_tensor`` may return."""

    def __init__(self, pad: int) -> None:
        import torch

        self._torch = torch
        self._pad = pad

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def zeros(self, shape: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(shape, tuple) and len(shape) == 4:
            inner = shape[1] * shape[2] * shape[3]
            base = self._torch.zeros((shape[0], inner + self._pad), *args, **kwargs)
            return base[:, :inner].unflatten(1, shape[1:])
        return self._torch.zeros(shape, *args, **kwargs)


def test_a_strided_v2_pool_view_offloads_and_onboards_exact_bytes(make_engine,
                                                                    monkeypatch) -> None:
    import kvbm_plugin.testing.engine_bringup as bringup  # where the rank pools are made

    monkeypatch.setattr(bringup, "torch", _StridedTorch(pad=5))
    engine = make_engine(num_gpu_blocks=16, env=tiers(host=64))
    assert not engine.kv_pools[0].is_contiguous()
    a = prompt(9, 33)
    engine.submit(a, 1)
    engine.run_until_idle()
    evict_gpu(engine)
    again = engine.submit(a, 1)
    engine.run_until_idle()
    assert engine.result(again).host_hit_tokens == 32
    assert engine.stats().kv_mismatches == 0


def test_register_kv_caches_takes_a_secondary_tensor_and_names_an_unusable_layout() -> None:
    import torch

    from kvbm_plugin.connector_worker import KvbmConnectorWorker
    from kvbm_plugin.testing.fake_trtllm import KvCacheConfig, LlmArgs, ParallelConfig

    def worker(group: str) -> KvbmConnectorWorker:
        return KvbmConnectorWorker(LlmArgs(KvCacheConfig(BS), ParallelConfig(0, 1),
                                           kvbm_plugin_env=OFF, kvbm_plugin_group=group))

    w = worker("secondary")
    try:
        w.register_kv_caches(torch.zeros((8, 2, 2, 16)), torch.zeros((4, 16)))
    finally:
        w.shutdown()
    layer_major = torch.zeros((2, 8, 2, 16)).transpose(0, 1)  # [blocks, layers, ...] view
    w = worker("layer-major")
    try:
        with pytest.raises(ValueError, match=r"unsupported pool layout: shape \(8, 2, 2, 16\), "
                                             r"strides \(32, 256, 16, 1\)"):
            w.register_kv_caches(layer_major)
    finally:
        w.shutdown()


def test_no_kv_cache_manager_warns_once_at_the_first_iteration(caplog) -> None:
    import logging

    from kvbm_plugin.connector_leader import KvbmConnectorLeader
    from kvbm_plugin.testing.fake_trtllm import (
        KvCacheConfig,
        LlmArgs,
        ParallelConfig,
        SchedulerOutput,
    )

    leader = KvbmConnectorLeader(LlmArgs(KvCacheConfig(BS), ParallelConfig(0, 1),
                                         kvbm_plugin_env=OFF, kvbm_plugin_group="no-manager"))
    try:
        with caplog.at_level(logging.WARNING, logger="kvbm_plugin.connector_leader"):
            for _ in range(12):  # like PyExecutorCoro: no self.kv_cache_manager in the frames
                leader.build_connector_meta(SchedulerOutput())
                if _ == 0:
                    first = [r for r in caplog.records if "no KV cache manager" in r.message]
                    assert len(first) == 1
        warned = [r for r in caplog.records if "no KV cache manager" in r.message]
        assert len(warned) == 1
        assert leader.event_source_status == "no KV cache manager found"
    finally:
        leader.shutdown()


# ---------------------------------------------------------------- 6. one name per block

def _run_recorded(engine: Any, seeds: range) -> Recorder:
    """Record the leader's GPU-tier and tier events while one request per seed runs."""
    rec = Recorder()
    engine.leader.event_sink._publisher = rec
    engine.leader._tier_events._publisher = rec
    for seed in seeds:
        engine.submit(prompt(seed, 25), 1)
        engine.run_until_idle()
    return rec


def test_without_block_hashes_tier_events_use_trtllms_names_in_passthrough(make_engine) -> None:
    """No RequestData.block_hashes (TRT-LLM <= 1.2.x, V2): the leader learns TRT-LLM's hash
    of each block from the GPU-tier events it publishes, and its CPU/DISK events use it, so a
    router that keeps one entry per hash holds one name per block across media."""
    engine = make_engine(num_gpu_blocks=16, env=tiers(host=8, disk=64),
                         provide_block_hashes=False)
    rec = _run_recorded(engine, seeds=range(10, 14))
    engine.submit(prompt(10, 25), 1)  # back from the tiers
    engine.run_until_idle()
    engine.leader.flush_events()
    names: dict[str, dict[int, tuple[int, ...]]] = {"GPU": {}, "CPU": {}, "DISK": {}}
    for batch in rec.batches:
        for ev in batch:
            if ev["type"] == "BlockStored":
                bs = ev["block_size"]
                for j, h in enumerate(ev["block_hashes"]):
                    names[ev["medium"]][h] = tuple(ev["token_ids"][j * bs:(j + 1) * bs])
    assert names["CPU"] and names["DISK"]
    for medium in ("CPU", "DISK"):
        for h, tokens in names[medium].items():
            assert names["GPU"].get(h) == tokens, (medium, h)  # the same name, same block
    assert engine.stats().kv_mismatches == 0
    assert engine.leader.event_sink.on_flush is not None


def test_with_block_hashes_the_leader_learns_no_names_from_events(make_engine) -> None:
    """Where TRT-LLM hands RequestData.block_hashes over, nothing watches the published
    batches (learning names from them costs the executor thread more than publishing), and
    the tier events still use TRT-LLM's hashes."""
    engine = make_engine(num_gpu_blocks=16, env=tiers(host=8))
    rec = _run_recorded(engine, seeds=range(20, 23))
    engine.leader.flush_events()
    assert engine.leader.event_sink.on_flush is None
    gpu = {h for batch in rec.batches for ev in batch
           if ev["type"] == "BlockStored" and ev["medium"] == "GPU" for h in ev["block_hashes"]}
    cpu = {h for batch in rec.batches for ev in batch
           if ev["type"] == "BlockStored" and ev["medium"] == "CPU" for h in ev["block_hashes"]}
    assert cpu and cpu <= gpu


def test_multimodal_inputs_scope_the_tier_keys(make_engine) -> None:
    engine = make_engine(num_gpu_blocks=16, env=tiers(host=64))
    shared = prompt(12, 25)
    engine.submit(shared, 1)
    engine.run_until_idle()

    def with_images(rid: int, hashes: list[list[int]] | None) -> LlmRequest:
        req = LlmRequest(rid, shared)
        req.multimodal_hashes = hashes  # as the C++ request binds it
        return req

    assert offered(engine, with_images(960, None)) == 24
    assert offered(engine, with_images(961, [[1, 2, 3, 4]])) == 0  # placeholder tokens match,
    # the image does not: never the text-only blocks


def test_sidecar_publishes_hex_string_hashes_as_v2_radix_keys() -> None:
    """``POST /kv_cache_events`` of a V2 engine with ``v2_sha256`` hashing: hex hashes."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kvbm_plugin.cli.sidecar import run_sidecar
    from kvbm_plugin.consolidator_config import load_consolidator_config

    key1, key2 = bytes(range(3, 35)), bytes(range(100, 132))
    body = json.dumps([
        {"event_id": 0, "window_size": 64, "hash_algo": "v2_sha256",
         "data": {"type": "stored", "parent_hash": None, "blocks": [
             stored(key1.hex())["data"]["blocks"][0],
             stored(key2.hex(), tokens=[5, 6, 7, 8])["data"]["blocks"][0]]}},
        {"event_id": 1, "window_size": 64, "hash_algo": "v2_sha256",
         "data": {"type": "removed", "block_hashes": [key2.hex()]}}]).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server API
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    recorders: list[Recorder] = []

    def factory(*args: Any) -> Recorder:
        recorders.append(Recorder())
        return recorders[-1]

    class Once(threading.Event):
        def __init__(self) -> None:
            super().__init__()
            self.n = 1

        def is_set(self) -> bool:
            self.n -= 1
            return self.n < 0

    try:
        config = load_consolidator_config({"DYN_KVBM_TRTLLM_ZMQ_PORT": "1"})
        stats = run_sidecar(f"http://127.0.0.1:{server.server_address[1]}", config,
                            block_size=BS, interval=0.001, stop_event=Once(),
                            publisher_factory=factory)
    finally:
        server.shutdown()
        server.server_close()
    assert stats["malformed_events"] == 0
    (events,) = recorders[0].batches
    assert events[0]["block_hashes"] == [radix_key_hash(key1), radix_key_hash(key2)]
    assert events[1]["block_hashes"] == [radix_key_hash(key2)]


def test_salt_spellings_map_to_one_id_and_odd_values_still_isolate() -> None:
    from types import SimpleNamespace

    from kvbm_plugin.wire.identity import request_scope, salt_of

    sid = cache_salt_id("tenant-a")
    assert salt_of(SimpleNamespace(cache_salt_id=sid)) == salt_of(
        SimpleNamespace(cache_salt="tenant-a")) == salt_of({"cache_salt": "tenant-a"}) == sid
    assert salt_of(SimpleNamespace(cache_salt_id=sid, cache_salt="ignored")) == sid
    assert salt_of(SimpleNamespace(cache_salt="")) is not None  # only None means unsalted
    assert salt_of(SimpleNamespace()) is None and request_scope(SimpleNamespace()) is None
    odd = salt_of(SimpleNamespace(cache_salt_id="not-a-number"))
    assert odd is not None and odd != salt_of(SimpleNamespace(cache_salt="not-a-number"))

"""The connector leader/worker driven by the simulated TRT-LLM engine (TRT-LLM's call order)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from _engines import flush_gpu, prompt, tiers
from _kvwire import wait_until

from kvbm_plugin.connector.meta import save_ops
from kvbm_plugin.connector_leader import KvbmConnectorLeader
from kvbm_plugin.consolidator_config import ConfigError
from kvbm_plugin.testing.engine import SimulatedEngine
from kvbm_plugin.testing.fake_trtllm import (
    KvCacheConfig,
    LlmArgs,
    LlmRequest,
    ParallelConfig,
    trtllm_block_hash,
)
from kvbm_plugin.tiers.content_keys import block_keys
from kvbm_plugin.tiers.disk import DiskTier


def test_prefix_evicted_from_gpu_onboards_from_host_with_exact_bytes(make_engine) -> None:
    engine = make_engine(num_gpu_blocks=16, env=tiers(host=64))
    a = prompt(1, 33)  # 8 full blocks + 1 token
    first = engine.submit(a, 2)
    engine.run_until_idle()
    assert engine.result(first).host_hit_tokens == 0
    flush_gpu(engine, 3)
    assert engine.pool.match([trtllm_block_hash(None, a[:4])]) == []  # gone from the GPU
    second = engine.submit(a, 2)
    engine.run_until_idle()
    r = engine.result(second)
    assert r.gpu_hit_tokens == 0
    assert r.host_hit_tokens == 32  # all 8 full blocks; the last token is computed
    assert r.kv_mismatches == 0 and engine.stats().kv_mismatches == 0
    assert engine.stats().bytes_onboarded == 8 * engine.workers[0]._block_bytes
    assert r.tokens == engine.result(first).tokens  # same continuation


def test_prefix_onboards_from_disk_after_host_eviction(make_engine) -> None:
    engine = make_engine(num_gpu_blocks=16, env=tiers(host=8, disk=64))
    a = prompt(2, 25)
    engine.submit(a, 1)
    engine.run_until_idle()
    flush_gpu(engine, 3)  # 30 more blocks through an 8-block host tier: `a` is demoted
    assert engine.leader.stats()["demotes_committed"] > 0
    second = engine.submit(a, 1)
    engine.run_until_idle()
    r = engine.result(second)
    assert r.disk_hit_tokens == 24 and r.host_hit_tokens == 0
    assert r.kv_mismatches == 0


def test_disk_only_tier_offloads_and_onboards(make_engine) -> None:
    engine = make_engine(num_gpu_blocks=16, env=tiers(disk=64))
    a = prompt(3, 17)
    engine.submit(a, 1)
    engine.run_until_idle()
    flush_gpu(engine, 2)
    second = engine.submit(a, 1)
    engine.run_until_idle()
    assert engine.result(second).disk_hit_tokens == 16
    assert engine.stats().kv_mismatches == 0


def test_corrupted_disk_block_is_a_miss_not_wrong_data(make_engine) -> None:
    engine = make_engine(num_gpu_blocks=16, env=tiers(disk=64), tp_size=2, num_kv_heads=4)
    a = prompt(4, 17)  # 4 full blocks
    engine.submit(a, 1)
    engine.run_until_idle()
    flush_gpu(engine, 2)
    disk = engine.workers[1]._disk_io.tier
    assert isinstance(disk, DiskTier)
    index = engine.leader._tiers.disk
    # Damage rank 1's copy of the prompt's third block (a write into the file).
    entry = index.get(block_keys(a, 4)[2])
    assert entry is not None
    with open(disk.path(entry.slot), "r+b") as f:
        f.seek(64)
        f.write(b"\xff\xff\xff\xff")
    second = engine.submit(a, 1)
    engine.run_until_idle()
    r = engine.result(second)
    assert r.disk_hit_tokens == 8  # blocks 0-1 only: block 2 is a miss, so 3 is not consecutive
    assert r.kv_mismatches == 0
    assert engine.leader.stats()["stale_disk_blocks"] == 1


def test_full_tiers_keep_working_and_stay_within_capacity(make_engine) -> None:
    engine = make_engine(num_gpu_blocks=12, env=tiers(host=4, disk=6))
    # One request at a time: each one's 3 full blocks fit the host tier in one iteration, so
    # what the tiers hold afterwards does not depend on how transfers interleave.
    for k in range(8):
        engine.submit(prompt(10 + k, 13), 1)
        engine.run_until_idle()
    st = engine.leader.stats()
    assert st["host_used"] <= 4 and st["disk_used"] <= 6
    assert st["host_evictions"] > 0 and st["disk_evictions"] > 0
    assert len(engine.resident_blocks()["CPU"][0]) <= 4
    # The most recent prompt's blocks are still in a tier (LRU keeps the newest); asked for
    # again, its KV comes back exactly.
    keys = block_keys(prompt(17, 13), 4)
    index_host, index_disk = engine.leader._tiers.host, engine.leader._tiers.disk
    assert any(index_host.get(k) is not None or index_disk.get(k) is not None for k in keys)
    last = engine.submit(prompt(17, 13), 1)
    engine.run_until_idle()
    r = engine.result(last)
    assert r.host_hit_tokens + r.disk_hit_tokens + r.gpu_hit_tokens > 0
    assert engine.stats().kv_mismatches == 0


def test_abort_mid_transfer_still_finishes_every_id(make_engine, monkeypatch) -> None:
    original = DiskTier.write
    release = threading.Event()  # disk writes wait here until the abort has happened

    def held_write(self, slot, key, block):
        release.wait(30)
        return original(self, slot, key, block)

    monkeypatch.setattr(DiskTier, "write", held_write)
    engine = make_engine(num_gpu_blocks=32, env=tiers(disk=64), max_num_tokens=8)
    victim = engine.submit(prompt(20, 40), 4)
    for _ in range(3):
        engine.step()  # three 8-token chunks: six offloads queued behind a slow disk
    engine.abort(victim)
    engine.step()
    # TRT-LLM frees a cancelled request's blocks at once and never calls request_finished for
    # it; the leader learns it from the request object and never commits saves that may have
    # read reused blocks.
    assert engine._reqs[victim].state == "done"
    release.set()
    engine.run_until_idle(timeout_s=30)
    assert engine.stats().requests_aborted == 1
    stats = engine.leader.stats()
    assert stats["ops_inflight"] == 0 and stats["requests_tracked"] == 0
    assert stats["requests_terminated_silently"] == 1
    assert stats["saves_discarded_terminated"] > 0


def test_abort_while_loading_finishes(make_engine, monkeypatch) -> None:
    engine = make_engine(num_gpu_blocks=16, env=tiers(disk=64))
    a = prompt(21, 17)
    engine.submit(a, 1)
    engine.run_until_idle()
    flush_gpu(engine, 2)
    original = DiskTier.read
    release = threading.Event()  # disk reads wait here until the abort has happened

    def held_read(self, slot, key, out):
        release.wait(30)
        return original(self, slot, key, out)

    monkeypatch.setattr(DiskTier, "read", held_read)
    second = engine.submit(a, 1)
    engine.step()
    assert engine._reqs[second].state == "loading"
    engine.abort(second)
    engine.step()
    release.set()
    engine.run_until_idle(timeout_s=30)
    assert engine._reqs[second].state == "done" and engine.stats().requests_aborted == 1


def test_failed_offload_finishes_and_is_never_advertised(make_engine, monkeypatch,
                                                         expect_errors) -> None:
    def broken(self, slot, key, block):
        raise OSError("disk on fire")

    monkeypatch.setattr(DiskTier, "write", broken)
    recorder = Recorder()
    engine = make_engine(num_gpu_blocks=16, env=tiers(disk=16), tier_events=recorder)
    engine.submit(prompt(30, 21), 1)
    engine.run_until_idle()
    assert engine.leader.stats()["saves_failed"] == 5
    assert recorder.calls == [] and engine.resident_blocks()["DISK"][0] == set()
    assert expect_errors.wait_for("disk write of slot")


def test_tp2_same_slots_own_shards(make_engine) -> None:
    engine = make_engine(num_gpu_blocks=16, env=tiers(host=64), tp_size=2, num_kv_heads=4)
    a = prompt(40, 25)
    engine.submit(a, 1)
    engine.run_until_idle()
    h0, h1 = engine.workers[0]._host, engine.workers[1]._host
    used = [s for s, k in enumerate(h0.keys) if k is not None]
    assert len(used) == 6 and h0.keys == h1.keys  # same block in the same slot on both ranks
    for s in used:
        assert not h0.pool[s].equal(h1.pool[s])  # each rank holds its own heads
    flush_gpu(engine, 3)
    second = engine.submit(a, 1)
    engine.run_until_idle()
    r = engine.result(second)
    assert r.host_hit_tokens == 24 and r.kv_mismatches == 0  # both shards verified


def test_chunked_prefill_offloads_every_full_block(make_engine) -> None:
    engine = make_engine(num_gpu_blocks=32, env=tiers(host=64), max_num_tokens=6)
    a = prompt(50, 42)  # 10 full blocks, delivered over 7 chunks that straddle blocks
    engine.submit(a, 1)
    engine.run_until_idle()
    want = []
    parent = None
    for i in range(10):
        parent = trtllm_block_hash(parent, a[i * 4:(i + 1) * 4])
        want.append(parent)
    assert engine.resident_blocks()["CPU"][0] == set(want)


class Recorder:
    """Recording fake of the consolidator's registration API; checks bytes at STORE time."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.remove_sizes: list[int] = []
        self.engine: SimulatedEngine | None = None
        self.violations: list[str] = []

    def register_store(self, tier, dp_rank, block_hash, parent_hash, token_ids, block_size):
        self.calls.append(("store", tier, block_hash, parent_hash, tuple(token_ids)))
        if self.engine is not None:
            self._check_bytes(tier, block_hash)

    def register_remove(self, tier, dp_rank, block_hashes):
        self.remove_sizes.append(len(block_hashes))
        for h in block_hashes:
            self.calls.append(("remove", tier, h))

    def register_clear(self, tier, dp_rank):
        self.calls.append(("clear", tier))

    def _check_bytes(self, tier: str, block_hash: int) -> None:
        leader = self.engine.leader
        index = leader._tiers.host if tier == "CPU" else leader._tiers.disk
        entry = next(e for e in index.entries() if e.event_hash == block_hash)
        for w in self.engine.workers:
            if tier == "CPU":
                ok = w._host.keys[entry.slot] == entry.key
            else:
                import torch

                disk = w._disk_io.tier
                out = torch.empty(disk.spec.block_shape, dtype=disk.spec.dtype)
                ok = disk.read(entry.slot, entry.key, out)
            if not ok:
                self.violations.append(f"{tier} STORE {block_hash:#x} before rank "
                                       f"{w._rank} has the bytes")


class BatchRecorder(Recorder):
    """:class:`Recorder` with the consolidator's batch form, which the leader then uses for
    the blocks one batch of reports commits; records each call's size."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_sizes: list[int] = []

    def register_store(self, *args, **kwargs) -> None:
        self.batch_sizes.append(1)
        super().register_store(*args, **kwargs)

    def register_stores(self, tier, dp_rank, stores, block_size):
        self.batch_sizes.append(len(stores))
        for block_hash, parent_hash, tokens, lora_id, extra_keys in stores:
            assert lora_id is None and extra_keys is None
            super().register_store(tier, dp_rank, block_hash, parent_hash, tokens, block_size)


@pytest.mark.parametrize("batches", [False, True], ids=["one-by-one", "batches"])
def test_tier_store_and_remove_reach_registration_in_order(make_engine, batches) -> None:
    recorder = BatchRecorder() if batches else Recorder()
    engine = make_engine(num_gpu_blocks=12, env=tiers(host=6, disk=8), tp_size=2,
                         tier_events=recorder)
    recorder.engine = engine
    # One request at a time: each one's offloads complete before the next fills the host tier,
    # so host evictions demote to disk whatever the machine's load (with all six at once, a
    # host tier full of copies still in flight skips offloads instead, and nothing reaches disk).
    for k in range(6):
        engine.submit(prompt(60 + k, 17), 2)
        engine.run_until_idle()
    assert recorder.violations == []
    # The last reports may be applied by the idle keeper after the engine went idle: once no
    # op is left, the truth (read under the leader's lock) and the calls are complete.
    wait_until(lambda: engine.leader.stats()["ops_inflight"] == 0, what="the last reports")
    truth = engine.resident_blocks()
    live: dict[str, set[int]] = {"CPU": set(), "DISK": set()}
    parents_seen: dict[str, set[int]] = {"CPU": set(), "DISK": set()}
    for call in recorder.calls:
        if call[0] == "store":
            _, tier, h, parent, tokens = call
            assert h not in live[tier], f"double STORE of {h:#x} in {tier}"
            assert len(tokens) == 4
            live[tier].add(h)
            parents_seen[tier].add(h)
        elif call[0] == "remove":
            _, tier, h = call
            assert h in live[tier], f"REMOVE of {h:#x} never stored in {tier}"
            live[tier].remove(h)
    assert live["CPU"] == truth["CPU"][0] and live["DISK"] == truth["DISK"][0]
    assert any(c[0] == "remove" and c[1] == "CPU" for c in recorder.calls)
    assert any(c[0] == "store" and c[1] == "DISK" for c in recorder.calls)
    if batches:  # the 4 full blocks of each prompt are reported together
        assert max(recorder.batch_sizes) >= 4, recorder.batch_sizes
    # A request's offloads evict several host blocks: their REMOVEs are registered together.
    assert max(recorder.remove_sizes) >= 2, recorder.remove_sizes
    # The disk tier keeps a block's tokens only until its STORE is registered (an entry still
    # being written, or one whose demotion waits for the next iteration's metadata, keeps them).
    disk = engine.leader._tiers.disk
    advertised = [e for e in disk.entries() if e.event_hash in live["DISK"]]
    dropped = 0
    for entry in advertised:
        try:
            disk.get(entry.key).token_ids  # noqa: B018 - raises once the tokens are dropped
        except LookupError:
            dropped += 1
    # Every advertised block should have dropped them; under load one was seen keeping them
    # (heap, not identity: its STORE went out with the right tokens), so at least one must.
    assert advertised and dropped >= 1, (len(advertised), dropped)
    # Tier events use TRT-LLM's hashes (RequestData.block_hashes): the same ids as GPU events.
    a = prompt(65, 17)
    assert trtllm_block_hash(None, a[:4]) in {c[2] for c in recorder.calls if c[0] == "store"}


def _leader(env: dict[str, str], group: str) -> KvbmConnectorLeader:
    return KvbmConnectorLeader(LlmArgs(KvCacheConfig(4), ParallelConfig(0, 1),
                                       kvbm_plugin_env=env, kvbm_plugin_group=group))


def test_matches_are_block_aligned_never_whole_prompt_never_0_true(make_engine) -> None:
    engine = make_engine(num_gpu_blocks=16, env=tiers(host=32))
    a = prompt(70, 16)  # exactly 4 blocks
    engine.submit(a, 1)
    engine.run_until_idle()
    leader = engine.leader
    req = LlmRequest(999, a)
    assert leader.get_num_new_matched_tokens(req, 0) == (12, True)  # last block recomputed
    leader.request_finished(req, [])
    assert leader.get_num_new_matched_tokens(LlmRequest(998, a), 3) == (0, False)
    assert leader.get_num_new_matched_tokens(LlmRequest(997, prompt(71, 16)), 0) == (0, False)
    assert leader.stats()["match_calls"] == 4


def test_a_generation_only_request_keeps_the_scope_its_request_object_carries(
        make_engine) -> None:
    """A disaggregated generation-only request loads nothing, but its blocks are offloaded
    later: under its adapter and multimodal items, which RequestData does not name, so the
    leader keeps them from the request object (else its tier keys would be unscoped, and a
    base-model request with the same tokens could load the adapter's KV)."""
    engine = make_engine(num_gpu_blocks=16, env=tiers(host=32))
    leader = engine.leader
    req = LlmRequest(990, prompt(72, 16), lora_task_id=5,
                     multimodal=[([1, 2, 3, 4, 5, 6, 7, 8], [(4, 4)])])
    req.is_generation_only_request = True
    assert leader.get_num_new_matched_tokens(req, 0) == (0, False)
    state = leader._reqs[990]  # noqa: SLF001
    assert state.scope == (5, None) and state.name_inputs.lora == 5
    assert state.name_inputs.mm and "lora:5" in state.salt and "mm:" in state.salt
    leader.request_finished(req, [])


def test_bad_config_names_variable(tmp_path) -> None:
    with pytest.raises(ConfigError, match="DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS"):
        _leader(tiers(DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="lots"), "bad-config")
    # (Unset, the port is no longer an error for one leader: its consolidator takes the
    # GPU tier by direct call; tests/consolidator/test_direct_hand_over.py.)
    with pytest.raises(ConfigError, match="DYN_KVBM_TRTLLM_ZMQ_PORT"):
        _leader({"DYN_KVBM_CPU_CACHE_GB": "1", "DYN_KVBM_TRTLLM_ZMQ_PORT": "70000"},
                "bad-config-2")


def test_leader_module_never_imports_torch() -> None:
    code = ("import sys\n"
            "from kvbm_plugin.connector_leader import KvbmConnectorLeader\n"
            "from kvbm_plugin.testing.fake_trtllm import LlmArgs, KvCacheConfig, ParallelConfig\n"
            "l = KvbmConnectorLeader(LlmArgs(KvCacheConfig(4), ParallelConfig(0, 1),"
            " kvbm_plugin_env={'DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR': 'false',"
            " 'DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS': '8'}, kvbm_plugin_group='t'))\n"
            "l.shutdown()\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_copy_that_cannot_be_issued_fails_its_ops_and_finishes_ids(make_engine,
                                                                   monkeypatch,
                                                                   expect_errors) -> None:
    import kvbm_plugin.worker.transfer_thread as transfer_mod

    original = transfer_mod.runs

    def broken_runs(pairs):
        # The first element of each run is past the end of its pool: the copy's shapes differ,
        # so issuing it raises on the transfer thread.
        return [(a + 10**6, b, n) for a, b, n in original(pairs)]

    monkeypatch.setattr(transfer_mod, "runs", broken_runs)
    recorder = Recorder()
    engine = make_engine(num_gpu_blocks=16, env=tiers(host=16), tier_events=recorder)
    req = engine.submit(prompt(31, 21), 1)
    engine.run_until_idle(timeout_s=10)
    # a request still saving when the loop went idle is released by the next pass's
    # get_finished (TRT-LLM's loop makes none while idle)
    engine.submit(prompt(32, 2), 1)  # no full block: nothing to offload
    engine.run_until_idle(timeout_s=10)
    assert engine._reqs[req].state == "done"
    assert engine.leader.stats()["saves_failed"] == 5
    assert engine.leader.stats()["ops_inflight"] == 0
    assert recorder.calls == []
    assert expect_errors.wait_for("offload copy of 1 blocks failed")


def test_reports_from_ranks_outside_the_group_or_for_unknown_ops_are_rejected() -> None:
    from kvbm_plugin.connector.meta import OpReport, find_hub

    leader = KvbmConnectorLeader(LlmArgs(KvCacheConfig(4), ParallelConfig(0, 2),
                                         kvbm_plugin_env=tiers(host=8),
                                         kvbm_plugin_group="reject-reports"))
    try:
        op_id = leader._ops.new("save", "host", 123, None)
        hub = find_hub("reject-reports")
        hub.put(OpReport(op_id, 0, True))
        hub.put(OpReport(op_id, 7, True))  # no rank 7 in a TP=2 group
        hub.put(OpReport(op_id + 100, 1, True))  # no such op
        leader._apply_reports()
        stats = leader.stats()
        assert stats["ops_inflight"] == 1  # rank 1 has not reported: not final
        assert stats["reports_rejected"] == 2 and stats["saves_committed"] == 0
        hub.put(OpReport(op_id, 1, False))
        leader._apply_reports()
        assert leader.stats()["ops_inflight"] == 0
    finally:
        leader.shutdown()


def test_worker_shutdown_runs_disk_writes_queued_by_the_last_transfer_job(make_engine,
                                                                        monkeypatch) -> None:
    from kvbm_plugin.connector.meta import DISK, ConnectorMetadata, SaveOp

    engine = make_engine(num_gpu_blocks=16, env=tiers(disk=16))
    engine.submit(prompt(32, 9), 1)
    engine.run_until_idle()
    worker = engine.workers[0]
    disk_thread = worker._disk_io.thread
    transfers = worker._transfers
    original = type(transfers)._save_to_disk

    def late_save_to_disk(self, op, fwd_event):
        # Runs on the transfer thread during shutdown: give the disk thread every chance to
        # have stopped already (it must not, while the transfer thread can still queue work).
        deadline = time.monotonic() + 0.5
        while disk_thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        original(self, op, fwd_event)

    monkeypatch.setattr(type(transfers), "_save_to_disk", late_save_to_disk)
    offloaded = worker.stats()["blocks_offloaded"]
    worker.bind_connector_meta(ConnectorMetadata(
        10**6, worker._layout, saves=(SaveOp(10**6, 4242, 0, DISK, 15, 77),)))
    worker.shutdown()
    assert worker.stats()["saves_inflight"] == 0
    assert worker.stats()["blocks_offloaded"] == offloaded + 1


def test_prompt_blocks_are_hashed_once_per_request(monkeypatch) -> None:
    import kvbm_plugin.tiers.content_keys as content_keys
    from kvbm_plugin.testing.fake_trtllm import RequestData, SchedulerOutput

    leader = _leader(tiers(host=8), "hash-once")
    try:
        calls = []
        reference = content_keys._keys_py

        class Counting:  # stands in for the compiled keys: counts every block hashed
            def keys(self, parent, tokens, block_size, start, suffix, digests):
                out = reference(parent, tokens, block_size, start, suffix, digests)
                calls.extend(out)
                return out

        monkeypatch.setattr(content_keys, "_COMPILED", Counting())
        tokens = prompt(33, 17)  # 4 full blocks of 4 and one token
        assert leader.get_num_new_matched_tokens(LlmRequest(1, tokens), 0) == (0, False)
        leader.build_connector_meta(SchedulerOutput(new_requests=[
            RequestData(1, tokens, [0, 1, 2, 3, 4], 0, 17)]))
        assert len(calls) == 4  # not 4 for the match and 4 again for the offload walk
        digests: list[bytes] = []
        expected = block_keys(tokens, 4, digests=digests)
        assert leader._reqs[1].keys == expected
        assert leader._reqs[1].digests == digests  # hashed with the keys, kept with them
    finally:
        leader.shutdown()


def test_a_generation_step_that_fills_no_block_costs_no_planning(monkeypatch) -> None:
    """A running request's step that fills no block is absorbed in O(1): RequestData's
    cumulative hash chain is not copied again and the planner does not start a walk (its
    cost per step must not grow with the context); the step that fills one offloads it."""
    from kvbm_plugin.testing.fake_trtllm import RequestData, SchedulerOutput

    leader = _leader(tiers(host=32), "decode-step")
    try:
        tokens = prompt(44, 9)  # 2 full blocks of 4 and one token
        chain = [101, 102]
        assert leader.get_num_new_matched_tokens(LlmRequest(1, tokens), 0) == (0, False)
        meta = leader.build_connector_meta(SchedulerOutput(new_requests=[
            RequestData(1, tokens, [0, 1, 2], 0, 9, list(chain))]))
        assert len(save_ops(meta.saves)) == 2
        state = leader._reqs[1]
        hashes = state.event_hashes
        walks = []
        planner = leader._offload
        real = planner._schedule
        monkeypatch.setattr(planner, "_schedule", lambda *a: walks.append(1) or real(*a))
        for step in range(2):  # tokens 10 and 11: block 2 is not full yet
            meta = leader.build_connector_meta(SchedulerOutput(cached_requests=[
                RequestData(1, [500 + step], [], 9 + step, 1, list(chain))]))
            assert meta.saves == () and walks == []
        assert state.event_hashes is hashes
        meta = leader.build_connector_meta(SchedulerOutput(cached_requests=[
            RequestData(1, [502], [], 11, 1, [*chain, 103])]))  # token 12 fills it
        assert [save.device_block for save in save_ops(meta.saves)] == [2] and walks == [1]
        assert state.event_hashes == [*chain, 103]
    finally:
        leader.shutdown()


def test_a_bad_mpi_rank_variable_is_named(monkeypatch) -> None:
    from types import SimpleNamespace

    from kvbm_plugin.connector.llm_args import parallel_of

    monkeypatch.delenv("OMPI_COMM_WORLD_RANK", raising=False)
    monkeypatch.setenv("PMI_RANK", "one")
    with pytest.raises(ConfigError, match=r"PMI_RANK='one'"):
        parallel_of(SimpleNamespace(tensor_parallel_size=2))
    monkeypatch.setenv("PMI_RANK", "1")
    assert parallel_of(SimpleNamespace(tensor_parallel_size=2)).rank == 1


def test_tier_events_without_consolidator_survive_a_raising_publisher(expect_errors) -> None:
    from kvbm_plugin.connector_leader import TierEventPublisher

    class Raising:
        def publish(self, events, data_parallel_rank=None):
            raise RuntimeError("transport plugin bug")

    tier_events = TierEventPublisher(Raising(), 4, 0)
    tier_events.register_remove("CPU", 0, [1])
    assert tier_events.flush() is False  # called on the executor thread: never raises
    assert tier_events.lost_batches == 1
    assert tier_events.flush() is True  # nothing pending
    assert expect_errors.wait_for("transport plugin bug")


def test_jobs_split_into_copy_batches_move_every_block_exactly(make_engine) -> None:
    # On CUDA a job's host copies complete in ~64 MiB batches; force 3-block batches here.
    engine = make_engine(num_gpu_blocks=16, env=tiers(host=64))
    worker = engine.workers[0]
    worker._transfers.batch_blocks = 3
    a = prompt(41, 33)  # 8 full blocks: batches of 3 + 3 + 2 each way
    engine.submit(a, 2)
    engine.run_until_idle()
    assert worker.stats()["blocks_offloaded"] == 8
    offload_batches = worker.stats()["copies_issued"]
    flush_gpu(engine, 3)
    second = engine.submit(a, 2)
    engine.run_until_idle()
    r = engine.result(second)
    assert r.host_hit_tokens == 32 and r.kv_mismatches == 0
    assert worker.stats()["blocks_onboarded"] == 8
    assert offload_batches >= 3  # (runs of consecutive slots coalesce only within a batch)
    assert engine.leader.stats()["ops_inflight"] == 0


def test_a_job_with_no_host_copies_has_no_copy_batch() -> None:
    """A load served only from disk (no host copies) must not fail the job."""
    from kvbm_plugin.worker.copy_runs import chunked

    assert list(chunked([], 0)) == []
    assert list(chunked([1, 2], 0)) == [[1, 2]]


def test_a_run_the_full_tier_cuts_short_resumes_at_its_first_unreserved_block() -> None:
    """A request's newly full blocks are reserved as one run; where the tier has room for
    part of it (the rest of its slots pending), the run stops there (counted), those blocks
    are offloaded, and the next iteration takes the rest, evicting the least recently used
    leaves once the pending writes are committed."""
    from kvbm_plugin.connector.meta import OpReport, find_hub
    from kvbm_plugin.testing.fake_trtllm import RequestData, SchedulerOutput

    leader = _leader(tiers(host=4), "run-cut-short")
    try:
        a, b = prompt(50, 13), prompt(51, 13)  # 3 full blocks of 4 and one token each
        requests = [LlmRequest(1, a), LlmRequest(2, b)]  # alive: never taken as terminated
        for request in requests:
            assert leader.get_num_new_matched_tokens(request, 0) == (0, False)
        meta = leader.build_connector_meta(SchedulerOutput(new_requests=[
            RequestData(1, a, [0, 1, 2, 3], 0, 13), RequestData(2, b, [4, 5, 6, 7], 0, 13)]))
        # a's 3, then room for one of b's
        assert [s.req_id for s in save_ops(meta.saves)] == [1, 1, 1, 2]
        assert leader.stats()["tier_full_skips"] == 1 and leader._reqs[2].offload_next == 1
        hub = find_hub("run-cut-short")
        for save in save_ops(meta.saves):  # every write done: a's blocks become evictable
            hub.put(OpReport(save.op_id, 0, True))
        meta = leader.build_connector_meta(SchedulerOutput(cached_requests=[
            RequestData(2, [9], [], 13, 1)]))
        assert [(s.req_id, s.device_block) for s in save_ops(meta.saves)] == [(2, 5), (2, 6)]
        assert leader.stats()["host_evictions"] == 2 and leader._reqs[2].offload_next == 3
        host = leader._tiers.host
        assert all(key in host for key in block_keys(b, 4))
        assert [key in host for key in block_keys(a, 4)] == [True, False, False]  # leaves first
    finally:
        leader.shutdown()


def test_a_run_of_saves_is_done_when_every_rank_reported_every_block() -> None:
    """A request's run of saves is one record (op ids consecutive, one per block): nothing of
    it is committed until every rank reported every block (reports over several batches, a
    rank's duplicate counted once); then each block is committed where both ranks succeeded,
    a block one rank failed is not, nor the blocks written after it (no orphan), and the
    request is forgotten."""
    from kvbm_plugin.connector.meta import OpReport, find_hub
    from kvbm_plugin.testing.fake_trtllm import RequestData, SchedulerOutput

    leader = KvbmConnectorLeader(LlmArgs(KvCacheConfig(4), ParallelConfig(0, 2),
                                         kvbm_plugin_env=tiers(host=16),
                                         kvbm_plugin_group="save-run-fold"))
    try:
        tokens = prompt(60, 17)  # 4 full blocks of 4 and one token
        request = LlmRequest(1, tokens)
        assert leader.get_num_new_matched_tokens(request, 0) == (0, False)
        meta = leader.build_connector_meta(SchedulerOutput(new_requests=[
            RequestData(1, tokens, [0, 1, 2, 3, 4], 0, 17)]))
        ids = [s.op_id for s in save_ops(meta.saves)]
        assert len(ids) == 4 and ids == list(range(ids[0], ids[0] + 4))
        assert leader.stats()["ops_inflight"] == 4
        hub = find_hub("save-run-fold")
        for op_id in ids:  # rank 0: every block; block 2 failed
            hub.put(OpReport(op_id, 0, op_id != ids[2]))
        for op_id in ids[:3]:  # rank 1: three blocks, the first twice
            hub.put(OpReport(op_id, 1, True))
        hub.put(OpReport(ids[0], 1, True))
        leader._apply_reports()
        stats = leader.stats()
        assert stats["ops_inflight"] == 4 and stats["saves_committed"] == 0
        assert leader.request_finished(request, [0, 1, 2, 3, 4]) is True  # saves in flight
        hub.put(OpReport(ids[3], 1, True))
        leader._apply_reports()
        stats = leader.stats()
        assert stats["ops_inflight"] == 0 and stats["saves_failed"] == 1
        host = leader._tiers.host
        committed = [host.get(k) is not None and host.get(k).resident
                     for k in block_keys(tokens, 4)]
        assert committed == [True, True, False, False]
        assert len(host) == 2  # the failed block and its child forgotten
        assert 1 not in leader._reqs  # its last run done: forgotten
    finally:
        leader.shutdown()


def test_a_run_stops_at_a_block_with_no_device_block() -> None:
    """One layer group: a block TensorRT-LLM gave no device block (-1) ends the run of saves
    before it (no copy from block -1), and the blocks after it are not offloaded (their
    parent has no copy anywhere)."""
    from kvbm_plugin.testing.fake_trtllm import RequestData, SchedulerOutput

    leader = _leader(tiers(host=16), "run-no-device-block")
    try:
        tokens = prompt(61, 17)  # 4 full blocks of 4 and one token
        assert leader.get_num_new_matched_tokens(LlmRequest(1, tokens), 0) == (0, False)
        meta = leader.build_connector_meta(SchedulerOutput(new_requests=[
            RequestData(1, tokens, [5, 6, -1, 8, 9], 0, 17)]))
        assert [s.device_block for s in save_ops(meta.saves)] == [5, 6]
        assert leader.stats()["orphan_saves_skipped"] == 1
    finally:
        leader.shutdown()


def test_keys_extend_from_the_last_digest_and_mend_a_mismatch(expect_errors) -> None:  # noqa: ANN001
    """A request's keys are extended from its last digest (the chain continues: the same keys
    as hashing the whole prompt at once); keys without their digests are said (an error
    logged) and both hashed again from the first block, never chained from a root."""
    from kvbm_plugin.leader.offload_planner import _extend_keys
    from kvbm_plugin.leader.requests import RequestState

    tokens = prompt(40, 23)
    digests: list[bytes] = []
    whole = block_keys(tokens, 4, "t", digests=digests)
    state = RequestState(1, salt="t", tokens=tokens[:12])
    _extend_keys(state, 4)
    state.tokens.extend(tokens[12:])
    _extend_keys(state, 4)
    assert state.keys == whole and state.digests == digests
    broken = RequestState(2, salt="t", tokens=tokens, keys=[1, 2])  # (wrong keys, no digests)
    _extend_keys(broken, 4)
    assert broken.keys == whole and broken.digests == digests
    assert expect_errors.wait_for("request 2 had 2 content keys but 0 digests")


def test_a_shared_save_run_is_read_as_its_ops() -> None:
    """The metadata's SharedSaveOpRun (a planner run's write-throughs, one record) reads as one
    SharedSaveOp per block, in order, between single ops as given; a run whose fields disagree
    in length is refused."""
    from kvbm_plugin.connector.meta import SharedSaveOp, SharedSaveOpRun, shared_save_ops

    single = SharedSaveOp(5, -1, -1, b"d" * 16, 3, 77)
    run = SharedSaveOpRun(10, (1, 2, 4), (30, 31, 33), (b"a" * 16, b"b" * 16, b"c" * 16))
    assert shared_save_ops((single, run)) == [
        single, SharedSaveOp(10, 1, 30, b"a" * 16), SharedSaveOp(11, 2, 31, b"b" * 16),
        SharedSaveOp(12, 4, 33, b"c" * 16)]
    assert shared_save_ops(()) == []
    with pytest.raises(ValueError):
        shared_save_ops((SharedSaveOpRun(1, (1, 2), (3,), (b"x" * 16,) * 2),))


def test_a_save_run_is_read_as_its_ops_and_counted_per_request() -> None:
    """The metadata's SaveOpRun (a planner run's saves, one record) reads as one SaveOp per
    block, in order, with each block's layer-group pages where it has them; the worker's
    transfer thread reads a metadata's runs as ops (ops_of: the same object where it has
    none); request progress counts a run's blocks at bind time."""
    from kvbm_plugin.connector.meta import (
        HOST,
        ConnectorMetadata,
        SaveOp,
        SaveOpRun,
        SharedSaveOp,
        SharedSaveOpRun,
        TierLayout,
        ops_of,
        save_count,
    )
    from kvbm_plugin.worker.load_errors import LoadErrorRecord
    from kvbm_plugin.worker.request_progress import RequestProgress
    from kvbm_plugin.worker.transfer_counters import TransferCounters

    run = SaveOpRun(7, 3, HOST, (10, 11), (0, 1), (101, 102))
    grouped = SaveOpRun(9, 4, HOST, (12,), (2,), (103,), ((12, 40),))
    single = SaveOp(20, 5, 13, HOST, 3, 104)
    assert save_ops((run, single, grouped)) == [
        SaveOp(7, 3, 10, HOST, 0, 101), SaveOp(8, 3, 11, HOST, 1, 102), single,
        SaveOp(9, 4, 12, HOST, 2, 103, (12, 40))]
    assert [save_count(x) for x in (run, single, grouped)] == [2, 1, 1]
    layout = TierLayout(8, 0, None)
    plain = ConnectorMetadata(1, layout, saves=(single,))
    assert ops_of(plain) is plain
    meta = ConnectorMetadata(2, layout, saves=(run,), shared_saves=(
        SharedSaveOpRun(30, (7, 8), (10, 11), (b"a" * 16, b"b" * 16)),))
    read = ops_of(meta)
    assert read.saves == (SaveOp(7, 3, 10, HOST, 0, 101), SaveOp(8, 3, 11, HOST, 1, 102))
    assert read.shared_saves == (SharedSaveOp(30, 7, 10, b"a" * 16),
                                 SharedSaveOp(31, 8, 11, b"b" * 16))
    counters = TransferCounters()
    progress = RequestProgress(0, counters, LoadErrorRecord(0, counters))
    progress.expect(ConnectorMetadata(3, layout, saves=(run, single)))
    progress.save_ended([3])
    assert progress.finished([3, 5], []) == ([], [])  # one of the run's two still in flight
    progress.save_ended([3, 5])
    assert progress.finished([], []) == ([3, 5], [])

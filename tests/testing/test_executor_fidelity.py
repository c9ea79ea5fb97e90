"""The simulated executor behaves like TensorRT-LLM's where the connector can tell the difference:
allocation, first reports, event timing and form, the overlap scheduler, call depth, ranks in
other processes and pool variants."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import pytest
from _engines import OFF, flush_gpu, prompt, tiers
from _kvwire import wait_until

from kvbm_plugin.leader import gpu_tier_events as leader_gpu_events
from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine
from kvbm_plugin.testing.fake_trtllm import KVCacheEventSerializer


def record(engine: SimulatedEngine) -> dict[str, list]:
    """Wrap the leader's hooks (instance attributes) to record what TRT-LLM hands them."""
    seen: dict[str, list] = {"alloc": [], "outputs": [], "finished": []}
    leader = engine.leader
    alloc, build, finished = (leader.update_state_after_alloc, leader.build_connector_meta,
                              leader.request_finished)

    def rec_alloc(request: Any, block_ids: list[int]) -> None:
        seen["alloc"].append((request.request_id, list(block_ids)))
        alloc(request, block_ids)

    def rec_build(output: Any) -> Any:
        seen["outputs"].append((engine.stats().iterations, output))
        return build(output)

    def rec_finished(request: Any, block_ids: list[int]) -> bool:
        seen["finished"].append((engine.stats().iterations, request.request_id))
        return finished(request, block_ids)

    leader.update_state_after_alloc = rec_alloc
    leader.build_connector_meta = rec_build
    leader.request_finished = rec_finished
    return seen


def reports(seen: dict[str, list], req_id: int) -> list[tuple[str, Any]]:
    out = []
    for _, output in seen["outputs"]:
        out += [("new", rd) for rd in output.new_requests if rd.request_id == req_id]
        out += [("cached", rd) for rd in output.cached_requests if rd.request_id == req_id]
    return out


# --------------------------------------------------------------------------- allocation


@pytest.mark.parametrize("overlap", [True, False])
def test_whole_prompt_allocated_on_first_chunk_and_chunks_arrive_as_positions(
        make_engine, overlap: bool) -> None:
    engine = make_engine(env=OFF, max_num_tokens=8, overlap_scheduler=overlap)
    seen = record(engine)
    req = engine.submit(prompt(1, 30), 2)
    engine.run_until_idle()
    assert [len(ids) for rid, ids in seen["alloc"] if rid == req] == [8]  # ceil(30 / 4)
    rows = reports(seen, req)
    kind, first = rows[0]
    assert kind == "new" and len(first.new_tokens) == 30 and len(first.new_block_ids) == 8
    assert (first.computed_position, first.num_scheduled_tokens) == (0, 8)
    chunks = [rd for k, rd in rows[1:4]]
    assert [rd.computed_position for rd in chunks] == [8, 16, 24]
    assert [rd.num_scheduled_tokens for rd in chunks] == [8, 8, 6]
    assert all(not rd.new_tokens and not rd.new_block_ids for rd in chunks)
    assert engine.stats().kv_mismatches == 0


def test_first_report_after_an_async_load_carries_the_full_position(make_engine) -> None:
    engine = make_engine(num_gpu_blocks=16, env=tiers(host=64))
    a = prompt(2, 17)
    engine.submit(a, 1)
    engine.run_until_idle()
    flush_gpu(engine, 3)
    seen = record(engine)
    second = engine.submit(a, 1)
    engine.run_until_idle()
    result = engine.result(second)
    loaded = result.host_hit_tokens
    assert loaded == 16 and result.gpu_hit_tokens == 0
    kind, first = reports(seen, second)[0]
    # upstream clears external_loads in the build that skipped the loading request
    assert kind == "new" and first.computed_position == loaded
    assert first.num_scheduled_tokens == 1
    assert engine.stats().kv_mismatches == 0


# --------------------------------------------------------------------------- call depth


def test_frame_walk_crosses_the_connector_manager_frames(make_engine, monkeypatch) -> None:
    chains: list[list[str]] = []
    original = leader_gpu_events.find_kv_cache_manager

    def spy(max_depth: int = 32) -> Any:
        names: list[str] = []
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_name != "build_connector_meta":
            frame = frame.f_back
        frame = frame.f_back if frame is not None else None
        while frame is not None:
            if not frame.f_code.co_filename.endswith("keeper.py"):  # the leader's own lock
                names.append(frame.f_code.co_name)
            if getattr(frame.f_locals.get("self"), "kv_cache_manager", None) is not None:
                break
            frame = frame.f_back
        chains.append(names)
        return original(max_depth)

    monkeypatch.setattr(leader_gpu_events, "find_kv_cache_manager", spy)
    engine = make_engine(env=OFF)
    engine.submit(prompt(3, 9), 1)
    engine.run_until_idle()
    # The building handle_metadata is called by the loop itself (``_executor_loop`` /
    # ``_executor_loop_overlap`` @ 0004396720054; ``step`` here), before
    # ``_kv_connector_start_batch`` calls it again as a no-op.
    assert chains and chains[0] == ["<lambda>", "_run_on_leader", "handle_metadata", "step"]
    assert engine.leader.event_source is not None


# --------------------------------------------------------------------------- events


def test_events_are_objects_readable_only_after_the_iteration_flush(make_engine) -> None:
    engine = make_engine(env=OFF, overlap_scheduler=False)
    manager = engine.kv_cache_manager
    assert manager.get_latest_events(0) == []  # "created" is recorded, not flushed yet
    engine.submit(prompt(4, 9), 1)
    engine.step()  # builds (attaching the plugin), computes, stores two blocks, flushes
    raw = manager.get_latest_events(0)
    assert raw and all(type(e).__name__ == "KVCacheEvent" for e in raw)
    dicts = KVCacheEventSerializer.serialize(raw)
    assert [d["data"]["type"] for d in dicts][:2] == ["created", "stored"]
    assert all(set(d) == {"event_id", "data", "window_size"} for d in dicts)
    block = dicts[1]["data"]["blocks"][0]
    assert set(block) == {"type", "block_hash", "tokens", "cache_level", "priority"}
    sink = engine.leader.event_sink.stats()  # our read went through the plugin's tee
    assert sink["events_in"] == len(raw) and sink["malformed_events"] == 0


def test_draining_event_source_starves_trtllm_event_reader(make_engine) -> None:
    """The plugin's per-iteration drain takes events from TRT-LLM's own dispatch reader (what
    LLM.get_kv_cache_events / /kv_cache_events / Dynamo's TRT-LLM publisher read)."""
    engine = make_engine(env={**OFF, "DYN_KVBM_KV_EVENTS_SOURCE": "drain"},
                         trtllm_event_reader=True)
    reader = engine.event_reader
    assert reader is not None
    reader.pause()  # a reader that polls rarely, e.g. an HTTP client of /kv_cache_events
    for k in range(4):
        engine.submit(prompt(10 + k, 13), 2)
    engine.run_until_idle()
    produced = engine.kv_cache_manager.produced
    source = engine.leader.event_source
    # The leader's event pump drains off the executor thread, within its period
    wait_until(lambda: source.events_seen >= produced, what="the plugin's drain")
    reader.resume()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and engine.kv_cache_manager.wait_readable(0.05):
        time.sleep(0.01)  # let the reader take what is still queued
    got = len(reader.events())
    assert produced > 0
    assert got < produced  # starved: the plugin drained the rest


def _wait_reader_has(reader: Any, produced: int) -> None:
    """Until TRT-LLM's reader (its dispatch thread) has taken ``produced`` events."""
    wait_until(lambda: len(reader.events()) >= produced, what=f"the reader's {produced} events")


def test_trtllm_event_reader_gets_every_event_when_nobody_else_drains(make_engine) -> None:
    """Control for the test above: the reader itself loses nothing."""
    engine = make_engine(env={**OFF, "DYN_KVBM_KV_EVENTS_SOURCE": "off"},
                         trtllm_event_reader=True)
    for k in range(4):
        engine.submit(prompt(20 + k, 13), 2)
    engine.run_until_idle()
    produced = engine.kv_cache_manager.produced
    _wait_reader_has(engine.event_reader, produced)
    assert produced > 0 and len(engine.event_reader.events()) == produced


def test_tap_source_leaves_every_event_to_trtllm_reader_and_still_publishes_them(
        make_engine) -> None:
    """With the non-draining source (DYN_KVBM_KV_EVENTS_SOURCE=tap) TRT-LLM's own reader gets
    every event, and the plugin still receives each one through its tee."""
    engine = make_engine(env={**OFF, "DYN_KVBM_KV_EVENTS_SOURCE": "tap"},
                         trtllm_event_reader=True)
    for k in range(4):
        engine.submit(prompt(30 + k, 13), 2)
    engine.run_until_idle()
    produced = engine.kv_cache_manager.produced
    reader = engine.event_reader
    _wait_reader_has(reader, produced)
    assert produced > 0 and len(reader.events()) == produced
    assert engine.leader.event_sink.stats()["events_in"] == produced


def test_auto_source_stops_draining_once_trtllm_reader_reads(make_engine) -> None:
    """auto (the default): the plugin drains while TRT-LLM's reader has not read yet; from its
    first read on, the reader gets every event."""
    engine = make_engine(env=OFF, trtllm_event_reader=True)
    reader = engine.event_reader
    reader.pause()
    engine.submit(prompt(40, 13), 2)
    engine.run_until_idle()
    assert engine.leader.event_source.drains
    reader.resume()
    deadline = time.monotonic() + 10
    while engine.leader.event_source.drains and time.monotonic() < deadline:
        reader.read_once()  # its first call: from now on the plugin only taps
        time.sleep(0.01)
    assert not engine.leader.event_source.drains
    seen_before, produced_before = len(reader.events()), engine.kv_cache_manager.produced
    for k in range(3):
        engine.submit(prompt(41 + k, 13), 2)
    engine.run_until_idle()
    produced = engine.kv_cache_manager.produced - produced_before
    while len(reader.events()) - seen_before < produced and time.monotonic() < deadline + 10:
        time.sleep(0.01)
    assert produced > 0 and len(reader.events()) - seen_before == produced


# --------------------------------------------------------------------------- overlap


def test_overlap_scheduler_lags_and_terminates_one_pass_late(
        make_engine) -> None:
    results = {}
    for overlap in (False, True):
        engine = make_engine(env=OFF, overlap_scheduler=overlap)
        seen = record(engine)
        req = engine.submit(prompt(5, 9), 3)
        engine.run_until_idle()
        stats = engine.stats()
        manager = engine.kv_cache_connector_manager
        gen = [rd for kind, rd in reports(seen, req)[1:]]
        results[overlap] = (seen["finished"], stats.forward_passes,
                            manager.get_finished_calls, gen, engine.result(req).tokens)
    (fin0, fwd0, gf0, gen0, tok0), (fin1, fwd1, gf1, gen1, tok1) = results[False], results[True]
    assert tok0 == tok1 and len(tok0) == 12  # same tokens either way
    assert fwd0 == 3 and fwd1 == 4  # the overlap loop runs the finished request once more
    # one get_finished per pass; the request terminates in the extra pass's
    # _process_previous_batch, after which the loop blocks (no pass without a forward)
    assert gf0 == fwd0 and gf1 == fwd1
    assert fin0[0][0] == 3 and fin1[0][0] == 4  # terminated one iteration later
    # the first generation step: without overlap the sampled token is reported; with overlap
    # the request object does not have it yet (computed_position lags by one)
    assert (len(gen0[0].new_tokens), gen0[0].computed_position) == (1, 9)
    assert (len(gen1[0].new_tokens), gen1[0].computed_position) == (0, 8)


def test_overlap_is_the_default() -> None:
    assert EngineConfig().overlap_scheduler is True


# --------------------------------------------------------------------------- pool variants


@pytest.mark.parametrize("variant", [{"kv_factor": 1}, {"kv_cache_dtype": "fp8"},
                                     {"kv_factor": 1, "kv_cache_dtype": "fp8"}])
def test_pool_variants_onboard_exact_bytes(make_engine, variant: dict[str, Any]) -> None:
    import torch

    engine = make_engine(num_gpu_blocks=16, tp_size=2, env=tiers(host=32, disk=64), **variant)
    pool = engine.kv_pools[0]
    assert pool.shape[2] == variant.get("kv_factor", 2)
    assert pool.dtype == (torch.int8 if variant.get("kv_cache_dtype") == "fp8"
                          else torch.float32)
    a = prompt(6, 17)
    engine.submit(a, 1)
    engine.run_until_idle()
    flush_gpu(engine, 3)
    second = engine.submit(a, 1)
    engine.run_until_idle()
    result = engine.result(second)
    assert result.host_hit_tokens + result.disk_hit_tokens == 16
    assert result.kv_mismatches == 0 and engine.stats().kv_mismatches == 0
    block_bytes = pool[0].numel() * pool.element_size()
    assert engine.stats().bytes_onboarded >= 4 * 2 * block_bytes  # 4 blocks on both ranks


def test_pool_variant_options_are_checked() -> None:
    with pytest.raises(ValueError, match="kv_factor=3"):
        SimulatedEngine(EngineConfig(kv_factor=3, env=OFF))
    with pytest.raises(ValueError, match="processes=True needs tp_size"):
        SimulatedEngine(EngineConfig(processes=True, env=OFF))


# --------------------------------------------------------------------------- processes


def test_ranks_in_processes_report_completions_over_zmq(make_engine, caplog) -> None:
    engine = make_engine(num_gpu_blocks=16, tp_size=2, processes=True,
                         env=tiers(host=32, disk=64))
    assert len(engine.workers) == 1 and len(engine.ranks) == 2  # rank 1 is another process
    assert engine.leader._receiver is not None  # the leader listens for TP>1 reports
    with caplog.at_level(logging.ERROR):
        a = prompt(7, 17)
        engine.submit(a, 2)
        engine.run_until_idle(timeout_s=60)
        flush_gpu(engine, 3)
        second = engine.submit(a, 1)
        engine.run_until_idle(timeout_s=60)
    result = engine.result(second)
    assert result.host_hit_tokens + result.disk_hit_tokens == 16
    stats = engine.stats()
    assert stats.kv_mismatches == 0  # both ranks' blocks checked, rank 1 in its process
    remote = engine.ranks[1].stats()
    assert remote["bytes_offloaded"] > 0 and remote["bytes_onboarded"] > 0
    leader = engine.leader.stats()
    # a save is committed only once both ranks reported it: rank 1's reports came over ZMQ
    assert leader["saves_committed"] > 0 and leader["saves_failed"] == 0
    assert leader["ops_inflight"] == 0 and leader["reports_malformed"] == 0
    assert "ERROR" not in caplog.text


def test_load_with_only_disk_copies_runs_without_a_failed_transfer_job(make_engine,
                                                                        caplog) -> None:
    """A load job whose copies all come from disk has no host-copy batch (on CPU the batch size
    is 0: one batch per job); it must not fail the transfer job."""
    engine = make_engine(num_gpu_blocks=16, env=tiers(disk=64))
    a = prompt(8, 17)
    engine.submit(a, 1)
    engine.run_until_idle()
    flush_gpu(engine, 3)
    with caplog.at_level(logging.ERROR, logger="kvbm_plugin.connector_worker"):
        second = engine.submit(a, 1)
        engine.run_until_idle()
    assert engine.result(second).disk_hit_tokens == 16
    assert "transfer job failed" not in caplog.text
    assert engine.stats().kv_mismatches == 0


def test_serializer_keeps_newer_per_block_fields_only_when_present() -> None:
    from kvbm_plugin.testing.fake_trtllm import event_object

    plain = {"event_id": 3, "window_size": 64, "data": {
        "type": "stored", "parent_hash": None, "blocks": [{
            "type": "stored_block", "block_hash": 7, "cache_level": 0, "priority": 35,
            "tokens": [{"type": "unique_token", "token_id": 1, "token_extra_id": 0}]}]}}
    assert KVCacheEventSerializer.serialize([event_object(plain)]) == [plain]
    salted = {**plain, "data": {**plain["data"], "blocks": [
        {**plain["data"]["blocks"][0], "cache_salt": "tenant-a"}]}}
    assert KVCacheEventSerializer.serialize([event_object(salted)]) == [salted]


def test_a_rank_process_that_dies_is_reported_not_waited_for(make_engine) -> None:
    engine = make_engine(tp_size=2, processes=True, env=OFF)
    remote = engine.ranks[1]
    remote._proc.kill()
    remote._proc.join(10)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 process exited"):
        engine.submit(prompt(9, 9), 1)
        engine.run_until_idle(timeout_s=30)
    assert time.monotonic() - started < 20

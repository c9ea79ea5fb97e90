"""The simulated executor follows ``py_executor.py`` @ 0004396720054 where the connector can
tell: no call while idle, no build without a prepared batch, ``request_finished`` only for
finished requests from ``_send_kv_async``, cancellation freeing blocks at once (also during an
async load), GPU STOREs in ``update_resources`` / at release, and ``add_sequence_batch``'s
order (every query before any ``update_state_after_alloc``, the report after the trim)."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from _engines import OFF, held_disk, prompt, tiers

from kvbm_plugin.testing.engine import SimulatedEngine


class Calls:
    """Every connector call the engine makes, leader and workers, in order."""

    LEADER = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
              "request_finished")
    WORKER = ("bind_connector_meta", "start_load_kv", "get_finished", "wait_for_save")

    def __init__(self, engine: SimulatedEngine) -> None:
        self.log: list[tuple[str, Any, str]] = []
        for name in self.LEADER:
            self._wrap(engine.leader, name)
        for worker in engine.workers:
            for name in self.WORKER:
                self._wrap(worker, name)

    def _wrap(self, obj: Any, name: str) -> None:
        original = getattr(obj, name)

        def call(*args: Any) -> Any:
            arg = getattr(args[0], "request_id", None) if args else None
            frame, callers = sys._getframe(1), []
            while frame is not None and len(callers) < 6:
                callers.append(frame.f_code.co_name)
                frame = frame.f_back
            self.log.append((name, arg, ",".join(callers)))
            return original(*args)

        setattr(obj, name, call)

    def names(self) -> list[str]:
        return [name for name, _, _ in self.log]


def in_disk_not_gpu(engine: SimulatedEngine, tokens: list[int]) -> None:
    engine.submit(tokens, 1)
    engine.run_until_idle()
    for k in range(3):  # unrelated requests evict it from the GPU pool
        engine.submit(prompt(500 + k, 40), 1)
        engine.run_until_idle()


@pytest.mark.parametrize("overlap", [True, False])
def test_an_idle_engine_makes_no_connector_call(make_engine, overlap) -> None:
    engine = make_engine(env=tiers(host=16), overlap_scheduler=overlap)
    engine.submit(prompt(1, 9), 2)
    engine.run_until_idle()
    calls = Calls(engine)
    for _ in range(5):
        assert engine.step() == 0
    assert calls.log == []


def test_a_pass_without_a_prepared_batch_builds_nothing_but_asks_get_finished(
        make_engine, monkeypatch) -> None:
    engine = make_engine(num_gpu_blocks=16, env=tiers(disk=64))
    a = prompt(21, 17)
    in_disk_not_gpu(engine, a)
    release = held_disk(monkeypatch, "read")
    req = engine.submit(a, 1)
    engine.step()
    assert engine.result(req).state == "loading"
    calls = Calls(engine)
    builds = engine.kv_cache_connector_manager.metadata_builds
    for _ in range(3):
        engine.step()  # only the async-loading request is active: nothing is scheduled
    assert engine.kv_cache_connector_manager.metadata_builds == builds
    assert set(calls.names()) == {"get_finished"}
    release.set()
    engine.run_until_idle()


@pytest.mark.parametrize("overlap", [True, False])
def test_request_finished_only_for_finished_requests_and_from_send_kv_async(
        make_engine, overlap) -> None:
    engine = make_engine(env=tiers(host=64), overlap_scheduler=overlap, max_num_tokens=8)
    calls = Calls(engine)
    done = [engine.submit(prompt(30 + k, 13), 3) for k in range(2)]
    cancelled = [engine.submit(prompt(40 + k, 13), 3) for k in range(3)]
    engine.step()
    engine.abort(cancelled[0])  # in prefill
    engine.abort(cancelled[2])  # still queued
    for _ in range(3):
        engine.step()
    engine.abort(cancelled[1])
    engine.run_until_idle()
    finished = [(arg, frame) for name, arg, frame in calls.log if name == "request_finished"]
    assert sorted(arg for arg, _ in finished) == sorted(done)
    assert all("_send_kv_async" in callers for _, callers in finished)
    stats = engine.leader.stats()
    assert stats["requests_tracked"] == 0 and stats["ops_inflight"] == 0


def test_a_batch_is_queried_whole_before_any_allocation_is_reported(make_engine) -> None:
    engine = make_engine(env=tiers(host=64), max_num_tokens=20)
    calls = Calls(engine)
    for k in range(3):
        engine.submit(prompt(60 + k, 9), 1)
    engine.step()
    order = [name for name in calls.names()
             if name in ("get_num_new_matched_tokens", "update_state_after_alloc",
                         "build_connector_meta")]
    assert order == ["get_num_new_matched_tokens"] * 3 + ["update_state_after_alloc"] * 3 + \
        ["build_connector_meta"]


def test_the_report_comes_after_the_token_budget_trim(make_engine) -> None:
    """A prompt mostly found in the host tier: the chunk scheduled before the match shrinks to
    what is left to compute, and the report says so."""
    engine = make_engine(num_gpu_blocks=16, env=tiers(host=64), max_num_tokens=64)
    a = prompt(70, 33)
    in_disk_not_gpu(engine, a)
    seen: list[Any] = []
    build = engine.leader.build_connector_meta

    def rec(output: Any) -> Any:
        seen.append(output)
        return build(output)

    engine.leader.build_connector_meta = rec
    req = engine.submit(a, 1)
    engine.run_until_idle()
    first = [rd for out in seen for rd in (*out.new_requests, *out.cached_requests)
             if rd.request_id == req][0]
    # 32 tokens came from the host tier: one token is left, and that is what is scheduled
    assert engine.result(req).host_hit_tokens == 32
    assert first.num_scheduled_tokens == 1


@pytest.mark.parametrize("overlap", [True, False])
def test_gpu_stores_come_from_update_resources_and_generated_blocks_at_release(
        make_engine, overlap) -> None:
    engine = make_engine(env=OFF, overlap_scheduler=overlap)
    manager = engine.kv_cache_manager
    engine.submit(prompt(80, 9), 8)  # 2 prompt blocks; the generated tokens fill a third
    stored: list[tuple[int, int]] = []  # (pass, blocks) per STORE event readable after it
    while engine.active():
        engine.step()
        for ev in engine.get_latest_kv_cache_events():
            if type(ev.data).__name__ == "KVCacheStoredData":
                stored.append((engine.stats().iterations, len(ev.data.blocks)))
    # pass 1 computes the prompt; its blocks are stored in that pass's update_resources
    # (plain loop) or the next pass's _process_previous_batch (overlap loop)
    first_pass = 2 if overlap else 1
    assert stored[0] == (first_pass, 2)
    # the generated full block and the trailing partial one only when the request is released
    assert stored[1:] == [(engine.stats().iterations, 2)]
    assert manager.dropped == 0


@pytest.mark.parametrize("overlap", [True, False])
def test_a_cancel_during_an_async_load_frees_the_blocks_at_once(make_engine, monkeypatch,
                                                                 overlap) -> None:
    engine = make_engine(num_gpu_blocks=16, env=tiers(disk=64), overlap_scheduler=overlap)
    a = prompt(90, 17)
    in_disk_not_gpu(engine, a)
    release = held_disk(monkeypatch, "read")
    calls = Calls(engine)
    loading = engine.submit(a, 1)
    other = engine.submit(prompt(91, 9), 4)  # keeps batches running
    engine.step()
    assert engine.result(loading).state == "loading"
    free_before = engine.pool.available()
    engine.abort(loading)
    engine.step()
    if overlap:
        engine.step()  # processed in _process_previous_batch, which needs a previous batch
    assert engine.result(loading).state == "done"  # while its load still runs
    assert engine.pool.available() > free_before
    assert all(arg != loading for name, arg, _ in calls.log if name == "request_finished")
    release.set()
    engine.run_until_idle()
    assert engine.result(other).state in ("done", "saving")  # saving: freed by a later pass
    assert engine.leader.stats()["requests_tracked"] == 0

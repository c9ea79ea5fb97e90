"""The truth a router can know: blocks a request's release stores after the pass's flush.

Upstream (``py_executor.py``, stored file id 3542389387): ``_kv_connector_terminate_requests``
runs after the pass's ``_add_kv_cache_events``, so a request that ``get_finished`` releases
there stores its blocks into the C++ event queue after the flush; nobody can read them before
the next pass's flush, and an engine that then waits for a request never makes one. The
simulator keeps that order, and its truth (``resident_blocks``) is the pool as the flushed
events describe it; ``unflushed_gpu_blocks`` is the difference. A demo run that ended this way
once compared the consolidated view with the pool itself and failed on a block nobody could
have published.
"""

from __future__ import annotations

import threading
import time

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine
from kvbm_plugin.testing.gpu_pool import GpuPool
from kvbm_plugin.wire.events import to_unsigned_u64
from kvbm_plugin.worker import transfer_thread


def test_the_pool_is_readable_as_its_taken_events_describe_it() -> None:
    pool = GpuPool(8, 4, 64)
    a, b, c = pool.alloc(), pool.alloc(), pool.alloc()
    pool.store_blocks([a, b], [(11, [1, 2, 3, 4]), (12, [5, 6, 7, 8])])
    pool.take_events()
    assert pool.readable_full == {11, 12} == pool.resident_full_hashes()
    pool.store_blocks([a, b, c], [(11, [1, 2, 3, 4]), (12, [5, 6, 7, 8]), (13, [9, 9, 9, 9])],
                      first=2)
    assert pool.readable_full == {11, 12}  # stored, not flushed
    pool.take_events()
    assert pool.readable_full == {11, 12, 13}
    for block in (c, b, a):
        pool.release(block)
    while pool.free:  # use up the free list: the next allocation evicts the LRU leaf (13)
        pool.alloc()
    pool.alloc()
    assert pool.resident_full_hashes() == {11, 12} and pool.readable_full == {11, 12, 13}
    pool.take_events()
    assert pool.readable_full == {11, 12}


def test_a_release_after_the_flush_is_out_of_the_truth_until_the_next_pass(
        tmp_path, monkeypatch) -> None:  # noqa: ANN001
    # Saves wait for ``go``: request A finishes while its offloads are in flight (SAVING) and
    # is released by a later pass's get_finished, after that pass's flush.
    go = threading.Event()
    run_saves = transfer_thread.TransferThread._run_saves

    def held(self, meta, fwd_event):  # noqa: ANN001, ANN202
        go.wait(30)
        return run_saves(self, meta, fwd_event)

    monkeypatch.setattr(transfer_thread.TransferThread, "_run_saves", held)
    env = {"DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "true",
           "DYN_KVBM_KV_EVENTS_ENDPOINT": f"ipc://{tmp_path}/gpu",
           "DYN_KVBM_KV_EVENTS_REPLAY_ENDPOINT": f"ipc://{tmp_path}/gpu-replay",
           "DYN_KVBM_KV_EVENTS_OUTPUT_ENDPOINT": f"ipc://{tmp_path}/out",
           "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "16",
           cc.CONSOLIDATOR_MODE: "passthrough"}  # a view per tier: the GPU tier's own
    engine = SimulatedEngine(EngineConfig(num_gpu_blocks=32, env=env, tp_size=1))
    try:
        a = engine.submit(list(range(1, 9)), 8)  # its 3rd block fills with generated tokens
        b = engine.submit(list(range(101, 109)), 40)  # keeps the loop stepping
        deadline = time.monotonic() + 30
        while engine.state(a) != "saving":
            assert time.monotonic() < deadline and engine.step() >= 0
        go.set()
        while not all(w.idle() for w in engine.workers):
            assert time.monotonic() < deadline
            time.sleep(0.001)  # the transfer thread copies; nothing to poll
        engine.step()  # get_finished releases A after this pass's flush
        assert engine.state(a) == "done" and engine.state(b) != "done"
        stored, removed = engine.unflushed_gpu_blocks()
        assert stored and not removed
        truth = engine.resident_blocks()["GPU"][0]
        assert not stored & truth and stored <= engine.pool.resident_full_hashes()

        # What the consolidated stream holds once settled is that truth, not the pool.
        consolidator = engine.leader.consolidator
        engine.leader.publish_now()

        def visible() -> dict[str, set[int]]:
            consolidator.wait_idle(1.0)
            return {m: {to_unsigned_u64(h) for h in consolidator._core.visible_hashes(0, m)}
                    for m in ("GPU", "CPU")}

        def want() -> dict[str, set[int]]:
            return {m: engine.resident_blocks()[m][0] for m in ("GPU", "CPU")}

        while visible() != want():
            assert time.monotonic() < deadline, (visible(), want())
        assert not stored & visible()["GPU"]

        engine.step()  # the next pass flushes them, and the stream has them then
        assert engine.unflushed_gpu_blocks() == (set(), set())
        assert stored <= engine.resident_blocks()["GPU"][0]
        engine.leader.publish_now()
        while not stored <= visible()["GPU"]:
            assert time.monotonic() < deadline
    finally:
        go.set()
        engine.shutdown()

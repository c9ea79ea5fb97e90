"""End to end: simulated engine → real leader (sink, publisher, in-process consolidator)."""

from __future__ import annotations

import time

from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine
from kvbm_plugin.testing.fake_trtllm import SchedulerOutput
from kvbm_plugin.wire.events import to_unsigned_u64


def test_consolidated_view_equals_gpu_host_disk_truth(tmp_path) -> None:
    env = {"DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "true",
           "DYN_KVBM_KV_EVENTS_ENDPOINT": f"ipc://{tmp_path}/gpu",
           "DYN_KVBM_KV_EVENTS_OUTPUT_ENDPOINT": f"ipc://{tmp_path}/out",
           "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "6",
           "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "8",
           "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path / "disk")}
    engine = SimulatedEngine(EngineConfig(num_gpu_blocks=12, env=env, tp_size=2))
    try:
        consolidator = engine.leader.consolidator
        assert consolidator is not None
        for k in range(6):
            engine.submit([(k * 1000 + i * 7) % 997 + 1 for i in range(17)], 2)
        engine.run_until_idle()
        engine.leader.build_connector_meta(SchedulerOutput())  # flush the last GPU events
        truth = set().union(*(ranks[0] for ranks in engine.resident_blocks().values()))
        assert engine.resident_blocks()["DISK"][0]  # all three tiers took part
        deadline = time.monotonic() + 10
        while True:
            consolidator.wait_idle(1.0)
            visible = {to_unsigned_u64(h) for h in consolidator._core.visible_hashes(0)}
            if visible == truth or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert visible == truth
        stats = consolidator.stats()
        assert stats["registration_errors"] == 0 and stats["unknown_parents"] == 0
        assert engine.stats().kv_mismatches == 0
    finally:
        engine.shutdown()


def test_request_larger_than_the_pool_is_rejected_not_queued_forever() -> None:
    import pytest

    engine = SimulatedEngine(EngineConfig(num_gpu_blocks=4, tokens_per_block=4, env={
        "DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "false"}))
    try:
        with pytest.raises(ValueError, match="num_gpu_blocks=4"):
            engine.submit(list(range(1, 17)), 1)
        engine.submit(list(range(1, 15)), 1)  # 15 tokens fit in 4 blocks
        engine.run_until_idle(timeout_s=30)
        assert engine.stats().requests_finished == 1
    finally:
        engine.shutdown()


def test_no_endpoint_with_consolidator_off_warns_that_nothing_is_published(caplog) -> None:
    import logging

    with caplog.at_level(logging.WARNING, logger="kvbm_plugin.connector_leader"):
        engine = SimulatedEngine(EngineConfig(env={
            "DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "0",
            "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "4"}))
    try:
        assert "no KV-event endpoint configured" in caplog.text
        assert engine.leader.consolidator is None
    finally:
        engine.shutdown()


def test_engine_without_an_event_buffer_gets_a_warning_not_a_silent_empty_stream(caplog) -> None:
    import logging

    engine = SimulatedEngine(EngineConfig(env={"DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "0"}))
    try:
        engine.kv_cache_manager.event_buffer_max_size = 0  # as TRT-LLM's KVCacheManager reports it
        with caplog.at_level(logging.WARNING, logger="kvbm_plugin.connector_leader"):
            engine.submit(list(range(1, 10)), 1)
            engine.run_until_idle()
        assert "event_buffer_max_size=0" in caplog.text
        assert engine.leader.event_source is None
    finally:
        engine.shutdown()

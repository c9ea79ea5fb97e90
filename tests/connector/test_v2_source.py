"""The GPU-tier source on KVCacheManagerV2 (issue 26, item 2): the plugin's Python hooks are
refused where TensorRT-LLM's C++ backend calls its event sink natively, and a source that
receives nothing while the pool holds computed blocks is never reported as working: the
leader's self-check warns (rate-limited), counts and says so in its status line."""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace
from typing import Any

import pytest
from _engines import OFF

from kvbm_plugin.connector.metrics import get_metrics
from kvbm_plugin.connector_leader import KvbmConnectorLeader
from kvbm_plugin.testing.fake_trtllm import (
    KvCacheConfig,
    LlmArgs,
    ParallelConfig,
    RequestData,
    SchedulerOutput,
    V2KVCacheManager,
)

BS = 4
CHECK = 4  # the leader's SELF_CHECK_ITERATIONS in these tests
LOG = "kvbm_plugin.connector_leader"


@pytest.fixture
def leader(request: pytest.FixtureRequest):
    lead = KvbmConnectorLeader(LlmArgs(KvCacheConfig(BS), ParallelConfig(0, 1),
                                       kvbm_plugin_env=OFF,
                                       kvbm_plugin_group=f"v2src-{request.node.name}"))
    lead._gpu.SELF_CHECK_ITERATIONS = CHECK
    yield lead
    lead.shutdown()


def _run(leader: KvbmConnectorLeader, kv_cache_manager: Any, iterations: int) -> None:
    """One request decoding for ``iterations`` executor iterations; each iteration the
    stand-in's radix tree stores the request's full blocks (as TensorRT-LLM commits them).
    ``kv_cache_manager`` is a local here: the leader finds it in its caller's frames."""
    tokens = list(range(100, 108))
    for i in range(iterations):
        if i == 0:
            out = SchedulerOutput(new_requests=[RequestData(1, list(tokens), [0, 1], 0, 8)])
        else:
            tokens.append(200 + i)
            out = SchedulerOutput(cached_requests=[RequestData(
                1, [tokens[-1]], [2 + i // BS] if len(tokens) % BS == 1 else [],
                len(tokens) - 1, 1)])
        leader.build_connector_meta(out)
        kv_cache_manager.commit(tokens, BS)


def _silent_metric() -> float:
    return get_metrics().registry.get_sample_value(
        "kvbm_leader_gpu_source_silent_iterations_total", {"dp_rank": "0"}) or 0.0


def test_a_native_sink_python_cannot_see_is_reported_silent_once(leader, caplog) -> None:
    """The C++ backend's radix tree calls its sink natively (a stand-in whose type does not
    give it away): the wrapped hooks are never called. The leader never says "attached",
    warns once (rate-limited) past the self-check, counts every silent iteration (stats and
    the metric) and its status line says it is not receiving."""
    manager = V2KVCacheManager(cpp_sink=True)
    with caplog.at_level(logging.INFO, logger=LOG):
        _run(leader, manager, CHECK + 6)
    assert manager.event_manager.stored, "the stand-in's own sink got the blocks"
    found = [r.getMessage() for r in caplog.records if "GPU-tier event source" in r.message]
    assert len(found) == 1 and "attached" not in found[0] and "unconfirmed" in found[0]
    silent = [r for r in caplog.records if "NOT receiving" in r.getMessage()]
    assert len(silent) == 1 and silent[0].levelno == logging.WARNING
    assert leader.stats()["gpu_source_silent_iterations"] == 6
    assert _silent_metric() == 6
    assert leader.event_source_status.startswith("GPU-tier events: NOT receiving")
    assert "TLLM_KV_CACHE_MANAGER_V2_BACKEND=python" in leader.event_source_status


def test_python_hooks_confirm_the_source_and_the_self_check_stays_quiet(leader,
                                                                         caplog) -> None:
    manager = V2KVCacheManager()
    with caplog.at_level(logging.INFO, logger=LOG):
        _run(leader, manager, CHECK + 6)
    assert not [r for r in caplog.records if "NOT receiving" in r.getMessage()]
    assert leader.stats()["gpu_source_silent_iterations"] == 0
    assert leader.event_sink.stats()["blocks_stored"] > 0
    assert leader.event_source_status.endswith("receiving")


def test_v2_hooks_batches_are_flushed_on_the_executor_thread(leader, monkeypatch) -> None:
    """The V2 hooks fill the sink's batches without its lock on the executor thread: the
    leader's event pump stops at attach, and every flush runs on that thread."""
    import threading

    from kvbm_plugin.event_sink import KvEventSink

    flushed_on: set[int] = set()
    flush = KvEventSink.flush

    def recorded(self: Any) -> bool:
        flushed_on.add(threading.get_ident())
        return flush(self)

    monkeypatch.setattr(KvEventSink, "flush", recorded)
    _run(leader, V2KVCacheManager(), 3)  # attaches at the first iteration
    flushed_on.clear()
    _run(leader, V2KVCacheManager(), 3)
    assert not leader._gpu.pump._thread.is_alive()  # noqa: SLF001
    assert flushed_on == {threading.get_ident()}
    assert leader.event_sink.stats()["blocks_stored"] > 0


def test_the_self_check_waits_for_computed_blocks(leader, caplog) -> None:
    """Iterations without a full block of computed prompt KV are not evidence of silence."""
    kv_cache_manager = V2KVCacheManager(cpp_sink=True)  # found in this frame
    for _ in range(CHECK + 6):
        leader.build_connector_meta(SchedulerOutput())
    assert leader.event_source is not None
    # A prompt shorter than a block, decoding past a block: TensorRT-LLM commits no generated
    # token into its radix tree, so no stored event is due.
    tokens = [1, 2, 3]
    leader.build_connector_meta(SchedulerOutput(new_requests=[RequestData(7, tokens, [0], 0, 3)]))
    for i in range(CHECK + 6):
        leader.build_connector_meta(SchedulerOutput(cached_requests=[RequestData(
            7, [50 + i], [1 + (3 + i) // BS] if (3 + i) % BS == 0 else [], 3 + i, 1)]))
    assert leader._reqs[7].valid_tokens > BS
    assert leader.stats()["gpu_source_silent_iterations"] == 0
    assert "unconfirmed" in leader.event_source_status
    del kv_cache_manager


def test_a_cpp_event_manager_type_is_refused_at_attach(leader, caplog) -> None:
    """TensorRT-LLM's nanobind event manager (its type lives in tensorrt_llm.bindings): not
    attached, one warning naming the way out, no self-check needed."""
    manager = V2KVCacheManager(cpp_sink=True, bindings_type=True)
    with caplog.at_level(logging.INFO, logger=LOG):
        _run(leader, manager, CHECK + 6)
    warned = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warned) == 1 and "calls the event sink natively" in warned[0]
    assert "kv_events_config" in warned[0]
    assert leader.event_source is None
    assert leader.event_source_status.startswith("unavailable: KVCacheManagerV2's event "
                                                 "manager is TensorRT-LLM's C++ one")
    assert not [r for r in caplog.records if "GPU-tier event source found" in r.message]


def test_the_loaded_v2_module_naming_the_cpp_backend_is_refused(leader, monkeypatch) -> None:
    """``tensorrt_llm.runtime.kv_cache_manager_v2`` chose ``cpp`` at import: even an event
    manager that looks like Python is refused (its hooks are the C++ ones)."""
    monkeypatch.setitem(sys.modules, "tensorrt_llm.runtime.kv_cache_manager_v2",
                        SimpleNamespace(_BACKEND="cpp"))
    manager = V2KVCacheManager()
    _run(leader, manager, 2)
    assert leader.event_source is None
    assert "TLLM_KV_CACHE_MANAGER_V2_BACKEND=cpp" in leader.event_source_status


@pytest.mark.parametrize("backend", [None, "cpp", "python"])
def test_doctor_says_what_the_v2_backend_means(monkeypatch, capsys, backend) -> None:
    import json

    from kvbm_plugin.cli.doctor import main_doctor

    if backend is None:
        monkeypatch.delenv("TLLM_KV_CACHE_MANAGER_V2_BACKEND", raising=False)
    else:
        monkeypatch.setenv("TLLM_KV_CACHE_MANAGER_V2_BACKEND", backend)
    monkeypatch.setenv("DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR", "false")
    main_doctor(["--json"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    detail = checks["KV event source"]["detail"]
    if backend == "python":
        assert "TLLM_KV_CACHE_MANAGER_V2_BACKEND=python: its Python event hooks" in detail
    else:  # unset: TensorRT-LLM's default, the C++ backend
        assert "TLLM_KV_CACHE_MANAGER_V2_BACKEND=cpp (C++, TensorRT-LLM's default)" in detail
        assert "kv_events_config" in detail and "gpu_source_silent_iterations" in detail


def test_a_chain_whose_request_ended_before_its_names_came_back_is_named_whole(
        make_engine, tmp_path) -> None:
    """TensorRT-LLM's own stream (the GPU-tier source on the C++ V2 backend) reaches the
    leader on the consolidator's thread, so a request can end before its blocks' names come
    back. Its tier copies are then named from their content, parents first, each from its
    parent's tier entry: the whole chain is advertised (was: the root only, the other blocks
    held unadvertised until dropped at the bound)."""
    from _kvwire import wait_until

    from kvbm_plugin.testing.fake_trtllm import KVEventsConfig

    events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/trt",
                            replay_endpoint=f"ipc://{tmp_path}/trt-replay")
    engine = make_engine(num_gpu_blocks=12, tokens_per_block=BS, kv_events_config=events,
                         provide_block_hashes=False, env={
                             "DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "true",
                             "DYN_KVBM_KV_EVENTS_OUTPUT_ENDPOINT": f"ipc://{tmp_path}/out",
                             "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "24"})
    engine.submit([9000 + i for i in range(10 * BS)], 1)  # one request, ten full blocks
    engine.run_until_idle()

    def all_named() -> bool:
        engine.leader.publish_now()
        return engine.leader.stats()["tier_stores_waiting_for_name"] == 0

    wait_until(all_named, 10, "every tier copy named from TensorRT-LLM's stream")
    host = engine.leader.resident_hashes("host")
    assert len(host) == 10
    assert host <= {h & ((1 << 64) - 1) for h in engine.kv_cache_manager.published_hashes}

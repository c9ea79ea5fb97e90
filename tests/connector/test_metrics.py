"""Metrics: registered stats are exported at scrape time; transfer histograms; HTTP endpoint."""

from __future__ import annotations

import urllib.request

from _kvwire import free_port

from kvbm_plugin.connector.metrics import Metrics
from kvbm_plugin.consolidator_config import MetricsSettings


def test_stats_sources_become_counters_and_gauges() -> None:
    metrics = Metrics()
    state = {"batches_published": 3, "queue_high_water": 7, "note": "x"}
    metrics.register_stats("publisher", lambda: state, rank="0")
    state["batches_published"] = 5  # read at scrape time, not at registration
    families = {f.name: f for f in metrics.registry.collect()}
    counter = families["kvbm_publisher_batches_published"]
    assert counter.type == "counter"
    assert counter.samples[0].value == 5 and counter.samples[0].labels == {"rank": "0"}
    assert families["kvbm_publisher_queue_high_water"].type == "gauge"
    assert not any("note" in name for name in families)
    metrics.unregister_stats("publisher", rank="0")
    assert "kvbm_publisher_batches_published" not in {f.name for f in metrics.registry.collect()}


def test_failing_source_does_not_break_scrape() -> None:
    metrics = Metrics()
    metrics.register_stats("broken", lambda: 1 / 0)
    metrics.register_stats("fine", lambda: {"ok": 1})
    names = {f.name for f in metrics.registry.collect()}
    assert "kvbm_fine_ok" in names


def test_transfer_histogram_and_http_endpoint() -> None:
    metrics = Metrics()
    metrics.observe_transfer("offload", "CPU", 0.002, 4 << 20)
    assert metrics.serve(MetricsSettings(enabled=False)) is None
    port = free_port()
    assert metrics.serve(MetricsSettings(enabled=True, port=port)) == port
    assert metrics.serve(MetricsSettings(enabled=True, port=port)) == port  # once
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'kvbm_transfer_seconds_count{direction="offload",tier="CPU"} 1.0' in body
    assert 'kvbm_transfer_bytes_sum{direction="offload",tier="CPU"} 4.194304e+06' in body


def test_engine_run_exports_component_counters_and_transfer_histograms(tmp_path) -> None:
    from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine

    port = free_port()
    env = {"DYN_KVBM_KV_EVENTS_ENDPOINT": f"ipc://{tmp_path}/gpu",
           "DYN_KVBM_KV_EVENTS_OUTPUT_ENDPOINT": f"ipc://{tmp_path}/out",
           "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "4",
           "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "16",
           "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path / "disk"),
           "DYN_KVBM_METRICS": "1", "DYN_KVBM_METRICS_PORT": str(port)}
    from kvbm_plugin.connector.metrics import get_metrics

    engine = SimulatedEngine(EngineConfig(num_gpu_blocks=12, env=env, tp_size=2))
    try:
        for k in range(4):
            engine.submit([(k * 100 + i) % 97 + 1 for i in range(17)], 2)
        engine.run_until_idle()
        served = get_metrics().serve(MetricsSettings(enabled=True, port=port))
        body = urllib.request.urlopen(f"http://127.0.0.1:{served}/metrics",
                                      timeout=10).read().decode()
    finally:
        engine.shutdown()
    assert 'kvbm_event_sink_blocks_stored_total{dp_rank="0"}' in body
    assert 'kvbm_consolidator_registrations_total{dp_rank="0"}' in body
    assert 'kvbm_leader_saves_committed_total{dp_rank="0"}' in body
    assert 'kvbm_transfer_seconds_count{direction="offload",tier="CPU"}' in body


def test_levels_the_components_report_are_gauges() -> None:
    levels = {  # keys of the leader's, the sink's (with its publisher's) and the
        # consolidator's stats() that go down as well as up
        "leader": ("ops_inflight", "host_used", "disk_used"),
        "event_sink": ("pending_events", "publisher_queue_depth", "publisher_queue_high_water",
                       "publisher_replay_buffered"),
        "consolidator": ("registrations_queued", "blocks_tracked", "blocks_visible"),
    }
    metrics = Metrics()
    for component, keys in levels.items():
        metrics.register_stats(component, lambda keys=keys: dict.fromkeys(keys, 1))
    families = {f.name: f.type for f in metrics.registry.collect()}
    for component, keys in levels.items():
        for key in keys:
            assert families[f"kvbm_{component}_{key}"] == "gauge", key

"""The demo as a live endpoint: user endpoints honoured, steady workload, router checks."""

from __future__ import annotations

import threading
import time
from typing import Any

from _kvwire import free_port

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.cli import demo
from kvbm_plugin.routers.router_view import RouterView, TreeSubscriber
from kvbm_plugin.testing import chat_workload

SMALL = ["--sessions", "6", "--turns", "3", "--system-tokens", "64", "--gpu-blocks", "24",
         "--host-blocks", "16", "--disk-blocks", "64", "--no-progress"]
STEADY = ["--sessions", "4", "--turns", "4", "--system-tokens", "32", "--user-tokens", "24",
          "--gen-tokens", "8", "--gpu-blocks", "12", "--host-blocks", "8", "--disk-blocks", "48",
          "--max-context", "176", "--tenants", "3", "--no-progress"]


def test_default_demo_reports_router_accuracy_and_rules(capsys, caplog) -> None:
    code = demo.main_demo(SMALL)
    # the router's settling never makes the leader look for the KV cache manager from outside
    # an engine iteration
    assert not [r for r in caplog.records if "no KV cache manager" in r.getMessage()]
    assert code == 0
    out = capsys.readouterr().out
    assert "[PASS] router rule warnings 0: 0" in out
    assert "[PASS] router agrees with engine reuse on >= 99% of prompt tokens" in out
    assert "router accuracy" in out and "router view (strict)" in out


def test_requests_mode_runs_n_requests_and_passes(capsys) -> None:
    assert demo.main_demo([*STEADY, "--requests", "16"]) == 0
    out = capsys.readouterr().out
    assert "16 finished / 16 submitted" in out
    assert "all checks passed" in out


def test_duration_mode_tp2_passthrough_holds_router_accuracy(capsys) -> None:
    # How many requests fit in the duration depends on the machine's load, so whether the tiers
    # got to serve a prefix does too: only the router's checks (and completion) are asserted.
    demo.main_demo([*STEADY, "--duration", "2", "--tp", "2", "--mode", "passthrough"])
    out = capsys.readouterr().out
    assert "[PASS] every request finished" in out
    assert "[PASS] router rule warnings 0: 0" in out
    assert "[PASS] router agrees with engine reuse" in out


def test_router_disagreement_fails_the_demo(monkeypatch, capsys) -> None:
    monkeypatch.setattr(RouterView, "cached_tokens", lambda self, tokens, **kw: 0)
    assert demo.main_demo(SMALL) == 1
    assert "[FAIL] router agrees with engine reuse" in capsys.readouterr().out


def test_router_rule_warnings_fail_the_demo(monkeypatch, capsys) -> None:
    original = RouterView.apply_batch

    def with_a_stale_batch(self: RouterView, batch, worker: str = "") -> bool:  # noqa: ANN001
        applied = original(self, batch, worker)
        original(self, batch, worker)  # the same seq again: dropped by the watermark, counted
        return applied

    monkeypatch.setattr(RouterView, "apply_batch", with_a_stale_batch)
    assert demo.main_demo(SMALL) == 1
    assert "[FAIL] router rule warnings 0:" in capsys.readouterr().out


def test_port_variables_replace_the_private_endpoints_they_would_lose_to() -> None:
    private = {cc.EVENTS_ENDPOINT: "ipc:///p/gpu", cc.OUTPUT_ENDPOINT: "ipc:///p/out",
               cc.REPLAY_ENDPOINT: "ipc:///p/gpu-replay"}
    merged = demo._with_user_endpoints(private, {cc.TRTLLM_ZMQ_PORT: "20081",
                                                 cc.LEADER_ZMQ_PUB_PORT: "56001"})
    assert cc.EVENTS_ENDPOINT not in merged and cc.OUTPUT_ENDPOINT not in merged
    assert merged[cc.REPLAY_ENDPOINT] == "ipc:///p/gpu-replay"
    config = cc.load_consolidator_config({**merged, cc.ENABLE_CONSOLIDATOR: "true"})
    assert config.publish_endpoint(0).connect == "tcp://127.0.0.1:20081"
    assert config.output.connect == "tcp://127.0.0.1:57001"
    # an endpoint variable wins over a port variable, as in the plugin itself
    merged = demo._with_user_endpoints(private, {cc.TRTLLM_ZMQ_PORT: "20081",
                                                 cc.EVENTS_ENDPOINT: "ipc:///u/gpu"})
    assert merged[cc.EVENTS_ENDPOINT] == "ipc:///u/gpu"


def test_user_endpoint_settings_reads_only_socket_variables() -> None:
    env = {cc.OUTPUT_ENDPOINT: "tcp://*:1", cc.TRTLLM_ZMQ_PORT: " ", cc.CPU_CACHE_GB: "4"}
    assert cc.user_endpoint_settings(env) == {cc.OUTPUT_ENDPOINT: "tcp://*:1"}


def test_demo_serves_the_endpoints_the_user_sets(monkeypatch, tmp_path, capsys) -> None:
    gpu_port, leader_port = free_port(), free_port()
    output = f"ipc://{tmp_path}/out"
    monkeypatch.setenv(cc.TRTLLM_ZMQ_PORT, str(gpu_port))
    monkeypatch.setenv(cc.LEADER_ZMQ_PUB_PORT, str(leader_port))
    monkeypatch.setenv(cc.OUTPUT_ENDPOINT, output)
    monkeypatch.setenv(cc.OUTPUT_REPLAY_ENDPOINT, f"ipc://{tmp_path}/out-replay")
    monkeypatch.setenv(cc.REPLAY_ENDPOINT, f"ipc://{tmp_path}/gpu-replay")
    # An operator's subscriber, joined before the demo starts; it asks for the stream from seq
    # 0 through the replay endpoint, as a router that registered it would.
    watcher = TreeSubscriber(output, f"ipc://{tmp_path}/out-replay", start_seq=0,
                             view=RouterView(16))
    stop = threading.Event()
    has_stream = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            watcher.poll(20)
            if watcher.view.counts.stores > 0:
                has_stream.set()

    # The demo can serve a few requests before the subscriber's sockets have connected (ZMQ
    # retries an ipc connect every 100 ms); the subscriber then fills the gap from the replay
    # endpoint at the next live batch. So the workload goes on (the demo's steady chat, in
    # --duration mode) until the subscriber holds blocks and 10 requests were submitted, as a
    # live endpoint keeps serving while a router joins; a bound ends it if it never does.
    real_drive = chat_workload.drive

    class UntilWatched:
        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.submitted = 0
            self.deadline = time.monotonic() + 60

        def done(self) -> bool:
            return self.submitted >= 10 and (has_stream.is_set()
                                             or time.monotonic() > self.deadline)

        def next_request(self) -> Any:
            if self.done():
                return None
            self.submitted += 1
            return self.inner.next_request()

        def exhausted(self) -> bool:
            return self.done()

        def finished(self, *args: Any) -> None:
            self.inner.finished(*args)

    def drive(engine: Any, probe: Any, workload: Any, **kwargs: Any) -> Any:
        return real_drive(engine, probe, UntilWatched(workload), **kwargs)

    monkeypatch.setattr(chat_workload, "drive", drive)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        demo.main_demo([*STEADY, "--block-size", "16", "--duration", "3600"])
    finally:
        stop.set()
        thread.join(10)
        watcher.close()
    out = capsys.readouterr().out
    assert (f"serving GPU-tier events, dp rank 0: tcp://127.0.0.1:{gpu_port}  "
            f"(replay ipc://{tmp_path}/gpu-replay_dp0)") in out
    assert f"serving consolidated events: {output}  (replay {output}-replay)" in out
    assert "[PASS] every request finished" in out
    assert has_stream.is_set()
    assert watcher.stats.batches > 0 and watcher.view.counts.stores > 0
    assert watcher.view.counts.warnings == 0

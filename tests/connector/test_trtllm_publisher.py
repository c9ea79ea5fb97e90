"""TensorRT-LLM's own streaming publisher (``kv_cache_config.kv_events_config``): where it
runs, the plugin publishes no second GPU-tier stream, its consolidator reads TensorRT-LLM's
per-rank stream (upstream's bytes, from ``testing.trtllm_stream``) and merges the tiers into
it under TensorRT-LLM's names, and the start-up log and ``doctor`` say which source is used."""

from __future__ import annotations

import json
import logging
import socket
import time

import msgpack
import pytest
from _engines import prompt, tiers
from _kvwire import free_port, wait_until

from kvbm_plugin.consolidator_config import ConfigError
from kvbm_plugin.events.trtllm_publisher import offset_endpoint, read_trtllm_publisher
from kvbm_plugin.testing.fake_trtllm import KvCacheConfig, KVEventsConfig, LlmArgs, ParallelConfig
from kvbm_plugin.testing.trtllm_stream import encode_batch, radix_key, wire_hash
from kvbm_plugin.wire.subscriber import StreamSubscriber


def _args(events: KVEventsConfig | None) -> LlmArgs:
    return LlmArgs(KvCacheConfig(4, kv_events_config=events), ParallelConfig(0, 1))


def test_kv_events_config_is_on_only_where_tensorrt_llm_streams() -> None:
    # KVEventsConfig's defaults: enable_kv_cache_events=False, publisher None (zmq when on)
    assert read_trtllm_publisher(_args(None)) is None
    assert read_trtllm_publisher(_args(KVEventsConfig())) is None
    on = read_trtllm_publisher(_args(KVEventsConfig(enable_kv_cache_events=True)))
    assert on is not None and on.streams and on.endpoint == "tcp://*:5557"
    null = read_trtllm_publisher(_args(KVEventsConfig(enable_kv_cache_events=True,
                                                 publisher="null")))
    assert null is not None and not null.streams
    yaml_form = {"kv_cache_config": {"kv_events_config": {"enable_kv_cache_events": True,
                                                          "endpoint": "ipc:///tmp/x"}}}
    assert read_trtllm_publisher(yaml_form).endpoint == "ipc:///tmp/x"
    with pytest.raises(ConfigError, match=r"kv_events_config.endpoint='tcp://\*:99999'"):
        read_trtllm_publisher(_args(KVEventsConfig(enable_kv_cache_events=True,
                                              endpoint="tcp://*:99999")))


@pytest.mark.parametrize(("endpoint", "rank", "expected"), [
    ("tcp://*:5557", 0, "tcp://*:5557"),
    ("tcp://127.0.0.1:5557", 2, "tcp://127.0.0.1:5559"),
    ("ipc:///tmp/kv-events", 0, "ipc:///tmp/kv-events"),  # rank 0: no suffix, unlike ours
    ("ipc:///tmp/kv-events", 1, "ipc:///tmp/kv-events_dp1"),
    ("inproc://kv-events", 2, "inproc://kv-events_dp2"),
])
def test_per_rank_endpoints_follow_tensorrt_llms_offset_rule(endpoint, rank, expected) -> None:
    assert offset_endpoint(endpoint, rank) == expected


def test_a_subscriber_connects_where_the_rank_binds() -> None:
    native = read_trtllm_publisher(_args(KVEventsConfig(enable_kv_cache_events=True,
                                                   endpoint="tcp://*:6000",
                                                   replay_endpoint="tcp://0.0.0.0:6100")))
    assert native.connect_endpoint(3, "127.0.0.1").connect == "tcp://127.0.0.1:6003"
    assert native.connect_replay(3, "10.1.2.3").connect == "tcp://10.1.2.3:6103"
    explicit = read_trtllm_publisher(_args(KVEventsConfig(enable_kv_cache_events=True,
                                                     endpoint="tcp://10.0.0.5:6000")))
    assert explicit.connect_endpoint(1, "127.0.0.1").connect == "tcp://10.0.0.5:6001"


def test_the_simulated_publisher_writes_upstreams_bytes() -> None:
    key = bytes.fromhex("ff" * 8) + b"\x00" * 24
    assert wire_hash(key) == -1  # first 8 bytes big-endian, as signed int64
    payload = encode_batch(1.5, [
        {"type": "BlockStored", "block_hashes": [wire_hash(radix_key(7))],
         "parent_block_hash": None, "token_ids": [1, 2, 3, 4]},
        {"type": "BlockRemoved", "block_hashes": [5]}], 4, 0)
    ts, events, rank = msgpack.unpackb(payload)
    assert (ts, rank) == (1.5, 0)
    assert list(events[0]) == ["type", "block_hashes", "parent_block_hash", "token_ids",
                               "block_size", "lora_id", "medium", "lora_name"]
    assert events[0]["medium"] == "GPU" and events[0]["lora_id"] is None
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}
    assert payload.count(b"\xd3") == 1 + 4 + 1 + 1 + 1  # every int is an int64 (0xd3)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _native_engine(make_engine, tmp_path, **env):
    trt_port, replay_port = free_port(), free_port()
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{trt_port}",
                            replay_endpoint=f"tcp://*:{replay_port}")
    settings = {"DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "true",
                "DYN_KVBM_KV_EVENTS_OUTPUT_ENDPOINT": f"ipc://{tmp_path}/out",
                "DYN_KVBM_KV_EVENTS_OUTPUT_REPLAY_ENDPOINT": f"ipc://{tmp_path}/out-replay",
                "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "24", **env}
    engine = make_engine(num_gpu_blocks=12, env=settings, kv_events_config=events,
                         provide_block_hashes=False)
    return engine, trt_port


def _run(engine) -> None:
    for seed in range(6):  # 6 prompts of 4 full blocks through a 12-block GPU pool
        engine.submit(prompt(seed, 17), 2)
        engine.run_until_idle()


def test_the_consolidator_reads_tensorrt_llms_stream_and_merges_the_tiers_into_it(
        make_engine, tmp_path, caplog) -> None:
    own_port = free_port()
    caplog.set_level(logging.INFO, logger="kvbm_plugin")
    engine, trt_port = _native_engine(make_engine, tmp_path,
                                      DYN_KVBM_TRTLLM_ZMQ_PORT=str(own_port))
    leader, manager = engine.leader, engine.kv_cache_manager
    sub = StreamSubscriber(f"ipc://{tmp_path}/out", f"ipc://{tmp_path}/out-replay",
                           start_seq=0)
    try:
        _run(engine)
        gpu = manager.resident_wire_hashes()
        host = {h - (1 << 64) if h >= 1 << 63 else h for h in leader.resident_hashes("host")}
        evicted_but_offloaded = host - gpu
        assert gpu and evicted_but_offloaded  # the workload left blocks only in the host tier
        view: set[int] = set()

        def settled() -> bool:
            sub.poll(20)  # applies what it returns to sub.held: never apply a batch twice
            view.clear()
            view.update(h for _, h in sub.held)
            return view == gpu | host

        wait_until(settled, 10, "the consolidated view = TRT-LLM's GPU blocks + host tier")
        # The view can match before the consolidator applied TRT-LLM's last batch (a GPU
        # removal of a block the host tier holds leaves the union as it is): wait for it too.
        wait_until(lambda: leader.consolidator.stats()["batches_applied"] >= manager.batches,
                   10, "the consolidator to apply every batch TRT-LLM published")
        wait_until(settled, 10, "the view after TRT-LLM's last batch")
        # every tier block carries the name TRT-LLM's stream gave it (one name per block)
        assert host <= manager.published_hashes
        assert sub.stats.orphan_stores == 0 and sub.stats.unknown_removes == 0
        assert sub.stats.duplicate_stores == 0
        assert leader.consolidator.stats()["batches_applied"] >= manager.batches
    finally:
        sub.close()
    # no second GPU-tier stream: the plugin never published a GPU event nor bound its port
    stats = leader.event_sink.stats()
    assert stats["events_in"] == stats["batches_published"] == 0
    assert _bindable(own_port)
    line = (f"GPU-tier KV events: TensorRT-LLM's own publisher (kv_cache_config."
            f"kv_events_config): rank 0 at tcp://127.0.0.1:{trt_port} (replay "
            f"tcp://127.0.0.1:")
    assert any(line in r.getMessage() for r in caplog.records)
    assert "the plugin publishes no GPU-tier stream" in leader.event_source_status


def test_without_a_consolidator_the_plugins_stream_carries_only_the_tiers(
        make_engine, tmp_path) -> None:
    own = f"ipc://{tmp_path}/own"
    engine, _ = _native_engine(make_engine, tmp_path,
                               DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR="false",
                               DYN_KVBM_KV_EVENTS_ENDPOINT=own,
                               DYN_KVBM_KV_EVENTS_REPLAY_ENDPOINT=own + "-replay")
    sub = StreamSubscriber(own + "_dp0", own + "-replay_dp0", start_seq=0)
    try:
        _run(engine)
        media: set[str] = set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "CPU" not in media:
            for batch in sub.poll(20):
                media.update(e.medium for e in batch.events if hasattr(e, "medium"))
        assert media == {"CPU"}
    finally:
        sub.close()


def test_a_leader_without_tensorrt_llms_stream_keeps_its_own(caplog) -> None:
    from kvbm_plugin.connector_leader import KvbmConnectorLeader

    caplog.set_level(logging.INFO, logger="kvbm_plugin")
    for events, own in ((KVEventsConfig(), True),
                        (KVEventsConfig(enable_kv_cache_events=True, publisher="null"), False)):
        args = _args(events)
        port = free_port()
        args.kvbm_plugin_env = tiers(host=8, DYN_KVBM_TRTLLM_ZMQ_PORT=str(port))
        args.kvbm_plugin_group = f"native-{own}"
        leader = KvbmConnectorLeader(args)
        try:
            status = leader.event_source_status
            if own:  # enable_kv_cache_events=False: TRT-LLM's buffered path, ours to read
                assert "TensorRT-LLM's own publisher" not in status
                assert leader._gpu.attach_attempts == 0
                line = (f"GPU-tier KV events: the plugin's own publisher (rank 0 at "
                        f"tcp://127.0.0.1:{port}; DYN_KVBM_KV_EVENTS_SOURCE=auto)")
                assert any(line in r.getMessage() for r in caplog.records)
            else:
                assert "publisher='null'" in status and "no process publishes" in status
                warned = [r for r in caplog.records if r.levelno == logging.WARNING
                          and "publisher='null'" in r.getMessage()]
                assert warned
        finally:
            leader.shutdown()


def test_doctor_names_the_gpu_tier_source(tmp_path, capsys, monkeypatch) -> None:
    from kvbm_plugin.cli.doctor import main_doctor

    monkeypatch.setenv("DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR", "true")
    monkeypatch.delenv("DYN_KVBM_TRTLLM_ZMQ_PORT", raising=False)
    monkeypatch.delenv("DYN_KVBM_KV_EVENTS_ENDPOINT", raising=False)
    monkeypatch.setenv("DYN_KVBM_LEADER_ZMQ_PUB_PORT", str(free_port()))
    options = tmp_path / "llm_api_options.json"
    options.write_text(json.dumps({"kv_cache_config": {"kv_events_config": {
        "enable_kv_cache_events": True, "endpoint": "tcp://*:5999"}}}))
    main_doctor(["--json", "--num-ranks", "2", "--llm-api-options", str(options)])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    source = checks["GPU-tier KV events"]
    assert source["status"] == "ok"
    assert "TensorRT-LLM's own publisher (kv_cache_config.kv_events_config): rank 0 at " \
        "tcp://127.0.0.1:5999" in source["detail"]
    assert "rank 1 at tcp://127.0.0.1:6000" in source["detail"]
    # the plugin's GPU-tier port is not required where TRT-LLM streams
    assert checks["consolidator config"]["status"] == "ok"
    main_doctor(["--json"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    # one leader's consolidator takes its batches by direct call: no port needed
    assert checks["consolidator config"]["status"] == "ok"
    main_doctor(["--json", "--num-ranks", "2"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert checks["consolidator config"]["status"] == "fail"  # attention DP, no port set
    monkeypatch.setenv("DYN_KVBM_TRTLLM_ZMQ_PORT", "5800")
    main_doctor(["--json"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert "the plugin's own publisher (rank 0 at tcp://127.0.0.1:5800; " \
        "DYN_KVBM_KV_EVENTS_SOURCE=auto)" in checks["GPU-tier KV events"]["detail"]



def test_an_attention_dp_ranks_consolidator_reads_that_ranks_stream(tmp_path) -> None:
    from kvbm_plugin.consolidator.service import KvEventConsolidator
    from kvbm_plugin.consolidator_config import load_consolidator_config
    from kvbm_plugin.events.trtllm_publisher import trtllm_streams
    from kvbm_plugin.testing.trtllm_stream import SimZmqEventPublisher

    events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/trt",
                            replay_endpoint=f"ipc://{tmp_path}/trt-replay")
    native = read_trtllm_publisher(_args(events))
    streams = trtllm_streams(native, 2, "127.0.0.1")
    assert streams[0][0] == 2 and streams[0][1].connect == f"ipc://{tmp_path}/trt_dp2"
    config = load_consolidator_config(
        {"DYN_KVBM_KV_EVENTS_OUTPUT_ENDPOINT": f"ipc://{tmp_path}/out",
         "DYN_KVBM_KV_EVENTS_OUTPUT_REPLAY_ENDPOINT": f"ipc://{tmp_path}/out-replay"},
        gpu_streams=streams)
    publisher = SimZmqEventPublisher(events, native, 2)  # binds trt_dp2, as TRT-LLM's rank 2
    h = wire_hash(radix_key(11))
    publisher.publish(encode_batch(1.0, [{"type": "BlockStored", "block_hashes": [h],
                                          "parent_block_hash": None,
                                          "token_ids": [1, 2, 3, 4]}], 4, 2))
    consolidator = KvEventConsolidator(config)
    consolidator.start()
    sub = StreamSubscriber(f"ipc://{tmp_path}/out", f"ipc://{tmp_path}/out-replay",
                           start_seq=0)
    try:
        def held() -> bool:  # the batch sent before anyone subscribed comes from the replay
            sub.poll(20)  # applies what it returns
            return sub.held == {(2, h)}

        wait_until(held, 10, "rank 2's block in the consolidated stream, dp rank kept")
    finally:
        sub.close()
        consolidator.shutdown()
        publisher.shutdown()


def test_tensorrt_llms_ports_count_in_the_collision_check() -> None:
    from kvbm_plugin.consolidator_config import load_consolidator_config
    from kvbm_plugin.events.trtllm_publisher import trtllm_streams

    native = read_trtllm_publisher(_args(KVEventsConfig(enable_kv_cache_events=True,
                                                   endpoint="tcp://*:57001")))
    streams = trtllm_streams(native, 0, "127.0.0.1")
    # the consolidated output's default port (leader port 56001 + 1000) is TRT-LLM's here
    with pytest.raises(ConfigError, match=r"consolidated output endpoint .* collides with "
                                          r"rank 0 GPU-tier stream from kv_cache_config"):
        load_consolidator_config({"DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "true"},
                                 gpu_streams=streams)


def test_the_standalone_consolidator_reads_tensorrt_llms_stream(tmp_path) -> None:
    import os
    import signal
    import subprocess
    import sys

    from kvbm_plugin.testing.trtllm_stream import SimZmqEventPublisher

    events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/trt",
                            replay_endpoint=f"ipc://{tmp_path}/trt-replay")
    options = tmp_path / "options.json"
    options.write_text(json.dumps({"kv_cache_config": {"kv_events_config": {
        "enable_kv_cache_events": True, "endpoint": events.endpoint,
        "replay_endpoint": events.replay_endpoint}}}))
    publisher = SimZmqEventPublisher(events, read_trtllm_publisher(_args(events)), 0)
    h = wire_hash(radix_key(5))
    publisher.publish(encode_batch(1.0, [{"type": "BlockStored", "block_hashes": [h],
                                          "parent_block_hash": None,
                                          "token_ids": [9, 8, 7, 6]}], 4, 0))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_KVBM_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbm_plugin.cli.main", "consolidate", "--llm-api-options",
         str(options), "--output-endpoint", f"ipc://{tmp_path}/out",
         "--output-replay-endpoint", f"ipc://{tmp_path}/out-replay"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sub = StreamSubscriber(f"ipc://{tmp_path}/out", f"ipc://{tmp_path}/out-replay",
                           start_seq=0)
    try:
        def held() -> bool:
            sub.poll(20)  # applies what it returns
            return sub.held == {(0, h)}

        wait_until(held, 20, "TRT-LLM's block through `kvbm-plugin consolidate`")
    finally:
        sub.close()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        publisher.shutdown()
    assert f"started (dedup): ipc://{tmp_path}/trt ->" in out

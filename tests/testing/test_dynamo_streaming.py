"""Dynamo's STREAMING mode served by the consolidated output
(``DYN_KVBM_KV_EVENTS_TRTLLM_MOVED_ENDPOINT``, ``leader.dynamo_streaming``), end to end
through the simulated executor under attention DP 2: each rank's leader, built before the KV
cache manager as in ``create_py_executor``, moves TensorRT-LLM's publisher (the stand-in) to
the private endpoint, and its consolidated output takes the endpoint the YAML names (rank r at
+ r, under the YAML's topic), where Dynamo subscribes. Dynamo's own relay reading it:
tests/interop/test_dynamo_streaming_relay.py."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import zmq
from _engines import adp_settled, adp_truth
from _kvwire import free_port, wait_until

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.cli.demo_adp import subscribers_for
from kvbm_plugin.events.trtllm_publisher import trtllm_streams
from kvbm_plugin.leader.dynamo_streaming import load_moved_endpoint, take_yaml_endpoint
from kvbm_plugin.routers.router_view import RouterView
from kvbm_plugin.testing.adp import AttentionDpEngine
from kvbm_plugin.testing.engine import EngineConfig
from kvbm_plugin.testing.fake_trtllm import KVEventsConfig

BS = 4
RANKS = 2
TOPIC = "kv-events"


def free_port_pair() -> int:
    """A free tcp port whose next one is free too (attention DP 2 binds both)."""
    import socket

    for _ in range(50):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two consecutive free ports")


def _prompt(rank: int, turn: int) -> list[int]:
    return [100 * rank + i for i in range(6 * BS)] + [5000 + 10 * turn + rank, 7, 9]


@pytest.mark.parametrize("processes", [False, True])
def test_the_output_takes_the_yaml_endpoint_per_rank_and_trtllm_moves_to_its_own(
        tmp_path, processes: bool) -> None:
    port = free_port_pair()
    yaml_endpoint = f"tcp://*:{port}"  # what Dynamo reads; rank 1 at port + 1
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint=yaml_endpoint, topic=TOPIC,
                            replay_endpoint=f"ipc://{tmp_path}/trt-replay")
    moved = f"ipc://{tmp_path}/private-trt"
    env = {cc.ENABLE_CONSOLIDATOR: "true", cc.CONSOLIDATOR_MODE: "passthrough",
           cc.TRTLLM_MOVED_ENDPOINT: moved,
           cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp_path}/out-replay",
           cc.CPU_CACHE_NUM_BLOCKS: "24", cc.DISK_CACHE_NUM_BLOCKS: "64",
           cc.DISK_CACHE_DIR: str(tmp_path / "disk")}
    config = EngineConfig(attention_dp=RANKS, processes=processes, env=env,
                          tokens_per_block=BS, num_gpu_blocks=12, kv_events_config=events,
                          provide_block_hashes=False)
    # What Dynamo subscribes to: the YAML's endpoint, rank r by the same offset rule, with the
    # YAML's topic as its filter (dynamo/trtllm/publisher.py, Publisher.initialize).
    ctx = zmq.Context.instance()
    dynamo_like = []
    for r in range(RANKS):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        sub.connect(f"tcp://127.0.0.1:{port + r}")
        dynamo_like.append(sub)
    monitors = [sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED) for sub in dynamo_like]
    try:
        with AttentionDpEngine(config) as engine:
            # Each of these SUBs connected before anything was bound there (Dynamo's relays
            # start after the engine; here they start first, which is harder): ZMQ retries
            # every 100 ms, and a busy host could run the whole workload before the retry.
            # So the workload waits until each SUB's connection is made (its subscription
            # follows at once), as a relay that started after the engine would be.
            for r, monitor in enumerate(monitors):
                assert monitor.poll(20_000), f"Dynamo-like SUB of rank {r} never connected"
                monitor.recv_multipart()
            # TensorRT-LLM's publisher (the stand-in) bound where the leader moved it, by
            # upstream's per-rank rule; the shared config object itself was not changed
            assert engine.rank0.kv_cache_manager.publisher.endpoint == moved
            if not processes:
                rank1 = engine.ranks[1].engine.kv_cache_manager  # type: ignore[union-attr]
                assert rank1.publisher.endpoint == f"{moved}_dp1"
            assert events.endpoint == yaml_endpoint
            view = RouterView(BS)
            out_env = {**env, cc.OUTPUT_ENDPOINT: f"tcp://127.0.0.1:{port}", cc.TOPIC: TOPIC,
                       cc.EVENTS_ENDPOINT: moved}  # (this view reads the outputs only)
            out_env.pop(cc.TRTLLM_MOVED_ENDPOINT)
            subscribers = subscribers_for(cc.load_consolidator_config(
                out_env, num_ranks=RANKS, attention_dp=True), RANKS, view)
            try:
                for turn in range(3):
                    for r in range(RANKS):
                        engine.submit(_prompt(r, turn), 2, dp_rank=r)
                    engine.run_until_idle()
                    for r in range(RANKS):  # evicts the prefix: the next turn loads it
                        engine.submit([9000 + 100 * r + i for i in range(10 * BS)], 1,
                                      dp_rank=r)
                    engine.run_until_idle()
                for r in range(RANKS):
                    engine.call(r, "publish_now")

                def truth(r: int) -> set[tuple[int, int]]:
                    return adp_truth(engine, r)

                def settled() -> bool:
                    return adp_settled(engine, subscribers)

                wait_until(settled, 20, "each rank's output at the YAML's endpoint = truth")
                for r in range(RANKS):
                    resident = engine.call(r, "resident_blocks")
                    assert resident["CPU"][r] and engine.call(r, "stream_batches") > 0
                assert view.counts.warnings == 0
            finally:
                for subscriber in subscribers:
                    subscriber.close()
        # Dynamo's filter passed every rank's batches, each tagged with its rank, with the
        # lower tiers' media among them (TensorRT-LLM's own stream alone says GPU only)
        for r, sub in enumerate(dynamo_like):
            media: set[str] = set()
            while sub.poll(0):
                topic, _, payload = sub.recv_multipart()
                batch = msgpack.unpackb(payload, strict_map_key=False)
                assert topic == TOPIC.encode() and batch[2] == r
                media |= {e.get("medium") for e in batch[1] if isinstance(e, dict)}
            assert {"GPU", "CPU"} <= media, (r, media)
    finally:
        for sub, monitor in zip(dynamo_like, monitors, strict=True):
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)


def _args(endpoint: str = "tcp://*:5557", **extra: Any) -> dict[str, Any]:
    return {"kv_cache_config": {"kv_events_config": {
        "enable_kv_cache_events": True, "endpoint": endpoint, **extra}}}


def test_moving_rewrites_only_the_endpoint_and_points_the_output_at_the_yamls() -> None:
    args = _args(replay_endpoint="tcp://*:5657", topic="t")
    env = {cc.TRTLLM_MOVED_ENDPOINT: "tcp://127.0.0.1:25557"}
    native, settings, line = take_yaml_endpoint(args, env)
    assert args["kv_cache_config"]["kv_events_config"] == {
        "enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:25557",
        "replay_endpoint": "tcp://*:5657", "topic": "t"}
    assert native is not None and native.bind_endpoint(1) == "tcp://127.0.0.1:25558"
    assert settings[cc.OUTPUT_ENDPOINT] == "tcp://*:5557" and settings[cc.TOPIC] == "t"
    assert line and "5557" in line
    config = cc.load_consolidator_config(settings, num_ranks=2, attention_dp=True,
                                         gpu_streams=trtllm_streams(native, 1, "127.0.0.1"))
    assert config.for_dp_rank(1).output.bind == "tcp://*:5558"  # Dynamo's rank 1: + 1
    # unset: nothing moved, nothing changed
    untouched = _args()
    assert take_yaml_endpoint(untouched, {})[2] is None
    assert untouched == _args()


@pytest.mark.parametrize("env,args,needle", [
    ({cc.TRTLLM_MOVED_ENDPOINT: "udp://x:1"}, _args(), "udp://x:1"),
    ({cc.TRTLLM_MOVED_ENDPOINT: "tcp://h"}, _args(), "needs a port"),
    ({cc.TRTLLM_MOVED_ENDPOINT: "tcp://h:1"}, {"kv_cache_config": {}}, "enable_kv_cache_events"),
    ({cc.TRTLLM_MOVED_ENDPOINT: "tcp://h:1"}, _args(publisher="null"), "no endpoint"),
    ({cc.TRTLLM_MOVED_ENDPOINT: "tcp://h:1", cc.ENABLE_CONSOLIDATOR: "false"}, _args(),
     "needs the consolidator"),
    ({cc.TRTLLM_MOVED_ENDPOINT: "tcp://h:1", cc.OUTPUT_ENDPOINT: "tcp://h:9"}, _args(),
     cc.OUTPUT_ENDPOINT),
    ({cc.TRTLLM_MOVED_ENDPOINT: "tcp://*:5557"}, _args(), "already names"),
    ({cc.TRTLLM_MOVED_ENDPOINT: "tcp://h:1", cc.TOPIC: "other"}, _args(topic="kv"),
     "prefix Dynamo subscribes with"),
    ({cc.TRTLLM_MOVED_ENDPOINT: "tcp://h:1"}, _args("ipc:///run/kv"), "_dp0"),
])
def test_a_setting_that_cannot_work_is_refused_by_name(env: dict[str, str],
                                                       args: dict[str, Any],
                                                       needle: str) -> None:
    with pytest.raises(cc.ConfigError) as info:
        take_yaml_endpoint(args, env, attention_dp=True)
    assert cc.TRTLLM_MOVED_ENDPOINT in str(info.value) and needle in str(info.value)


def test_the_setting_alone_is_checked_by_trtllms_endpoint_rules() -> None:
    assert load_moved_endpoint({}) is None
    assert load_moved_endpoint({cc.TRTLLM_MOVED_ENDPOINT: " ipc:///p/trt "}) == "ipc:///p/trt"
    with pytest.raises(cc.ConfigError, match=f"{cc.TRTLLM_MOVED_ENDPOINT}='tcp://h:0'"):
        load_moved_endpoint({cc.TRTLLM_MOVED_ENDPOINT: "tcp://h:0"})


def test_kvbm_plugin_yaml_for_dynamo_streaming_is_a_configuration_that_works(capsys) -> None:
    from kvbm_plugin._util.mini_yaml import parse
    from kvbm_plugin.cli import main as cli

    assert cli.main(["yaml", "--for", "dynamo-streaming"]) == 0
    text = capsys.readouterr().out
    env = dict(line.split()[1].split("=", 1) for line in text.splitlines()
               if line.startswith("#   "))
    assert env["TLLM_KV_CACHE_MANAGER_V2_BACKEND"] == "python"
    args = parse(text)
    assert args["kv_connector_config"]["connector_module"] == "kvbm_plugin"
    native, settings, line = take_yaml_endpoint(args, env, attention_dp=True)
    assert line is not None and native is not None
    config = cc.load_consolidator_config(settings, num_ranks=2, attention_dp=True,
                                         gpu_streams=trtllm_streams(native, 1, "127.0.0.1"))
    # Dynamo's rank r subscribes to the YAML's endpoint + r; the plugin's rank r binds it
    assert [config.for_dp_rank(r).output.bind for r in (0, 1)] == [
        "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"]
    assert native.bind_endpoint(1) == "tcp://127.0.0.1:25558"  # TensorRT-LLM's, moved


def test_doctor_checks_the_endpoints_the_leader_will_bind_when_it_moves_trtllm(
        monkeypatch, capsys, tmp_path) -> None:
    import json

    from kvbm_plugin.cli.doctor import main_doctor

    for var in cc.ENV_VARS:
        monkeypatch.delenv(var.name, raising=False)
    port = free_port_pair()
    options = tmp_path / "kvbm.yaml"
    options.write_text(json.dumps(_args(f"tcp://127.0.0.1:{port}")))
    monkeypatch.setenv(cc.TRTLLM_MOVED_ENDPOINT, f"ipc://{tmp_path}/trt")
    main_doctor(["--json", "--llm-api-options", str(options)])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    # the consolidated output's port is the YAML's (checked free), TensorRT-LLM's is moved
    assert checks[f"consolidated output tcp://127.0.0.1:{port}"]["status"] == "ok"
    assert f"ipc://{tmp_path}/trt" in checks["GPU-tier KV events"]["detail"]
    monkeypatch.setenv(cc.OUTPUT_ENDPOINT, "tcp://127.0.0.1:9")
    main_doctor(["--json", "--llm-api-options", str(options)])
    failed = [c for c in json.loads(capsys.readouterr().out) if c["status"] == "fail"]
    assert any(cc.TRTLLM_MOVED_ENDPOINT in c["detail"] for c in failed), failed


@pytest.mark.parametrize("moved,why", [
    ("tcp://127.0.0.1:5558", "Dynamo's rank 1"),   # TRT-LLM rank 0 would take Dynamo's rank 1
    ("tcp://127.0.0.1:5556", "Dynamo's rank 0"),   # TRT-LLM rank 1 would take Dynamo's rank 0
    ("tcp://*:5656", "replay_endpoint"),           # TRT-LLM rank 1 on TRT-LLM rank 0's replay
])
def test_under_attention_dp_a_moved_range_overlapping_the_yamls_is_refused(
        moved: str, why: str) -> None:
    """Rank r binds base + r for every endpoint, so under attention DP the moved endpoint's
    ports must not meet the YAML's for any rank: TensorRT-LLM's rank 0 on Dynamo's rank 1
    port would have Dynamo relay rank 0's GPU-only stream as rank 1's (or fail a bind)."""
    args = _args(replay_endpoint="tcp://*:5657")
    with pytest.raises(cc.ConfigError) as info:
        take_yaml_endpoint(args, {cc.TRTLLM_MOVED_ENDPOINT: moved}, attention_dp=True,
                           dp_size=2)
    assert cc.TRTLLM_MOVED_ENDPOINT in str(info.value) and why in str(info.value)
    # one rank, or ports apart, is fine
    for ok, dp_size in ((moved, 1), ("tcp://127.0.0.1:5559", 2), ("ipc:///run/trt", 2)):
        assert take_yaml_endpoint(_args(replay_endpoint="tcp://*:5657"),
                                  {cc.TRTLLM_MOVED_ENDPOINT: ok}, attention_dp=dp_size > 1,
                                  dp_size=dp_size)[2] is not None

"""The consolidated output, which routers on other hosts read: what outsiders send to it is
bounded while the consolidator's ingest thread idles (it, not a publish, reads their
subscriptions and connection events)."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from _kvwire import free_port, recv, wait_until

from kvbm_plugin.consolidator.service import KvEventConsolidator
from kvbm_plugin.consolidator_config import (
    EVENTS_ENDPOINT,
    OUTPUT_ENDPOINT,
    OUTPUT_REPLAY_ENDPOINT,
    load_consolidator_config,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _zmtp import RawPeer  # noqa: E402


@pytest.fixture
def consolidator() -> Iterator[tuple[KvEventConsolidator, int, int]]:
    ipc_dir = tempfile.mkdtemp(prefix="kvb", dir="/tmp")  # ipc paths must stay short
    out, replay = free_port(), free_port()
    config = load_consolidator_config({
        EVENTS_ENDPOINT: f"ipc://{ipc_dir}/ev", OUTPUT_ENDPOINT: f"tcp://127.0.0.1:{out}",
        OUTPUT_REPLAY_ENDPOINT: f"tcp://127.0.0.1:{replay}", "DYN_KVBM_ZMQ_MAX_PEERS": "3"})
    running = KvEventConsolidator(config)
    running.start()
    try:
        yield running, out, replay
    finally:
        running.shutdown(5.0)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def test_an_idle_consolidator_cuts_flooding_and_surplus_peers_of_its_output(
        consolidator, ctx) -> None:
    running, out, replay = consolidator
    stats = running._publisher.stats  # type: ignore[union-attr]
    flood = RawPeer("127.0.0.1", out, b"SUB")
    try:
        for i in range(3_000):
            if not flood.send(b"\x01" + i.to_bytes(4, "big") + b"x" * 60):
                break
        wait_until(lambda: stats()["subscription_peers_cut"] >= 1, what="the flood cut")
    finally:
        flood.close()
    wait_until(lambda: stats()["subscriptions_held"] == 0, what="its subscriptions freed")
    idle: list[RawPeer] = []
    try:
        for _ in range(5):
            with contextlib.suppress(OSError):  # refused before its handshake ended
                idle.append(RawPeer("127.0.0.1", replay, b"DEALER"))
        wait_until(lambda: stats()["replay_connections_refused"] >= 2, what="2 refused")
        assert stats()["replay_connections_live"] == 3
    finally:
        for peer in idle:
            peer.close()
    # A router's SUB still gets what the consolidator publishes.
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{out}")
    wait_until(lambda: stats()["subscriptions_applied"] >= 1, what="the router's subscription")
    running.register_store("CPU", 0, 1, None, list(range(16)), 16)
    assert recv(sub)[0] == b""


def test_a_dp_rank_field_in_the_topic_is_refused_for_an_output_of_several_ranks(
        tmp_path: Path) -> None:
    # `kvbm-plugin consolidate --num-ranks 2`: one output, one topic fixed at bind time, so
    # rank 1's batches would go out under rank 0's llm-d pod. Refused, naming the variable.
    from kvbm_plugin.consolidator_config import TOPIC, ConfigError

    env = {EVENTS_ENDPOINT: f"ipc://{tmp_path}/ev", OUTPUT_ENDPOINT: f"ipc://{tmp_path}/out",
           TOPIC: "kv@pod-dp{dp_rank}@m"}
    running = KvEventConsolidator(load_consolidator_config(env, num_ranks=2))
    try:
        with pytest.raises(ConfigError, match=r"DYN_KVBM_KV_EVENTS_TOPIC='kv@pod-dp\{dp_rank\}"
                                              r"@m'.*dp ranks \[0, 1\]"):
            running.start()
    finally:
        running.shutdown(5.0)
    # one consolidator per rank (the leader's way) starts, each under its own pod
    config = load_consolidator_config(env, num_ranks=2).for_dp_rank(1)
    assert config.publisher.topic == "kv@pod-dp1@m"
    per_rank = KvEventConsolidator(config)
    per_rank.start()
    per_rank.shutdown(5.0)

"""A consumer that joins after the replay buffer rolled, by llm-d's replay rules (the model in
routers/llmd_replay.py, llm-d-router @ ebab6879) against the plugin's real publisher and replay
server: what each ``DYN_KVBM_KV_EVENTS_OUTPUT_REPLAY_ROLLED`` answer leaves llm-d with."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from _kvwire import recv

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.consolidator_config import PublisherSettings, parse_endpoint
from kvbm_plugin.routers.llmd_model import LlmdIndexer
from kvbm_plugin.routers.llmd_replay import REPLAY_COOLDOWN_S, LlmdSubscriber
from kvbm_plugin.wire.events import BlockStored
from kvbm_plugin.wire.publisher import ZmqEventPublisher

BS = 4
POD, MODEL = "pod-0", "m"
TOPIC = f"kv@{POD}@{MODEL}"


def _store(i: int) -> dict:
    return BlockStored([(1 << 40) + i], None, [100 * i + k for k in range(BS)], BS).to_wire()


def _held(llmd: LlmdIndexer, i: int) -> bool:
    return llmd.cached_tokens([100 * i + k for k in range(BS)], MODEL, pod=POD) == BS


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


def _setup(tmp: Path, ctx: zmq.Context, rolled: str) -> tuple[ZmqEventPublisher, zmq.Socket]:
    pub_ep = parse_endpoint("e", f"ipc://{tmp}/pub", default_host="127.0.0.1")
    replay_ep = parse_endpoint("r", f"ipc://{tmp}/replay", default_host="127.0.0.1")
    pub = ZmqEventPublisher(PublisherSettings(buffer_steps=4, topic=TOPIC), pub_ep, replay_ep,
                            replay_rolled=rolled)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(pub_ep.connect)
    deadline = time.monotonic() + 10
    while not sub.poll(20):  # joined once a probe batch arrives
        assert time.monotonic() < deadline, "SUB never joined"
        pub.publish([])
    while sub.poll(50):
        sub.recv_multipart()
    return pub, sub


def _live(pub: ZmqEventPublisher, sub: zmq.Socket, llmd_sub: LlmdSubscriber, i: int) -> None:
    assert pub.publish([_store(i)])
    frames = recv(sub)
    llmd_sub.on_live(frames)


@pytest.mark.parametrize("rolled", ["oldest", "empty"])
def test_llm_d_joining_after_the_buffer_rolled(tmp_path: Path, ctx: zmq.Context,
                                              rolled: str) -> None:
    pub, sub = _setup(tmp_path, ctx, rolled)
    try:
        for i in range(10):  # seq 0 and more leave the 4-batch buffer; llm-d not there yet
            pub.publish([_store(i)])
            recv(sub)
        llmd = LlmdIndexer(block_size=BS)
        clock = _Clock()
        llmd_sub = LlmdSubscriber(llmd, POD, f"ipc://{tmp_path}/replay", ctx, clock)
        llmd_sub.connect()  # llm-d asks for seq 0 on connect
        for i in range(10, 13):
            _live(pub, sub, llmd_sub, i)
        clock.now += REPLAY_COOLDOWN_S + 1  # past the cooldown of a failed replay
        for i in range(13, 16):
            _live(pub, sub, llmd_sub, i)
        stats = pub.stats()
    finally:
        sub.close(0)
        pub.shutdown(2.0)
    assert stats["replay_rolled_requests"] >= 1
    live = [_held(llmd, i) for i in range(10, 16)]
    if rolled == "oldest":
        # the answer starts past seq 0: "incomplete replay", reset, cooldown, and again after
        # it: llm-d never applies a live batch while the buffer has rolled
        assert llmd_sub.counts["replay_failures"] >= 2
        assert not any(live) and llmd_sub.counts["applied_live"] == 0
    else:
        # the end marker alone: the replay from 0 succeeds, the live stream applies from the
        # next batch on (blocks stored before the join stay unknown to llm-d)
        assert llmd_sub.counts["replay_failures"] == 0
        assert all(live) and llmd_sub.counts["applied_live"] == 6
        assert not any(_held(llmd, i) for i in range(10))


@pytest.mark.parametrize("rolled", ["oldest", "empty"])
def test_llm_d_with_a_gap_past_the_buffer(tmp_path: Path, ctx: zmq.Context,
                                          rolled: str) -> None:
    """llm-d had the stream, then lost more batches than the buffer keeps."""
    pub, sub = _setup(tmp_path, ctx, rolled)
    try:
        llmd = LlmdIndexer(block_size=BS)
        clock = _Clock()
        llmd_sub = LlmdSubscriber(llmd, POD, f"ipc://{tmp_path}/replay", ctx, clock)
        llmd_sub.connect()
        _live(pub, sub, llmd_sub, 0)
        assert _held(llmd, 0)
        for i in range(1, 10):  # lost by llm-d (never handed to it)
            pub.publish([_store(i)])
            recv(sub)
        _live(pub, sub, llmd_sub, 10)  # the gap: a replay from the lost seq, rolled out
        assert llmd_sub.counts["replay_failures"] == 1 and not _held(llmd, 0)  # reset
        clock.now += REPLAY_COOLDOWN_S + 1
        for i in range(11, 14):
            _live(pub, sub, llmd_sub, i)
    finally:
        sub.close(0)
        pub.shutdown(2.0)
    live = [_held(llmd, i) for i in range(11, 14)]
    if rolled == "oldest":
        assert not any(live)  # every retry from seq 0 fails the same way
    else:
        assert all(live)  # after the cooldown the replay from 0 succeeds: live from then on


def test_the_setting() -> None:
    assert cc.load_publisher_settings({}).output_replay_rolled == "oldest"
    assert cc.load_publisher_settings(
        {cc.OUTPUT_REPLAY_ROLLED: "Empty"}).output_replay_rolled == "empty"
    with pytest.raises(cc.ConfigError, match=r"DYN_KVBM_KV_EVENTS_OUTPUT_REPLAY_ROLLED='x'"):
        cc.load_publisher_settings({cc.OUTPUT_REPLAY_ROLLED: "x"})

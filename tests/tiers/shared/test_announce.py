"""Announcements between leaders: the wire format, its checks, the endpoint rule, and an agent
fed bad or untrue announcements by a raw publisher."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from _kvwire import wait_until
from _shared_blocks import Clock, chain
from _shared_leader import LEASE, SECRET, Leader

from kvbm_plugin.consolidator_config import ConfigError
from kvbm_plugin.settings.shared import SharedSettings
from kvbm_plugin.testing.memory_store import MemoryStore
from kvbm_plugin.tiers.shared.announce import (
    AnnouncementError,
    Unauthenticated,
    announce_endpoint,
    decode,
    encode,
)
from kvbm_plugin.tiers.shared.block import SharedBlock


def test_an_announcement_round_trips_every_field() -> None:
    root = SharedBlock(b"\x01" * 16, None, -(1 << 63), None, (0, 1, -1, 2 ** 40), None,
                       ("dynamo-cache-salt:t1", ("mm", 7, b"\x00")))
    child = SharedBlock(b"\x02" * 16, root.digest, (1 << 64) - 1, root.event_hash, (5,), 3,
                        None)
    frame = encode(SECRET, 42, 7, [root, child], [None, "ab12"], time_ms=5)
    assert decode(frame, SECRET) == (42, 7, 5, [root, child], [None, "ab12"])


def _message(*, magic="kvbm-shared", version=3, sender=1, seq=0, time_ms=0,
             blocks=None) -> bytes:
    if blocks is None:
        blocks = [[b"\x01" * 16, None, 1, None, [1, 2], None, None, None]]
    body = msgpack.packb([magic, version, sender, seq, time_ms, blocks], use_bin_type=True)
    return hmac.new(SECRET, body, hashlib.sha256).digest() + body


def _block(**kw) -> list:
    fields = dict(digest=b"\x01" * 16, parent=None, eh=1, peh=None, tokens=[1], lora=None,
                  extra=None, mm=None)
    fields.update(kw)
    return list(fields.values())


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def _signed(body: bytes) -> bytes:
    return hmac.new(SECRET, body, hashlib.sha256).digest() + body


@pytest.mark.parametrize(("payload", "why"), [
    (_signed(b"\xc1"), "not msgpack"),
    (_signed(msgpack.packb({"a": 1})), "6-item array"),
    (_message(magic="other"), "magic"),
    (_message(version=1), "version"),
    (_message(version=2), "version"),  # the digests of the earlier form
    (_message(sender=-1), "sender"),
    (_message(seq="0"), "seq"),
    (_message(time_ms=-5), "time_ms"),
    (_message(blocks=5), "blocks"),
    (_message(blocks=[_block()] * 257), "257 blocks in one message"),
    (_message(blocks=[[b"\x01" * 16]]), "8-item array"),
    (_message(blocks=[_block(digest=b"\x01" * 15)]), "digest"),
    (_message(blocks=[_block(parent=b"\x01" * 16)]), "parent_digest equals"),
    (_message(blocks=[_block(eh=1.5)]), "event_hash"),
    (_message(blocks=[_block(tokens=[True])]), "token_ids"),
    (_message(blocks=[_block(tokens=list(range(70000)))]), "token_ids has 70000"),
    (_message(blocks=[_block(lora="lora")]), "lora_id"),
    (_message(blocks=[_block(extra={"k": 1})]), "extra_keys"),
    (_message(blocks=[_block(extra=_nested(500))]), "extra_keys"),
    (_message(blocks=[_block(mm=7)]), "mm"),
])
def test_a_bad_message_is_refused_naming_what_is_wrong(payload: bytes, why: str) -> None:
    with pytest.raises(AnnouncementError, match=why):
        decode(payload, SECRET)


@pytest.mark.parametrize("payload", [
    b"", b"short", _message()[:-1], b"\x00" * 32 + _message()[32:],
    _message()[:32] + _message(seq=1)[32:],
    encode(b"another-secret-of-at-least-32-bytes", 1, 0, []),
], ids=["empty", "short", "truncated", "zeroed-mac", "mac-of-another-message",
        "another-secret"])  # the frames carry a timestamp: ids must not
def test_a_frame_not_signed_with_the_secret_is_refused_before_it_is_parsed(
        payload: bytes) -> None:
    with pytest.raises(Unauthenticated, match="failed authentication"):
        decode(payload, SECRET)


def _settings(endpoint: str | None = None) -> SharedSettings:
    return SharedSettings(store="memory", model_key="m", announce_endpoint=endpoint)


def test_the_announce_endpoint_defaults_to_the_leader_port_plus_2000_plus_the_dp_rank() -> None:
    env = {"DYN_KVBM_LEADER_ZMQ_HOST": "10.0.0.5", "DYN_KVBM_LEADER_ZMQ_PUB_PORT": "50000"}
    assert announce_endpoint(_settings(), env, 0) == "tcp://10.0.0.5:52000"
    assert announce_endpoint(_settings(), env, 3) == "tcp://10.0.0.5:52003"
    assert announce_endpoint(_settings(), {}, 0) == "tcp://127.0.0.1:58001"
    with pytest.raises(ConfigError, match="DYN_KVBM_LEADER_ZMQ_PUB_PORT=64000"):
        announce_endpoint(_settings(), {"DYN_KVBM_LEADER_ZMQ_PUB_PORT": "64000"}, 0)
    with pytest.raises(ConfigError, match="DYN_KVBM_LEADER_ZMQ_PUB_PORT"):
        announce_endpoint(_settings(), {"DYN_KVBM_LEADER_ZMQ_PUB_PORT": "x"}, 0)


def test_a_set_announce_endpoint_is_per_dp_rank_like_every_endpoint() -> None:
    assert announce_endpoint(_settings("tcp://*:7000"), {}, 2) == "tcp://*:7002"
    assert announce_endpoint(_settings("tcp://node1:7000"), {}, 0) == "tcp://node1:7000"
    assert announce_endpoint(_settings("ipc:///run/kv/a"), {}, 1) == "ipc:///run/kv/a_dp1"
    with pytest.raises(ConfigError, match="DYN_KVBM_SHARED_ANNOUNCE_ENDPOINT"):
        announce_endpoint(_settings("tcp://node1"), {}, 0)


# ---- an agent fed by a raw publisher ---------------------------------------------------

@pytest.fixture
def fed(tmp_path: Path, ctx: zmq.Context) -> Iterator[tuple[Leader, zmq.Socket]]:
    clock = Clock()
    store = MemoryStore(lease_s=LEASE, clock=clock)
    endpoint = f"ipc://{tmp_path}/peer.ipc"
    pub = ctx.socket(zmq.XPUB)
    pub.bind(endpoint)
    leader = Leader(store, clock, peers=(endpoint,))
    leader.agent.start()
    try:
        assert pub.poll(10_000), "the agent's SUB never subscribed"
        assert pub.recv() == b"\x01"  # its subscription: what is sent now reaches it
        yield leader, pub
    finally:
        leader.agent.close()


def test_a_bad_announcement_is_counted_and_logged_never_raised(
        fed: tuple[Leader, zmq.Socket], caplog: pytest.LogCaptureFixture) -> None:
    leader, pub = fed
    pub.send(_signed(b"\xc1garbage"))
    pub.send_multipart([b"two", b"frames"])
    pub.send(b"\xc1garbage")  # unsigned
    leader.wait_stat("bad_announcements", 2)
    leader.wait_stat("unauthenticated", 1)
    assert "bad shared-tier announcement ignored" in caplog.text
    assert "failed authentication" in caplog.text
    assert "DYN_KVBM_SHARED_ANNOUNCE_SECRET_FILE" in caplog.text
    # The thread goes on: a good announcement after them is confirmed.
    [block] = chain(1)
    leader.write([block])
    pub.send(encode(SECRET, 9, 0, [block]))
    leader.wait_stat("confirmed_heard", 1)
    assert leader.directory.lookup(block.digest) == block


def test_an_announced_block_is_tracked_only_once_the_store_has_it_on_every_rank(
        fed: tuple[Leader, zmq.Socket]) -> None:
    leader, pub = fed
    nowhere, half = chain(1, first_token=1)[0], chain(1, first_token=2)[0]
    leader.write([half], ranks=(0,))
    pub.send(encode(SECRET, 9, 0, [nowhere, half]))
    leader.wait_stat("confirm_absent", 2)
    for block in (nowhere, half):
        assert not leader.directory.is_tracked(block.digest)
    assert leader.stored == []


def test_lost_announcements_are_counted_from_the_sender_seq(
        fed: tuple[Leader, zmq.Socket]) -> None:
    leader, pub = fed
    a, b = chain(1, first_token=1)[0], chain(1, first_token=2)[0]
    pub.send(encode(SECRET, 9, 0, [a]))
    pub.send(encode(SECRET, 9, 3, [b]))  # seqs 1 and 2 never arrived
    leader.wait_stat("heard_messages", 2)
    assert leader.stat("lost") == 2
    pub.send(encode(SECRET, 10, 5, [a]))  # another sender: its first message is no gap
    wait_until(lambda: leader.stat("heard_messages") == 3, 10, "third message")
    assert leader.stat("lost") == 2


def test_an_engine_whose_peer_went_silent_hears_it_again(monkeypatch) -> None:  # noqa: ANN001
    """Engine B's end of its connection to engine A hears nothing more (every packet
    dropped, no FIN, no reset: A's host cut off and back): B's keepalive probes go
    unanswered, it drops the connection and connects again, and A's later announcements reach
    it
    (wire/reconnect.py's keepalive, shortened here). Without it B heard A no more."""
    import sys
    import time

    from _kvwire import free_port, short_keepalive, silence, tcp_connections

    from kvbm_plugin.tiers.shared.announce import Announcer

    if not sys.platform.startswith("linux"):
        pytest.skip("a Linux socket filter")
    short_keepalive(monkeypatch)
    port = free_port()
    a = Announcer(f"tcp://127.0.0.1:{port}", (), secret=SECRET, max_peers=4, allow=())
    b = Announcer(None, (f"tcp://127.0.0.1:{port}",), secret=SECRET, max_peers=4, allow=())
    a.open()
    b.open()
    try:
        def heard_after(first_token: int) -> bool:
            deadline = time.monotonic() + 20
            while True:
                assert time.monotonic() < deadline, "B never heard A"
                blocks = chain(1, first_token=first_token)
                a.publish(blocks)
                a.receive(0.01)  # A's turn: B's subscription
                if blocks[0] in b.receive(0.01):
                    return True
                first_token += 1000
                time.sleep(0.05)  # the pace of A's announcements, not synchronisation

        assert heard_after(100)
        (fd,) = tcp_connections(port, "peer")
        silence(fd)
        assert heard_after(10 ** 6)
        assert b.stats()["peer_disconnects"] >= 1
    finally:
        a.close()
        b.close()

"""The announce channel against peers and outsiders that do not play fair: floods, oversized and
over-long messages, forged metadata, replays, unsigned frames, a rate per peer, the secret's
configuration. Each test fails on the channel without the matching defence."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from _kvwire import wait_until
from _shared_blocks import Clock, chain
from _shared_leader import LEASE, MARGIN, SECRET, Leader

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.consolidator_config import ConfigError
from kvbm_plugin.settings.shared import load_shared_settings
from kvbm_plugin.testing.memory_store import MemoryStore
from kvbm_plugin.tiers.shared import announce
from kvbm_plugin.tiers.shared.announce import Announcer, encode
from kvbm_plugin.wire.identity import salt_extra_key, scope_string

# ---- a raw publisher at a peer's endpoint ----------------------------------------------


@pytest.fixture
def fed(tmp_path: Path, ctx: zmq.Context) -> Iterator[tuple[Leader, zmq.Socket]]:
    """A leader whose one peer is a raw XPUB of the test's (subscribed when yielded)."""
    clock = Clock()
    store = MemoryStore(lease_s=LEASE, clock=clock)
    endpoint = f"ipc://{tmp_path}/peer.ipc"
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # each connection's subscription, a new one's too
    pub.bind(endpoint)
    leader = Leader(store, clock, peers=(endpoint,))
    leader.agent.start()
    try:
        assert pub.poll(10_000), "the agent's SUB never subscribed"
        assert pub.recv() == b"\x01"
        yield leader, pub
    finally:
        leader.agent.close()


def test_a_forged_announcement_is_not_advertised_and_the_honest_one_after_it_is(
        fed: tuple[Leader, zmq.Socket]) -> None:
    leader, pub = fed
    [honest] = chain(1)
    leader.write([honest])  # the object is in the store: only its metadata is forged
    forgeries = [
        dataclasses.replace(honest, token_ids=(9, 9, 9, 9)),  # other tokens, same digest
        dataclasses.replace(honest, extra_keys=(salt_extra_key(7),)),  # another tenant's
        dataclasses.replace(honest, lora_id=3),  # another adapter's
        dataclasses.replace(honest, token_ids=honest.token_ids[:2]),  # not this block size
        dataclasses.replace(honest, extra_keys=("dynamo-cache-salt:zz",)),
    ]
    pub.send(encode(SECRET, 66, 0, forgeries))
    pub.send(encode(SECRET, 66, 1, [honest], ["ab"]))  # a multimodal part it was not keyed by
    leader.wait_stat("forged", len(forgeries) + 1)
    pub.send(encode(SECRET, 9, 0, [honest]))
    leader.wait_stat("confirmed_heard", 1)
    assert leader.directory.lookup(honest.digest) == honest
    assert leader.stored == [honest]


def test_an_own_write_replaces_a_peers_still_pending_announcement_of_the_same_block(
        fed: tuple[Leader, zmq.Socket]) -> None:
    leader, pub = fed
    [block] = chain(1)
    # Same digest, tokens and scope (all a receiver can recompute), another event hash.
    renamed = dataclasses.replace(block, event_hash=12345)
    leader.write([block])
    leader.store.down = True  # type: ignore[attr-defined]
    pub.send(encode(SECRET, 9, 0, [renamed]))
    leader.wait_stat("confirm_failed", 1)  # pending: checked again at the next sweep
    leader.agent.committed(block)
    assert leader.stat("committed") == 1
    leader.store.down = False  # type: ignore[attr-defined]
    leader.sweep()
    leader.wait_stat("confirmed_own", 1)
    assert leader.stored == [block] and leader.stat("confirmed_heard") == 0


def test_a_block_of_every_scope_is_heard_when_its_metadata_hashes_to_its_digest(
        fed: tuple[Leader, zmq.Socket]) -> None:
    leader, pub = fed
    salt, lora, mm = 0x1234, 0, "00ff"
    blocks = chain(2, scope=scope_string(salt, lora, mm), lora_id=lora,
                   extra_keys=(salt_extra_key(salt),))
    salted = chain(1, scope=scope_string(salt, None, None), extra_keys=(salt_extra_key(salt),),
                   first_token=7)
    leader.write(blocks + salted)
    pub.send(encode(SECRET, 9, 0, blocks + salted, [mm, mm, None]))
    leader.wait_stat("confirmed_heard", 3)
    assert leader.stat("forged") == 0
    assert leader.stored == blocks + salted


def test_a_multimodal_blocks_digests_are_heard_and_malformed_ones_dropped(
        fed: tuple[Leader, zmq.Socket]) -> None:
    """A block's items' digests ride in its extra_keys before the salt (the identity its GPU
    copy has); digests without a multimodal scope, or not 64 lowercase hex digits, or after
    the salt, are no form the plugin writes: dropped as forged."""
    leader, pub = fed
    salt, mm, digest = 0x1234, "00ff", "ab" * 32
    scope = scope_string(salt, None, mm)
    good = chain(2, scope=scope, extra_keys=(digest, salt_extra_key(salt)))
    only_mm = chain(1, scope=scope_string(None, None, mm), extra_keys=(digest, digest),
                    first_token=5)
    bad = [dataclasses.replace(good[0], extra_keys=(digest.upper(), salt_extra_key(salt))),
           dataclasses.replace(good[0], extra_keys=(salt_extra_key(salt), digest)),
           dataclasses.replace(good[0], extra_keys=(digest,) * (announce.MAX_MM_KEYS + 1))]
    no_mm = chain(1, scope=scope_string(salt, None, None),
                  extra_keys=(digest, salt_extra_key(salt)), first_token=9)
    leader.write(good + only_mm + no_mm)
    pub.send(encode(SECRET, 9, 0, bad + no_mm, [mm, mm, mm, None]))
    leader.wait_stat("forged", 4)
    pub.send(encode(SECRET, 9, 1, good + only_mm, [mm, mm, mm]))
    leader.wait_stat("confirmed_heard", 3)
    assert leader.stat("forged") == 4 and leader.stored == good + only_mm


def test_an_own_multimodal_block_reaches_a_peer_with_its_scope(tmp_path: Path) -> None:
    clock = Clock()
    store = MemoryStore(lease_s=LEASE, clock=clock)
    ep_a, ep_b = f"ipc://{tmp_path}/a.ipc", f"ipc://{tmp_path}/b.ipc"
    a = Leader(store, clock, endpoint=ep_a, peers=(ep_b,))
    b = Leader(store, clock, endpoint=ep_b, peers=(ep_a,))
    a.agent.start()
    b.agent.start()
    try:
        a.wait_stat("subscriptions", 1)
        scope = scope_string(None, None, "beef")
        blocks = chain(2, scope=scope)
        a.write(blocks)
        for block in blocks:
            a.agent.committed(block, scope)
        b.wait_stat("confirmed_heard", 2)
        assert b.stat("forged") == 0 and b.stored == blocks
    finally:
        a.agent.close()
        b.agent.close()


def test_unsigned_replayed_and_stale_messages_are_dropped_and_counted(
        fed: tuple[Leader, zmq.Socket]) -> None:
    leader, pub = fed
    a, b, c, d = (chain(1, first_token=t)[0] for t in (1, 2, 3, 4))
    leader.write([a, b, c, d])
    pub.send(encode(b"not-the-deployment-secret-at-all-32b", 5, 0, [a]))
    good = encode(SECRET, 5, 0, [b])
    pub.send(good)
    pub.send(good)  # the same message again: a replay
    pub.send(encode(SECRET, 6, 0, [c], time_ms=int((time.time() - 600) * 1000)))
    pub.send(encode(SECRET, 5, 1, [d]))
    leader.wait_stat("confirmed_heard", 2)
    leader.wait_stat("stale", 1)
    assert (leader.stat("unauthenticated"), leader.stat("replayed")) == (1, 1)
    assert [blk.digest for blk in leader.stored] == [b.digest, d.digest]


def test_an_oversized_announcement_is_refused_unread_and_counted(
        fed: tuple[Leader, zmq.Socket]) -> None:
    leader, pub = fed
    for _ in range(4):
        pub.send(b"\x00" * (4 << 20))  # 4 MiB each: ZMQ refuses them by their size header
    leader.wait_stat("peer_disconnects", 1)
    # The SUB connects again (a connection per oversized frame that reached it): a good
    # announcement, sent again until one lands on a connection that lives, is heard.
    [block] = chain(1)
    leader.write([block])
    seqs = iter(range(10_000))
    wait_until(lambda: pub.send(encode(SECRET, 9, next(seqs), [block])) is None
               and leader.stat("confirmed_heard") >= 1, 20, "a good announcement heard")
    assert leader.stat("bad_announcements") == 0 and leader.stat("unauthenticated") == 0
    assert leader.stat("turn_max_ms") < MARGIN * 1000  # no turn near the lease margin


def test_more_blocks_than_a_message_may_hold_are_refused(
        fed: tuple[Leader, zmq.Socket]) -> None:
    leader, pub = fed
    blocks = [chain(1, first_token=t)[0] for t in range(announce.BLOCKS_PER_MESSAGE + 1)]
    payload = encode(SECRET, 9, 0, blocks)
    assert len(payload) < announce.MAX_MESSAGE_BYTES
    pub.send(payload)
    leader.wait_stat("bad_announcements", 1)
    assert "257 blocks" in str(leader.agent._announcer.last_bad)
    assert leader.stat("heard") == 0 and leader.stat("pending") == 0


def test_a_peer_over_its_rate_loses_the_excess_counted(tmp_path: Path,
                                                       ctx: zmq.Context) -> None:
    clock = Clock()
    store = MemoryStore(lease_s=LEASE, clock=clock)
    endpoint = f"ipc://{tmp_path}/peer.ipc"
    pub = ctx.socket(zmq.XPUB)
    pub.bind(endpoint)
    leader = Leader(store, clock, peers=(endpoint,), announce_rate=1.0)  # burst: 256 blocks
    leader.agent.start()
    try:
        assert pub.poll(10_000) and pub.recv() == b"\x01"
        first = [chain(1, first_token=t)[0] for t in range(200)]
        second = [chain(1, first_token=t)[0] for t in range(1000, 1200)]
        leader.write(first + second)
        pub.send(encode(SECRET, 9, 0, first))
        pub.send(encode(SECRET, 9, 1, second))
        leader.wait_stat("rate_limited", 200)
        leader.wait_stat("confirmed_heard", 200)
        assert leader.stat("lost") == 0
    finally:
        leader.agent.close()


# ---- an outsider on this leader's own announce endpoint --------------------------------

class _EndlessXpub:
    """An XPUB that always has one more subscription frame waiting (a flood faster than any
    reader); gives up after ``limit`` frames so that a reader without a bound ends too."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.read = 0

    def recv(self, flags: int = 0, copy: bool = True) -> zmq.Frame | bytes:
        self.read += 1
        if self.read > self.limit:
            raise zmq.Again()
        return b"\x01flood" if copy else zmq.Frame(b"\x01flood")


def test_one_receive_reads_a_bounded_number_of_subscription_frames() -> None:
    announcer = Announcer(None, (), secret=SECRET)
    flood = _EndlessXpub(limit=2_000_000)
    announcer.pub = flood  # type: ignore[assignment]
    start = time.monotonic()
    assert announcer.receive() == []
    assert flood.read <= announce.SUBSCRIPTIONS_PER_TURN
    assert time.monotonic() - start < 1.0


_FLOODER = """
import sys, time, zmq
kind, endpoint, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
ctx = zmq.Context()
if kind == "subscriptions":  # an outsider on the leader's own announce endpoint
    s = ctx.socket(zmq.XSUB)
    s.setsockopt(zmq.SNDHWM, 0)
    s.connect(endpoint)
    frame = b"\\x01flood"
else:  # an outsider bound where a peer should be: unsigned frames just under the size cap
    s = ctx.socket(zmq.XPUB)
    s.bind(endpoint)
    s.recv()
    frame = b"\\x00" * (250 << 10)
end = time.monotonic() + seconds
print("ready", flush=True)
while time.monotonic() < end:
    for _ in range(100):
        try:
            s.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            pass
s.close(linger=0)
ctx.term()
"""


@pytest.mark.parametrize(("kind", "seconds"), [
    ("subscriptions", 3.0), ("announcements", 3.0),
    pytest.param("subscriptions", 60.0, marks=pytest.mark.slow),
    pytest.param("announcements", 60.0, marks=pytest.mark.slow),
])
def test_a_flood_leaves_every_agent_turn_short_and_the_leases_renewed(
        tmp_path: Path, kind: str, seconds: float) -> None:
    lease, margin = 1.5, 0.6
    store = MemoryStore(lease_s=lease, clock=time.monotonic)
    own, peer = f"ipc://{tmp_path}/own.ipc", f"ipc://{tmp_path}/peer.ipc"
    target, counter = (own, "subscription_frames") if kind == "subscriptions" \
        else (peer, "unauthenticated")
    flooder = subprocess.Popen([sys.executable, "-c", _FLOODER, kind, target, str(seconds)],
                               stdout=subprocess.PIPE, text=True)
    leader = Leader(store, time.monotonic, endpoint=own, peers=(peer,), lease=(lease, margin))
    leader.agent.start()
    try:
        [block] = chain(1)
        leader.commit([block])
        leader.wait_stat("confirmed_own", 1)
        assert flooder.stdout is not None and flooder.stdout.readline().strip() == "ready"
        wait_until(lambda: leader.stat(counter) > 10, 10, "the flood arrives")
        sweeps = leader.stat("renewal_sweeps")
        flooder.wait(timeout=seconds + 30)
        # A sweep every lease / 3 all along the flood, each renewing the block.
        assert leader.stat("renewal_sweeps") >= sweeps + int(seconds / lease), \
            leader.agent.stats()
        assert leader.removed_flat() == [] and leader.directory.lookup(block.digest) == block
        # The agent's own work per turn stays under the margin. The wall clock of a turn also
        # counts time the OS ran other processes: on two cores shared with a CI run and four
        # other test runs a 60 s flood saw one 660 ms turn whose work was short. So the wall
        # clock is held to the lease, and the leases above were renewed all along.
        assert leader.stat("turn_max_cpu_ms") < margin * 1000, leader.agent.stats()
        assert leader.stat("turn_max_ms") < lease * 1000, leader.agent.stats()
        assert leader.stat("flood_pauses") > 0  # it left the process's GIL to the engine
    finally:
        if flooder.poll() is None:
            flooder.kill()
        flooder.wait()
        leader.agent.close()


# ---- the secret --------------------------------------------------------------------------

BASE = {cc.SHARED_TIER: "memory", cc.SHARED_MODEL_KEY: "m"}


def _load(**env: str) -> Any:
    return load_shared_settings({**BASE, **env})


def test_peers_without_a_secret_are_refused_naming_the_variable() -> None:
    with pytest.raises(ConfigError, match=f"{cc.SHARED_PEERS}=.*needs "
                                          f"{cc.SHARED_ANNOUNCE_SECRET_FILE}"):
        _load(**{cc.SHARED_PEERS: "tcp://node2:58001"})
    assert _load().announce_secret is None  # one engine alone needs none


@pytest.mark.parametrize(("content", "why"), [
    (None, "cannot read it"), ("", "holds 0 bytes"), ("short\n", "holds 5 bytes"),
    ("x" * 5000, "more than 4096 bytes"), ("dir", "cannot read it"),
])
def test_a_missing_unreadable_or_short_secret_gives_one_clear_line(
        tmp_path: Path, content: str | None, why: str) -> None:
    path = tmp_path / "secret"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=f"{cc.SHARED_ANNOUNCE_SECRET_FILE}=.*{why}") as caught:
        _load(**{cc.SHARED_ANNOUNCE_SECRET_FILE: str(path),
                 cc.SHARED_PEERS: "tcp://node2:58001"})
    assert "\n" not in str(caught.value)


def test_a_secret_file_is_read_stripped_and_never_shown(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("  " + "s" * 40 + "\n")
    settings = _load(**{cc.SHARED_ANNOUNCE_SECRET_FILE: str(path),
                        cc.SHARED_PEERS: "tcp://node2:58001"})
    assert settings.announce_secret == b"s" * 40
    assert "s" * 40 not in repr(settings)
    with pytest.raises(ConfigError, match=cc.SHARED_ANNOUNCE_RATE):
        _load(**{cc.SHARED_ANNOUNCE_RATE: "0"})


def test_without_a_secret_the_agent_opens_no_announce_socket(tmp_path: Path) -> None:
    clock = Clock()
    store = MemoryStore(lease_s=LEASE, clock=clock)
    leader = Leader(store, clock, endpoint=f"ipc://{tmp_path}/own.ipc", announce_secret=None)
    leader.agent.start()
    try:
        assert leader.agent._announcer.sockets() == []
    finally:
        leader.agent.close()
    with pytest.raises(ConfigError, match=cc.SHARED_ANNOUNCE_SECRET_FILE):
        Leader(store, clock, peers=(f"ipc://{tmp_path}/peer.ipc",), announce_secret=None)


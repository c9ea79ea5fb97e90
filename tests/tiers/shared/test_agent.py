"""SharedAgent on a MemoryStore with a settable clock: confirmation, renewal, eviction, the store
going down, LRU, and two leaders sharing one store."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _kvwire import free_port, wait_until
from _shared_blocks import Clock, chain
from _shared_leader import LEASE, MARGIN, SETTINGS, Leader

from kvbm_plugin.consolidator_config import ConfigError
from kvbm_plugin.testing.memory_store import MemoryStore
from kvbm_plugin.tiers.shared import agent as agent_module
from kvbm_plugin.tiers.shared.agent import SharedAgent
from kvbm_plugin.tiers.shared.directory import SharedDirectory


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(clock: Clock) -> MemoryStore:
    return MemoryStore(lease_s=LEASE, clock=clock)


@pytest.fixture
def leader(store: MemoryStore, clock: Clock) -> Iterator[Leader]:
    one = Leader(store, clock)
    one.agent.start()
    yield one
    one.agent.close()


def test_a_commit_is_confirmed_on_every_rank_then_offered_and_reported(
        leader: Leader, store: MemoryStore, clock: Clock) -> None:
    blocks = chain(3)
    start = clock.now
    leader.commit(blocks)
    leader.wait_stat("confirmed", 3)
    assert leader.stored == blocks  # parents first
    for block in blocks:
        assert leader.directory.lookup(block.digest) == block
        assert leader.directory.deadline_of(block.digest) == start + LEASE
        for key in leader.keys(block):  # exists() on every rank leased every object
            assert store.lease_end(key) == start + LEASE
    assert leader.agent.available


def test_a_block_missing_on_one_rank_is_never_tracked(leader: Leader) -> None:
    [block] = chain(1)
    leader.write([block], ranks=(0,))
    leader.agent.committed(block)
    leader.wait_stat("confirm_absent", 1)
    assert not leader.directory.is_tracked(block.digest)
    assert leader.stored == [] and leader.directory.lookup(block.digest) is None


def test_renewal_keeps_a_leased_block_offerable_past_one_lease(
        leader: Leader, store: MemoryStore, clock: Clock) -> None:
    [block] = chain(1)
    leader.commit([block])
    leader.wait_stat("confirmed", 1)
    for _ in range(4):  # 4 periods: past the first lease
        leader.sweep()
        assert store.evict_unleased() == []  # the store kept it: its lease was renewed
        assert leader.directory.lookup(block.digest) == block
    assert leader.stat("renewed") == 4
    assert leader.removed == []


def test_a_pinned_block_keeps_being_renewed(store: MemoryStore, clock: Clock) -> None:
    leader = Leader(store, clock, capacity=1)
    leader.agent.start()
    try:
        [a] = chain(1, first_token=1)
        [b] = chain(1, first_token=2)
        leader.commit([a])
        leader.wait_stat("confirmed", 1)
        assert leader.directory.pin(a.digest)
        leader.commit([b])  # no room: a is pinned
        leader.wait_stat("refused_full", 1)
        for _ in range(4):  # past one lease
            leader.sweep()
            evicted = store.evict_unleased()  # b's objects go once their check's lease ends
            assert not set(leader.keys(a)) & set(evicted)
            assert leader.directory.lookup(a.digest) == a
        assert leader.stat("renewed") == 4
        leader.directory.unpin(a.digest)
        leader.commit([b])
        leader.wait_stat("dropped_lru", 1)
        assert leader.removed == [[a]] and leader.directory.lookup(b.digest) == b
    finally:
        leader.agent.close()


def test_a_block_evicted_from_the_store_is_dropped_at_the_next_renewal_with_descendants(
        leader: Leader, store: MemoryStore) -> None:
    a, b, c = chain(3)
    [other] = chain(1, first_token=900)
    leader.commit([a, b, c, other])
    leader.wait_stat("confirmed", 4)
    store.evict([leader.keys(b)[1]])  # rank 1's object of b is gone
    leader.sweep()
    assert leader.removed == [[c, b]]  # descendants before ancestors, in one batch
    assert leader.stat("dropped_absent") == 1
    for block in (b, c):
        assert not leader.directory.is_tracked(block.digest)
    assert leader.directory.lookup(a.digest) == a
    assert leader.directory.lookup(other.digest) == other


def test_store_down_nothing_offered_renewals_fail_blocks_dropped_at_their_deadlines(
        leader: Leader, store: MemoryStore, clock: Clock) -> None:
    blocks = chain(2)
    start = clock.now
    leader.commit(blocks)
    leader.wait_stat("confirmed", 2)
    store.down = True
    leader.sweep()  # start + PERIOD
    assert not leader.agent.available
    assert leader.directory.lookup(blocks[0].digest) is None
    assert leader.stat("renewals_failed") >= 1 and leader.stat("renewed") == 0
    assert leader.removed == []  # still leased in the store: kept, not offered
    clock.now = start + LEASE - MARGIN - 0.01
    leader.settle()
    assert leader.removed == []
    clock.now = start + LEASE - MARGIN  # can no longer be offered: dropped, reported
    leader.settle()
    assert leader.removed == [[blocks[1], blocks[0]]]
    assert leader.stat("dropped_expired") == 1 and len(leader.directory) == 0
    store.down = False
    leader.sweep()  # nothing to renew: the store is probed
    assert leader.agent.available


def test_a_commit_while_the_store_is_down_is_checked_again_when_it_is_back(
        leader: Leader, store: MemoryStore) -> None:
    [block] = chain(1)
    store.down = True
    leader.commit([block])
    leader.wait_stat("confirm_failed", 1)
    assert leader.directory.is_tracked(block.digest)  # pending, not offered
    assert leader.directory.lookup(block.digest) is None
    store.down = False
    leader.sweep()
    leader.wait_stat("confirmed", 1)
    assert leader.directory.lookup(block.digest) == block


def test_least_recently_used_leaves_are_dropped_and_reported(store: MemoryStore,
                                                             clock: Clock) -> None:
    leader = Leader(store, clock, capacity=3)
    leader.agent.start()
    try:
        a, b = chain(2)
        [c] = chain(1, first_token=500)
        [e] = chain(1, first_token=600)
        leader.commit([a, b, c])
        leader.wait_stat("confirmed", 3)
        assert leader.directory.lookup(c.digest) is not None
        leader.commit([e])
        leader.wait_stat("confirmed", 4)
        assert leader.removed == [[b]]  # the LRU leaf (a is older, but b's parent)
        assert leader.stat("dropped_lru") == 1
    finally:
        leader.agent.close()


def test_a_callback_that_raises_is_counted_and_the_agent_goes_on(
        store: MemoryStore, clock: Clock, expect_errors) -> None:
    calls = []

    def on_store(block):
        calls.append(block)
        raise RuntimeError("consumer bug")

    directory = SharedDirectory(10, LEASE, MARGIN, clock)
    agent = SharedAgent(SETTINGS, store, Leader(store, clock).layouts, directory, on_store,
                        lambda blocks: None, None, ())
    agent.start()
    try:
        a, b = chain(2)
        for block in (a, b):
            for key in Leader(store, clock).keys(block):
                store.put_bytes(key, b"x")
            agent.committed(block)
        wait_until(lambda: agent.stats()["confirmed"] == 2, 10, "both confirmed")
        assert calls == [a, b] and agent.stats()["callback_errors"] == 2
    finally:
        agent.close()
    assert expect_errors.wait_for("consumer bug")


def test_an_endpoint_that_cannot_be_bound_is_a_config_error(store: MemoryStore,
                                                           clock: Clock) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    first = Leader(store, clock, endpoint=endpoint)
    first.agent.start()
    try:
        second = Leader(store, clock, endpoint=endpoint)  # the port is taken
        with pytest.raises(ConfigError, match="SHARED_ANNOUNCE_ENDPOINT") as caught:
            second.agent.start()
        assert endpoint in str(caught.value)
        second.agent.close()  # nothing left to close: no error either
    finally:
        first.agent.close()


def test_a_bad_block_from_the_leader_is_a_value_error(leader: Leader) -> None:
    [block] = chain(1)
    with pytest.raises(ValueError, match="digest"):
        leader.agent.committed(type(block)(b"x", None, 1, None, (1,), None, None))


def test_a_bad_block_in_a_batch_of_commits_queues_none_of_it(leader: Leader) -> None:
    """The leader's batch form checks every block before it queues any."""
    good = chain(3)
    bad = type(good[0])(b"x", None, 1, None, (1,), None, None)
    with pytest.raises(ValueError, match="digest"):
        leader.agent.committed_many([(good[0], None), (bad, None), (good[1], None)])
    assert leader.stat("committed") == 0
    assert leader.agent.committed_many([(b, None) for b in good]) == 3
    assert leader.stat("committed") == 3


def test_a_hand_over_is_checked_and_queued_on_the_agents_thread(
        leader: Leader, expect_errors: Any) -> None:
    """The leader's batch hand-over (executor thread) raises nothing and queues nothing on the
    caller's thread: the agent's thread checks and queues the list in its next turn, a
    malformed block counted and logged there, the others confirmed; once ``wakes_handled``
    reaches the returned ticket, the whole list was taken."""
    import threading

    good = chain(3)
    leader.write(good)
    bad = type(good[0])(b"x", None, 1, None, (1,), None, None)
    callers: list[str] = []
    queue_commits = leader.agent._queue_commits  # noqa: SLF001

    def on_its_thread(blocks: Any) -> int:
        callers.append(threading.current_thread().name)
        return queue_commits(blocks)

    leader.agent._queue_commits = on_its_thread  # noqa: SLF001
    # (the leader hands a block over as its fields, made on the agent's thread: one of each
    # here, and fields of the wrong count, malformed)
    fields = tuple(getattr(good[1], name) for name in (
        "digest", "parent_digest", "event_hash", "parent_event_hash", "token_ids", "lora_id",
        "extra_keys"))
    ticket = leader.agent.hand_over([(good[0], None), (bad, None), (fields, None),
                                     (fields[:3], None), (good[2], None)])
    assert ticket > 0
    wait_until(lambda: leader.agent.wakes_handled >= ticket, 10.0, "the hand-over's turn")
    assert callers == ["kvbm-shared-agent"]
    assert leader.stat("commits_malformed") == 2 and leader.stat("committed") == 3
    leader.wait_stat("confirmed", 3)
    assert leader.stored == good
    assert expect_errors.wait_for("shared-tier commit not tracked: digest")


def test_a_hand_over_of_too_few_fields_names_their_count_and_value(
        leader: Leader, expect_errors: Any) -> None:
    ticket = leader.agent.hand_over([((b"d" * 16, None, 1), None)])
    wait_until(lambda: leader.agent.wakes_handled >= ticket, 10.0, "the hand-over's turn")
    assert leader.stat("commits_malformed") == 1 and leader.stat("committed") == 0
    assert expect_errors.wait_for("commit fields: 3 values, not 7: (b'dddd")


def test_a_hand_over_after_close_is_refused_and_counted(store: MemoryStore,
                                                         clock: Clock) -> None:
    leader = Leader(store, clock)
    leader.agent.start()
    leader.agent.close()
    assert leader.agent.hand_over([(b, None) for b in chain(2)]) == 0
    assert leader.stat("commits_refused") == 2 and leader.stat("committed") == 0


class _CountingOs:
    """The agent module's ``os`` with its writes to one pipe counted (the wake bytes)."""

    def __init__(self) -> None:
        self.fd = -1
        self.writes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def write(self, fd: int, data: bytes) -> int:
        self.writes += fd == self.fd
        return os.write(fd, data)


@pytest.mark.parametrize("linger_rounds", [1_000_000, 0])
def test_commits_while_the_agent_lingers_write_no_wake_byte(
        store: MemoryStore, clock: Clock, monkeypatch: pytest.MonkeyPatch,
        linger_rounds: int) -> None:
    """After a wake the agent polls with its flag set, so the leader's next commits (each
    with its wake) write nothing to the pipe and are confirmed all the same; the control,
    an agent that sleeps at once, is woken by a byte each time."""
    counting = _CountingOs()
    monkeypatch.setattr(agent_module, "os", counting)
    leader = Leader(store, clock)
    leader.agent.LINGER_ROUNDS = linger_rounds
    counting.fd = leader.agent._wake_w  # noqa: SLF001
    leader.agent.start()
    try:
        blocks = chain(12)
        leader.commit(blocks[:1])
        leader.wait_stat("confirmed", 1)
        for n, block in enumerate(blocks[1:], start=2):
            if not linger_rounds:  # asleep: the commit's wake must write the byte
                wait_until(lambda: not leader.agent._wake_pending, 10.0, "the agent asleep")  # noqa: SLF001
            before = counting.writes
            leader.commit([block])
            leader.wait_stat("confirmed", n)
            assert (counting.writes == before) == bool(linger_rounds)
    finally:
        leader.agent.close()


def test_a_wake_after_the_linger_is_answered(store: MemoryStore, clock: Clock) -> None:
    """Once the agent cleared its flag to sleep, a wake (no commit: a moved clock) is still
    answered by a whole turn: no ticket is lost between the linger and the sleep."""
    leader = Leader(store, clock)
    leader.agent.LINGER_ROUNDS = 2
    leader.agent.start()
    try:
        for _ in range(20):
            wait_until(lambda: not leader.agent._wake_pending, 10.0, "the agent asleep")  # noqa: SLF001
            leader.settle()
    finally:
        leader.agent.close()


def test_close_is_clean_and_idempotent(store: MemoryStore, clock: Clock) -> None:
    leader = Leader(store, clock)
    leader.agent.start()
    leader.agent.close()
    leader.agent.close()
    [block] = chain(1)
    leader.agent.committed(block)  # after close: counted, nothing queued
    assert leader.stat("commits_refused") == 1


# ---- two leaders, one store ------------------------------------------------------------

@pytest.fixture
def pair(store: MemoryStore, clock: Clock, tmp_path: Path) -> Iterator[tuple[Leader, Leader]]:
    ep_a, ep_b = f"ipc://{tmp_path}/a.ipc", f"ipc://{tmp_path}/b.ipc"
    # Both list both endpoints, as one deployment-wide list would: a leader ignores itself.
    a = Leader(store, clock, endpoint=ep_a, peers=(ep_a, ep_b))
    b = Leader(store, clock, endpoint=ep_b, peers=(ep_a, ep_b))
    a.agent.start()
    b.agent.start()
    try:
        for one in (a, b):  # each XPUB saw both SUBs (the other's and its own)
            one.wait_stat("subscriptions", 2)
        yield a, b
    finally:
        a.agent.close()
        b.agent.close()


def test_a_peer_announcement_is_confirmed_then_stored_on_the_other_leader(
        pair: tuple[Leader, Leader], store: MemoryStore) -> None:
    a, b = pair
    blocks = chain(3)
    a.commit(blocks)
    a.wait_stat("announced", 3)
    b.wait_stat("confirmed_heard", 3)
    assert b.stored == blocks
    for block in blocks:
        assert b.directory.lookup(block.digest) == block
    assert b.stat("announced") == 0 and b.stat("confirmed_own") == 0  # never forwarded
    # A's own SUB hears A's announcement on A's next turn, in no order with B's confirming
    a.wait_stat("own_ignored", 1)
    assert a.stat("heard") == 0
    # B writes the next block of the chain: A learns it the same way.
    [more] = chain(1, first_token=500, parent=blocks[-1])
    b.commit([more])
    a.wait_stat("confirmed_heard", 1)
    assert a.stored == [*blocks, more]


class _Breaker(MemoryStore):
    """A store with a circuit breaker's ``available`` (opened by another thread's calls)."""

    open = False

    @property
    def available(self) -> bool:
        return not self.open


def test_a_breaker_opened_by_another_thread_stops_offers_at_once(clock: Clock) -> None:
    store = _Breaker(lease_s=LEASE, clock=clock)
    leader = Leader(store, clock)
    leader.agent.start()
    try:
        [block] = chain(1)
        leader.commit([block])
        leader.wait_stat("confirmed", 1)
        assert leader.directory.lookup(block.digest) == block
        store.open = True  # e.g. the worker's put found the store down
        assert not leader.agent.available
        assert leader.directory.lookup(block.digest) is None
        store.open = False
        assert leader.directory.lookup(block.digest) == block
    finally:
        leader.agent.close()


# ---- a real Mooncake master --------------------------------------------------------------

def test_with_a_real_master_a_block_one_client_wrote_is_confirmed_by_another_agent(
        mooncake_master_factory: Any, mooncake_store_factory: Any, tmp_path: Path) -> None:
    from _payload import Arena, payload

    from kvbm_plugin.tiers.shared.breaker import GuardedStore

    master = mooncake_master_factory(lease_ms=3000)
    lease = {"lease_s": 3.0, "load_margin_s": 1.0}
    writer = mooncake_store_factory(master, **lease)  # engine A: its worker's segment
    reader = mooncake_store_factory(master, segment_bytes=0, **lease)  # engine B's leader
    page = 4096
    ep_a, ep_b = f"ipc://{tmp_path}/a.ipc", f"ipc://{tmp_path}/b.ipc"
    a = Leader(GuardedStore(writer), time.monotonic, endpoint=ep_a, peers=(ep_b,),
               lease=(3.0, 1.0), page=page)
    b = Leader(GuardedStore(reader), time.monotonic, endpoint=ep_b, peers=(ep_a,),
               lease=(3.0, 1.0), page=page)
    a.agent.start()
    b.agent.start()
    try:
        a.wait_stat("subscriptions", 1)
        b.wait_stat("subscriptions", 1)
        blocks = chain(2)
        keys = [k for block in blocks for k in a.keys(block)]
        arena = Arena(len(keys), page)
        for i, key in enumerate(keys):
            arena.write(i, payload(key, page))
        assert writer.put(keys, [arena.buffer(i) for i in range(len(keys))]) == [0] * 4
        for block in blocks:
            a.agent.committed(block)
        b.wait_stat("confirmed_heard", 2)
        assert a.stat("confirmed_own") == 2 and b.stored == blocks
        for block in blocks:
            assert b.directory.lookup(block.digest) == block
        # What B was offered it can read, byte for byte, through its own client.
        out = Arena(len(keys), page)
        assert reader.get_into(keys, [out.buffer(i) for i in range(len(keys))]) == [page] * 4
        assert [out.read(i) for i in range(len(keys))] == [payload(k, page) for k in keys]
        b.wait_stat("renewed", 2)  # a real renewal a period later
    finally:
        a.agent.close()
        b.agent.close()


def test_an_agent_that_fails_drops_what_it_advertised(leader: Leader, monkeypatch,
                                                      expect_errors) -> None:
    blocks = chain(2)
    leader.commit(blocks)
    leader.wait_stat("confirmed", 2)

    def broken(self: SharedDirectory) -> float | None:
        raise RuntimeError("agent bug")

    monkeypatch.setattr(SharedDirectory, "next_expiry", broken)
    leader.agent.wake()
    wait_until(lambda: leader.removed_flat() == [blocks[1], blocks[0]], 10, "blocks dropped")
    assert not leader.agent.available and len(leader.directory) == 0
    assert expect_errors.wait_for("shared-tier agent stopped")

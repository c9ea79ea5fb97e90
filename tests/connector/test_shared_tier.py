"""The shared tier in the connector: match, write-through, identity, what the router is told.

Two simulated engines (TP 2, ranks in-process) share one in-memory store; each has its own
leader, host tier, directory and agent (``_shared_fakes.BusAgent``: the SharedAgent API, with
announcements between the two agents). The engine checks every onboarded block's KV bytes
against what the forward pass wrote (``kv_mismatches``).
"""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from _engines import prompt, tiers
from _shared_fakes import Bus, BusAgent, Client

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.leader import shared_tier as leader_shared_tier
from kvbm_plugin.testing.fake_trtllm import LlmRequest
from kvbm_plugin.testing.memory_store import MemoryStore
from kvbm_plugin.tiers.content_keys import block_keys
from kvbm_plugin.tiers.shared import frame
from kvbm_plugin.tiers.shared.keys import chain_digests
from kvbm_plugin.wire.identity import request_scope
from kvbm_plugin.worker import shared_io

BS = 4


class TierRecorder:
    def __init__(self) -> None:
        self.stores: list[tuple[str, int, int | None, tuple[int, ...], dict]] = []
        self.removes: list[tuple[str, int]] = []

    def register_store(self, tier, dp_rank, block_hash, parent_hash, token_ids, block_size,
                       **scope: Any) -> None:
        self.stores.append((tier, block_hash, parent_hash, tuple(token_ids), scope))

    def register_remove(self, tier, dp_rank, block_hashes) -> None:
        self.removes.extend((tier, h) for h in block_hashes)

    def register_clear(self, tier, dp_rank) -> None:
        return None

    def hashes(self, tier: str) -> set[int]:
        return {s[1] for s in self.stores if s[0] == tier}


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


@pytest.fixture(params=["bus"])
def shared(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, make_engine: Any,
           tmp_path: Any) -> SimpleNamespace:
    """One store; ``engine(**env)`` builds an engine on it. ``bus``: the stand-in agents of
    one announcement bus; ``real``: SharedAgent, each engine announcing on an ipc endpoint and
    subscribed to every engine built before it."""
    ns = SimpleNamespace(store=MemoryStore(lease_s=10.0), bus=Bus(), clients=[],
                         fail_put_keys=None)

    def open_store(settings: Any, *, segment_bytes: int | None = None) -> Client:
        client = Client(ns.store, "leader" if segment_bytes == 0 else "worker")
        put = client.put

        def failing_put(keys, buffers):  # noqa: ANN001, ANN202
            pattern = ns.fail_put_keys
            if pattern is None:
                return put(keys, buffers)
            return [-4 if pattern in k else code
                    for k, code in zip(keys, put(keys, buffers), strict=True)]

        client.put = failing_put  # type: ignore[method-assign]
        ns.clients.append(client)
        return client

    monkeypatch.setattr(shared_io, "open_store", open_store)
    real = request.param == "real"
    if not real:
        monkeypatch.setattr(leader_shared_tier, "agent_class",
                            lambda: functools.partial(BusAgent, ns.bus))
    endpoints: list[str] = []
    built: list[Any] = []

    def engine(host: int = 64, gpu: int = 32, **extra: str) -> Any:
        rec = TierRecorder()
        if real:
            endpoint = f"ipc://{tmp_path}/announce-{len(endpoints)}"
            secret = tmp_path / "announce.secret"
            secret.write_text("a-test-deployment-secret-of-32-bytes\n")
            extra = {cc.SHARED_ANNOUNCE_ENDPOINT: endpoint,
                     cc.SHARED_PEERS: ",".join(endpoints),
                     cc.SHARED_ANNOUNCE_SECRET_FILE: str(secret), **extra}
            endpoints.append(endpoint)
        env = tiers(host=host, **{cc.SHARED_TIER: "memory", cc.SHARED_MODEL_KEY: "test-model",
                                   **extra})
        eng = make_engine(num_gpu_blocks=gpu, tp_size=2, tokens_per_block=BS, env=env,
                          tier_events=rec)
        eng.recorder = rec
        # The agent starts at the leader's first idle tick after rank 0 registered its pool:
        # wait for it, so that this engine hears what the others announce from now on.
        wait_for(lambda: agent(eng) is not None, "the agent to start")
        if real:  # the engines built before this one hear it... once its SUB joined theirs
            built.append(eng)
            for n, earlier in enumerate(built[:-1]):
                wait_for(lambda e=earlier, n=n: agent(e).stats()["subscriptions"]
                         >= len(built) - 1 - n, "the new engine to subscribe")
        return eng

    ns.engine = engine
    return ns


def agent(engine: Any) -> BusAgent:
    return engine.leader._shared.agent


def agent_idle(eng: Any) -> bool:
    a = agent(eng)
    if a is None or eng.leader.stats()["shared_writes_inflight"]:
        return False
    if isinstance(a, BusAgent):
        return a.idle()
    ticket = a.wake()
    wait_for(lambda: a.stats()["wakes_handled"] >= ticket, "a turn of the agent")
    return a.stats()["pending"] == 0


def settle(*engines: Any, resident: int | None = None) -> None:
    """Every engine idle, every agent done confirming, each change registered."""
    for eng in engines:
        eng.run_until_idle()
    for eng in engines:
        wait_for(lambda e=eng: agent_idle(e), "the agent and the write-throughs")
        if resident is not None:
            wait_for(lambda e=eng: len(e.leader._shared.directory) >= resident,
                     f"{resident} resident blocks")
        eng.leader.publish_now()


def run(engine: Any, tokens: list[int], salt: str | None = None) -> Any:
    before = engine.leader.stats()
    req = engine.submit(tokens, 2, cache_salt=salt)
    engine.run_until_idle()
    after = engine.leader.stats()
    result = engine.result(req)
    assert result.state in ("done", "saving") and result.kv_mismatches == 0
    return SimpleNamespace(result=result, **{
        k: after[k] - before[k] for k in ("matched_host_tokens", "matched_shared_tokens",
                                          "matched_disk_tokens")})


def test_a_prefix_computed_by_one_engine_is_loaded_by_the_other_with_its_bytes(shared) -> None:
    a, b = shared.engine(), shared.engine()
    system = prompt(1, 6 * BS)
    run(a, system + prompt(2, 3))
    settle(a, b, resident=6)
    got = run(b, system + prompt(3, 3))
    assert got.matched_shared_tokens == 6 * BS and got.matched_host_tokens == 0
    assert b.stats().kv_mismatches == 0
    ws = [r.stats() for r in b.ranks]
    assert all(w["shared_loads"] == 6 and w["shared_loads_failed"] == 0 for w in ws)
    # The objects hold exactly A's host copies (each rank's shard under its own key), behind
    # the 64-byte header that names the key (tiers/shared/frame.py).
    digests = chain_digests(system, BS, None)
    keys = block_keys(system, BS, None)
    for worker in a.workers:
        layout, host = worker._shared.layout, worker._host
        assert layout.rank == worker._rank and layout.world == 2
        for digest, key in zip(digests, keys, strict=True):
            block = host.pool[host.keys.index(key)]
            stored = shared.store.get_bytes(layout.key(digest))
            assert stored[:8] == frame.MAGIC and stored[24:40] == digest
            assert stored[frame.HEADER_BYTES:] == ctypes.string_at(
                block.data_ptr(), layout.bytes_per_page)


def test_a_run_writes_through_only_the_blocks_the_shared_tier_lacks(shared) -> None:
    """B loads a prefix from the shared tier and computes three more blocks: its host saves
    are one run of all nine, and only the three new ones are written through (the planner's
    run with some blocks tracked, one SharedRun of the others); after they settle, A loads
    all nine from the shared tier."""
    a, b = shared.engine(), shared.engine()
    system = prompt(21, 6 * BS)
    run(a, system + prompt(22, 3))
    settle(a, b, resident=6)
    longer = system + prompt(23, 3 * BS + 1)
    before = b.leader.stats()
    got = run(b, longer)
    assert got.matched_shared_tokens == 6 * BS
    after = b.leader.stats()
    assert after["saves_scheduled"] - before["saves_scheduled"] == 9
    assert after["shared_saves_scheduled"] - before["shared_saves_scheduled"] == 3
    settle(a, b, resident=9)
    for k in range(6):  # A's copies out of its GPU pool: the match starts at 0
        run(a, prompt(200 + k, 7 * BS))
    got = run(a, longer)  # its own host copies, then B's three new blocks
    assert (got.matched_host_tokens, got.matched_shared_tokens) == (6 * BS, 3 * BS)


def test_the_loaded_blocks_are_byte_identical_to_the_writers(shared) -> None:
    import torch

    a, b = shared.engine(), shared.engine()
    system = prompt(4, 5 * BS)
    ra = run(a, system + prompt(5, 2))
    settle(a, b, resident=5)
    rb = run(b, system + prompt(6, 2))
    assert rb.matched_shared_tokens == 5 * BS
    blocks_a, blocks_b = a.block_ids(ra.result.request_id), b.block_ids(rb.result.request_id)
    for pool_a, pool_b in zip(a.kv_pools, b.kv_pools, strict=True):
        for i in range(5):
            assert torch.equal(pool_a[blocks_a[i]], pool_b[blocks_b[i]])


def test_match_takes_the_host_prefix_then_shared_blocks(shared) -> None:
    a, b = shared.engine(), shared.engine()
    system = prompt(7, 8 * BS)
    run(b, system[:3 * BS] + prompt(8, 2))  # B's host tier: blocks 0..2
    run(a, system + prompt(9, 2))  # the shared tier: blocks 0..7
    settle(a, b, resident=8)
    # Push B's copies out of its GPU pool (the host copies stay) so the match starts at 0.
    for k in range(6):
        run(b, prompt(100 + k, 7 * BS))
    got = run(b, system + prompt(10, 2))
    assert got.matched_host_tokens == 3 * BS
    assert got.matched_shared_tokens == 5 * BS


def test_a_block_is_offered_only_while_its_lease_lasts(shared) -> None:
    short = {cc.SHARED_LEASE_S: "0.6", cc.SHARED_LOAD_MARGIN_S: "0.3"}
    a, b = shared.engine(**short), shared.engine(**short)
    system = prompt(11, 4 * BS)
    run(a, system + prompt(12, 2))
    settle(a, b, resident=4)
    agent(b)._stop.set()  # nobody renews B's leases any more
    agent(b)._thread.join(5)
    digest = chain_digests(system, BS, None)[0]
    wait_for(lambda: b.leader._shared.directory.lookup(digest) is None, "the lease to run short")
    got = run(b, system + prompt(13, 2))
    assert got.matched_shared_tokens == 0


def test_the_write_through_is_committed_after_the_host_copy_under_its_name(shared) -> None:
    a, b = shared.engine(), shared.engine()
    system = prompt(14, 4 * BS)
    run(a, system + prompt(15, 2))
    settle(a, b, resident=4)
    committed = agent(a).committed_blocks
    host_names = a.recorder.hashes("CPU")
    assert len(committed) == 4
    assert {blk.event_hash for blk in committed} <= host_names
    assert a.leader.stats()["shared_saves_committed"] == 4
    # Committed, nothing of them stays in the leader's hand (else a block the shared tier
    # drops later would never be written through again: its host key would read "in hand").
    assert not a.leader._shared._by_key and not a.leader._shared._waiting  # noqa: SLF001
    # What each engine advertises as EXTERNAL: the blocks it can load, under the same names.
    assert a.recorder.hashes("EXTERNAL") == {blk.event_hash for blk in committed}
    assert b.recorder.hashes("EXTERNAL") == {blk.event_hash for blk in committed}
    by_hash = {s[1]: s for s in b.recorder.stores if s[0] == "EXTERNAL"}
    for blk in committed:
        assert by_hash[blk.event_hash][2] == blk.parent_event_hash


def test_the_shared_tiers_changes_reach_the_router_without_a_hook(shared) -> None:
    """A tier-event target that is not thread-safe (the recorder here; in a deployment the
    leader's TierEventPublisher, without the consolidator) hears the shared tier's residency
    changes from the leader's keeper, which the agent nudges, not from the next hook on the
    executor thread: with B's idle ticks off and no hook of B called, B advertises the blocks
    A wrote through as soon as its agent heard them."""
    a, b = shared.engine(), shared.engine()
    keeper = b.leader._keeper  # noqa: SLF001
    keeper.period_s = 3600.0  # no idle tick from here on (each one asks the period anew)...
    with b.leader._lock:  # noqa: SLF001 - ...nor one still running
        pass
    ticks, calls = keeper.ticks, b.leader._last_call  # noqa: SLF001
    system = prompt(31, 4 * BS)
    run(a, system + prompt(32, 2))
    wait_for(lambda: len(agent(a).committed_blocks) == 4, "A's write-throughs")
    written = {blk.event_hash for blk in agent(a).committed_blocks}
    wait_for(lambda: b.recorder.hashes("EXTERNAL") == written, "B to advertise A's blocks")
    assert keeper.ticks == ticks and b.leader._last_call == calls  # noqa: SLF001


def test_a_failed_write_on_one_rank_is_never_advertised(shared) -> None:
    a, b = shared.engine(), shared.engine()
    shared.fail_put_keys = "/w2r1/"
    system = prompt(16, 4 * BS)
    run(a, system + prompt(17, 2))
    settle(a, b)
    stats = a.leader.stats()
    assert stats["shared_saves_failed"] == stats["shared_saves_scheduled"] > 0
    assert stats["shared_saves_committed"] == 0
    assert not a.recorder.hashes("EXTERNAL") and not b.recorder.hashes("EXTERNAL")
    probe = LlmRequest(40_000, system + prompt(18, 2))  # asked, never computed by B
    assert b.leader.get_num_new_matched_tokens(probe, 0) == (0, False)
    b.leader.request_finished(probe, [])
    # The next request using A's host copies writes them through from the host tier.
    shared.fail_put_keys = None
    for k in range(6):  # push A's device copies out: the prefix comes from its host tier
        run(a, prompt(200 + k, 7 * BS))
    assert run(a, system + prompt(45, 2)).matched_host_tokens == 4 * BS
    settle(a, b, resident=4)
    assert run(b, system + prompt(46, 2)).matched_shared_tokens == 4 * BS


def test_a_block_in_hand_is_not_written_through_again_before_the_agent_queues_it(
        shared) -> None:
    """The leader hands each batch of commits to the agent, whose thread queues it in its next
    turn: until then the blocks are in the leader's hand, and a request using their host
    copies meanwhile writes none of them through again (the hand-over held here: the agent
    never queues it, so the directory never tracks the blocks)."""
    a = shared.engine()
    held: list[Any] = []
    bus_agent = agent(a)
    hand_over = bus_agent.hand_over
    # Kept, not queued: its ticket is the one the agent's next hand-over answers.
    bus_agent.hand_over = lambda blocks: (held.append(blocks), bus_agent.wakes_handled + 1)[1]
    system = prompt(47, 4 * BS)
    run(a, system + prompt(48, 2))
    wait_for(lambda: a.leader.stats()["shared_saves_committed"] == 4, "4 commits")
    for k in range(6):  # push A's device copies out: the prefix comes from its host tier
        run(a, prompt(210 + k, 7 * BS))
    before = a.leader.stats()["shared_saves_scheduled"]
    assert run(a, system + prompt(49, 2)).matched_host_tokens == 4 * BS
    assert a.leader.stats()["shared_saves_scheduled"] == before  # all four in hand
    assert not a.leader._shared.directory.is_tracked(chain_digests(system, BS, None)[0])
    for blocks in held:  # the agent takes them after all: tracked, confirmed
        hand_over(blocks)
    settle(a, resident=4)
    run(a, prompt(216, 2 * BS))  # its batch of reports forgets what the agent queued since
    assert not set(chain_digests(system, BS, None)) & set(a.leader._shared._in_hand)


def test_a_dropped_write_is_counted_and_never_advertised(shared) -> None:
    a, b = shared.engine(**{cc.SHARED_QUEUE_BLOCKS: "1"}), shared.engine()
    system = prompt(19, 5 * BS)
    run(a, system + prompt(20, 2))
    settle(a, b)
    dropped = sum(r.stats()["shared_writes_dropped"] for r in a.ranks)
    assert dropped > 0
    stats = a.leader.stats()
    assert stats["shared_saves_failed"] >= stats["shared_writes_dropped"] > 0
    committed = {blk.digest for blk in agent(a).committed_blocks}
    digests = chain_digests(system, BS, None)
    # The run's blocks that every rank wrote are committed beside those dropped; none is
    # left in flight.
    assert 0 < len(committed) < len(digests)
    assert stats["shared_writes_inflight"] == 0
    # Only a prefix of the chain is advertised, and B loads no more than that prefix.
    offered = len(b.leader._shared.directory)
    assert b.recorder.hashes("EXTERNAL") == {blk.event_hash for blk in
                                             b.leader._shared.directory.blocks()}
    got = run(b, system + prompt(21, 2))
    assert got.matched_shared_tokens == offered * BS < 5 * BS


def test_a_block_loaded_back_from_the_host_tier_is_written_through_if_the_shared_tier_lacks_it(
        shared) -> None:
    """Its write-through failed when it was offloaded: the next request that loads its host
    copy back writes it through (the offload planner passes a match's host run in one step,
    and asks the shared tier about the run at once)."""
    a, b = shared.engine(), shared.engine()
    system = prompt(60, 4 * BS)
    digests = chain_digests(system, BS, None)
    shared.fail_put_keys = ""  # every put fails: nothing of it reaches the shared tier
    run(a, system + prompt(61, 2))
    settle(a)
    assert a.leader.stats()["shared_saves_failed"] >= 4
    assert not any(a.leader._shared.directory.is_tracked(d) for d in digests)  # noqa: SLF001
    shared.fail_put_keys = None
    for k in range(6):  # push A's GPU copies out (the host copies stay)
        run(a, prompt(200 + k, 7 * BS))
    got = run(a, system + prompt(62, 2))
    assert got.matched_host_tokens == 4 * BS and got.matched_shared_tokens == 0
    settle(a)
    wait_for(lambda: all(b.leader._shared.directory.lookup(d) is not None  # noqa: SLF001
                         for d in digests), "B to hear of the blocks written through")
    assert run(b, system + prompt(63, 2)).matched_shared_tokens == 4 * BS


@pytest.mark.parametrize("writer,reader", [("t1", "t2"), ("t1", None), (None, "t1")])
def test_tenants_never_load_each_others_blocks(shared, writer, reader) -> None:
    a, b = shared.engine(), shared.engine()
    system = prompt(22, 4 * BS)
    run(a, system + prompt(23, 2), salt=writer)
    settle(a, b, resident=4)
    assert run(b, system + prompt(24, 2), salt=reader).matched_shared_tokens == 0
    assert run(b, system + prompt(25, 2), salt=writer).matched_shared_tokens == 4 * BS


@pytest.mark.parametrize("lora", [0, 1])
def test_an_adapter_never_matches_the_base_models_blocks(shared, lora) -> None:
    a, b = shared.engine(), shared.engine()
    system = prompt(26, 4 * BS)
    run(a, system + prompt(27, 2))
    settle(a, b, resident=4)
    tokens = system + prompt(28, 2)
    request = LlmRequest(10_000 + lora, tokens, lora_task_id=lora)
    assert request_scope(request) == f"lora:{lora}"
    assert b.leader.get_num_new_matched_tokens(request, 0) == (0, False)
    base = LlmRequest(20_000, tokens)
    assert b.leader.get_num_new_matched_tokens(base, 0) == (4 * BS, True)
    b.leader.request_finished(base, [])  # releases the pins of the unbound plan
    assert b.leader._shared.directory.stats()["pinned"] == 0


# ------------------------------------------------------------------ faults, with SharedAgent

real_agents = pytest.mark.parametrize("shared", ["real"], indirect=True)


@real_agents
def test_the_real_agents_carry_a_prefix_across_engines(shared) -> None:
    a = shared.engine()
    b = shared.engine()  # subscribed to A's announcements
    system = prompt(30, 5 * BS)
    run(a, system + prompt(31, 2))
    settle(a)
    wait_for(lambda: len(b.leader._shared.directory) >= 5, "B to confirm A's blocks")
    settle(b)
    assert run(b, system + prompt(32, 2)).matched_shared_tokens == 5 * BS
    assert b.recorder.hashes("EXTERNAL") >= {blk.event_hash
                                             for blk in a.leader._shared.directory.blocks()}


@pytest.mark.parametrize("shared", ["bus", "real"], indirect=True)
def test_the_agent_is_woken_once_per_batch_of_reports_not_once_per_block(shared) -> None:
    """A request's write-throughs are committed by one batch of reports: the leader wakes the
    agent's thread once for them (a wake-up is a write to its pipe, and the thread it wakes
    takes the GIL from the executor thread), and the blocks still become resident."""
    eng = shared.engine()
    a = agent(eng)
    wakes: list[int] = []
    wake = a.wake

    def counted() -> int:
        wakes.append(1)
        return wake()

    a.wake = counted
    run(eng, prompt(40, 16 * BS + 1))
    # The saves' last reports may still be on their way ("saving"): the idle keeper applies them.
    wait_for(lambda: eng.leader.stats()["shared_saves_committed"] == 16, "16 commits",
             timeout=30)
    assert 1 <= len(wakes) <= 16 // 4, len(wakes)
    wait_for(lambda: len(eng.leader._shared.directory) >= 16, "the blocks to become resident",
             timeout=30)


@real_agents
def test_a_multimodal_prefix_crosses_engines_with_its_items_digests(shared) -> None:
    """A multimodal block's shared copy is advertised, by its writer and by the engine that
    heard its announcement, with the items' digests in extra_keys (its GPU copy's identity),
    and loads on the other engine for a request with the same image."""
    from kvbm_plugin.naming.names import mm_hash_bytes
    from kvbm_plugin.wire.identity import mm_marker

    a = shared.engine()
    b = shared.engine()
    parts = [0x0A0B0C0D + k for k in range(8)]
    digest = mm_marker(mm_hash_bytes(parts).hex())  # as every stream spells it
    tokens = prompt(40, BS) + [999] * (2 * BS) + prompt(41, 2 * BS)
    image = [(parts, [(BS, 2 * BS)])]  # blocks 1 and 2
    req = a.submit(tokens + prompt(42, 2), 2, multimodal=image)
    a.run_until_idle()
    assert a.result(req).kv_mismatches == 0
    settle(a)
    wait_for(lambda: len(b.leader._shared.directory) >= 5, "B to confirm A's blocks")
    settle(b)
    for eng in (a, b):
        extras = [scope.get("extra_keys") for tier, *_, scope in eng.recorder.stores
                  if tier == "EXTERNAL"]
        assert extras.count((digest,)) == 2 and extras.count(None) == 3, extras
    req = b.submit(tokens + prompt(43, 2), 2, multimodal=image)
    b.run_until_idle()
    assert b.result(req).kv_mismatches == 0
    assert b.leader.stats()["matched_shared_tokens"] == 5 * BS


@real_agents
def test_eviction_between_match_and_load_cannot_take_a_leased_block(shared) -> None:
    a = shared.engine()
    b = shared.engine()
    system = prompt(33, 4 * BS)
    run(a, system + prompt(34, 2))
    settle(a)
    wait_for(lambda: len(b.leader._shared.directory) >= 4, "B to confirm A's blocks")
    tokens = system + prompt(35, 2)
    request = LlmRequest(30_000, tokens)
    assert b.leader.get_num_new_matched_tokens(request, 0) == (4 * BS, True)
    # The store evicts whatever it may now: the confirmed (leased) objects stay.
    assert not [k for k in shared.store.evict_unleased() if "/w2r" in k
                and any(d.hex() in k for d in chain_digests(system, BS, None))]
    b.leader.request_finished(request, [])
    assert run(b, tokens).matched_shared_tokens == 4 * BS
    assert b.stats().kv_mismatches == 0


@real_agents
def test_a_promised_load_whose_object_is_gone_fails_counted(shared, expect_errors) -> None:
    a = shared.engine()
    b = shared.engine()
    system = prompt(36, 4 * BS)
    run(a, system + prompt(37, 2))
    settle(a)
    wait_for(lambda: len(b.leader._shared.directory) >= 4, "B to confirm A's blocks")
    digests = chain_digests(system, BS, None)
    # What a master restart does: every object gone at once, leases or not.
    stored = shared.store.keys()  # (a list of the object keys)
    shared.store.evict([k for k in stored if any(d.hex() in k for d in digests[2:])])
    before = b.leader.stats()
    b.submit(system + prompt(38, 2), 2)
    b.run_until_idle()
    after = b.leader.stats()
    assert after["shared_loads_failed"] - before["shared_loads_failed"] == 2
    assert after["loads_failed"] - before["loads_failed"] == 2
    assert sum(r.stats()["shared_loads_failed"] for r in b.ranks) == 4  # 2 blocks x 2 ranks
    assert not expect_errors.thread_exceptions
    # Recomputed (handle_load_errors), never computed on the blocks nobody filled.
    assert b.stats().recomputed_requests == 1 and b.stats().kv_mismatches == 0


def test_a_load_that_raises_is_reported_failed_and_recomputed_not_left_waiting(
        shared, monkeypatch, expect_errors) -> None:  # noqa: ANN001
    a = shared.engine()
    b = shared.engine()
    system = prompt(52, 4 * BS)
    run(a, system + prompt(53, 2))
    settle(a, b, resident=4)

    def broken_check(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug in the reader")

    # Raised inside the reader's load (not a refusal): every op must still be reported.
    monkeypatch.setattr(frame, "check", broken_check)
    before = b.leader.stats()
    req = b.submit(system + prompt(54, 2), 2)
    b.run_until_idle(timeout_s=20.0)  # the old reader left the ops unreported: TimeoutError
    after = b.leader.stats()
    assert after["matched_shared_tokens"] - before["matched_shared_tokens"] == 4 * BS
    assert sum(r.stats()["shared_loads_failed"] for r in b.ranks) == 8  # 4 blocks x 2 ranks
    assert b.result(req).state in ("done", "saving")
    assert b.stats().recomputed_requests == 1 and b.stats().kv_mismatches == 0
    assert any("shared-tier load of 4 blocks raised" in r.getMessage()
               for r in expect_errors.records)


@pytest.mark.parametrize("where", [5, frame.HEADER_BYTES + 3], ids=["header", "payload"])
def test_a_flipped_byte_in_a_shared_object_is_recomputed_and_the_key_repaired(
        shared, where) -> None:  # noqa: ANN001
    a = shared.engine()
    b = shared.engine()
    system = prompt(48, 4 * BS)
    run(a, system + prompt(49, 2))
    settle(a, b, resident=4)
    stored = shared.store.keys()  # (a list of the object keys)
    key = next(k for k in stored if "/w2r1/" in k
               and chain_digests(system, BS, None)[2].hex() in k)
    good = shared.store.get_bytes(key)
    bad = bytearray(good)
    bad[where] ^= 0x01
    shared.store.replace_bytes(key, bytes(bad))
    got = run(b, system + prompt(50, 2))  # run() checks every block's KV on every rank
    assert got.matched_shared_tokens == 4 * BS
    assert b.stats().recomputed_requests == 1 and b.stats().kv_mismatches == 0
    rank1 = b.ranks[1].stats()
    assert rank1["shared_loads_corrupt"] == 1 and rank1["shared_objects_removed"] == 1
    assert shared.store.get_bytes(key) is None  # removed: the next correct write stores it
    assert shared.store.put_bytes(key, good) is None and shared.store.get_bytes(key) == good


def test_a_worker_whose_breaker_is_still_open_reads_what_its_leader_promised(
        shared, monkeypatch) -> None:  # noqa: ANN001
    """After an outage each client's circuit breaker closes on its own schedule: the leader's
    agent can see the store back while a worker's breaker still waits for its next probe. A
    shared load the leader promised then must still be read, not failed at once (it would
    leave the request computing on blocks nobody filled)."""
    from kvbm_plugin.tiers.shared.breaker import GuardedStore

    plain = shared_io.open_store
    workers: list[GuardedStore] = []

    def guarded_open(settings: Any, *, segment_bytes: int | None = None) -> Any:
        store = plain(settings, segment_bytes=segment_bytes)
        if segment_bytes == 0:
            return store  # the leader's agent
        guarded = GuardedStore(store, backoff_s=3600.0)  # no probe during this test
        workers.append(guarded)
        return guarded

    monkeypatch.setattr(shared_io, "open_store", guarded_open)
    a = shared.engine()
    b = shared.engine()
    b_workers = workers[len(workers) // 2:]
    assert len(b_workers) == 2  # TP 2
    system = prompt(45, 4 * BS)
    run(a, system + prompt(46, 2))
    settle(a)
    wait_for(lambda: len(b.leader._shared.directory) >= 4, "B to confirm A's blocks")
    shared.store.down = True  # a blip only B's workers saw: their breakers open
    for guarded in b_workers:
        for _ in range(3):
            guarded.exists(["probe"])
        assert not guarded.available
    shared.store.down = False
    got = run(b, system + prompt(47, 2))  # run() checks the onboarded bytes
    assert got.matched_shared_tokens == 4 * BS
    assert b.leader.stats()["shared_loads_failed"] == 0
    assert all(g.available for g in b_workers)  # the read found the store back


@real_agents
def test_the_store_going_down_leaves_the_local_tiers_and_comes_back(shared) -> None:
    # The agents see the store go and come back at their renewal sweeps (every lease / 3):
    # a 3 s lease makes that about a second each, not the default 10 s lease's 3.3 s.
    short = {cc.SHARED_LEASE_S: "3", cc.SHARED_LOAD_MARGIN_S: "1"}
    a = shared.engine(**short)
    b = shared.engine(**short)
    shared.store.down = True
    system = prompt(39, 4 * BS)
    run(a, system + prompt(40, 2))  # the host tier works; every write-through fails
    wait_for(lambda: not agent(a).available, "A's agent to see the store down")
    got = run(a, system + prompt(41, 2))
    assert got.result.gpu_hit_tokens + got.matched_host_tokens >= 4 * BS
    assert got.matched_shared_tokens == 0
    assert not a.recorder.hashes("EXTERNAL") and not b.recorder.hashes("EXTERNAL")
    failed = a.leader.stats()["shared_saves_failed"] + \
        a.leader.stats()["shared_saves_skipped_unavailable"]
    assert failed > 0
    shared.store.down = False  # the store is back: the next write-throughs land
    wait_for(lambda: agent(a).available and agent(b).available, "the agents to see it back")
    other = prompt(42, 4 * BS)
    run(a, other + prompt(43, 2))
    settle(a)
    wait_for(lambda: len(b.leader._shared.directory) >= 4, "B to confirm A's new blocks")
    assert run(b, other + prompt(44, 2)).matched_shared_tokens == 4 * BS


def test_a_shared_tier_without_a_host_tier_is_refused_naming_both(make_engine) -> None:
    env = tiers(disk=16, **{cc.SHARED_TIER: "memory", cc.SHARED_MODEL_KEY: "test-model"})
    with pytest.raises(cc.ConfigError, match=f"{cc.SHARED_TIER}='memory' writes through the "
                       f"host tier.*{cc.CPU_CACHE_GB}"):
        make_engine(num_gpu_blocks=16, env=env)


@pytest.mark.parametrize("shared", ["real"], indirect=True)
def test_with_the_consolidator_the_agent_thread_registers_external_blocks(
        shared: SimpleNamespace, make_engine: Any, tmp_path: Any) -> None:
    """The in-process consolidator's register_* are thread-safe: the agent's own thread
    registers the blocks it made resident (EXTERNAL), never TensorRT-LLM's executor thread
    nor the leader's idle keeper (whose tick holds the leader's lock)."""
    secret = tmp_path / "announce.secret"
    secret.write_text("a-test-deployment-secret-of-32-bytes\n")
    env = {**tiers(host=64), cc.ENABLE_CONSOLIDATOR: "true",
           cc.EVENTS_ENDPOINT: f"ipc://{tmp_path}/gpu", cc.REPLAY_ENDPOINT: f"ipc://{tmp_path}/r",
           cc.OUTPUT_ENDPOINT: f"ipc://{tmp_path}/out",
           cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp_path}/out-r",
           cc.SHARED_TIER: "memory", cc.SHARED_MODEL_KEY: "test-model",
           cc.SHARED_ANNOUNCE_ENDPOINT: f"ipc://{tmp_path}/announce",
           cc.SHARED_ANNOUNCE_SECRET_FILE: str(secret)}
    eng = make_engine(num_gpu_blocks=32, tp_size=2, tokens_per_block=BS, env=env)
    wait_for(lambda: agent(eng) is not None, "the agent to start")
    consolidator = eng.leader.consolidator
    assert consolidator is not None
    threads: list[str] = []
    register = consolidator.register_store

    def spy(tier: str, *args: Any, **kwargs: Any) -> None:
        if tier == "EXTERNAL":
            threads.append(threading.current_thread().name)
        register(tier, *args, **kwargs)

    consolidator.register_store = spy
    eng.submit(prompt(1, 4 * BS + 1), 1)
    eng.run_until_idle()
    wait_for(lambda: len(threads) >= 4, "the agent to register A's four blocks")
    assert set(threads) == {"kvbm-shared-agent"}, threads
    # counted just after each registration returns (the spy saw the call before that)
    wait_for(lambda: eng.leader.stats()["shared_stores_registered"] == len(threads),
             "the agent to count its registrations")

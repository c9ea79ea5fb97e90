"""Prefix-closed tiers and GPU stream: every block a tier or the GPU pool keeps can be reused.

A tier never holds a block whose parent is resident nowhere; the tiers and the simulated
executor's GPU pool evict leaves first, and their event streams, read by the router model
(:class:`~kvbm_plugin.routers.router_view.RouterView`), never store under an unknown parent
nor remove a parent before its descendants.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
from _depth import depths, run_examples
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbm_plugin.consolidator_config import PublisherSettings
from kvbm_plugin.event_sink import KvEventSink
from kvbm_plugin.leader import offload_tiers
from kvbm_plugin.routers.router_view import WARNING_RULES, RouterView
from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine
from kvbm_plugin.tiers.index import TierFullError, TierIndex
from kvbm_plugin.wire.events import (
    BlockRemoved,
    BlockStored,
    decode_event,
    events_as_maps,
)
from kvbm_plugin.wire.publisher_base import EventPublisher

OFF = {"DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "false"}


# ---------------------------------------------------------------- the tier index on its own

class _ModelEntry:
    def __init__(self, parent: int | None) -> None:
        self.parent = parent
        self.resident = False
        self.pins = 0
        self.tick = 0


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 8))
def test_tier_index_evicts_the_lru_leaf_and_stays_prefix_closed(seed: int, capacity: int) -> None:
    """Random reserve/commit/lookup/pin/unpin/evict ahead/discard against a brute-force model
    (60 examples x 150 steps): the victim is always the least recently used resident, unpinned
    leaf, and every entry's parent is in the tier."""
    rng = random.Random(seed)
    index = TierIndex("host", capacity)
    model: dict[int, _ModelEntry] = {}
    clock = 0
    next_key = 1

    def leaf(key: int) -> bool:
        return not any(e.parent == key for e in model.values())

    for _ in range(150):
        op = rng.random()
        keys = list(model)
        if op < 0.4:
            parent = rng.choice([None, *keys]) if keys else None
            key, next_key = next_key, next_key + 1
            candidates = [k for k, e in model.items() if e.resident and not e.pins and leaf(k)
                          and k != parent]
            full = len(model) >= capacity
            try:
                entry, evicted = index.reserve(key, key, parent, [key], parent)
            except TierFullError:
                assert full and not candidates
                continue
            assert entry.parent_key == parent
            if full:
                want = min(candidates, key=lambda k: model[k].tick)
                assert evicted is not None and evicted.key == want
                del model[want]
            else:
                assert evicted is None
            model[key] = _ModelEntry(parent)
        elif op < 0.6 and keys:
            key = rng.choice(keys)
            if not model[key].resident:
                parent = model[key].parent
                if parent is None or model[parent].resident:
                    index.commit(key)
                    clock += 1
                    model[key].resident = True
                    model[key].tick = clock
        elif op < 0.75 and keys:
            key = rng.choice(keys)
            hit = index.lookup(key)
            assert (hit is not None) == model[key].resident
            if hit is not None:
                clock += 1
                model[key].tick = clock
        elif op < 0.85 and keys:
            key = rng.choice(keys)
            entry = index.get(key)
            assert entry is not None
            if model[key].pins and rng.random() < 0.6:
                index.unpin(entry)
                model[key].pins -= 1
            elif model[key].resident:
                index.pin(entry)
                model[key].pins += 1
        elif op < 0.9:
            # Eviction ahead of need (the keeper's): the same victims, in the same order, as
            # reservations would take; each one's row still in place when it is handed over.
            spare, most = rng.randrange(capacity + 2), rng.randrange(1, 4)
            want = min(spare - (capacity - len(model)), most)
            expected = []
            while len(expected) < want:
                candidates = [k for k, e in model.items() if e.resident and not e.pins
                              and leaf(k)]
                if not candidates:
                    break
                victim = min(candidates, key=lambda k: model[k].tick)
                expected.append(victim)
                del model[victim]
            seen: list[int] = []
            done = index.evict_ahead(spare, most,
                                     lambda ix, slot, seen=seen: seen.append(ix.evicting(slot)[0]))
            assert seen == expected and done == len(expected)
        elif keys:
            key = rng.choice(keys)
            gone = [e.key for e in index.discard(key)]
            subtree = {key}
            changed = True
            while changed:
                more = {k for k, e in model.items() if e.parent in subtree} - subtree
                changed = bool(more)
                subtree |= more
            assert set(gone) == subtree
            for position, k in enumerate(gone):  # children before parents
                assert all(model[c].parent != k for c in gone[position + 1:])
            for k in subtree:
                del model[k]
        assert {e.key for e in index.entries()} == set(model)
        # The eviction order holds the evictable entries and nothing else (no stale items).
        assert index.evictable() == sum(1 for k, e in model.items()
                                        if e.resident and not e.pins and leaf(k))
        for entry in index.entries():
            assert entry.parent_key is None or index.get(entry.parent_key) is not None
            if entry.resident and entry.parent_key is not None:
                assert index.get(entry.parent_key).resident


def test_a_pinned_leaf_keeps_its_chain_and_the_parent_is_evicted_after_its_child() -> None:
    index = TierIndex("host", 3)
    for key, parent in ((1, None), (2, 1), (3, 2)):
        index.reserve(key, key, parent, [key], parent)
        index.commit(key)
    index.pin(index.get(3))
    with pytest.raises(TierFullError):  # 3 pinned; 1 and 2 are its ancestors
        index.reserve(4, 4, None, [4])
    index.unpin(index.get(3))
    _, evicted = index.reserve(4, 4, None, [4])
    assert evicted is not None and evicted.key == 3  # the leaf, although 1 is older
    index.commit(4)
    _, evicted = index.reserve(5, 5, None, [5])
    assert evicted is not None and evicted.key == 2  # its parent, a leaf now, at its own age
    with pytest.raises(ValueError, match="not in the tier"):
        index.reserve(6, 6, 3, [6], 3)


# ---------------------------------------------------------------- the whole engine


class _TierRecorder:
    """Stands where the consolidator stands: feeds the leader's tier registrations to the
    router model (:class:`RouterView`: one flat map per lower tier, each checked for
    prefix closure on its own)."""

    def __init__(self, router: RouterView) -> None:
        self.router = router

    def register_store(self, tier: str, dp_rank: int, block_hash: int, parent_hash: int | None,
                       token_ids: Any, block_size: int) -> None:
        self.router.apply_event(BlockStored([block_hash], parent_hash, list(token_ids),
                                            block_size, medium=tier), "engine", dp_rank)

    def register_remove(self, tier: str, dp_rank: int, block_hashes: Any) -> None:
        self.router.apply_event(BlockRemoved(list(block_hashes), medium=tier), "engine",
                                dp_rank)

    def register_clear(self, tier: str, dp_rank: int) -> None:
        raise AssertionError("no tier is cleared in this test")


def _gpu_stream(engine: SimulatedEngine) -> list[dict[str, Any]]:
    """Every event the simulated GPU pool's readers take (TensorRT-LLM's readable queue), as
    they take it (before the sink). Tapped at the take, not at the emit: the pool coalesces a
    removal into its last event not yet taken, so an event seen when emitted can still grow
    (a tap at the emit lost those removals whenever a free came after the iteration's flush)."""
    log: list[dict[str, Any]] = []
    take = engine.pool.take_events

    def taking() -> list[dict[str, Any]]:
        out = take()
        log.extend(event["data"] for event in out)
        return out

    engine.pool.take_events = taking  # type: ignore[method-assign]
    return log


class _Published(EventPublisher):
    """Keeps what the event sink publishes, as wire maps."""

    def __init__(self) -> None:
        super().__init__(PublisherSettings())
        self.events: list[dict[str, Any]] = []

    def publish(self, events: Any, data_parallel_rank: int | None = None) -> bool:
        self.events.extend(events_as_maps(events))
        return True

    def shutdown(self, timeout: float = 5.0) -> None:
        pass


def _warnings(view: RouterView) -> dict[str, dict[str, int]]:
    """The router rules each medium's stream broke: the tiers' streams, and the GPU-tier
    stream the event sink made of the pool's events (a store under a parent the router does
    not hold, an unknown or cutting removal, a re-store or alias)."""
    return {medium: {r: n for r, n in rules.items() if r in WARNING_RULES and n}
            for medium, rules in view.by_medium.items()
            if any(n for r, n in rules.items() if r in WARNING_RULES)}


def _apply_gpu(router: RouterView, sink: KvEventSink, published: _Published,
               events: list[dict[str, Any]]) -> None:
    """Feed the GPU pool's events (TensorRT-LLM's form) through the plugin's event sink, and
    what it publishes to the router's device tree: the GPU-tier stream a router reads (full
    blocks only; a removal whose block still has published children after those children)."""
    sink.ingest([{"event_id": i, "data": data, "window_size": 4096}
                 for i, data in enumerate(events)])
    sink.flush()
    for raw in published.events:
        router.apply_event(decode_event(raw), "engine")
    published.events.clear()
    events.clear()


def _check_closed(engine: SimulatedEngine) -> None:
    # Under the leader's lock, as a hook reads the tiers: the keeper thread applies the
    # workers' reports between iterations (commits, demotions, drops), and a read without the
    # lock once saw an entry leave its tier half-way through (a detached view whose parent
    # was gone: a CI-like run, once).
    with engine.leader._lock:  # noqa: SLF001
        _check_closed_locked(engine)


def _check_closed_locked(engine: SimulatedEngine) -> None:
    leader = engine.leader
    pool = engine.pool
    gpu = set(pool.hash_of.values())
    for block, parent in pool.parent_of.items():  # the GPU pool's own tree
        assert parent is None or parent in pool.hash_of, f"GPU block {block} orphaned"
    resident: set[int] = set(gpu)
    tiers = [t for t in (leader._tiers.host, leader._tiers.disk) if t is not None]
    for tier in tiers:
        resident |= {e.event_hash for e in tier.resident_entries()}
    for tier in tiers:
        for entry in tier.entries():
            if entry.parent_key is None:
                continue
            parent = tier.get(entry.parent_key)
            assert parent is not None, f"{tier.name}: {entry.key:#x} without its parent"
            if entry.resident:
                assert parent.resident, f"{tier.name}: {entry.key:#x} resident, parent pending"
                # The invariant: the parent is resident somewhere.
                assert entry.parent_event_hash in resident


def _workload_step(rng: random.Random, engine: SimulatedEngine, prompts: list[list[int]],
                   live: list[int]) -> None:
    bs = engine.block_size
    for _ in range(rng.choice((0, 0, 1, 1, 2))):
        roll = rng.random()
        if roll < 0.5 and prompts:  # a later turn: an earlier prompt plus more tokens
            base = rng.choice(prompts)[: rng.randrange(1, 7) * bs]
        else:  # a new conversation under one of a few shared system prompts
            system = rng.randrange(4)
            base = [1000 + system * 50 + i for i in range(rng.randrange(1, 4) * bs)]
        tokens = base + [rng.randrange(1, 900) for _ in range(rng.randrange(1, 3 * bs))]
        tokens = tokens[: 9 * bs]
        prompts.append(tokens)
        if len(prompts) > 40:
            prompts.pop(rng.randrange(len(prompts)))
        live.append(engine.submit(tokens, rng.randrange(1, 6)))
    if live and rng.random() < 0.05:
        engine.abort(live.pop(rng.randrange(len(live))))
    engine.step()


@depths(quick=2, thorough=6)
def test_tiers_and_gpu_pool_stay_prefix_closed_under_random_workloads(
        caplog: pytest.LogCaptureFixture, examples: int) -> None:
    """Random multi-turn workloads (2, or 6 in the slow set) x 350 engine iterations, tiers
    under eviction pressure: after every iteration every tier-resident block's parent is
    resident somewhere, each tier is prefix-closed on its own, and the GPU pool's and the
    tiers' event streams are clean for the router model (no rule warning: no store under a
    parent it does not hold, no unknown or cutting removal, no re-store or alias), ending equal
    to what each holds."""
    run_examples(examples, lambda seed, host, disk: _random_workload(caplog, seed, host, disk),
                 seed=st.integers(0, 2**32), host=st.sampled_from((0, 6, 10)),
                 disk=st.sampled_from((0, 8, 16)))


@pytest.mark.parametrize("disk", [0, 8], ids=["host-only", "host-and-disk"])
@depths(quick=1, thorough=3)
def test_eviction_ahead_keeps_the_tiers_and_the_router_view_exact(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, examples: int,
        disk: int) -> None:
    """The same random workloads with the keeper evicting ahead of need in tiers of any size
    (in a deployment only from 16,384 blocks) and, where a disk tier is behind the host tier,
    demoting the host tier's next victims to disk ahead of need and evicting from the host tier
    those the disk holds: every tier stays prefix-closed, the router's view equal to what each
    tier holds, nothing is left in flight once the engine idles (a demotion made ahead after
    the last metadata is withdrawn at the idle tick; one left waiting would time the engine's
    idle wait out), and both ran."""
    monkeypatch.setattr(offload_tiers, "EVICT_AHEAD_MIN_CAPACITY", 1)
    monkeypatch.setattr(offload_tiers, "EVICT_AHEAD_SLOTS", 3)
    monkeypatch.setattr(offload_tiers, "EVICT_AHEAD_STEP", 2)
    monkeypatch.setattr(offload_tiers, "DEMOTE_AHEAD_VICTIMS", 2)
    done: dict[str, list[int]] = {"evict_ahead": [], "demote_ahead": []}
    for name, counts in done.items():
        original = getattr(offload_tiers.OffloadTiers, name)

        def counted(self: Any, _original: Any = original, _counts: list[int] = counts) -> int:
            n = _original(self)
            _counts.append(n)
            return n

        monkeypatch.setattr(offload_tiers.OffloadTiers, name, counted)
    run_examples(examples, lambda seed, host: _random_workload(caplog, seed, host, disk),
                 seed=st.integers(0, 2**32), host=st.sampled_from((6, 10)))
    assert sum(done["evict_ahead"]) > 0
    assert (sum(done["demote_ahead"]) > 0) == bool(disk)


def _random_workload(caplog: pytest.LogCaptureFixture, seed: int, host: int, disk: int) -> None:
    if not host and not disk:
        host = 6
    env = dict(OFF)
    if host:
        env["DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS"] = str(host)
    if disk:
        env["DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS"] = str(disk)
    router = RouterView(8)  # the block size is the engine's; set below
    recorder = _TierRecorder(router)
    rng = random.Random(seed)
    engine = SimulatedEngine(EngineConfig(num_gpu_blocks=20, max_num_tokens=24, max_batch_size=4,
                                          env=env, tier_events=recorder))
    try:
        gpu_events = _gpu_stream(engine)
        router.block_size = bs = engine.block_size
        published = _Published()
        sink = KvEventSink(published, block_size=bs, strict=True)
        prompts: list[list[int]] = []
        live: list[int] = []
        for _ in range(350):
            _workload_step(rng, engine, prompts, live)
            _check_closed(engine)
            _apply_gpu(router, sink, published, gpu_events)
            assert _warnings(router) == {}, router.by_medium
        engine.run_until_idle(timeout_s=60)
        _check_closed(engine)
        engine.pool.take_events()  # the idle engine's last frees, after its last flush
        _apply_gpu(router, sink, published, gpu_events)
        assert _warnings(router) == {}, router.by_medium

        def held(tier: str) -> set[int]:
            return {h for _, h in router.edges().get(("engine", 0, tier), set())}

        pool = engine.pool
        u64 = (1 << 64) - 1
        assert {h & u64 for h in held("GPU")} == {pool.hash_of[b] & u64 for b in pool.full
                                                 if b in pool.hash_of}
        assert held("CPU") == engine.leader.resident_hashes("host")
        assert held("DISK") == engine.leader.resident_hashes("disk")
        assert engine.stats().kv_mismatches == 0
        # A load job with disk copies only (no host copy) runs without a worker error.
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        engine.shutdown()

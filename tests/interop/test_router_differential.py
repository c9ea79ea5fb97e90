"""The router model against the real router: the same streams into
:class:`~kvbm_plugin.routers.router_view.RouterView` and NVIDIA Dynamo's own indexer
(tests/interop/_feed.py), which must agree on every block held per worker, dp rank and tier
(``/dump``: parent and hash of each) and on the warnings (the indexer's "Failed to find parent
block" and "Failed to find block to remove" lines against the view's ``skipped_stores`` and
``unknown_removes``).

Two kinds of stream: hand-made ones, each hitting one rule (aliases, a moved hash, a missing
parent, a cut subtree, clears, tiers), and streams recorded from the simulated engine (GPU-tier
and consolidated, dedup and passthrough, two tenants), as they are and broken the ways a
publisher can break them (the salt left out, a batch lost).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _feed import Step, compare, feed_indexer, feed_view
from _kvwire import wait_all_sent

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.routers.dynamo_indexer import Indexer
from kvbm_plugin.routers.router_view import RouterView
from kvbm_plugin.testing.chat_workload import TurnWaves, drive
from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine
from kvbm_plugin.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvbm_plugin.wire.identity import SALT_TAG
from kvbm_plugin.wire.subscriber import StreamSubscriber

BS = 2
A, B, A1 = (1, 0), (2, 0), (1, 1)  # (worker, dp rank) streams


def t(*blocks: int) -> list[int]:
    """Tokens of blocks whose content is named by one int each."""
    return [x for b in blocks for x in (b, b + 1000)]


def st(hashes: list[int], parent: int | None, blocks: list[int] | None = None,
       **kw: Any) -> BlockStored:
    return BlockStored(hashes, parent, t(*(hashes if blocks is None else blocks)), BS, **kw)


def rm(*hashes: int, medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved(list(hashes), medium)


# name -> (steps, the view's counters the scenario must trigger)
HAND_MADE: dict[str, tuple[list[Step], dict[str, int]]] = {
    "second worker's alias: store under it skipped, removal a no-op": (
        [(A, [st([100, 101], None, [1, 2])]), (B, [st([200, 201], None, [1, 2])]),
         (B, [st([202], 201, [3])]), (B, [rm(201)])],
        {"alias_blocks": 2, "skipped_stores": 1, "alias_removes": 1}),
    "an alias cannot remove the first hash": (
        [(A, [st([100, 101], None, [1, 2])]), (B, [st([200, 201], None, [1, 2])]),
         (B, [rm(200)]), (B, [rm(100)])],
        {"alias_blocks": 2, "alias_removes": 1, "unknown_removes": 1}),
    "alias across dp ranks of one worker": (
        [(A, [st([100], None, [1])]), (A1, [st([110], None, [1])]), (A1, [st([111], 110, [2])])],
        {"alias_blocks": 1, "skipped_stores": 1}),
    "own alias; removing the first hash ends both": (
        [(A, [st([100], None, [1]), st([110], None, [1])]), (A, [st([111], 110, [2])]),
         (A, [st([112], 100, [3])]), (A, [rm(100)])],
        {"alias_blocks": 1, "skipped_stores": 1}),
    "an alias extended past the first worker's chain": (
        [(A, [st([100, 101], None, [1, 2])]), (B, [st([200, 201, 202], None, [1, 2, 3])]),
         (B, [st([203], 202, [4]), rm(201)])],
        {"alias_blocks": 2, "alias_removes": 1}),
    "the first worker leaves, the alias keeps its coverage": (
        [(A, [st([100, 101], None, [1, 2])]), (B, [st([200, 201], None, [1, 2])]),
         (A, [rm(101), rm(100)]), (B, [st([202], 201, [3])])],
        {"alias_blocks": 2, "skipped_stores": 1}),
    "a prefix alias outlives the first worker": (
        [(A, [st([100, 101], None, [1, 2])]), (B, [st([200], None, [1])]),
         (A, [rm(101), rm(100)]), (B, [st([201], 200, [2])]), ((3, 0), [st([300], None, [1])])],
        {"alias_blocks": 2, "skipped_stores": 1}),
    "a content nobody holds any more is named anew": (
        [(A, [st([100, 101], None, [1, 2])]), (A, [rm(100)]), (B, [st([200, 201], None, [1, 2])])],
        {"cut_subtrees": 1}),
    "a re-stored hash moves; the old node cannot be removed": (
        [(A, [st([100], None, [1])]), (A, [st([100], None, [2])]), (A, [st([101], 100, [3])]),
         (A, [rm(100)])],
        {"duplicate_stores": 1}),
    "a moved parent takes its children with it": (
        [(A, [st([100, 101], None, [1, 2])]), (A, [st([101], None, [7])]),
         (A, [st([102], 101, [3])]), (A, [rm(101)])],
        {"duplicate_stores": 1, "cut_subtrees": 1}),
    "a re-store changes nothing, a second removal is unknown": (
        [(A, [st([1, 2], None), st([1, 2], None), st([2], 1)]), (A, [rm(2), rm(2)])],
        {"duplicate_stores": 3, "unknown_removes": 1}),
    "parent missing: the store is skipped whole": (
        [(A, [st([1], None), st([5, 6], 99, [2, 3])]), (A, [st([7], 6, [4])])],
        {"skipped_stores": 2, "skipped_blocks": 3}),
    "a cut edge: stores under it skipped, removals unknown": (
        [(A, [st([1, 2, 3], None)]), (A, [rm(2)]), (A, [st([4], 3, [4])]), (A, [rm(3)]),
         (A, [st([5], 1, [5])])],
        {"cut_subtrees": 1, "skipped_stores": 1, "unknown_removes": 1}),
    "a cut edge restored": (
        [(A, [st([1, 2, 3], None)]), (A, [rm(2)]), (A, [st([2, 3], 1)]), (A, [st([4], 3)])],
        {"cut_subtrees": 1}),
    "cut branches: stores under them accepted and never shown": (
        [(A, [st([1, 2], None), st([3], 2), st([4], 2)]), (A, [rm(2)]), (A, [st([5], 3)]),
         (A, [rm(4)]), (A, [st([6], 1)])],
        {"cut_subtrees": 1, "unreachable_stores": 1}),
    "a clear empties one dp rank": (
        [(A, [st([1], None), st([3], 1)]), (A1, [st([2], None)]), (A, [AllBlocksCleared()]),
         (A, [st([4], 3)]), (A1, [st([5], 2)])],
        {"skipped_stores": 1}),
    "tiers: a lower tier checks no parent, names stay per tier": (
        [(A, [st([1], None), st([2], 1, medium="CPU"), st([3], None, medium="CPU"),
              st([4], 3, medium="DISK"), st([9], 99, medium="CPU"),
              st([11], None, [1], medium="CPU"), st([12], 11, [2], medium="CPU")]),
         (A, [st([5], 3, medium="GPU"), rm(77, medium="CPU"), rm(4, medium="GPU")])],
        {"skipped_stores": 1, "unknown_removes": 1}),
    "lower tier: the first hash for a content is the only one": (
        [(A, [st([11], None, [1], medium="CPU")]),
         (B, [st([21], None, [1], medium="CPU"), st([22], 21, [2], medium="CPU")]),
         (A, [st([12], None, [1], medium="CPU"), st([11], None, [5], medium="CPU")]),
         (A, [rm(11, medium="CPU")])],
        {}),
    "a repeated hash drops the event": (
        [(A, [st([1, 1], None, [1, 2]), st([2, 3], 3), st([5], None)])],
        {"duplicate_hash_drops": 2}),
    "salt and adapter keep equal tokens apart; lora_id alone does not": (
        [(A, [st([1, 2], None, extra_keys=[[SALT_TAG + "aa"], [SALT_TAG + "aa"]]),
              st([3, 4], None, [1, 2], extra_keys=[[SALT_TAG + "bb"], None]),
              st([5, 6], None, [1, 2], lora_name="lora-7"),
              st([7, 8], None, [1, 2])]),
         (B, [st([9], None, [1], extra_keys=[["salt:aa"]])])],
        {"alias_blocks": 1}),
}


@pytest.mark.parametrize("name", list(HAND_MADE))
def test_hand_made_streams(indexer: Indexer, tmp_path: Path, name: str) -> None:
    steps, triggered = HAND_MADE[name]
    _agree(indexer, tmp_path, steps, BS, triggered)


def _agree(indexer: Indexer, tmp: Path, steps: list[Step], block_size: int,
           triggered: dict[str, int] | None = None) -> RouterView:
    feed_indexer(indexer, tmp, steps, block_size)
    view = RouterView(block_size)
    feed_view(view, steps)
    real, ours, real_parent, our_parent = compare(indexer, view)
    assert ours == real
    assert our_parent == real_parent
    assert view.counts.unknown_removes == indexer.count("Failed to find block to remove")
    for rule, n in (triggered or {}).items():
        assert getattr(view.counts, rule) == n, (rule, view.counts.as_dict())
    return view


# ------------------------------------------------------------------ recorded streams

ENGINE_BS = 4


def _record(tmp: Path, mode: str, salts: tuple[str, ...]) -> dict[str, list[EventBatch]]:
    """The GPU-tier and consolidated streams of a chat workload, every batch, in order."""
    env = {
        cc.ENABLE_CONSOLIDATOR: "true", cc.CONSOLIDATOR_MODE: mode,
        cc.EVENTS_ENDPOINT: f"ipc://{tmp}/gpu", cc.REPLAY_ENDPOINT: f"ipc://{tmp}/gpu-r",
        cc.OUTPUT_ENDPOINT: f"ipc://{tmp}/out", cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp}/out-r",
        cc.CPU_CACHE_NUM_BLOCKS: "24", cc.DISK_CACHE_NUM_BLOCKS: "48",
        cc.DISK_CACHE_DIR: f"{tmp}/disk",
    }
    config = cc.load_consolidator_config(env)
    engine = SimulatedEngine(EngineConfig(
        num_layers=1, num_kv_heads=2, head_dim=4, tokens_per_block=ENGINE_BS,
        num_gpu_blocks=32, tp_size=1, max_num_tokens=128, max_batch_size=4,
        dtype=torch.float32, env=env, vocab_size=30000))
    subs = {"gpu": StreamSubscriber(config.publish_endpoint(0).connect,
                                    config.replay_endpoint(0).connect, start_seq=0),
            "consolidated": StreamSubscriber(config.output.connect,
                                             config.output_replay.connect, start_seq=0)}
    out: dict[str, list[EventBatch]] = {name: [] for name in subs}
    try:
        drive(engine, None, TurnWaves(sessions=4, turns=4, system_tokens=16, user_tokens=8,
                                      gen_tokens=3, seed=5, salts=salts), timeout_s=120)
        engine.leader.flush_events()

        def published() -> dict[str, int]:
            assert engine.leader.consolidator.wait_idle(10)
            return {"gpu": wait_all_sent(engine.leader.event_sink.stats),
                    "consolidated": engine.leader.consolidator.stats()["batches_out"]}

        # Batches sent before a SUB listened come from the replay that a later one triggers
        # (start_seq=0): the subscribers connected before the workload began. Tier copies
        # still finishing publish more: the target is re-read each time.
        deadline = time.monotonic() + 30
        while any(subs[name].next_seq != n for name, n in published().items()):
            assert time.monotonic() < deadline, {n: s.next_seq for n, s in subs.items()}
            for name, sub in subs.items():
                out[name].extend(sub.poll(20))
        return out
    finally:
        for sub in subs.values():
            sub.close()
        engine.shutdown()


def _steps(recorded: dict[str, list[EventBatch]]) -> list[Step]:
    """The GPU-tier stream as worker 1, the consolidated one as worker 2."""
    return ([((1, b.data_parallel_rank or 0), b.events) for b in recorded["gpu"]]
            + [((2, b.data_parallel_rank or 0), b.events) for b in recorded["consolidated"]])


def _unsalted(steps: list[Step]) -> list[Step]:
    """The streams with the cache salt left out of ``extra_keys`` (a router then sees the
    tenants' equal system prompts as one content under two names)."""
    out: list[Step] = []
    for stream, events in steps:
        kept = []
        for e in events:
            if isinstance(e, BlockStored) and e.extra_keys is not None:
                e = BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size,
                                e.lora_id, e.medium, e.lora_name,
                                [[x for x in k if not str(x).startswith(SALT_TAG)] or None
                                 if k is not None else None for k in e.extra_keys])
            kept.append(e)
        out.append((stream, kept))
    return out


def _one_store_lost(steps: list[Step]) -> list[Step]:
    """The consolidated stream without its first batch that stores a block with a child."""
    for i, (stream, events) in enumerate(steps):
        if stream[0] != 2 or i <= 3:
            continue
        def device_stores(batch: list[Any]) -> list[BlockStored]:
            return [e for e in batch if isinstance(e, BlockStored)
                    and (e.medium or "GPU") == "GPU"]  # lower tiers check no parent

        stored = {h for e in device_stores(events) for h in e.block_hashes}
        later = [e for later_stream, batch in steps[i + 1:] if later_stream == stream
                 for e in device_stores(batch)]
        # Only a batch with a device block that a later store names as parent and no later
        # store brings back: what the recording holds depends on the engine's threads, and a
        # lost leaf, or one stored again, breaks nothing.
        again = {h for e in later for h in e.block_hashes}
        if any(e.parent_block_hash in stored - again for e in later):
            return steps[:i] + steps[i + 1:]
    raise AssertionError("no store batch with a later child to lose")


@pytest.mark.parametrize("mode", ["dedup", "passthrough"])
@pytest.mark.parametrize("variant", ["as recorded", "salt left out", "a store lost"])
def test_recorded_engine_streams(indexer: Indexer, tmp_path: Path, mode: str,
                                 variant: str) -> None:
    recorded = _record(tmp_path, mode, salts=("tenant-a", "tenant-b"))
    steps = _steps(recorded)
    assert sum(len(events) for _, events in steps) > 40
    if variant == "salt left out":
        steps = _unsalted(steps)
    elif variant == "a store lost":
        steps = _one_store_lost(steps)
    view = _agree(indexer, tmp_path, steps, ENGINE_BS)
    if variant == "as recorded":
        assert view.counts.warnings == 0
    else:  # the breakage shows, in both
        assert view.counts.skipped_stores + view.counts.alias_blocks > 0
    if variant == "salt left out":
        assert view.counts.alias_blocks > 0

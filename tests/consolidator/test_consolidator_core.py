"""ConsolidatorCore: the pure dedup/passthrough state machine (no sockets, no threads).

Every output is checked by :class:`Consumer`, a router model that replays the output the way a
strict consumer does (parent known before child, no duplicate STORE, no REMOVE for a block it
does not hold) and reconstructs each block's content from the STOREs' tokens and parents.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgpack
import pytest
from _depth import depths, run_examples
from _loops import both_implementations
from hypothesis import strategies as st

from kvbm_plugin.consolidator.service import (
    SOURCE_ENGINE,
    SOURCE_TIERS,
    ConsolidatorCore,
    UnknownDpRankError,
    UnknownMediumError,
)
from kvbm_plugin.routers.router_view import RouterView
from kvbm_plugin.wire.events import (
    MAX_DP_RANKS,
    WireFormatError,
    decode_event,
    encode_payload,
    to_signed_int64,
)

BS = 2
MASK = (1 << 64) - 1
Path = tuple[int, ...]


def tokens_of(path: Path) -> list[int]:
    """The token ids of the last block of ``path`` (content c -> [c, c + 100])."""
    return [path[-1], path[-1] + 100]


def chain_tokens(path: Path, start: int = 0) -> list[int]:
    out: list[int] = []
    for i in range(start, len(path)):
        out += tokens_of(path[:i + 1])
    return out


def hash_a(path: Path) -> int:
    """The engine's (and host tier's) hash algorithm, u64."""
    return hash(("A", path)) & MASK


def hash_b(path: Path) -> int:
    """The disk tier's hash algorithm, deliberately different, u64."""
    return hash(("B", path)) & MASK


class Consumer:
    """A strict router model of one output stream; asserts the invariants on every event."""

    def __init__(self, passthrough: bool = False) -> None:
        self.passthrough = passthrough
        self.held: dict[int, dict[str, set[int]]] = {}  # dp rank -> medium -> hashes
        self.path_of: dict[int, dict[int, Path]] = {}  # dp rank -> hash -> content path
        self.stores = 0
        self.removes = 0
        self.clears = 0

    def apply(self, output: dict[int, list[dict[str, Any]]]) -> None:
        for dp_rank, events in output.items():
            held = self.held.setdefault(dp_rank, {})
            path_of = self.path_of.setdefault(dp_rank, {})
            for event in events:
                kind = event["type"]
                if kind == "AllBlocksCleared":
                    self.clears += 1
                    held.clear()
                    continue
                medium = event["medium"]
                assert medium in ("GPU", "CPU", "DISK")
                if not self.passthrough:
                    assert medium == "GPU", "dedup output must be tagged GPU"
                hashes = held.setdefault(medium, set())
                for h in event["block_hashes"]:
                    assert -(1 << 63) <= h < (1 << 63), "wire hashes are signed int64"
                if kind == "BlockStored":
                    self.stores += len(event["block_hashes"])
                    bs = event["block_size"]
                    assert len(event["token_ids"]) == len(event["block_hashes"]) * bs
                    parent = event["parent_block_hash"]
                    if parent is None:
                        base: Path = ()
                    else:
                        assert parent in path_of, f"STORE before its parent {parent}"
                        base = path_of[parent]
                    for i, h in enumerate(event["block_hashes"]):
                        assert h not in hashes, f"duplicate STORE of held block {h}"
                        base = base + (event["token_ids"][i * bs],)
                        hashes.add(h)
                        path_of[h] = base
                else:
                    assert kind == "BlockRemoved"
                    for h in event["block_hashes"]:
                        assert h in hashes, f"REMOVE of block {h} not held"
                        hashes.discard(h)
                        self.removes += 1

    def paths(self, dp_rank: int, medium: str | None = None) -> set[Path]:
        held = self.held.get(dp_rank, {})
        path_of = self.path_of.get(dp_rank, {})
        media: Iterable[str] = held if medium is None else [medium]
        return {path_of[h] for m in media for h in held.get(m, set())}

    def count(self, dp_rank: int, medium: str | None = None) -> int:
        held = self.held.get(dp_rank, {})
        media: Iterable[str] = held if medium is None else [medium]
        return sum(len(held.get(m, set())) for m in media)


def engine_store(core: ConsolidatorCore, dp: int, path: Path, start: int = 0,
                 signed: bool = True, medium: str = "GPU") -> None:
    """The engine's GPU stream stores path[start:] (parent path[:start]) as a wire map."""
    conv = to_signed_int64 if signed else (lambda h: h)
    core.apply_event(dp, {
        "type": "BlockStored",
        "block_hashes": [conv(hash_a(path[:i + 1])) for i in range(start, len(path))],
        "parent_block_hash": conv(hash_a(path[:start])) if start else None,
        "token_ids": chain_tokens(path, start), "block_size": BS, "lora_id": None,
        "medium": medium, "lora_name": None})


def engine_remove(core: ConsolidatorCore, dp: int, paths: Iterable[Path],
                  medium: str = "GPU") -> None:
    core.apply_event(dp, {"type": "BlockRemoved",
                          "block_hashes": [to_signed_int64(hash_a(p)) for p in paths],
                          "medium": medium})


def tier_store(core: ConsolidatorCore, tier: str, dp: int, path: Path,
               one_hash: bool = False) -> None:
    """A tier registers the last block of ``path`` (host: hash A unsigned; disk: hash B, or
    hash A with ``one_hash``, as tiers that carry the engine's hash do)."""
    h = hash_a if tier == "CPU" or one_hash else hash_b
    core.store(SOURCE_TIERS, tier, dp, [h(path)], h(path[:-1]) if len(path) > 1 else None,
               tokens_of(path), BS)


def tier_remove(core: ConsolidatorCore, tier: str, dp: int, paths: Iterable[Path],
                one_hash: bool = False) -> None:
    h = hash_a if tier == "CPU" or one_hash else hash_b
    core.remove(SOURCE_TIERS, tier, dp, [h(p) for p in paths])


block_loops = both_implementations("consolidator")  # every test: compiled and Python loops


@pytest.fixture
def core() -> ConsolidatorCore:
    return ConsolidatorCore("dedup")


@pytest.fixture
def consumer() -> Consumer:
    return Consumer()


def step(core: ConsolidatorCore, consumer: Consumer) -> dict[int, list[dict[str, Any]]]:
    out = core.take_output()
    consumer.apply(out)
    return out


# ---------------------------------------------------------------------- residency and dedup


def test_first_residency_stores_once_then_other_tiers_add_nothing(core, consumer):
    engine_store(core, 0, (1, 2))
    out = step(core, consumer)
    assert [e["type"] for e in out[0]] == ["BlockStored"]  # one coalesced chain
    assert out[0][0]["block_hashes"] == [to_signed_int64(hash_a((1,))),
                                         to_signed_int64(hash_a((1, 2)))]
    tier_store(core, "CPU", 0, (1,))
    tier_store(core, "DISK", 0, (1,))
    tier_store(core, "DISK", 0, (1, 2))
    assert core.take_output() == {}
    assert consumer.paths(0) == {(1,), (1, 2)}


def test_host_eviction_while_disk_holds_publishes_nothing(core, consumer):
    tier_store(core, "CPU", 0, (1,))
    tier_store(core, "DISK", 0, (1,))
    step(core, consumer)
    tier_remove(core, "CPU", 0, [(1,)])
    assert core.take_output() == {}
    assert consumer.paths(0) == {(1,)}
    tier_remove(core, "DISK", 0, [(1,)])
    out = step(core, consumer)
    assert out[0] == [{"type": "BlockRemoved", "block_hashes": [to_signed_int64(hash_a((1,)))],
                       "medium": "GPU"}]


def test_engine_eviction_while_host_holds_publishes_nothing(core, consumer):
    engine_store(core, 0, (5,))
    tier_store(core, "CPU", 0, (5,))
    step(core, consumer)
    engine_remove(core, 0, [(5,)])
    assert core.take_output() == {}
    assert consumer.paths(0) == {(5,)}


def test_last_residency_gone_publishes_exactly_one_remove(core, consumer):
    engine_store(core, 0, (7,))
    tier_store(core, "CPU", 0, (7,))
    tier_store(core, "DISK", 0, (7,))
    step(core, consumer)
    engine_remove(core, 0, [(7,)])
    tier_remove(core, "DISK", 0, [(7,)])
    tier_remove(core, "CPU", 0, [(7,)])
    engine_remove(core, 0, [(7,)])  # again: the engine no longer holds it
    tier_remove(core, "CPU", 0, [(7,)])
    step(core, consumer)
    assert consumer.removes == 1
    assert consumer.paths(0) == set()
    assert core.stats()["unknown_removes"] == 2
    assert core.stats()["blocks_tracked"] == 0  # forgotten once resident nowhere


def test_dedup_tags_gpu_even_when_first_residency_is_disk(core, consumer):
    tier_store(core, "DISK", 0, (3,))
    out = step(core, consumer)
    assert out[0][0]["medium"] == "GPU"
    # The published hash is the first one seen (the disk's); the engine's maps to it.
    assert out[0][0]["block_hashes"] == [to_signed_int64(hash_b((3,)))]
    engine_store(core, 0, (3,))
    tier_remove(core, "DISK", 0, [(3,)])
    assert core.take_output() == {}
    engine_remove(core, 0, [(3,)])
    assert step(core, consumer)[0][0]["block_hashes"] == [to_signed_int64(hash_b((3,)))]


def test_same_tokens_under_a_different_parent_is_a_different_block(core, consumer):
    engine_store(core, 0, (1, 9))
    engine_store(core, 0, (2, 9))
    step(core, consumer)
    assert consumer.paths(0) == {(1,), (2,), (1, 9), (2, 9)}
    engine_remove(core, 0, [(1, 9)])
    step(core, consumer)
    assert consumer.paths(0) == {(1,), (2,), (2, 9)}


def test_same_tokens_as_root_and_under_unknown_parent_are_different(core, consumer):
    core.store(SOURCE_TIERS, "CPU", 0, [11], None, [4, 104], BS)
    core.store(SOURCE_TIERS, "CPU", 0, [12], 999, [4, 104], BS)  # parent 999 unknown
    out = core.take_output()
    # The root is published; the block under an unknown parent is tracked as another block but
    # held back: a strict router would skip a store whose parent it does not hold.
    assert [e["block_hashes"] for e in out[0]] == [[11]]
    stats = core.stats()
    assert stats["blocks_tracked"] == 2 and stats["unknown_parents"] == 1
    assert stats["held_back_stores"] == 1 and stats["blocks_held_back"] == 1
    core.remove(SOURCE_TIERS, "CPU", 0, [12])  # its removal publishes nothing either
    assert core.take_output() == {}
    assert core.stats()["blocks_held_back"] == 0 and core.stats()["blocks_tracked"] == 1


def test_signed_and_unsigned_forms_of_one_hash_are_one_block(core, consumer):
    path = (42,)
    assert hash_a(path) != to_signed_int64(hash_a(path)) or hash_a(path) < (1 << 63)
    engine_store(core, 0, path, signed=True)
    engine_store(core, 0, path, signed=False)  # the same engine block, u64 spelling
    step(core, consumer)
    assert consumer.stores == 1
    assert core.stats()["duplicate_stores"] == 1
    # Removing by the unsigned spelling frees it.
    core.apply_event(0, {"type": "BlockRemoved", "block_hashes": [hash_a(path)],
                         "medium": "GPU"})
    step(core, consumer)
    assert consumer.removes == 1


def test_signed_parent_hash_resolves_to_the_block_stored_unsigned(core, consumer):
    # A root whose u64 hash has the top bit set, so its signed spelling is negative.
    root = next((c,) for c in range(100) if hash_a((c,)) >= 1 << 63)
    engine_store(core, 0, root, signed=False)
    engine_store(core, 0, root + (5,), start=1, signed=True)  # parent named signed
    tier_store(core, "CPU", 0, root + (5,))
    step(core, consumer)
    assert core.stats()["unknown_parents"] == 0
    assert consumer.stores == 2
    assert consumer.paths(0) == {root, root + (5,)}


def test_u64_hash_at_the_top_of_the_range():
    core = ConsolidatorCore()
    consumer = Consumer()
    core.apply_event(0, {"type": "BlockStored", "block_hashes": [-1, (1 << 63) - 1],
                         "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
                         "block_size": 2, "medium": "GPU"})
    core.store(SOURCE_TIERS, "CPU", 0, [(1 << 64) - 1], None, [1, 2], 2)
    out = step(core, consumer)
    assert out[0][0]["block_hashes"] == [-1, (1 << 63) - 1]
    assert consumer.stores == 2


def test_dp_ranks_are_kept_apart(core, consumer):
    engine_store(core, 0, (1,))
    engine_store(core, 1, (1,))
    out = step(core, consumer)
    assert set(out) == {0, 1}
    tier_store(core, "CPU", 1, (1,))
    engine_remove(core, 0, [(1,)])
    engine_remove(core, 1, [(1,)])
    out = step(core, consumer)
    assert set(out) == {0}  # rank 1's host copy keeps it there
    assert consumer.paths(0) == set() and consumer.paths(1) == {(1,)}


def test_parent_is_named_by_its_published_hash_across_hash_algorithms(core, consumer):
    engine_store(core, 0, (1,))
    tier_store(core, "DISK", 0, (1,))  # disk knows the parent under its own hash
    step(core, consumer)
    tier_store(core, "DISK", 0, (1, 2))  # child, parent named by the disk's hash
    out = step(core, consumer)
    assert out[0][0]["parent_block_hash"] == to_signed_int64(hash_a((1,)))
    assert out[0][0]["block_hashes"] == [to_signed_int64(hash_b((1, 2)))]


def test_parent_resolves_through_another_tier_sharing_the_hash(core, consumer):
    engine_store(core, 0, (1,))
    step(core, consumer)
    tier_store(core, "CPU", 0, (1, 2))  # host never held (1,), but uses the engine's hash
    out = step(core, consumer)
    assert out[0][0]["parent_block_hash"] == to_signed_int64(hash_a((1,)))
    assert core.stats()["unknown_parents"] == 0


def test_parent_removed_before_its_child_cascades_and_comes_back(core, consumer):
    """A source that removes a parent while a child stays resident: the output stays
    prefix-closed (the child is removed first, in the same event, counted); a sibling stored
    under the removed parent is held back with its tokens and published once the parent is
    back; the cascaded child comes back when a source stores it again."""
    tier_store(core, "DISK", 0, (1,))
    tier_store(core, "DISK", 0, (1, 2))
    step(core, consumer)
    tier_remove(core, "DISK", 0, [(1,)])  # parent gone, child still on disk
    out = step(core, consumer)
    assert out[0] == [{"type": "BlockRemoved", "medium": "GPU", "block_hashes": [
        to_signed_int64(hash_b((1, 2))), to_signed_int64(hash_b((1,)))]}]  # child first
    assert consumer.paths(0) == set() and core.stats()["cascade_removes"] == 1
    tier_store(core, "DISK", 0, (1, 3))  # a sibling names the evicted parent
    assert step(core, consumer) == {}
    assert core.stats()["unknown_parents"] == 0  # the parent is known, just not published
    assert core.stats()["held_back_stores"] == 1 and core.stats()["blocks_held_back"] == 2
    tier_store(core, "DISK", 0, (1,))  # the parent is back: the sibling follows it
    step(core, consumer)
    assert consumer.paths(0) == {(1,), (1, 3)} and core.stats()["released_stores"] == 1
    tier_store(core, "DISK", 0, (1, 2))  # stored again: its tokens are known again
    step(core, consumer)
    assert consumer.paths(0) == {(1,), (1, 2), (1, 3)}
    assert core.stats()["blocks_held_back"] == 0


def test_engine_evicting_a_middle_block_removes_its_descendants_first(core, consumer):
    engine_store(core, 0, (1, 2, 3))
    engine_store(core, 0, (1, 2, 4), start=2)
    step(core, consumer)
    engine_remove(core, 0, [(1, 2)])  # a middle block, its two children still held
    out = step(core, consumer)
    assert len(out[0]) == 1
    removed = out[0][0]["block_hashes"]
    assert removed[-1] == to_signed_int64(hash_a((1, 2)))
    assert set(removed[:2]) == {to_signed_int64(hash_a((1, 2, 3))),
                                to_signed_int64(hash_a((1, 2, 4)))}
    assert consumer.paths(0) == {(1,)} and core.stats()["cascade_removes"] == 2
    engine_remove(core, 0, [(1, 2, 3), (1, 2, 4)])  # their own removals publish nothing more
    assert step(core, consumer) == {}
    assert core.stats()["blocks_held_back"] == 0


def test_passthrough_holds_a_store_back_until_its_parent_is_in_the_same_medium(consumer):
    core = ConsolidatorCore("passthrough")
    consumer = Consumer(True)
    engine_store(core, 0, (1,))  # GPU holds the parent
    tier_store(core, "CPU", 0, (1, 2))  # the child only on the host: no CPU parent
    out = step(core, consumer)
    assert [e["medium"] for e in out[0]] == ["GPU"]
    tier_store(core, "CPU", 0, (1,))  # the parent on the host too: the child follows it
    out = step(core, consumer)
    assert [(e["medium"], len(e["block_hashes"])) for e in out[0]] == [("CPU", 1),
                                                                    ("CPU", 1)]
    assert consumer.paths(0, "CPU") == {(1,), (1, 2)}
    tier_remove(core, "CPU", 0, [(1,)])  # removal carries the medium of the store it undoes
    out = step(core, consumer)
    assert out[0] == [{"type": "BlockRemoved", "medium": "CPU", "block_hashes": [
        to_signed_int64(hash_a((1, 2))), to_signed_int64(hash_a((1,)))]}]


def test_a_chain_is_stored_parent_first_in_one_event(core, consumer):
    engine_store(core, 0, (1, 2, 3, 4))
    out = step(core, consumer)
    assert len(out[0]) == 1
    assert out[0][0]["token_ids"] == chain_tokens((1, 2, 3, 4))


def test_partly_new_chain_publishes_only_the_new_suffix(core, consumer):
    tier_store(core, "CPU", 0, (1,))
    tier_store(core, "CPU", 0, (1, 2))
    step(core, consumer)
    engine_store(core, 0, (1, 2, 3, 4))
    out = step(core, consumer)
    assert out[0] == [{"type": "BlockStored",
                       "block_hashes": [to_signed_int64(hash_a(p)) for p in [(1, 2, 3),
                                                                             (1, 2, 3, 4)]],
                       "parent_block_hash": to_signed_int64(hash_a((1, 2))),
                       "token_ids": chain_tokens((1, 2, 3, 4), 2), "block_size": BS,
                       "lora_id": None, "medium": "GPU", "lora_name": None}]


def test_hash_clash_between_sources_gets_a_derived_hash(core, consumer):
    # Two different contents arrive under one external hash from two sources.
    core.store(SOURCE_ENGINE, "GPU", 0, [77], None, [1, 101], BS)
    core.store(SOURCE_TIERS, "DISK", 0, [77], None, [2, 102], BS)
    out = step(core, consumer)
    hashes = [h for e in out[0] for h in e["block_hashes"]]
    assert len(set(hashes)) == 2 and 77 in hashes
    assert core.stats()["hash_conflicts"] == 1
    core.remove(SOURCE_TIERS, "DISK", 0, [77])
    step(core, consumer)
    assert consumer.paths(0) == {(1,)}


def test_a_published_hash_no_source_names_any_more_is_still_not_reused(core, consumer):
    """Block A publishes 77; the engine reuses 77 for other content B (A stays, held by the
    host tier under its own hash), then B goes: no source names A by 77 any more, yet A still
    publishes it, so a third content stored under 77 gets a derived hash."""
    core.store(SOURCE_ENGINE, "GPU", 0, [77], None, [1, 101], BS)  # A publishes 77
    core.store(SOURCE_TIERS, "CPU", 0, [5], None, [1, 101], BS)  # A, also held by the host
    core.store(SOURCE_ENGINE, "GPU", 0, [77], None, [2, 102], BS)  # B: a derived hash
    core.remove(SOURCE_ENGINE, "GPU", 0, [77])  # B goes
    core.store(SOURCE_TIERS, "DISK", 0, [77], None, [3, 103], BS)  # C
    step(core, consumer)
    assert consumer.paths(0) == {(1,), (3,)}
    visible = core.visible_hashes(0)
    assert len(visible) == 2 and 77 in visible
    assert core.stats()["hash_conflicts"] == 2
    core.remove(SOURCE_TIERS, "CPU", 0, [5])  # A goes: 77 is free again
    core.store(SOURCE_ENGINE, "GPU", 0, [77], None, [4, 104], BS)
    step(core, consumer)
    assert consumer.paths(0) == {(3,), (4,)} and 77 in core.visible_hashes(0)
    assert core.stats()["hash_conflicts"] == 2


def test_slot_reusing_a_hash_for_new_content_replaces_the_old_block(core, consumer):
    core.store(SOURCE_ENGINE, "GPU", 0, [5], None, [1, 101], BS)
    core.store(SOURCE_ENGINE, "GPU", 0, [5], None, [2, 102], BS)
    step(core, consumer)
    assert consumer.paths(0) == {(2,)}


# ---------------------------------------------------------------------- clears and resync


def test_clear_of_one_tier_removes_only_blocks_resident_nowhere_else(core, consumer):
    engine_store(core, 0, (1,))
    engine_store(core, 0, (2,))
    tier_store(core, "CPU", 0, (1,))
    step(core, consumer)
    core.apply_event(0, {"type": "AllBlocksCleared"})
    out = step(core, consumer)
    assert out[0] == [{"type": "BlockRemoved", "block_hashes": [to_signed_int64(hash_a((2,)))],
                       "medium": "GPU"}]
    assert consumer.paths(0) == {(1,)}


def test_clear_leaving_nothing_sends_all_blocks_cleared(core, consumer):
    engine_store(core, 0, (1, 2, 3))
    tier_store(core, "DISK", 0, (1,))
    step(core, consumer)
    core.clear(SOURCE_TIERS, "DISK", 0)
    out = step(core, consumer)
    assert out == {}  # the engine still holds everything
    core.apply_event(0, {"type": "AllBlocksCleared"})
    out = step(core, consumer)
    assert out[0] == [{"type": "AllBlocksCleared"}]
    assert core.stats()["blocks_tracked"] == 0
    # Clearing what holds nothing says nothing.
    core.clear(SOURCE_TIERS, "CPU", 0)
    assert core.take_output() == {}


def test_clear_of_one_dp_rank_leaves_the_other(core, consumer):
    engine_store(core, 0, (1,))
    engine_store(core, 1, (1,))
    step(core, consumer)
    core.apply_event(1, {"type": "AllBlocksCleared"})
    out = step(core, consumer)
    assert set(out) == {1}
    assert consumer.paths(0) == {(1,)}


def test_resync_drops_only_the_engine_residency(core, consumer):
    engine_store(core, 0, (1,))
    engine_store(core, 0, (2,), medium="CPU")  # engine stream may report other media
    tier_store(core, "DISK", 0, (1,))
    step(core, consumer)
    core.resync(0)
    step(core, consumer)
    assert consumer.paths(0) == {(1,)}
    assert core.resident_in(SOURCE_ENGINE, "GPU", 0) == set()
    assert core.stats()["resyncs"] == 1
    engine_remove(core, 0, [(1,)])  # a stale remove after the resync: ignored
    assert core.take_output() == {}


# ---------------------------------------------------------------------- passthrough


def test_passthrough_forwards_each_tier_with_its_medium():
    core = ConsolidatorCore("passthrough")
    consumer = Consumer(passthrough=True)
    engine_store(core, 0, (1,))
    tier_store(core, "CPU", 0, (1,))
    tier_store(core, "DISK", 0, (1,))
    out = step(core, consumer)
    assert [e["medium"] for e in out[0]] == ["GPU", "CPU", "DISK"]
    # One published hash per block in every medium.
    assert {h for e in out[0] for h in e["block_hashes"]} == {to_signed_int64(hash_a((1,)))}
    tier_remove(core, "CPU", 0, [(1,)])
    out = step(core, consumer)
    assert out[0] == [{"type": "BlockRemoved", "block_hashes": [to_signed_int64(hash_a((1,)))],
                       "medium": "CPU"}]
    assert consumer.paths(0, "GPU") == {(1,)} and consumer.paths(0, "DISK") == {(1,)}


# ---------------------------------------------------------------------- tolerant decoding


def test_legacy_positional_arrays_are_decoded(core, consumer):
    h1, h2 = hash_a((1,)), hash_a((1, 2))
    core.apply_event(0, ["BlockStored", [h1, h2], None, chain_tokens((1, 2)), BS, None,
                         "DEVICE"])
    core.apply_event(0, ["BlockRemoved", [h2], "gpu"])
    step(core, consumer)
    assert consumer.paths(0) == {(1,)}
    core.apply_event(0, ["AllBlocksCleared"])
    step(core, consumer)
    assert consumer.paths(0) == set()


@pytest.mark.parametrize("medium, tier", [("cpu_pinned", "CPU"), ("CPU_TIER1", "CPU"),
                                          ("cpu_tier2", "DISK"), ("Storage", "DISK"),
                                          ("NVME", "DISK"), ("device", "GPU")])
def test_medium_aliases_are_case_insensitive(core, medium, tier):
    engine_store(core, 0, (1,), medium=medium)
    assert core.resident_in(SOURCE_ENGINE, tier, 0) == {hash_a((1,))}


@pytest.mark.parametrize("event", [
    {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
     "token_ids": [1, 2], "block_size": 2, "medium": "HBM"},
    {"type": "BlockRemoved", "block_hashes": [1], "medium": "cpu_tier9"},
])
def test_unknown_medium_is_refused_never_guessed_as_gpu(core, event):
    with pytest.raises(UnknownMediumError, match="HBM|cpu_tier9"):
        core.apply_event(0, event)
    assert core.take_output() == {}
    assert core.resident_in(SOURCE_ENGINE, "GPU", 0) == set()


@pytest.mark.parametrize("event, match", [
    ({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
      "token_ids": [1, 2, 3], "block_size": 2}, "3 token ids"),
    ({"type": "BlockStored", "block_hashes": [1, "x"], "parent_block_hash": None,
      "token_ids": [1, 2, 3, 4], "block_size": 2}, "'x'"),
    ({"type": "BlockStored", "block_hashes": [True], "parent_block_hash": None,
      "token_ids": [1, 2], "block_size": 2}, "True"),
    ({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": 1.5,
      "token_ids": [1, 2], "block_size": 2}, "1.5"),
    ({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
      "token_ids": [1, 2], "block_size": 0}, "block_size"),
    ({"type": "BlockStored", "block_hashes": 5, "parent_block_hash": None,
      "token_ids": [1, 2], "block_size": 2}, "not a list"),
    ({"type": "BlockRemoved", "block_hashes": None}, "not a list"),
    ({"type": "BlockInactive"}, "BlockInactive"),
    ("garbage", "neither"),
    ([], "neither"),
])
def test_malformed_events_raise_naming_the_value_and_change_nothing(core, event, match):
    with pytest.raises(WireFormatError, match=match):
        core.apply_event(0, event)
    assert core.take_output() == {}
    assert core.stats()["blocks_tracked"] == 0


def test_hash_only_store_adds_residency_to_a_visible_block(core, consumer):
    engine_store(core, 0, (1,))
    step(core, consumer)
    core.apply_event(0, {"type": "BlockStored", "block_hashes": [hash_a((1,)), 12345],
                         "parent_block_hash": None, "token_ids": [], "block_size": BS,
                         "medium": "CPU"})
    assert core.stats()["hash_only_stores_dropped"] == 1  # 12345: no tokens, unknown
    engine_remove(core, 0, [(1,)])
    assert core.take_output() == {}  # the engine's CPU copy still holds it


def test_a_hash_reused_along_one_chain_keeps_the_state_consistent(core):
    """A source that names a block and its child with the same hash (a hash collision in the
    source): storing the parent again releases the child that held the hash, which must not
    collect the parent being stored. (Found by the compiled-vs-Python differential test: the
    parent was collected, stayed held, and a later clear raised KeyError.)"""
    def chain(hashes: list[int]) -> dict[str, Any]:
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": 1,
                "token_ids": [0, 0, 0, 0], "block_size": BS, "medium": "CPU"}

    core.apply_event(1, chain([2, 2]))
    core.apply_event(1, chain([2, 1]))
    held = core.resident_in(SOURCE_ENGINE, "CPU", 1)
    assert held == {1, 2}
    assert core.stats()["blocks_tracked"] == 2  # every held block is still tracked
    core.resync(1)
    assert core.take_output() == {}  # parent 1 unknown: nothing was ever published
    assert core.stats()["blocks_tracked"] == 0


def test_an_event_that_fails_part_way_is_reported_and_the_batch_goes_on(core, monkeypatch):
    """apply_events: an event that raises (here: a bug in the release of the block a reused
    hash named) goes to on_error as a WireFormatError naming the exception; the events before
    and after it are applied and counted."""
    def stored(h: int, tokens: list[int]) -> dict[str, Any]:
        return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None,
                "token_ids": tokens, "block_size": BS, "medium": "GPU"}

    core.apply_event(0, stored(1, [0, 0]))  # the rank exists: the compiled loop takes batches

    def broken_release(*args: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(core, "_release", broken_release)
    errors: list[str] = []
    applied = core.apply_events(0, [stored(7, [1, 1]), stored(7, [2, 2]), stored(9, [3, 3])],
                                lambda exc: errors.append(str(exc)))
    assert errors == ["RuntimeError: boom"]
    assert applied == 2
    assert core.stats()["stores_in"] == 3  # 1, 7 and 9; not the event that failed
    assert 9 in core.resident_in(SOURCE_ENGINE, "GPU", 0)


def test_remove_for_a_block_never_stored_publishes_nothing(core):
    engine_remove(core, 0, [(1,), (2,)])
    tier_remove(core, "DISK", 0, [(3,)])
    assert core.take_output() == {}
    assert core.stats()["unknown_removes"] == 3


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode"):
        ConsolidatorCore("sometimes")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- property


SLOTS = ["engine-GPU", "engine-CPU", "host", "disk"]
CONTENT = st.integers(min_value=0, max_value=2)
PATHS = st.lists(CONTENT, min_size=1, max_size=3).map(tuple)
OPS = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 1), st.sampled_from(SLOTS), PATHS,
              st.integers(0, 2)),
    st.tuples(st.just("remove"), st.integers(0, 1), st.sampled_from(SLOTS),
              st.lists(PATHS, min_size=1, max_size=4)),
    st.tuples(st.just("clear"), st.integers(0, 1), st.sampled_from(SLOTS)),
    st.tuples(st.just("resync"), st.integers(0, 1)),
)


class Model:
    """Ground truth: which content paths each (dp rank, slot) holds."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, str], set[Path]] = {}

    def slot(self, dp: int, slot: str) -> set[Path]:
        return self.held.setdefault((dp, slot), set())

    def resident(self, dp: int, media: tuple[str, ...] = ("GPU", "CPU", "DISK")) -> set[Path]:
        medium_of = {"engine-GPU": "GPU", "engine-CPU": "CPU", "host": "CPU", "disk": "DISK"}
        return {p for (d, s), paths in self.held.items() if d == dp and medium_of[s] in media
                for p in paths}


def apply_op(core: ConsolidatorCore, model: Model, op: tuple[Any, ...],
             closed: bool = True, one_hash: bool = False) -> None:
    """Apply ``op`` to the core and the model. ``closed``: the source is prefix-closed, as the
    tiers and TensorRT-LLM's pool are (it removes a block only after its descendants);
    otherwise a removal may take any block. ``one_hash``: the disk tier names blocks by the
    engine's hash too (else by its own algorithm)."""
    kind, dp = op[0], op[1]
    if kind == "store":
        _, _, slot, path, start = op
        held = model.slot(dp, slot)
        start = min(start, len(path) - 1)
        if start and path[:start] not in held:
            start = 0  # the source names only parents it holds
        if slot.startswith("engine"):
            engine_store(core, dp, path, start, signed=bool(dp), medium=slot[7:])
            held.update(path[:i + 1] for i in range(start, len(path)))
        else:
            tier = "CPU" if slot == "host" else "DISK"
            for i in range(start, len(path)):  # tiers register block by block
                tier_store(core, tier, dp, path[:i + 1], one_hash)
                held.add(path[:i + 1])
    elif kind == "remove":
        _, _, slot, paths = op
        if closed:
            held = model.slot(dp, slot)
            left = set(held)
            kept = []
            for p in sorted(set(paths), key=len, reverse=True):  # children first
                if not any(len(q) > len(p) and q[:len(p)] == p for q in left):
                    kept.append(p)
                    left.discard(p)
            paths = kept
        if slot.startswith("engine"):
            engine_remove(core, dp, paths, medium=slot[7:])
        else:
            tier_remove(core, "CPU" if slot == "host" else "DISK", dp, paths, one_hash)
        model.slot(dp, slot).difference_update(paths)
    elif kind == "clear":
        slot = op[2]
        if slot.startswith("engine"):
            core.apply_event(dp, {"type": "AllBlocksCleared"})  # clears every engine tier
            model.slot(dp, "engine-GPU").clear()
            model.slot(dp, "engine-CPU").clear()
        else:
            core.clear(SOURCE_TIERS, "CPU" if slot == "host" else "DISK", dp)
            model.slot(dp, slot).clear()
    else:
        core.resync(dp)
        model.slot(dp, "engine-GPU").clear()
        model.slot(dp, "engine-CPU").clear()


@depths(quick=60, thorough=300)
def test_property_dedup_output_equals_resident_anywhere(examples):
    run_examples(examples, _dedup_output_equals_resident_anywhere,
                 st.lists(OPS, min_size=1, max_size=40))


def _dedup_output_equals_resident_anywhere(ops):
    core, model, consumer = ConsolidatorCore("dedup"), Model(), Consumer()
    for op in ops:
        apply_op(core, model, op)
        consumer.apply(core.take_output())  # asserts: no dup STORE, no stray REMOVE, parents
        for dp in (0, 1):
            assert consumer.paths(dp) == model.resident(dp)
            assert consumer.count(dp) == len(model.resident(dp))  # one hash per block
            assert core.visible_hashes(dp) == consumer.held.get(dp, {}).get("GPU", set())
    # Once nothing is resident the core forgets everything (no leak).
    for dp in (0, 1):
        for slot in SLOTS:
            apply_op(core, model, ("clear", dp, slot))
    consumer.apply(core.take_output())
    assert core.stats()["blocks_tracked"] == 0
    assert consumer.paths(0) == consumer.paths(1) == set()


@depths(quick=30, thorough=150)
def test_property_passthrough_output_equals_resident_per_medium(examples):
    run_examples(examples, _passthrough_output_equals_resident_per_medium,
                 st.lists(OPS, min_size=1, max_size=40))


def _passthrough_output_equals_resident_per_medium(ops):
    core, model, consumer = ConsolidatorCore("passthrough"), Model(), Consumer(True)
    for op in ops:
        apply_op(core, model, op)
        consumer.apply(core.take_output())
        for dp in (0, 1):
            for medium in ("GPU", "CPU", "DISK"):
                assert consumer.paths(dp, medium) == closure(model.resident(dp, (medium,)))
                assert consumer.count(dp, medium) == len(closure(model.resident(dp, (medium,))))


def closure(paths: set[Path]) -> set[Path]:
    """The prefix-closed part of ``paths``: those whose every prefix is in ``paths`` too."""
    return {p for p in paths if all(p[:i] in paths for i in range(1, len(p)))}


def apply_output(view: RouterView, output: dict[int, list[dict[str, Any]]]) -> None:
    """Feed one flush of the core's output (wire maps per dp rank) to the router model."""
    for dp, events in output.items():
        for event in events:
            view.apply_event(decode_event(event), "consolidator", dp)


@pytest.mark.parametrize("mode", ["dedup", "passthrough"])
@depths(quick=60, thorough=300)
def test_property_output_is_prefix_closed_whatever_the_sources_send(mode, examples):
    """Sources that remove any block, parents before children included (60 examples, 300 in
    the slow set, x up to 40 operations, each a batch; every source names a block by the
    engine's hash, as tiers that carry TensorRT-LLM's hash do): after every batch the router
    model of the output (:class:`RouterView`, Dynamo's indexer's rules) never sees a store
    under a parent it does not hold, a removal of a block it does not hold or that still has
    descendants, a re-store of a held block, nor a removal in another medium than its store
    (each a rule warning); what it holds is resident, and nothing is left once every source
    is cleared."""
    run_examples(examples, lambda ops: _output_is_prefix_closed(mode, ops),
                 st.lists(OPS, min_size=1, max_size=40))


def _output_is_prefix_closed(mode, ops):
    core, model = ConsolidatorCore(mode), Model()
    router = RouterView(BS)
    consumer = Consumer(mode == "passthrough")
    media = ("GPU", "CPU", "DISK") if mode == "passthrough" else ("GPU",)
    for op in ops:
        apply_op(core, model, op, closed=False, one_hash=True)
        out = core.take_output()
        apply_output(router, out)
        consumer.apply(out)
        assert router.counts.broken() == {}
        for dp in (0, 1):
            for medium in media:
                shown = consumer.paths(dp, medium)
                wanted = model.resident(dp, (medium,) if mode == "passthrough"
                                        else ("GPU", "CPU", "DISK"))
                assert shown <= closure(wanted)
                assert shown == closure(shown)
                held = router.edges().get(("consolidator", dp, medium), set())
                assert {h for _, h in held} == {hash_a(p)
                                                  for p in shown}
    for dp in (0, 1):
        for slot in SLOTS:
            apply_op(core, model, ("clear", dp, slot), one_hash=True)
    apply_output(router, core.take_output())
    assert router.counts.broken() == {}
    assert router.blocks() == {}
    assert core.stats()["blocks_tracked"] == 0 and core.stats()["blocks_held_back"] == 0


def test_stats_read_a_snapshot_of_the_dp_ranks() -> None:
    # stats() runs on the metrics thread while the ingest thread may add a dp rank; a rank
    # added during the walk must not break it ("dictionary changed size during iteration").
    core = ConsolidatorCore()
    core.apply_event(0, {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"})
    rank0 = core._ranks[0]

    class AddsARankWhenRead:
        visible = 0
        hidden: list[Any] = []

        @property
        def blocks(self) -> dict[int, Any]:
            core._ranks.setdefault(7, rank0)  # what the ingest thread could do meanwhile
            return {}

    core._ranks[1] = AddsARankWhenRead()  # type: ignore[assignment]
    stats = core.stats()
    assert stats["blocks_tracked"] == 0 and stats["blocks_visible"] == 0


# ---------------------------------------------------------------------- values the encoder refuses

def _good(h: int, parent: int | None = None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
            "token_ids": [h, h], "block_size": BS, "lora_id": None, "medium": "GPU",
            "lora_name": None}


_TS = msgpack.Timestamp(1, 2)
_EXT = msgpack.ExtType(5, b"x")


@pytest.mark.parametrize("field, value", [
    ("token_ids", [1, _TS]), ("token_ids", [_EXT, 1]), ("token_ids", [1, 1.0]),
    ("token_ids", [1, "1"]), ("token_ids", [True, 1]), ("token_ids", [1, -1]),
    ("token_ids", [1, 1 << 32]), ("token_ids", (1, _TS)),
    ("lora_id", _TS), ("lora_id", _EXT), ("lora_id", "7"), ("lora_id", 1.5),
    ("lora_id", False), ("lora_id", -1),
    ("lora_name", _TS), ("lora_name", _EXT), ("lora_name", 7), ("lora_name", b"name"),
])
def test_values_the_encoder_cannot_take_are_refused_at_ingest(core, field, value):
    """A msgpack Timestamp / ExtType or any other odd value in token_ids, lora_id or
    lora_name must be refused with its own event (as malformed, naming it), never copied to
    the output: there it would fail the encoder and lose every event of the flush. The other
    events of the batch go on, and the output encodes."""
    core.apply_event(0, _good(1))  # the rank exists: the compiled loop takes the batch
    bad = {**_good(2, parent=1), field: value}
    errors: list[WireFormatError] = []
    applied = core.apply_events(0, [_good(3, parent=1), bad, _good(4, parent=3)],
                                errors.append)
    assert applied == 2
    assert len(errors) == 1 and field in str(errors[0])
    output = core.take_output()
    encode_payload(0.0, output[0], 0)  # raises if anything odd reached the output
    assert [h for e in output[0] for h in e["block_hashes"]] == [1, 3, 4]
    assert core.stats()["stores_in"] == 3
    assert 2 not in core.resident_in(SOURCE_ENGINE, "GPU", 0)
    with pytest.raises(WireFormatError, match=field):
        core.apply_event(0, bad)


def test_the_edges_of_the_accepted_values_pass(core):
    event = {**_good(1), "token_ids": [0, (1 << 32) - 1], "lora_id": (1 << 64) - 1,
             "lora_name": "adapter"}
    core.apply_event(0, _good(9))
    assert core.apply_events(0, [event, {**_good(2, parent=1), "lora_id": 0}],
                             pytest.fail) == 2
    out = core.take_output()[0]
    encode_payload(0.0, out, 0)
    assert [(e["lora_id"], e["lora_name"]) for e in out] == [
        (None, None), ((1 << 64) - 1, "adapter"), (0, None)]


# ---------------------------------------------------------------------- dp ranks are bounded

def test_dp_ranks_beyond_the_bound_are_refused_and_counted():
    """Every dp rank gets state for the core's lifetime: ranks outside 0..max_dp_ranks-1 are
    refused (UnknownDpRankError, counted), whatever the path, and get no state."""
    core = ConsolidatorCore(max_dp_ranks=4)
    core.apply_event(3, _good(1))
    errors: list[WireFormatError] = []
    assert core.apply_events(4, [_good(1), _good(2)], errors.append) == 0
    assert len(errors) == 1 and isinstance(errors[0], UnknownDpRankError)
    assert "data_parallel_rank 4" in str(errors[0])
    with pytest.raises(UnknownDpRankError, match="0..3"):
        core.apply_event(1 << 40, _good(1))
    with pytest.raises(UnknownDpRankError):
        core.store(SOURCE_TIERS, "CPU", 9, [1], None, [1, 1], BS)
    with pytest.raises(UnknownDpRankError):
        core.apply_event(-1, _good(1))
    assert core.apply_events(3, [_good(2)], pytest.fail) == 1
    assert sorted(core._ranks) == [3]
    assert core.stats()["unknown_dp_ranks_refused"] == 4
    assert not core.admit_dp_rank(4) and core.admit_dp_rank(0)
    with pytest.raises(ValueError, match="max_dp_ranks"):
        ConsolidatorCore(max_dp_ranks=0)


def test_the_default_dp_rank_bound(core):
    core.apply_event(MAX_DP_RANKS - 1, _good(1))
    with pytest.raises(UnknownDpRankError):
        core.apply_event(MAX_DP_RANKS, _good(1))
    assert sorted(core._ranks) == [MAX_DP_RANKS - 1]


def test_a_held_back_block_keeps_its_scope_when_it_is_released(core):
    """A block stored under a parent that is not published (here: removed before its child)
    is held back with its tokens, LoRA id and extra keys, and published with all of them once
    the parent is back."""
    core.store(SOURCE_TIERS, "CPU", 0, [1, 2], None, [1, 1, 2, 2], BS)
    core.remove(SOURCE_TIERS, "CPU", 0, [1])  # the parent first: 2 is cascaded
    core.take_output()
    core.store(SOURCE_TIERS, "CPU", 0, [3], 1, [3, 3], BS, lora_id=7,
               extra_keys=[["salt-a"]])
    assert core.take_output() == {}  # held back: its parent is not published
    core.store(SOURCE_TIERS, "CPU", 0, [1], None, [1, 1], BS)
    out = core.take_output()[0]
    released = [e for e in out if e["block_hashes"] == [3]]
    assert len(released) == 1
    assert released[0]["parent_block_hash"] == 1 and released[0]["token_ids"] == [3, 3]
    assert released[0]["lora_id"] == 7 and released[0]["extra_keys"] == [["salt-a"]]
    assert core.stats()["released_stores"] == 1


def test_an_unscoped_block_is_one_block_whatever_its_chain_mates_carry(core):
    """TensorRT-LLM stores a multimodal chain's text blocks in the event of its image blocks
    (extra keys on some blocks only); a tier copy of a text block comes alone, without extra
    keys. Both name one block: no conflict, no second name."""
    core.apply_event(0, {"type": "BlockStored", "block_hashes": [1, 2, 3],
                         "parent_block_hash": None, "token_ids": [1, 1, 9, 9, 4, 4],
                         "block_size": BS, "lora_id": None, "medium": "GPU",
                         "extra_keys": [None, ["ab" * 32], None]})
    core.take_output()
    core.store(SOURCE_TIERS, "CPU", 0, [1], None, [1, 1], BS)
    core.store(SOURCE_TIERS, "CPU", 0, [2], 1, [9, 9], BS, extra_keys=[["ab" * 32]])
    core.store(SOURCE_TIERS, "CPU", 0, [3], 2, [4, 4], BS)
    assert core.take_output() == {}  # the same three blocks: nothing new downstream
    assert core.stats()["hash_conflicts"] == 0
    # the image block's name and tokens without its key: another block, renamed and counted
    core.store(SOURCE_TIERS, "CPU", 0, [2], 1, [9, 9], BS)
    assert core.stats()["hash_conflicts"] == 1

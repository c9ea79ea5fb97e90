"""The leader's unnamed tier stores (``naming.names.UnnamedStores``): a committed tier block
whose TensorRT-LLM name is not known waits, with its descendants, and is handed over for its
STORE once named, parents first; bounded, oldest out first; a waiting block's eviction owes
the wire no REMOVE."""

from __future__ import annotations

from kvbm_plugin.naming.names import BlockNames, UnnamedStores
from kvbm_plugin.tiers._entry import TierEntry
from kvbm_plugin.tiers.content_keys import TIER_HOST
from kvbm_plugin.tiers.index import TierIndex

BS = 2


def _commit(index: TierIndex, key: int, name: int, parent_key: int | None,
            parent_name: int | None, tokens: list[int]) -> TierEntry:
    index.reserve(key, name, parent_name, tokens, parent_key)
    return index.commit(key)


def _stored(parent: int | None, hashes: list[int], tokens: list[int]) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS}


def test_a_chain_waits_for_its_root_name_and_is_handed_over_parents_first() -> None:
    names = BlockNames(BS)
    stats: dict[str, int] = {}
    unnamed = UnnamedStores(names, stats)
    index = TierIndex(TIER_HOST, 8)
    # Placeholders: each block named by its content key (TRT-LLM's hash not known yet).
    root = _commit(index, 11, 11, None, None, [1, 2])
    assert not unnamed.ready(index, root)
    child = _commit(index, 12, 12, 11, 11, [3, 4])
    assert not unnamed.ready(index, child)
    assert len(unnamed) == 2 and (TIER_HOST, 12) in unnamed
    assert list(unnamed.named_now({TIER_HOST: index})) == []  # nothing learned yet

    # TRT-LLM's GPU STORE names both blocks: the chain is handed over root first.
    names.observe(0, [_stored(None, [901, 902], [1, 2, 3, 4])])
    out = list(unnamed.named_now({TIER_HOST: index}))
    assert [(e.key, e.event_hash, e.parent_event_hash) for _, e in out] == \
        [(11, 901, None), (12, 902, 901)]
    assert len(unnamed) == 0 and stats["tier_stores_unnamed"] == 2


def test_a_named_block_under_a_waiting_parent_waits_too() -> None:
    names = BlockNames(BS)
    unnamed = UnnamedStores(names, {})
    index = TierIndex(TIER_HOST, 8)
    assert not unnamed.ready(index, _commit(index, 21, 21, None, None, [5, 6]))
    # Its own and its parent's names are known (handed over), but the parent's STORE is not out.
    assert not unnamed.ready(index, _commit(index, 22, 702, 21, 701, [7, 8]))
    assert (TIER_HOST, 22) in unnamed
    assert list(unnamed.named_now({TIER_HOST: index})) == []  # its parent is still unnamed
    # A named root with no waiting parent goes out at once.
    assert unnamed.ready(index, _commit(index, 23, 703, None, None, [9, 9]))


def test_waiting_blocks_are_bounded_oldest_first_and_owe_no_remove() -> None:
    stats: dict[str, int] = {}
    unnamed = UnnamedStores(BlockNames(BS), stats)
    unnamed.MAX_WAITING = 2
    index = TierIndex(TIER_HOST, 8)
    for key in (31, 32, 33):
        unnamed.ready(index, _commit(index, key, key, None, None, [key, key]))
    dropped = []
    for tier, oldest in unnamed.overflow():  # the caller drops each from its tier
        dropped.append((tier, oldest.key))
        assert unnamed.forget(tier, oldest.key)  # waiting: its eviction owes no REMOVE
    assert dropped == [(TIER_HOST, 31)] and stats["tier_stores_unnamed_dropped"] == 1
    assert not unnamed.forget(TIER_HOST, 31)  # announced or gone: a REMOVE is owed
    # A block its tier no longer holds is forgotten, never handed over.
    index.discard(32)
    assert list(unnamed.named_now({TIER_HOST: index})) == [] and (TIER_HOST, 32) not in unnamed

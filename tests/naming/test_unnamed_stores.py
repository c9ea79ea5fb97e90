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
    names = BlockNames(BS)
    unnamed = UnnamedStores(names, stats)
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
    # A block its tier no longer holds is forgotten once a name comes for it, never handed
    # over.
    index.discard(32)
    names.name_key(32, 932)
    assert list(unnamed.named_now({TIER_HOST: index})) == [] and (TIER_HOST, 32) not in unnamed
    # The last block waiting gone, the names table stops recording what it names.
    assert unnamed.forget(TIER_HOST, 33) and not names.track and not names.fresh_keys


def test_a_block_whose_name_never_comes_costs_nothing_per_look() -> None:
    """named_now looks only at what the names learned since can name: thousands of blocks
    whose name never comes (a multimodal block whose request was forgotten) are not looked
    at again, and a chain named later still comes out whole, parents first."""
    names = BlockNames(BS)
    unnamed = UnnamedStores(names, {})
    index = TierIndex(TIER_HOST, 4096)
    for key in range(1, 3001):  # stuck: their events never come
        assert not unnamed.ready(index, _commit(index, key, key, None, None, [key, 0]))
    chain = [_commit(index, 5001, 5001, None, None, [7, 7])]
    for key in range(5002, 5006):
        chain.append(_commit(index, key, key, key - 1, key - 1, [key, key]))
    for entry in chain:
        assert not unnamed.ready(index, entry)
    looked = []
    name = unnamed.name

    def counted(entry, index=None):
        looked.append(entry.key)
        name(entry, index)

    unnamed.name = counted  # type: ignore[method-assign]
    assert list(unnamed.named_now({TIER_HOST: index})) == [] and looked == []
    # An event names the chain's blocks by content: only the blocks it may name are looked at.
    names.observe(0, [_stored(None, [9001], [7, 7])])
    for key in range(5002, 5006):
        names.name_key(key, 4000 + key)
    out = list(unnamed.named_now({TIER_HOST: index}))
    assert [(e.key, e.event_hash, e.parent_event_hash) for _, e in out] == [
        (5001, 9001, None), (5002, 9002, 9001), (5003, 9003, 9002), (5004, 9004, 9003),
        (5005, 9005, 9004)]
    assert len(looked) < 20 and len(unnamed) == 3000

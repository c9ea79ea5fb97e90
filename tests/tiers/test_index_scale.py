"""The tier index at scale, proven by structure (timings are in benchmarks/bench_tiers.py):
an eviction after a long chain skips nothing, the index adds no object per block for the
garbage collector, and a block costs a small, fixed number of bytes."""

from __future__ import annotations

import gc
import random
import tracemalloc

import pytest

from kvbm_plugin.tiers.index import TierIndex
from kvbm_plugin.tiers.index_rows import GROW_ROWS

TOKENS = list(range(1000, 1016))  # a 16-token block


def _fill(index: TierIndex, blocks: int, chain: int, seed: int = 1) -> list[int]:
    """``blocks`` committed blocks in chains of ``chain``, each stored and committed in turn
    (as the leader does), with one rank's disk signature."""
    rng = random.Random(seed)
    keys = []
    parent = None
    for i in range(blocks):
        if i % chain == 0:
            parent = None
        key = rng.getrandbits(64)
        index.reserve(key, key, parent, TOKENS, parent)
        index.commit(key, {0: (4_194_352, 1_700_000_000_000_000_000 + i)})
        keys.append(key)
        parent = key
    return keys


def test_after_one_long_chain_the_eviction_order_holds_only_its_leaf() -> None:
    """Each block of a chain was a leaf when committed and stopped being one when its child
    came: none of them may linger in the eviction order for the next eviction to skip."""
    n = 5_000
    index = TierIndex("disk", n)
    keys = _fill(index, n, chain=n)
    assert index.evictable() == 1
    for step in range(3):  # each eviction takes the chain's current leaf; its parent follows
        _, evicted = index.reserve(step, 1, None, TOKENS)
        assert evicted is not None and evicted.key == keys[-1 - step]
        assert index.evictable() == 1 + step  # the chain's new leaf and the roots committed
        index.commit(step)


def test_the_index_adds_no_object_per_block_for_the_collector() -> None:
    gc.collect()
    before = len(gc.get_objects())
    index = TierIndex("disk", 20_000)
    keys = _fill(index, 20_000, chain=16)
    held = [index.get(k) for k in keys[:10]]  # views the leader holds are objects, for a while
    gc.collect()
    grown = len(gc.get_objects()) - before
    assert grown < 200, f"{grown} tracked objects for 20,000 blocks"
    assert all(index.get(k) is v for k, v in zip(keys, held, strict=False))


@pytest.mark.parametrize("chain", [1, 16])
def test_bytes_per_block(chain: int) -> None:
    """Everything the index keeps for a 16-token block with one disk signature: row columns,
    key table, eviction order. (The full million is measured in benchmarks/bench_tiers.py.)"""
    n = 10_000
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        index = TierIndex("disk", n)
        _fill(index, n, chain)
        per_block = (tracemalloc.get_traced_memory()[0] - start) / n
    finally:
        tracemalloc.stop()
    assert len(index) == n
    assert per_block <= 200, f"{per_block:.0f} B per block"


def test_the_columns_grow_in_chunks_and_never_past_the_capacity() -> None:
    """A filling tier adds rows to its columns a chunk at a time (not one append per column
    and block on the executor thread), bounded by its capacity; the rows not handed out yet
    are no blocks, and a full tier evicts as before."""
    n = GROW_ROWS + 44
    index = TierIndex("host", n)
    _fill(index, 1, chain=1)
    assert len(index._key) == GROW_ROWS  # noqa: SLF001 - the columns, not the blocks
    assert len(index) == 1 and len(index.entries()) == 1
    keys = [*_fill(index, GROW_ROWS, chain=1, seed=2)]
    assert len(index._key) == len(index._tok) // len(TOKENS) == n  # noqa: SLF001
    keys += _fill(index, n - GROW_ROWS - 1, chain=1, seed=3)
    assert len(index) == n and len(index._key) == n  # noqa: SLF001
    _, evicted = index.reserve(7, 7, None, TOKENS)  # full: the least recently used goes
    assert evicted is not None and len(index._key) == n  # noqa: SLF001


def test_views_keep_identity_while_held_and_detach_with_their_values() -> None:
    index = TierIndex("host", 2)
    a, _ = index.reserve(1, -5, None, [7, 8])  # a signed event hash, as TRT-LLM's may be
    b, _ = index.reserve(2, 6, -5, [9, 10], 1)
    index.commit(1)
    index.commit(2, {0: (10, 20)})
    b.scope = (3, 4)
    assert index.get(2) is b and index.lookup(1) is a
    c, evicted = index.reserve(3, 7, None, [1, 1 << 40])  # tokens beyond int32 kept as given
    assert evicted is b and c.slot == b.slot and index.get(2) is None
    assert (b.key, b.event_hash, b.parent_event_hash, b.parent_key, b.token_ids, b.scope,
            b.signatures, b.resident) == (2, 6, -5, 1, (9, 10), (3, 4), {0: (10, 20)}, True)
    assert c.token_ids == (1, 1 << 40) and c.scope == (None, None) and c.signatures == {}
    b.event_hash = 99  # a detached view changes no tier
    assert index.get(3).event_hash == 7 and a.event_hash == -5

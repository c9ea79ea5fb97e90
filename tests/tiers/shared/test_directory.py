"""SharedDirectory: what the executor thread is offered, and how the directory stays bounded and
prefix-closed."""

from __future__ import annotations

import dataclasses

import pytest
from _shared_blocks import Clock, chain
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbm_plugin.tiers.shared.block import SharedBlock, check_block
from kvbm_plugin.tiers.shared.directory import SharedDirectory

LEASE = 10.0
MARGIN = 3.0


def directory(capacity: int = 100, clock: Clock | None = None) -> SharedDirectory:
    return SharedDirectory(capacity, LEASE, MARGIN, clock or Clock())


def admit(d: SharedDirectory, blocks: list[SharedBlock], deadline: float | None = None,
          own: bool = True):
    for block in blocks:
        d.enqueue(block, own)
    return d.admit(blocks, d._clock() + LEASE if deadline is None else deadline)


def test_lookup_offers_a_block_only_while_the_margin_of_its_lease_is_left() -> None:
    clock = Clock()
    d = directory(clock=clock)
    [block] = chain(1)
    assert d.lookup(block.digest) is None  # not tracked
    admit(d, [block], deadline=clock.now + LEASE)
    assert d.lookup(block.digest) == block
    clock.advance(LEASE - MARGIN)  # exactly the margin left: still offered
    assert d.lookup(block.digest) == block
    clock.advance(0.001)
    assert d.lookup(block.digest) is None
    assert d.stats()["late"] == 1
    assert d.is_tracked(block.digest)  # still resident: only the offer stops


def test_lookup_offers_nothing_while_the_store_is_unavailable() -> None:
    d = directory()
    [block] = chain(1)
    admit(d, [block])
    d.set_available(False)
    assert d.lookup(block.digest) is None
    assert d.stats()["unavailable"] == 1
    d.set_available(True)
    assert d.lookup(block.digest) == block


def test_an_inner_block_is_never_dropped_even_when_least_recently_used() -> None:
    d = directory(capacity=3)
    a, b = chain(2)
    [c] = chain(1, first_token=500)
    [e] = chain(1, first_token=600)
    admit(d, [a, b, c])
    for block in (a, b, c):  # a used least recently, but b's parent
        assert d.lookup(block.digest) is not None
    assert admit(d, [e]).evicted == [b]
    assert d.is_tracked(a.digest)


def test_blocks_round_trip_every_field() -> None:
    d = directory()
    root = SharedBlock(b"\x01" * 16, None, -5, None, (1, 2, 3, 4), 7, ("salt-x",))
    child = SharedBlock(b"\x02" * 16, root.digest, (1 << 64) - 1, -5, (2 ** 40, 1, 2, 3),
                        None, None)  # a token beyond int32
    odd = SharedBlock(b"\x03" * 16, child.digest, 3, (1 << 64) - 1, (9, 9), 0,
                      ("salt-x", ("mm", 12)))  # another length
    result = admit(d, [root, child, odd])
    assert result.resident == [root, child, odd]
    for block in (root, child, odd):
        assert d.lookup(block.digest) == block
    assert d.blocks() == [root, child, odd]


def test_lru_drops_the_least_recently_used_leaf_never_an_inner_block() -> None:
    d = directory(capacity=4)
    a, b = chain(2)
    [c] = chain(1, first_token=500)
    [e] = chain(1, first_token=600)
    [f] = chain(1, first_token=700)
    [g] = chain(1, first_token=800)
    admit(d, [a, b, c, e])  # a is the oldest, but b (its child) makes it inner
    assert d.lookup(c.digest) is not None  # c: most recently used
    assert admit(d, [f]).evicted == [b]  # the LRU leaf; a is older but not a leaf
    assert admit(d, [g]).evicted == [a]  # a is a leaf now, at its own age
    assert not d.is_tracked(a.digest) and not d.is_tracked(b.digest)
    assert {blk.digest for blk in d.blocks()} == {c.digest, e.digest, f.digest, g.digest}
    assert d.stats()["dropped_lru"] == 2


def test_lru_never_drops_a_pinned_block() -> None:
    d = directory(capacity=2)
    [a] = chain(1, first_token=100)
    [b] = chain(1, first_token=200)
    [c] = chain(1, first_token=300)
    [e] = chain(1, first_token=400)
    admit(d, [a, b])
    assert d.pin(a.digest)
    assert d.lookup(a.digest) == a  # looked up again while pinned (another request)
    assert d.lookup(b.digest) == b  # a is the least recently used now
    assert admit(d, [c]).evicted == [b]  # a is pinned
    assert d.pin(c.digest)
    result = admit(d, [e])  # everything pinned: refused, nothing dropped
    assert result.evicted == [] and result.refused == [(e, "full")]
    assert d.is_tracked(a.digest) and d.is_tracked(c.digest) and not d.is_tracked(e.digest)
    d.unpin(a.digest)
    assert admit(d, [e]).evicted == [a]


def test_dropping_a_block_drops_its_descendants_children_first() -> None:
    d = directory()
    a, b, c = chain(3)
    [x] = chain(1, first_token=900, parent=a)  # a second child of a
    [other] = chain(1, first_token=50)
    admit(d, [a, b, c, x, other])
    gone = d.drop([a.digest])
    assert {blk.digest for blk in gone} == {a.digest, b.digest, c.digest, x.digest}
    order = [blk.digest for blk in gone]
    assert order.index(c.digest) < order.index(b.digest) < order.index(a.digest)
    assert order.index(x.digest) < order.index(a.digest)
    assert len(d) == 1 and d.blocks() == [other]
    assert d.stats()["dropped_absent"] == 1 and d.stats()["dropped_descendants"] == 3


def test_an_orphan_is_refused_and_a_child_of_a_pending_parent_waits() -> None:
    d = directory()
    a, b = chain(2)
    d.enqueue(b, False)
    result = d.admit([b], 1e9)  # a is neither pending nor resident
    assert result.refused == [(b, "orphan")] and not d.is_tracked(b.digest)
    d.enqueue(a, False)
    d.enqueue(b, False)
    result = d.admit([b], 1e9)  # a pending: b waits for it
    assert result.waiting == [b] and d.is_tracked(b.digest) and len(d) == 0
    result = d.admit([b, a], 1e9)  # a batch in any order: parents are admitted first
    assert result.resident == [a, b]


def test_expire_drops_blocks_that_can_no_longer_be_offered_with_descendants() -> None:
    clock = Clock()
    d = directory(clock=clock)
    a, b = chain(2)
    [late] = chain(1, first_token=300)
    admit(d, [a], deadline=clock.now + LEASE)
    admit(d, [b, late], deadline=clock.now + LEASE + 5)  # b outlives a, but a goes first
    assert d.next_expiry() == clock.now + LEASE - MARGIN
    clock.advance(LEASE - MARGIN - 0.5)
    assert d.expire() == []
    clock.advance(0.5)
    assert d.expire() == [b, a]
    assert d.blocks() == [late] and d.stats()["dropped_expired"] == 1


def test_renewal_keeps_a_block_past_its_first_lease() -> None:
    clock = Clock()
    d = directory(clock=clock)
    [a] = chain(1)
    admit(d, [a], deadline=clock.now + LEASE)
    clock.advance(LEASE / 3)
    assert d.renew([a.digest], clock.now + LEASE) == 1
    clock.advance(LEASE - LEASE / 3 + 0.1)  # past the first lease's end
    assert d.expire() == []
    assert d.lookup(a.digest) == a
    clock.advance(LEASE / 3 - MARGIN)  # the renewed lease has less than the margin left
    assert d.expire() == [a]


def test_renewal_chunks_walk_every_resident_block_once() -> None:
    d = directory()
    blocks = chain(10)
    admit(d, blocks)
    d.drop([blocks[7].digest])  # 7, 8, 9 gone
    seen: list[bytes] = []
    cursor = 0
    while True:
        cursor, digests = d.renewal_chunk(cursor, 3)
        if not digests:
            break
        assert len(digests) <= 3
        seen += digests
    assert sorted(seen) == sorted(b.digest for b in blocks[:7])


def test_a_pin_taken_before_a_drop_does_not_unpin_the_block_admitted_again() -> None:
    d = directory(capacity=2)
    [a] = chain(1, first_token=100)
    [b] = chain(1, first_token=200)
    [c] = chain(1, first_token=300)
    admit(d, [a])
    assert d.pin(a.digest)  # load 1
    d.drop([a.digest])
    assert not d.pin(a.digest)  # gone: nothing pinned
    admit(d, [a, b])
    assert d.pin(a.digest)  # load 2, on the entry admitted again
    d.unpin(a.digest)  # load 1 ends: its pin left with the dropped entry
    assert admit(d, [c]).evicted == [b]  # a is still pinned by load 2
    d.unpin(a.digest)
    with pytest.raises(RuntimeError, match="not pinned"):
        d.unpin(a.digest)


def test_a_digest_sharing_the_first_eight_bytes_is_refused_never_confused() -> None:
    d = directory()
    a = SharedBlock(b"\x05" * 8 + b"\x00" * 8, None, 1, None, (1, 2, 3, 4), None, None)
    twin = dataclasses.replace(a, digest=b"\x05" * 8 + b"\x01" * 8, event_hash=2)
    admit(d, [a])
    assert admit(d, [twin]).refused == [(twin, "collision")]
    assert d.lookup(twin.digest) is None and not d.is_tracked(twin.digest)
    assert d.lookup(a.digest) == a


def test_pending_blocks_are_tracked_and_bounded() -> None:
    d = SharedDirectory(10, LEASE, MARGIN, Clock(), pending_limit=2)
    a, b, c = chain(3)
    assert d.enqueue(a, True) and d.enqueue(b, True)
    assert not d.enqueue(a, True)  # tracked already
    assert not d.enqueue(c, True)  # the limit
    assert d.stats()["refused_pending_full"] == 1
    assert d.is_tracked(a.digest) and not d.is_tracked(c.digest)
    assert [blk for blk, _, _ in d.take_pending(10)] == [a, b]
    assert d.is_tracked(a.digest)  # taken, not settled
    d.forget([a.digest, b.digest])
    assert not d.is_tracked(a.digest) and d.stats()["pending"] == 0


@pytest.mark.parametrize(("field", "value"), [
    ("digest", b"short"), ("parent_digest", b"x" * 15), ("event_hash", 1 << 64),
    ("parent_event_hash", "7"), ("token_ids", ()), ("token_ids", [1, 2]),
    ("token_ids", (1, True)), ("token_ids", (1, 1 << 63)), ("token_ids", (-(1 << 63) - 1, 2)),
    ("token_ids", (1, "2")), ("token_ids", (1, 2.0)), ("lora_id", 1.5), ("extra_keys", ["salt"]),
    ("extra_keys", (["unhashable"],)),
])
def test_check_block_names_the_bad_field(field: str, value: object) -> None:
    [block] = chain(1)
    with pytest.raises(ValueError, match=field):
        check_block(dataclasses.replace(block, **{field: value}))
    assert check_block(block) is block


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match="capacity"):
        SharedDirectory(0, LEASE, MARGIN)
    with pytest.raises(ValueError, match="margin_s"):
        SharedDirectory(1, LEASE, LEASE)
    with pytest.raises(ValueError, match="lease_s"):
        SharedDirectory(1, 0, 0)


# ---- a random walk: prefix-closed, advertised == resident, pins respected -----------------

def _tree() -> list[SharedBlock]:
    """Two chains of 3 with a branch of 2 off each root (10 blocks)."""
    blocks: list[SharedBlock] = []
    for root_token in (100, 200):
        trunk = chain(3, first_token=root_token)
        blocks += trunk
        blocks += chain(2, first_token=root_token + 50, parent=trunk[0])
    return blocks


TREE = _tree()
BY_DIGEST = {b.digest: b for b in TREE}


_OPS = ("admit", "admit", "admit", "lookup", "lookup", "pin", "unpin", "drop", "renew",
        "wait")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_OPS), st.integers(0, len(TREE) - 1)),
                min_size=10, max_size=120))
def test_random_operations_keep_the_directory_prefix_closed_and_advertised_exactly(
        ops: list[tuple[str, int]]) -> None:
    clock = Clock()
    d = SharedDirectory(4, LEASE, MARGIN, clock)
    advertised: dict[bytes, SharedBlock] = {}  # what a consumer of stores/removes holds
    pins: dict[bytes, int] = {}  # pins of the resident entry, by digest
    ghosts: dict[bytes, int] = {}  # pins of entries dropped while pinned

    def removed(blocks: list[SharedBlock]) -> None:
        for block in blocks:
            if pins.get(block.digest):
                ghosts[block.digest] = ghosts.get(block.digest, 0) + pins.pop(block.digest)
            # descendants before ancestors: nothing still advertised names it as parent
            assert not any(b.parent_digest == block.digest for b in advertised.values()
                           if b.digest != block.digest)
            del advertised[block.digest]

    for op, i in ops:
        block = TREE[i]
        if op == "admit":  # the block with its prefix, as the agent admits a chain
            path = [block]
            while path[0].parent_digest is not None:
                path.insert(0, BY_DIGEST[path[0].parent_digest])
            batch = [b for b in path if d.enqueue(b, True)]
            if batch:
                result = d.admit(batch, clock.now + LEASE)
                for victim in result.evicted:
                    assert pins.get(victim.digest, 0) == 0, "a pinned block was LRU-dropped"
                removed(result.evicted)
                for new in result.resident:
                    assert new.parent_digest is None or new.parent_digest in advertised
                    advertised[new.digest] = new
                d.forget([b.digest for b, _ in result.refused])
                d.forget([b.digest for b in result.waiting])
        elif op == "lookup":
            got = d.lookup(block.digest)
            assert (got is not None) == (block.digest in advertised)
            assert got is None or got == block
        elif op == "pin":
            if d.pin(block.digest):
                pins[block.digest] = pins.get(block.digest, 0) + 1
        elif op == "unpin":
            if ghosts.get(block.digest):  # an unpin is the oldest pin's: a ghost's first
                ghosts[block.digest] -= 1
                d.unpin(block.digest)
            elif pins.get(block.digest):
                pins[block.digest] -= 1
                d.unpin(block.digest)
        elif op == "drop":
            removed(d.drop([block.digest]))
        elif op == "renew":
            d.renew([block.digest], clock.now + LEASE)
        else:
            clock.advance(LEASE / 4)
            removed(d.expire())
        resident = d.blocks()
        assert {b.digest: b for b in resident} == advertised
        cursor, rows = d.renewal_chunk(0, 100)  # every used row, not only those reachable
        assert sorted(rows) == sorted(advertised)
        for b in resident:
            assert b.parent_digest is None or b.parent_digest in advertised
        assert len(d) == len(advertised) <= d.capacity
        assert d.stats()["pinned"] == sum(1 for v in pins.values() if v)

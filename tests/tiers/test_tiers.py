"""Offload tiers: the leader's slot index (LRU, pinning) and the workers' host/disk storage."""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from kvbm_plugin._util.plugins import TIERS_GROUP, get_plugin
from kvbm_plugin.consolidator_config import ConfigError
from kvbm_plugin.tiers._entry import TierEntry
from kvbm_plugin.tiers._rows import LeafOrder
from kvbm_plugin.tiers.base import TierSpec
from kvbm_plugin.tiers.content_keys import block_keys, chain_digest, key_of
from kvbm_plugin.tiers.disk import DiskTier
from kvbm_plugin.tiers.host import HostTier
from kvbm_plugin.tiers.index import TierFullError, TierIndex

SHAPE = (2, 2, 16)


def _block(seed: int) -> torch.Tensor:
    return (torch.arange(64, dtype=torch.float32).reshape(SHAPE) + seed) % 251


def test_index_lru_evicts_oldest_unpinned_and_never_pinned_or_pending() -> None:
    index = TierIndex("host", 2)
    a, _ = index.reserve(1, 11, None, [1])
    b, _ = index.reserve(2, 12, 11, [2])
    with pytest.raises(TierFullError):  # both pending: a write in flight is never evicted
        index.reserve(3, 13, None, [3])
    index.commit(1)
    index.commit(2)
    index.pin(a)  # in-flight read of block 1
    c, evicted = index.reserve(3, 13, None, [3])
    assert evicted is b and c.slot == b.slot and index.get(2) is None
    with pytest.raises(TierFullError):  # 1 pinned, 3 pending
        index.reserve(4, 14, None, [4])
    index.unpin(a)
    index.commit(3)
    assert index.lookup(1) is a  # touch: 1 becomes most recent, 3 is now the LRU
    _, evicted = index.reserve(4, 14, None, [4])
    assert evicted is not None and evicted.key == 3


def _twin_indexes() -> tuple[TierIndex, TierIndex, list[int]]:
    """Two indexes of the same history: chains of 4 committed blocks, every third block of
    the last chain pending, some touched out of order."""
    twins = (TierIndex("host", 64), TierIndex("host", 64))
    keys = list(range(1, 25))
    for index in twins:
        for k in keys:
            index.reserve(k, 100 + k, None if k % 4 == 1 else 99 + k, [k],
                          None if k % 4 == 1 else k - 1)
            if not (k > 20 and k % 3 == 0):
                index.commit(k)
        for k in (6, 2, 13):
            index.lookup(k)
    return twins[0], twins[1], keys


def _state(index: TierIndex) -> list[tuple[int, bool, int, int]]:
    return sorted((e.key, e.resident, e.pins, e.tick) for e in index.entries())


def _evictions(index: TierIndex) -> list[int]:
    out = []
    for k in range(1000, 1030):
        _, evicted = index.reserve(k, k, None, [k])
        index.commit(k)
        out.append(-1 if evicted is None else evicted.key)
    return out


def test_leaf_order_pop_first_takes_the_oldest_as_remove_would() -> None:
    """The eviction order's ``pop_first`` (each eviction's victim) against a sorted model,
    with adds at the end and at their own age, removes, and runs split and emptied."""
    rng = random.Random(7)
    class SmallRuns(LeafOrder):
        __slots__ = ()
        LOAD = 4  # runs of at most 8: splits and emptied runs occur

    order = SmallRuns()
    model: dict[int, int] = {}  # tick -> slot
    clock = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.45 or not model:
            clock += rng.choice((1, 1, 1, 5))
            tick = clock if rng.random() < 0.7 else clock - rng.randrange(clock)
            if tick in model or tick == 0:
                continue
            model[tick] = slot = rng.randrange(1 << 20)
            order.add(tick, slot)
        elif op < 0.75:
            oldest = min(model)
            assert order.first() == model[oldest]
            assert order.pop_first() == model.pop(oldest)
        else:
            tick = rng.choice(list(model))
            del model[tick]
            order.remove(tick)
        assert len(order) == len(model)
        assert order.first() == (model[min(model)] if model else -1)


def test_take_resident_is_lookup_and_pin_of_each_up_to_the_first_miss() -> None:
    fast, slow, _ = _twin_indexes()
    for start, stop in ((4, 8), (16, 24), (0, 3)):  # 21 is resident, 24 pending: stops there
        taken = fast.take_resident(list(range(1, 25)), start, stop)
        expected = []
        for k in range(start + 1, stop + 1):
            entry = slow.lookup(k)
            if entry is None:
                break
            slow.pin(entry)
            expected.append(entry.key)
        assert [e.key for e in taken] == expected and all(fast.holds(e) for e in taken)
    assert _state(fast) == _state(slow)
    assert _evictions(fast) == _evictions(slow)  # the same eviction order after


def test_skip_present_is_a_probe_of_each_up_to_the_first_absent() -> None:
    fast, slow, keys = _twin_indexes()
    for start in (0, 16, 20):
        n = fast.skip_present([*keys, 999], start, len(keys) + 1)
        count = 0
        for k in [*keys, 999][start:]:
            if not slow.probe(k)[1]:
                break
            count += 1
        assert n == count == len(keys) - start  # pending ones count, 999 stops it
    assert _state(fast) == _state(slow)
    assert _evictions(fast) == _evictions(slow)


def _entry_fields(index: TierIndex) -> list[tuple]:
    return sorted((e.key, e.event_hash, e.parent_event_hash, e.parent_key, e.token_ids,
                   e.scope, e.resident, e.pins, e.tick) for e in index.entries())


@pytest.mark.parametrize("big_token", [False, True])
def test_reserve_chain_is_reserve_of_each_block_in_order(big_token: bool) -> None:
    """One call for a run of a chain (the planner's) leaves the index as a reserve of each
    block would: the same rows (negative hashes, each block's parent its predecessor, tokens
    sliced per block or kept aside when the column cannot hold them, the scope), the same
    evictions in the same order, each handed over with its row in place (before the run's
    rows are written: the index then holds fewer blocks), and the same stop where the tier is
    full."""
    fast, slow, _ = _twin_indexes()
    width = 1
    chain = [500 + k for k in range(60)]
    hashes = [-(1 << 62) - k for k in range(60)]  # signed, as TensorRT-LLM's are
    tokens = [7000 + k for k in range(60)]
    if big_token:
        tokens[3] = 1 << 40  # past int32: that block's tokens live outside the column
    scope = (3, 9)
    seen: list[int] = []
    held: list[tuple[TierEntry, tuple]] = []

    def on_evict(index: TierIndex, slot: int) -> None:
        # The victim's row is still in its slot: read, or viewed (a demotion holds the view,
        # which keeps the victim's values once the slot is reused).
        key, event_hash = index.evicting(slot)
        seen.append(key)
        view = index.at(slot)
        assert (view.key, view.event_hash) == (key, event_hash)
        if len(held) < 2:
            held.append((view, (key, event_hash, view.parent_key, view.token_ids)))

    entries = fast.reserve_chain(chain, hashes, 42, tokens, width, 1, on_evict, scope)
    expected: list[int] = []
    parent_key, parent_hash = 1, 42
    for k, key in enumerate(chain):
        try:
            entry, evicted = slow.reserve(key, hashes[k], parent_hash, tokens[k:k + 1],
                                          parent_key)
        except TierFullError:
            break
        entry.scope = scope
        if evicted is not None:
            expected.append(evicted.key)
        parent_key, parent_hash = key, hashes[k]
    # The tier (64 slots, 24 used, 19 of them evictable) fills: both stop at one block.
    assert 40 < len(entries) < len(chain) and len(entries) == k
    assert seen == expected and len(seen) > 0
    assert len(held) == 2 and all(not fast.holds(v) for v, _ in held)
    assert [(v.key, v.event_hash, v.parent_key, v.token_ids) for v, _ in held] == \
        [fields for _, fields in held]
    assert all(v.key not in fast for v, _ in held)
    assert all(fast.holds(e) for e in entries)
    assert [e.parent_key for e in entries] == [1, *chain[:len(entries) - 1]]
    assert _entry_fields(fast) == _entry_fields(slow)
    for key in chain[:len(entries)]:
        fast.commit(key)
        slow.commit(key)
    assert _evictions(fast) == _evictions(slow)
    with pytest.raises(ValueError, match="not in the tier"):
        fast.reserve_chain([900], [1], None, [1], 1, 12345, lambda *_: None)


def test_commit_row_is_commit_and_store_fields_of_a_block_whose_parent_is_resident() -> None:
    """The write commit's one call (``OffloadTiers.finish_writes``) leaves the index as
    ``commit`` would (resident, the same LRU place, a pinned or parent row kept out of the
    eviction order, a disk signature) and returns the row ``store_fields`` reads (negative and
    absent parent hashes, tokens in the column or kept aside); a block whose parent is
    pending, or a view its block left, is not committed."""
    fast, slow, _ = _twin_indexes()
    for index in (fast, slow):
        index.reserve(40, -(1 << 63), -5, [1 << 40], 24)  # under the pending 24; odd tokens
        index.reserve(41, -7, None, [41])  # a root
        index.reserve(42, 8, -7, [42], 41)  # child of a pending block
        index.pin(index.get(20))  # a resident leaf, pinned (a load reads it)
    assert fast.commit_row(fast.get(40)) is None and fast.commit_row(fast.get(42)) is None
    rows = []
    for key, signatures in ((24, None), (41, {0: (4096, 17)}), (40, None), (42, None),
                            (20, None), (3, None), (8, None)):
        entry = fast.get(key)
        rows.append(fast.commit_row(entry, signatures))
        expected = slow.commit(key, signatures)
        assert rows[-1] == (key, expected.parent_key, *slow.store_fields(expected))
    assert rows[2][2:5] == (-(1 << 63), -5, [1 << 40]) and rows[1][3] is None
    assert _state(fast) == _state(slow) and _entry_fields(fast) == _entry_fields(slow)
    assert repr(fast) == repr(slow)  # the resident count
    assert fast.evictable() == slow.evictable()  # the pinned 20, the parents 24 and 41 out
    assert fast.get(41).signatures == slow.get(41).signatures == {0: (4096, 17)}
    gone = fast.get(42)
    fast.discard(41)
    slow.discard(41)
    assert fast.commit_row(gone) is None
    assert _evictions(fast) == _evictions(slow)


@pytest.mark.parametrize("given", ["none", "all", "short"])
@pytest.mark.parametrize("stop", ["none", "unnamed", "unnamed parent", "pending parent",
                                  "left", "no parent hash"])
def test_commit_named_is_commit_row_of_each_named_block_up_to_the_first_other(
        stop: str, given: str) -> None:
    """A run every rank wrote, committed in one call (``OffloadTiers.finish_writes``), leaves
    the index as ``commit_row`` of each block up to the first that is unnamed (its event hash
    its key), names its parent by the parent's key, has a parent not resident or left the
    tier, and returns what ``commit_row`` returns of each (hashes signed, tokens, scope);
    nothing from that block on is committed. ``given``: the run's token ids handed over (the
    planner's; the compiled loop, where built, takes the run), or those of its first two
    blocks only (the rest read from the rows)."""
    fast, slow, _ = _twin_indexes()
    chain = [60, 61, 62, 63, 64]
    for index in (fast, slow):
        index.reserve(59, -9, None, [59])
        index.commit(59)
        hashes = [-(1 << 63), 5, -6, 7, 1 << 63]
        parents = [-9, *hashes[:-1]]
        if stop == "unnamed":
            hashes[2] = 62  # reserved under its content key
        elif stop == "unnamed parent":
            parents[3] = 62  # its parent's name is its parent's key
        index.reserve_chain(chain[:3], hashes[:3], parents[0], [1 << 40, 2, 3], 1, 59,
                            lambda *_: None, scope=(7, None))
        index.reserve_chain(chain[3:], hashes[3:], parents[3], [4, 5], 1, 62,
                            lambda *_: None)
        if stop == "pending parent":
            index.discard(59)
            index.reserve(59, -9, None, [59])
            index.reserve_chain(chain, hashes, -9, [1, 2, 3, 4, 5], 1, 59, lambda *_: None)
        if stop == "no parent hash":
            index.get(63).parent_event_hash = None
    views = [fast.get(k) for k in chain]
    if stop == "left":
        fast.discard(63)
        slow.discard(63)
    expect = {"none": 5, "unnamed": 2, "unnamed parent": 3, "pending parent": 0, "left": 3,
              "no parent hash": 3}[stop]
    tokens = [1, 2, 3, 4, 5] if stop == "pending parent" else [1 << 40, 2, 3, 4, 5]
    rows = fast.commit_named(views) if given == "none" else fast.commit_named(
        views, tokens if given == "all" else tokens[:2], 1)
    assert len(rows) == expect
    for k, row in enumerate(rows):
        full = slow.commit_row(slow.get(chain[k]))
        assert full is not None and row == full[2:]
    if stop == "none":
        assert rows[0][:3] == (-(1 << 63), -9, [1 << 40]) and rows[0][3] == (7, None)
        assert rows[4][:2] == (1 << 63, 7)
    assert _state(fast) == _state(slow) and _entry_fields(fast) == _entry_fields(slow)
    assert fast.evictable() == slow.evictable() and repr(fast) == repr(slow)


@pytest.mark.parametrize("bad", ["hash", "key"])
def test_a_bad_block_in_a_chain_reserves_none_of_it(bad: str) -> None:
    """A run with a bad event hash or key anywhere raises before anything changes: no block
    of it is left pending with no op to finish it."""
    fast, slow, _ = _twin_indexes()
    keys, hashes = [500, 501, 502, 503], [-5, 6, 7, 8]
    if bad == "hash":
        hashes[2] = 1 << 64
    else:
        keys[2] = -1
    with pytest.raises(ValueError, match="event_hash" if bad == "hash" else "content key"):
        fast.reserve_chain(keys, hashes, None, [1, 2, 3, 4], 1, 1, lambda *_: None)
    assert _entry_fields(fast) == _entry_fields(slow) and len(fast) == len(slow)


def test_unpin_live_unpins_only_a_pinned_live_view() -> None:
    """A finished load's one call: a pinned live view is unpinned (evictable again once its
    last pin goes); an unpinned one, another tier's or one that left the tier is refused
    untouched (the caller's slow path decides)."""
    index, other = TierIndex("host", 4), TierIndex("disk", 4)
    a, _ = index.reserve(1, 11, None, [1])
    index.commit(1)
    assert not index.unpin_live(a)  # not pinned
    [taken] = index.take_resident([1], 0, 1)
    index.pin(taken)
    assert index.unpin_live(taken) and taken.pins == 1 and index.evictable() == 0
    assert index.unpin_live(taken) and taken.pins == 0 and index.evictable() == 1
    assert not other.unpin_live(taken)
    index.pin(taken)
    [gone] = index.discard(1)
    assert gone is taken and not index.unpin_live(taken) and taken.pins == 1


def test_unpin_live_all_is_unpin_live_of_each() -> None:
    """A finished run of loads unpinned in one call ends where :meth:`unpin_live` of each
    ends (pins, the eviction order, what is then evicted), and names the positions it left
    to the caller: a view that left the tier, another tier's, an unpinned one."""
    def build() -> tuple[TierIndex, TierIndex, list]:
        index, other = TierIndex("host", 8), TierIndex("disk", 4)
        index.reserve_chain([1, 2, 3, 4], [11, 12, 13, 14], None, [1, 2, 3, 4], 1, None,
                            lambda *_: None)
        index.reserve_chain([9], [19], None, [9], 1, None, lambda *_: None)
        for key in (1, 2, 3, 4, 9):
            index.commit(key)
        views = index.take_resident([1, 2, 3, 4], 0, 4)
        index.pin(views[1])  # a second pin: still pinned after one unpin
        [nine] = index.take_resident([9], 0, 1)
        index.discard(9)  # left the tier while pinned
        foreign, _ = other.reserve(5, 15, None, [5])
        a, _ = index.reserve(6, 16, None, [6])
        index.commit(6)  # resident, never pinned
        return index, other, views + [nine, foreign, index.get(6)]

    one, _, views = build()
    missed = [k for k, entry in enumerate(views) if not one.unpin_live(entry)]
    many, _, views2 = build()
    assert many.unpin_live_all(views2) == missed == [4, 5, 6]
    assert [e.pins for e in views2] == [e.pins for e in views]
    assert many.evictable() == one.evictable()
    evicted = [[], []]
    for k, index in enumerate((one, many)):
        index.reserve_chain(list(range(20, 26)), list(range(30, 36)), None, [7] * 6, 1, None,
                            lambda ix, slot, k=k: evicted[k].append(ix.evicting(slot)))
    assert evicted[0] == evicted[1] and evicted[0]


def test_an_index_without_kept_tokens_holds_them_until_dropped() -> None:
    """``keep_tokens=False`` (the leader's disk tier): a block's tokens are there until its
    STORE is registered, then dropped: no token column, nothing per block at rest."""
    index = TierIndex("disk", 4, keep_tokens=False)
    tokens = list(range(70000, 70016))
    a, _ = index.reserve(1, 11, None, tokens)
    b, _ = index.reserve(2, 12, 11, tokens[::-1], parent_key=1)
    assert a.token_ids == tuple(tokens) and b.token_ids == tuple(tokens[::-1])
    index.commit(1)
    a.drop_tokens()
    with pytest.raises(LookupError, match="dropped"):
        a.token_ids  # noqa: B018 - the property raises
    assert b.token_ids == tuple(tokens[::-1])  # another entry keeps its own
    b.drop_tokens()
    assert len(index._tok) == 0 and not index._odd_tokens
    evicted = index.discard(2)[0]
    assert evicted.token_ids == ()  # a detached view of a dropped entry: nothing kept
    c, _ = index.reserve(3, 13, None, tokens)  # a reused slot has its own tokens again
    assert c.token_ids == tuple(tokens)
    kept = TierIndex("host", 4)
    d, _ = kept.reserve(1, 11, None, tokens)
    d.drop_tokens()  # an index that keeps tokens keeps them (demotions read them)
    assert d.token_ids == tuple(tokens)


def test_index_discard_frees_slot_and_lookup_ignores_pending() -> None:
    index = TierIndex("disk", 1)
    entry, _ = index.reserve(7, 70, None, [0])
    assert index.lookup(7) is None  # pending is not a hit
    index.discard(7)
    again, evicted = index.reserve(8, 80, None, [0])
    assert again.slot == entry.slot and evicted is None


def test_chain_keys_depend_on_prefix_and_salt() -> None:
    toks = list(range(12))
    digests: list[bytes] = []
    keys = block_keys(toks, 4, digests=digests)
    assert len(keys) == 3 and digests[1] == chain_digest(digests[0], toks[4:8])
    assert keys == [key_of(d) for d in digests]
    assert block_keys([99, *toks[1:]], 4)[2] != keys[2]  # a different prefix changes later keys
    assert block_keys(toks, 4, "salt") != keys


def test_block_keys_are_chain_digests_along_the_chain() -> None:
    """block_keys packs a prompt once; every digest is still chain_digest's (the definition),
    every key its first 8 bytes."""
    rng = random.Random(7)
    for _ in range(50):
        bs = rng.choice([1, 3, 16, 32])
        toks = [rng.randrange(-(1 << 63), 1 << 63) if rng.random() < 0.05
                else rng.randrange(0, 200_000) for _ in range(rng.randrange(0, 9 * bs))]
        salt = rng.choice([None, "", "tenant-7", "ünï"])
        start = rng.randrange(0, 4)
        parent = rng.choice([None, bytes(16), b"\xff" * 16, rng.randbytes(16)])
        expected, digest = [], parent
        for i in range(start, len(toks) // bs):
            digest = chain_digest(digest, toks[i * bs:(i + 1) * bs], salt)
            expected.append(digest)
        got: list[bytes] = []
        assert block_keys(toks, bs, salt, start=start, parent=parent, digests=got) == \
            [key_of(d) for d in expected]
        assert got == expected
    # the definition, pinned
    assert chain_digest(None, [1, 2]).hex() == "9639ae593a1b42ae9e31167078ac8c01"
    assert key_of(chain_digest(None, [1, 2])) == 0xAE421B3A59AE3996


def test_tiers_are_registered_entry_points() -> None:
    assert get_plugin(TIERS_GROUP, "host") is HostTier
    assert get_plugin(TIERS_GROUP, "disk") is DiskTier


def test_host_roundtrip_and_reused_slot_reads_absent() -> None:
    host = HostTier(TierSpec(2, SHAPE, torch.float32, 0))
    host.write(1, 42, _block(1))
    out = torch.empty(SHAPE)
    assert host.read(1, 42, out) and torch.equal(out, _block(1))
    host.write(1, 43, _block(2))
    assert not host.read(1, 42, out)


@pytest.fixture
def disk(tmp_path) -> DiskTier:
    return DiskTier(TierSpec(4, SHAPE, torch.float32, rank=1, directory=str(tmp_path)))


def test_disk_roundtrip_atomic_no_tmp_left(disk: DiskTier, tmp_path) -> None:
    result = disk.write(2, 5, _block(3))
    assert result.ok and result.signature == (os.path.getsize(disk.path(2)),
                                              os.stat(disk.path(2)).st_mtime_ns)
    out = torch.empty(SHAPE)
    assert disk.read(2, 5, out) and torch.equal(out, _block(3))
    assert os.listdir(tmp_path / "rank1") == ["slot00000002.kvblk"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "trailing", "wrong_key", "missing"])
def test_disk_damaged_block_reads_absent(disk: DiskTier, damage: str) -> None:
    disk.write(0, 9, _block(4))
    path = disk.path(0)
    key = 9
    if damage == "flip":
        with open(path, "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "truncate":
        os.truncate(path, os.path.getsize(path) - 7)
    elif damage == "trailing":
        with open(path, "ab") as f:
            f.write(b"x")
    elif damage == "wrong_key":
        key = 10
    else:
        os.unlink(path)
    out = torch.full(SHAPE, -1.0)
    assert disk.read(0, key, out) is False


def test_disk_write_failure_is_reported_not_raised(disk: DiskTier, tmp_path) -> None:
    # The rank's directory path is taken by a file: every write fails with an OSError, also
    # for root (a permission-based setup is not enforced for root).
    (tmp_path / "rank1").write_bytes(b"not a directory")
    result = disk.write(0, 1, _block(0))
    assert not result.ok and result.error
    out = torch.full(SHAPE, -1.0)
    assert disk.read(0, 1, out) is False


def test_disk_directory_removed_mid_run_is_recreated(disk: DiskTier, tmp_path) -> None:
    assert disk.write(0, 1, _block(0)).ok
    shutil.rmtree(tmp_path / "rank1")  # e.g. a cache cleaner
    assert disk.write(1, 2, _block(1)).ok
    out = torch.empty(SHAPE)
    assert disk.read(1, 2, out) and torch.equal(out, _block(1))
    assert disk.dirs_recreated == 1 and disk.write_failures == 0


def test_leader_start_up_rejects_a_disk_directory_that_is_a_file(tmp_path) -> None:
    from kvbm_plugin.connector_leader import KvbmConnectorLeader
    from kvbm_plugin.testing.fake_trtllm import KvCacheConfig, LlmArgs, ParallelConfig

    taken = tmp_path / "a-file"
    taken.write_bytes(b"x")
    env = {"DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "false",
           "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "8",
           "DYN_KVBM_DISK_CACHE_DIR": str(taken)}
    with pytest.raises(ConfigError, match=f"DYN_KVBM_DISK_CACHE_DIR='?{re.escape(str(taken))}"):
        KvbmConnectorLeader(LlmArgs(KvCacheConfig(4), ParallelConfig(0, 1),
                                    kvbm_plugin_env=env, kvbm_plugin_group="disk-dir-file"))


def test_repeated_disk_write_failures_are_logged_rate_limited(caplog) -> None:
    from kvbm_plugin.tiers.base import WriteResult
    from kvbm_plugin.worker.disk_io import DiskIO

    class FullDisk:
        capacity = 1000

        def write(self, slot, key, block) -> WriteResult:
            return WriteResult(False, error="OSError: [Errno 28] No space left on device")

    reports = []
    disk_io = SimpleNamespace(tier=FullDisk(), _rank=7, _block_bytes=1, _metrics=None,
                              _counters=SimpleNamespace(add=lambda **kw: None),
                              _reporter=SimpleNamespace(report=lambda *a: reports.append(a)),
                              _progress=SimpleNamespace(save_ended=lambda req_ids: None))
    with caplog.at_level(logging.WARNING, logger="kvbm_plugin.connector_worker"):
        for slot in range(254):
            DiskIO._write(disk_io, slot, None, slot, slot, None, False)  # type: ignore[arg-type]
    assert len(reports) == 254 and not any(r[1] for r in reports)
    lines = [r for r in caplog.records if "disk write" in r.getMessage()]
    assert 1 <= len(lines) <= 2, len(lines)

"""The flat structures the leader's tier index and shared directory are built from (see
:class:`~.index.TierIndex` and :class:`~.shared.directory.SharedDirectory`).

Both keep their per-block state in ``array.array`` columns: no Python object per block, so the
cyclic garbage collector has nothing per block to traverse, and the heap per block is a few
machine words. Neither ever resizes in one step proportional to the tier: every operation is
bounded, whatever the tier's size.

* :class:`KeyTable`: content key -> slot, open addressing over a table sized once from the
  tier's capacity. A ``dict`` holding a million keys under churn (one delete and one insert per
  store) rebuilds itself every ~1.8M stores, ~65 ms of CPU each on this project's machines,
  and keeps ~150 B per key. :func:`key_table` makes the compiled form (``_keytable_c.c``)
  where it is built and not switched off (``DYN_KVBM_NATIVE``), else this one.
* :class:`LeafOrder`: the evictable leaves ordered by last use, as sorted runs of ticks. It holds
  exactly the evictable entries (an entry leaves it the moment it is pinned, touched, gains a
  child or goes), so taking the least recently used leaf never skips stale items.

Called on the leader's executor thread only (through the index); no locks.
"""

from __future__ import annotations

import struct
from array import array
from bisect import bisect_left
from typing import Any

from kvbm_plugin._util import compiled as _compiled

U64_MASK = (1 << 64) - 1
_HALVES = struct.Struct("<QQ")  # a 16-byte digest's two halves
_GOLDEN = 0x9E3779B97F4A7C15  # Fibonacci hashing: spreads sequential keys over the table


class KeyTable:
    """Maps a u64 content key to a slot by linear probing; the keys themselves live in the
    index's key column (``keys[slot]``), so the table holds one int32 per bucket.

    The table has at least twice as many buckets as the tier has slots (load <= 0.5, ~1.5
    probes per hit) and never grows; deletion shifts the cluster back (no tombstones), so
    probe lengths do not degrade under churn.
    """

    __slots__ = ("_table", "_mask", "_shift", "_keys")

    def __init__(self, capacity: int, keys: array[int]) -> None:
        bits = max(3, (2 * capacity).bit_length())
        self._table = array("i", [-1]) * (1 << bits)
        self._mask = (1 << bits) - 1
        self._shift = 64 - bits
        self._keys = keys

    def find(self, key: int) -> int:
        """The slot holding ``key`` (a u64), or -1."""
        table, keys, mask = self._table, self._keys, self._mask
        i = ((key * _GOLDEN) & U64_MASK) >> self._shift
        while True:
            slot = table[i]
            if slot < 0 or keys[slot] == key:
                return slot
            i = (i + 1) & mask

    def find_digests(self, digests: list[bytes], hi: array[int], stride: int) -> list[int]:
        """The slot of each of ``digests`` (16-byte digests: the table's key is a digest's
        first 8 bytes little-endian, and ``hi[stride * slot]`` must hold its last 8), or -1
        (also for a digest that is not 16 bytes): the shared directory's lookups of a run."""
        find, unpack = self.find, _HALVES.unpack
        out = []
        for digest in digests:
            slot = -1
            if isinstance(digest, bytes) and len(digest) == 16:
                lo, h = unpack(digest)
                slot = find(lo)
                if slot >= 0 and hi[stride * slot] != h:
                    slot = -1
            out.append(slot)
        return out

    def insert(self, key: int, slot: int) -> None:
        """Map ``key`` (absent; ``keys[slot] == key`` already) to ``slot``."""
        table, mask = self._table, self._mask
        i = ((key * _GOLDEN) & U64_MASK) >> self._shift
        while table[i] >= 0:
            i = (i + 1) & mask
        table[i] = slot

    def delete(self, key: int) -> None:
        """Forget ``key`` (present; ``keys[slot]`` still holds it)."""
        table, keys, mask, shift = self._table, self._keys, self._mask, self._shift
        i = ((key * _GOLDEN) & U64_MASK) >> shift
        while keys[table[i]] != key:
            i = (i + 1) & mask
        # Backward-shift deletion: move later members of the cluster whose home is at or
        # before the hole into it, so every key stays reachable from its home bucket.
        j = i
        while True:
            table[i] = -1
            while True:
                j = (j + 1) & mask
                slot = table[j]
                if slot < 0:
                    return
                home = ((keys[slot] * _GOLDEN) & U64_MASK) >> shift
                if (j - home) & mask >= (j - i) & mask:
                    break
            table[i] = slot
            i = j

    def clear(self) -> None:
        self._table = array("i", [-1]) * len(self._table)

    def buckets(self) -> list[int]:
        """Every bucket's slot (-1: empty), in table order (tests compare both forms)."""
        return list(self._table)


def key_table(capacity: int, keys: array[int], native: bool | None = None) -> Any:
    """A key table over ``keys`` (an ``array('Q')`` column): the compiled one where it is
    built and not switched off (``native``: as ``_util.compiled.choose`` reads it), else
    :class:`KeyTable`. Both answer every call alike."""
    compiled = _compiled.choose("tier_keys", native, "key_table")
    if compiled is None:
        return KeyTable(capacity, keys)
    return compiled.KeyTable(capacity, keys)


class LeafOrder:
    """The evictable entries as (tick, slot), ordered by tick (unique per entry): sorted runs
    of at most ``2 * LOAD`` ticks, found by bisection over each run's last tick.

    ``add`` of the most recent tick appends to the last run (O(1)); any other ``add`` or
    ``remove`` costs two bisections and a move of at most one run (~8 KB). ``first`` is O(1).
    """

    __slots__ = ("_ticks", "_slots", "_lasts", "_len")
    LOAD = 512

    def __init__(self) -> None:
        self._ticks: list[array[int]] = []
        self._slots: list[array[int]] = []
        self._lasts: list[int] = []  # last (largest) tick of each run
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def first(self) -> int:
        """The slot with the smallest tick, or -1 when empty."""
        return self._slots[0][0] if self._len else -1

    def add(self, tick: int, slot: int) -> None:
        lasts = self._lasts
        self._len += 1
        if not lasts:
            self._ticks.append(array("Q", (tick,)))
            self._slots.append(array("i", (slot,)))
            lasts.append(tick)
            return
        if tick > lasts[-1]:  # the newest (a touch, a commit): the end of the last run
            i = len(lasts) - 1
            ticks = self._ticks[i]
            ticks.append(tick)
            self._slots[i].append(slot)
            lasts[i] = tick
        else:  # an entry evictable again at its own age
            i = bisect_left(lasts, tick)
            ticks = self._ticks[i]
            j = bisect_left(ticks, tick)
            ticks.insert(j, tick)
            self._slots[i].insert(j, slot)
        if len(ticks) > 2 * self.LOAD:
            self._split(i)

    def _split(self, i: int) -> None:
        """Cut run ``i`` in two halves (bounds every insertion's move)."""
        ticks, slots, lasts = self._ticks[i], self._slots[i], self._lasts
        half = len(ticks) // 2
        self._ticks.insert(i + 1, ticks[half:])
        self._slots.insert(i + 1, slots[half:])
        del ticks[half:]
        del slots[half:]
        lasts.insert(i + 1, lasts[i])
        lasts[i] = ticks[-1]

    def peek(self, n: int) -> list[int]:
        """The ``n`` slots with the smallest ticks (all when fewer), smallest first; changes
        nothing. O(n)."""
        out: list[int] = []
        for slots in self._slots:
            if len(out) >= n:
                break
            out.extend(slots[:n - len(out)])
        return out

    def pop_first(self) -> int:
        """Remove the slot with the smallest tick (present: the order is not empty) and
        return it: an eviction's victim, with no bisection."""
        ticks, slots = self._ticks[0], self._slots[0]
        slot = slots[0]
        del ticks[0]
        del slots[0]
        self._len -= 1
        if not ticks:
            del self._ticks[0], self._slots[0], self._lasts[0]
        return slot

    def remove(self, tick: int) -> None:
        """Remove the item with ``tick`` (present)."""
        lasts = self._lasts
        i = bisect_left(lasts, tick)
        if i == len(lasts):
            raise KeyError(tick)
        ticks, slots = self._ticks[i], self._slots[i]
        j = bisect_left(ticks, tick)
        if ticks[j] != tick:
            raise KeyError(tick)
        del ticks[j]
        del slots[j]
        self._len -= 1
        if not ticks:
            del self._ticks[i], self._slots[i], lasts[i]
        elif j == len(ticks):
            lasts[i] = ticks[-1]

    def clear(self) -> None:
        self._ticks.clear()
        self._slots.clear()
        self._lasts.clear()
        self._len = 0

"""The rows of the leader's shared-tier directory: one row of ``array`` columns per resident
block, its key-table bucket, its place in the prefix tree and in the LRU order.

:class:`SharedRows` is the storage half of
:class:`~kvbm_plugin.tiers.shared.directory.SharedDirectory` (its base class): how a block is
written into a row, read back as a :class:`SharedBlock`, linked under its parent, queued as an
evictable leaf and taken out. The directory decides when (pending, leases, pins, availability)
and holds its lock around every call; nothing here locks, blocks or does I/O. Called on
TensorRT-LLM's executor thread (lookups, pins) and the shared agent's thread (admit, renew,
drop, expire), both on rank 0's leader. See the directory's module docstring for the layout's
size (about 210 bytes per 16-token block).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from typing import Final

from kvbm_plugin.tiers._rows import LeafOrder, key_table
from kvbm_plugin.tiers.shared.block import SharedBlock, make_block

_U64: Final = (1 << 64) - 1
_HALVES: Final = struct.Struct("<QQ")

# Row flags.
_USED: Final = 1
_QUEUED: Final = 2  # in the LRU order (an unpinned leaf)
_EH_NEG: Final = 4  # the event hash was given signed (negative)
_PEH_NONE: Final = 8
_PEH_NEG: Final = 16
_ODD_TOKENS: Final = 32  # tokens kept in the side table (another length, or beyond int32)

_Q_ROW: Final = array("Q", (0, 0, 0, 0))  # a new slot's _q row
_L_ROW: Final = array("i", (-1, -1, -1, -1, 0, 0))  # and its _l row


class SharedRows:
    """Resident shared blocks as rows (see the module docstring); ``capacity``: the most rows.
    Every method is called with the owning directory's lock held."""

    __slots__ = ("capacity", "_table", "_order", "_tick", "_lo", "_q", "_l", "_flags",
                 "_deadline", "_tok", "_tok_row", "_width", "_odd_tokens", "_scopes",
                 "_scope_ids", "_scope_refs", "_scope_free", "_free", "_used", "_pinned")

    def __init__(self, capacity: int) -> None:
        self.capacity: Final = capacity
        self._lo: array[int] = array("Q")  # digest bytes 0..7 (the table's key), little-endian
        # Per slot, the columns a lookup reads together, interleaved (one cache line each
        # instead of one per column at a million rows): _q holds hi (digest bytes 8..15),
        # event hash, parent event hash, last-use tick; _l holds the parent's, first
        # child's, next and previous sibling's slots (-1: none), pins, scope id.
        self._q: array[int] = array("Q")
        self._flags: array[int] = array("B")
        self._l: array[int] = array("i")
        self._deadline: array[float] = array("d")
        self._tok: array[int] = array("i")  # _width tokens per slot
        self._width = -1  # tokens per block, set by the first block admitted
        self._tok_row = struct.Struct("")  # one slot's tokens (set with _width)
        self._odd_tokens: dict[int, tuple[int, ...]] = {}
        self._scopes: list[tuple[int | None, tuple | None] | None] = [(None, None)]
        self._scope_ids: dict[tuple[int | None, tuple | None], int] = {(None, None): 0}
        self._scope_refs: list[int] = [0]
        self._scope_free: list[int] = []
        self._table = key_table(capacity, self._lo)
        self._order = LeafOrder()
        self._tick = 0
        self._free: array[int] = array("i")
        self._used = 0
        self._pinned = 0  # resident blocks with pins

    def _find(self, digest: bytes) -> int:
        try:
            lo, hi = _HALVES.unpack(digest)
        except (struct.error, TypeError):
            return -1
        slot = self._table.find(lo)
        return slot if slot >= 0 and self._q[4 * slot] == hi else -1

    def _find_all(self, digests: Sequence[bytes]) -> list[int]:
        """:meth:`_find` of each of ``digests`` (a run's), in one call of the key table
        (``KeyTable.find_digests``: a digest's last 8 bytes are column ``_q``'s first of
        four)."""
        return self._table.find_digests(
            digests if type(digests) is list else list(digests), self._q, 4)

    def _block(self, slot: int, digest: bytes | None = None) -> SharedBlock:
        flags = self._flags[slot]
        eh = self._q[4 * slot + 1]
        if flags & _EH_NEG:
            eh -= 1 << 64
        if flags & _PEH_NONE:
            peh = None
        else:
            peh = self._q[4 * slot + 2]
            if flags & _PEH_NEG:
                peh -= 1 << 64
        parent = self._l[6 * slot]
        if flags & _ODD_TOKENS:
            tokens = self._odd_tokens[slot]
        else:
            tokens = self._tok_row.unpack_from(self._tok, slot * self._tok_row.size)
        scope = self._scopes[self._l[6 * slot + 5]]
        assert scope is not None
        return make_block(
            digest if digest is not None else _HALVES.pack(self._lo[slot], self._q[4 * slot]),
            None if parent < 0 else _HALVES.pack(self._lo[parent], self._q[4 * parent]),
            eh, peh, tokens, scope[0], scope[1])

    def _claim_slot(self, parent: int, rows: int) -> tuple[int, bool]:
        """The slot for a new row whose parent is at slot ``parent`` (-1 for a root), with
        ``rows`` rows allocated so far: ``(slot, False)`` for a free or new one, ``(slot,
        True)`` for the evictable leaf the caller must remove first, ``(-1, False)`` when every
        row is pending, pinned or a parent. The parent leaves the eviction order first (it is
        about to gain a child), so the victim is never the new row's parent."""
        if self._free:
            return self._free.pop(), False
        if rows < self.capacity:
            return self._grow(), False
        if parent >= 0:
            self._dequeue(parent)
        victim = self._order.first()
        if victim < 0 and parent >= 0:
            self._offer(parent)  # nothing was taken: the parent is as it was
        return victim, victim >= 0

    def _insert(self, block: SharedBlock, parent: int, deadline: float,
                ) -> tuple[str, SharedBlock | None]:
        """Put ``block`` (absent; its parent at slot ``parent`` or -1) in a row. Returns
        (why refused or "", the block evicted for room or None)."""
        lo, hi = _HALVES.unpack(block.digest)
        if self._table.find(lo) >= 0:  # another digest with the same first 8 bytes
            return "collision", None
        victim: SharedBlock | None = None
        slot, evict = self._claim_slot(parent, len(self._lo))
        if slot < 0:
            return "full", None
        if evict:
            victim = self._block(slot)
            self._remove(slot)
        flags = _USED
        eh = block.event_hash
        if eh < 0:
            eh, flags = eh & _U64, flags | _EH_NEG
        peh = block.parent_event_hash
        if peh is None:
            peh, flags = 0, flags | _PEH_NONE
        elif peh < 0:
            peh, flags = peh & _U64, flags | _PEH_NEG
        self._lo[slot] = lo
        self._q[4 * slot] = hi
        self._q[4 * slot + 1] = eh
        self._q[4 * slot + 2] = peh
        self._l[6 * slot + 4] = 0
        self._deadline[slot] = deadline
        self._l[6 * slot + 1] = -1
        self._l[6 * slot] = parent
        self._l[6 * slot + 3] = -1
        self._l[6 * slot + 2] = -1
        if parent >= 0:
            self._dequeue(parent)
            first = self._l[6 * parent + 1]
            self._l[6 * slot + 2] = first
            if first >= 0:
                self._l[6 * first + 3] = slot
            self._l[6 * parent + 1] = slot
        if not self._store_tokens(slot, block.token_ids):
            flags |= _ODD_TOKENS
            self._odd_tokens[slot] = tuple(block.token_ids)
        self._l[6 * slot + 5] = self._intern((block.lora_id, block.extra_keys))
        self._flags[slot] = flags
        self._table.insert(lo, slot)
        self._used += 1
        self._touch(slot)
        return "", victim

    def _grow(self) -> int:
        slot = len(self._lo)
        self._lo.append(0)
        self._q.extend(_Q_ROW)
        self._l.extend(_L_ROW)
        self._flags.append(0)
        self._deadline.append(0.0)
        if self._width > 0:
            self._tok.extend(array("i", bytes(4 * self._width)))
        return slot

    def _store_tokens(self, slot: int, tokens: Sequence[int]) -> bool:
        """Tokens into the int32 column; False when they do not fit it (side table)."""
        if self._width < 0:
            self._width = len(tokens)
            self._tok_row = struct.Struct(f"={self._width}i")  # machine byte order, as the array
            self._tok.extend(array("i", bytes(4 * self._width * len(self._lo))))
        width = self._width
        if len(tokens) != width:
            return False
        try:
            self._tok[slot * width:(slot + 1) * width] = array("i", tokens)
        except OverflowError:
            return False
        return True

    def _intern(self, scope: tuple[int | None, tuple | None]) -> int:
        """Scopes (LoRA id, extra keys) are shared by every block of a tenant: one copy each,
        counted by use."""
        sid = self._scope_ids.get(scope)
        if sid is None:
            if self._scope_free:
                sid = self._scope_free.pop()
                self._scopes[sid] = scope
                self._scope_refs[sid] = 0
            else:
                sid = len(self._scopes)
                self._scopes.append(scope)
                self._scope_refs.append(0)
            self._scope_ids[scope] = sid
        if sid:
            self._scope_refs[sid] += 1
        return sid

    def _release_scope(self, sid: int) -> None:
        if sid:
            self._scope_refs[sid] -= 1
            if self._scope_refs[sid] == 0:
                scope = self._scopes[sid]
                assert scope is not None
                del self._scope_ids[scope]
                self._scopes[sid] = None
                self._scope_free.append(sid)

    def _remove(self, slot: int) -> None:
        """Take ``slot``'s row (a leaf now) out; the caller frees the slot or reuses it."""
        flags = self._flags[slot]
        if flags & _QUEUED:
            self._order.remove(self._q[4 * slot + 3])
        parent = self._l[6 * slot]
        if parent >= 0:
            prev, nxt = self._l[6 * slot + 3], self._l[6 * slot + 2]
            if prev >= 0:
                self._l[6 * prev + 2] = nxt
            else:
                self._l[6 * parent + 1] = nxt
            if nxt >= 0:
                self._l[6 * nxt + 3] = prev
            if self._l[6 * parent + 1] < 0:
                self._offer(parent)  # a leaf again, at its own age
        self._table.delete(self._lo[slot])
        if flags & _ODD_TOKENS:
            del self._odd_tokens[slot]
        self._release_scope(self._l[6 * slot + 5])
        self._l[6 * slot + 5] = 0
        if self._l[6 * slot + 4]:
            self._pinned -= 1
            self._l[6 * slot + 4] = 0
        self._flags[slot] = 0
        self._used -= 1

    def _touch(self, slot: int) -> None:
        self._dequeue(slot)
        self._tick += 1
        self._q[4 * slot + 3] = self._tick
        self._offer(slot)

    def _offer(self, slot: int) -> None:
        """Queue ``slot`` in the LRU order if it is an unpinned leaf."""
        flags = self._flags[slot]
        if flags & (_USED | _QUEUED) == _USED and not self._l[6 * slot + 4] \
                and self._l[6 * slot + 1] < 0:
            self._order.add(self._q[4 * slot + 3], slot)
            self._flags[slot] = flags | _QUEUED

    def _dequeue(self, slot: int) -> None:
        flags = self._flags[slot]
        if flags & _QUEUED:
            self._order.remove(self._q[4 * slot + 3])
            self._flags[slot] = flags & ~_QUEUED

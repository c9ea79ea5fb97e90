"""The leader's slot index of one offload tier (:class:`TierIndex`).

Which content key sits in which slot, whether its bytes are known to be there on every rank
(``resident``) or still being written (``pending``), how many in-flight reads pin it, and LRU
order. Owned by the leader (rank 0) and called on TensorRT-LLM's executor thread (the
scheduler's calls) and the leader's report path; workers never see it: they learn slot numbers
only from the connector metadata, so every rank writes the same slot for the same block. Pure
Python, no torch.
"""

from __future__ import annotations

import weakref
from array import array
from collections.abc import Sequence
from typing import Any

from kvbm_plugin.tiers._entry import (
    _EH_NEG,
    _NO_TOKENS,
    _ODD_TOKENS,
    _PEH_NEG,
    _PEH_NONE,
    _QUEUED,
    _RESIDENT,
    _S_PINS,
    _USED,
    TierEntry,
)
from kvbm_plugin.tiers._rows import KeyTable, LeafOrder, SlotRows
from kvbm_plugin.tiers.content_keys import Signature, TierName

# Same bits as content_keys' mask: a hash is accepted signed or unsigned.
_U64_MASK = (1 << 64) - 1
_I64_MIN = -(1 << 63)
_SIG_MAX = (1 << 63) - 1


def _u64(value: int, what: str) -> tuple[int, bool]:
    """``value`` (a signed or unsigned 64-bit hash) as (u64 bits, negative)."""
    if 0 <= value <= _U64_MASK:
        return value, False
    if _I64_MIN <= value < 0:
        return value & _U64_MASK, True
    raise ValueError(f"{what} {value!r} is not a 64-bit hash")


class TierFullError(RuntimeError):
    """No slot can be freed: every entry is pending, pinned or the parent of another entry."""


class TierIndex(SlotRows):
    """Slot allocation, residency, pinning and leaf-first LRU for one tier; owned by the leader.

    Called on the executor thread of rank 0 only (TensorRT-LLM's scheduler thread), so it takes
    no locks.

    **Prefix-closed.** The index never holds a block whose parent (``parent_key``) it does not
    hold too: :meth:`reserve` refuses an entry whose parent is absent, eviction takes only
    *leaves* (entries no other entry of this tier names as parent), and :meth:`discard` takes
    the entry's descendants with it. Every block a tier keeps can therefore be reused on its own
    (TensorRT-LLM matches a prefix contiguously) and every tier's event stream is prefix-closed.

    **Eviction** takes the least recently used leaf that is resident and unpinned (pending
    entries, a write in flight, are implicitly pinned). The evictable leaves, and only they,
    sit in a :class:`~._rows.LeafOrder` keyed by last use: an entry leaves it when it is used,
    pinned, gains a child or goes, and re-enters at its own age when it becomes evictable again
    (committed, unpinned, its last child left). Nothing stale is ever skipped: an eviction is
    two bisections and a move of a few KB, after a million-block chain as after ten blocks.

    **Rows, not objects.** Per block the index keeps a row of ``array`` columns indexed by slot
    (key, hashes, parent and sibling links, tick, pins, tokens as int32, disk signatures) and
    one bucket of a :class:`~._rows.KeyTable`: about 150 bytes for a 16-token block and no
    Python object the garbage collector would traverse. :class:`TierEntry` objects are views,
    made on demand. ``keep_tokens=False`` (the leader's disk tier: nothing copies its blocks
    to another tier) keeps a block's tokens only until :meth:`TierEntry.drop_tokens`, called
    once its STORE is registered: no token column, 64 bytes less per 16-token block.
    """

    __slots__ = ("name", "capacity", "evictions", "keeps_tokens", "_table", "_order", "_clock",
                 "_free", "_used", "_resident", "_width", "_key", "_eh", "_peh", "_flags",
                 "_parent", "_child", "_next", "_prev", "_tick", "_pins", "_scope", "_tok", "_sig",
                 "_odd_tokens", "_scopes", "_scope_ids", "_scope_refs", "_scope_free",
                 "_views", "_views_purge_at")

    def __init__(self, name: TierName, capacity: int, *, keep_tokens: bool = True) -> None:
        if capacity < 0:
            raise ValueError(f"{name} tier capacity {capacity} must be >= 0")
        if capacity >= 1 << 31:
            raise ValueError(f"{name} tier capacity {capacity} must be < 2**31 blocks")
        self.name: TierName = name
        self.capacity = capacity
        self.evictions = 0
        # An index that keeps tokens only until announced (``keep_tokens=False``: the leader's
        # disk tier, whose blocks nothing copies elsewhere) has no token column (width 0):
        # each entry's tokens wait in _odd_tokens until TierEntry.drop_tokens.
        self.keeps_tokens = keep_tokens
        self._width = -1 if keep_tokens else 0  # tokens per block: set by the first reservation
        # slot -> the live view handed out for it (dead references purged in bulk)
        self._views: dict[int, weakref.ref[TierEntry]] = {}
        self._views_purge_at = 64
        self._init_rows()

    def _init_rows(self) -> None:
        self._key: array[int] = array("Q")
        self._eh: array[int] = array("Q")
        self._peh: array[int] = array("Q")
        self._flags: array[int] = array("B")
        self._parent: array[int] = array("i")  # parent's slot, -1: a root block
        self._child: array[int] = array("i")  # first child's slot, -1: a leaf
        self._next: array[int] = array("i")  # next / previous sibling's slot, -1: none
        self._prev: array[int] = array("i")
        self._tick: array[int] = array("Q")
        self._pins: array[int] = array("I")
        self._scope: array[int] = array("I")  # index into _scopes
        self._tok: array[int] = array("i")  # _width token ids per slot
        self._sig: dict[int, array[int]] = {}  # rank -> (size, mtime_ns) per slot, size -1: none
        self._odd_tokens: dict[int, tuple[int, ...]] = {}  # slot -> tokens the column can't hold
        self._scopes: list[tuple[int | None, int | None] | None] = [(None, None)]
        self._scope_ids: dict[tuple[int | None, int | None], int] = {(None, None): 0}
        self._scope_refs: list[int] = [0]
        self._scope_free: list[int] = []
        self._table = KeyTable(self.capacity, self._key)
        self._order = LeafOrder()
        self._clock = 0
        self._free: array[int] = array("i")  # freed slots, reused last-in first-out
        self._used = 0
        self._resident = 0

    def __repr__(self) -> str:
        return (f"TierIndex({self.name!r}, capacity={self.capacity}, used={self._used}, "
                f"resident={self._resident})")

    def __len__(self) -> int:
        return self._used

    def __contains__(self, key: int) -> bool:
        return self._find(key) >= 0

    def get(self, key: int) -> TierEntry | None:
        """The entry for ``key``, pending or resident."""
        slot = self._find(key)
        return None if slot < 0 else self._view(slot)

    def lookup(self, key: int) -> TierEntry | None:
        """The resident entry for ``key`` (and mark it most recently used), or None."""
        slot = self._find(key)
        if slot < 0 or not self._flags[slot] & _RESIDENT:
            return None
        self._touch(slot)
        return self._view(slot)

    def pin(self, entry: TierEntry) -> None:
        if entry._snap is not None:  # left the tier: nothing of the tier to hold
            entry._snap[_S_PINS] += 1
            return
        slot = self._own(entry)
        self._dequeue(slot)
        self._pins[slot] += 1

    def unpin(self, entry: TierEntry) -> None:
        if entry.pins <= 0:
            raise RuntimeError(f"{self.name} tier: unpin of unpinned block {entry.key:#x}")
        if entry._snap is not None:
            entry._snap[_S_PINS] -= 1
            return
        slot = self._own(entry)
        self._pins[slot] -= 1
        self._offer(slot)

    def children_of(self, key: int) -> set[int]:
        """Keys of this tier's entries whose parent is ``key`` (a copy)."""
        slot = self._find(key)
        kids: set[int] = set()
        child = self._child[slot] if slot >= 0 else -1
        while child >= 0:
            kids.add(self._key[child])
            child = self._next[child]
        return kids

    def is_leaf(self, key: int) -> bool:
        slot = self._find(key)
        return slot < 0 or self._child[slot] < 0

    def can_reserve(self) -> bool:
        return bool(self._free) or len(self._key) < self.capacity or len(self._order) > 0

    def evictable(self) -> int:
        """How many entries could be evicted now (resident, unpinned leaves)."""
        return len(self._order)

    def reserve(self, key: int, event_hash: int, parent_event_hash: int | None,
                token_ids: Sequence[int], parent_key: int | None = None,
                ) -> tuple[TierEntry, TierEntry | None]:
        """A pending entry for ``key`` in a free slot, evicting the LRU evictable leaf if needed.

        Returns ``(entry, evicted)``; the caller must register the eviction's REMOVE before the
        metadata that reuses the slot leaves the leader. Raises TierFullError when nothing can be
        evicted. ``key`` (a u64) must not be present; ``parent_key`` (None for a root block) must
        be (pending or resident): a tier never holds an orphan. The parent leaves the eviction
        order before a victim is chosen, so the eviction can never take it.
        """
        if not 0 <= key <= _U64_MASK:
            raise ValueError(f"{self.name} tier: content key {key!r} is not a u64")
        find = self._table.find
        if find(key) >= 0:
            raise RuntimeError(f"{self.name} tier: block {key:#x} is already present")
        if parent_key is None:
            parent = -1
        else:
            parent = find(parent_key) if 0 <= parent_key <= _U64_MASK else -1
            if parent < 0:
                raise ValueError(f"{self.name} tier: parent {parent_key:#x} of block {key:#x} "
                                 "is not in the tier (a tier holds prefix-closed chains only)")
        if 0 <= event_hash <= _U64_MASK:
            eh, flags = event_hash, _USED
        else:
            eh, _ = _u64(event_hash, "event_hash")
            flags = _USED | _EH_NEG
        if parent_event_hash is None:
            peh, flags = 0, flags | _PEH_NONE
        elif 0 <= parent_event_hash <= _U64_MASK:
            peh = parent_event_hash
        else:
            peh, _ = _u64(parent_event_hash, "parent_event_hash")
            flags |= _PEH_NEG
        evicted: TierEntry | None = None
        slot, evict = self._claim_slot(parent, len(self._key))
        if slot < 0:
            raise TierFullError(f"{self.name} tier: all {self.capacity} slots are pending, "
                                "pinned or parents of other blocks")
        if evict:
            evicted = self._remove(slot)
            self.evictions += 1
        self._key[slot] = key
        self._eh[slot] = eh
        self._peh[slot] = peh
        self._tick[slot] = 0
        self._pins[slot] = 0
        self._scope[slot] = 0
        self._child[slot] = -1
        self._parent[slot] = parent
        self._prev[slot] = -1
        if parent >= 0:
            if self._flags[parent] & _QUEUED:
                self._dequeue(parent)
            first = self._child[parent]
            self._next[slot] = first
            if first >= 0:
                self._prev[first] = slot
            self._child[parent] = slot
        else:
            self._next[slot] = -1
        if self._sig:
            for sig in self._sig.values():
                sig[2 * slot] = -1
        width = self._width
        if width > 0 and len(token_ids) == width:
            try:
                self._tok[slot * width:(slot + 1) * width] = array("i", token_ids)
            except (OverflowError, TypeError):
                flags |= _ODD_TOKENS
        elif not self._store_tokens(slot, token_ids):
            flags |= _ODD_TOKENS
        if flags & _ODD_TOKENS:
            self._odd_tokens[slot] = tuple(token_ids)
        self._flags[slot] = flags
        self._table.insert(key, slot)
        self._used += 1
        return self._view(slot), evicted

    def commit(self, key: int, signatures: dict[int, Signature] | None = None) -> TierEntry:
        """Mark ``key`` resident: every rank reported its bytes written."""
        slot = self._table.find(key) if 0 <= key <= _U64_MASK else -1
        if slot < 0:
            raise KeyError(key)
        flags = self._flags[slot]
        if not flags & _RESIDENT:
            self._flags[slot] = flags | _RESIDENT
            self._resident += 1
        if signatures:
            for rank, (size, mtime) in signatures.items():
                if not (0 <= size <= _SIG_MAX and 0 <= mtime <= _SIG_MAX):
                    raise ValueError(f"{self.name} tier: signature {(size, mtime)!r} of rank "
                                     f"{rank} is not two non-negative int64s")
                column = self._sig.get(rank)
                if column is None:
                    column = self._sig[rank] = array("q", (-1, 0)) * len(self._key)
                column[2 * slot] = size
                column[2 * slot + 1] = mtime
        self._touch(slot)
        ref = self._views.get(slot)
        view = ref() if ref is not None else None
        return view if view is not None else self._view(slot)

    def discard(self, key: int) -> list[TierEntry]:
        """Forget ``key`` and its descendants in this tier, freeing their slots (a failed write,
        a corrupt or stale block). Returns the entries forgotten (detached), children before
        parents; the caller registers a REMOVE for each resident one. Empty when ``key`` is
        absent."""
        slot = self._find(key)
        if slot < 0:
            return []
        preorder: list[int] = []
        stack = [slot]
        child_of, next_of = self._child, self._next
        while stack:  # iterative: a long chain must not hit the recursion limit
            node = stack.pop()
            preorder.append(node)
            child = child_of[node]
            while child >= 0:
                stack.append(child)
                child = next_of[child]
        gone: list[TierEntry] = []
        for node in reversed(preorder):  # every descendant before its ancestors
            gone.append(self._remove(node))
            self._free.append(node)
        return gone

    def resident_entries(self) -> list[TierEntry]:
        """A copy of every resident entry as it is now (detached views: introspection and
        tests; they hold no place in the tier and change nothing)."""
        flags = self._flags
        return [self._copy(s) for s in range(len(flags)) if flags[s] & _RESIDENT]

    def entries(self) -> list[TierEntry]:
        """A copy of every entry, pending or resident (tests and invariant checks)."""
        flags = self._flags
        return [self._copy(s) for s in range(len(flags)) if flags[s] & _USED]

    def clear(self) -> None:
        for slot in list(self._views):
            self._detach(slot)
        self._init_rows()

    # ---- internals ---------------------------------------------------------------------

    def _find(self, key: int) -> int:
        return self._table.find(key) if 0 <= key <= _U64_MASK else -1

    def _own(self, entry: TierEntry) -> int:
        if entry._index is not self:
            raise ValueError(f"{self.name} tier: {entry!r} belongs to another tier")
        return entry.slot

    def _view(self, slot: int) -> TierEntry:
        views = self._views
        ref = views.get(slot)
        if ref is not None:
            view = ref()
            if view is not None:
                return view
        view = TierEntry(self, slot)
        views[slot] = weakref.ref(view)
        if len(views) > self._views_purge_at:
            # Views live as long as the leader holds them (an op in flight, a load's plan):
            # drop the references that died, amortised O(1) per view made.
            for dead in [s for s, r in views.items() if r() is None]:
                del views[dead]
            self._views_purge_at = 2 * len(views) + 64
        return view

    def _copy(self, slot: int) -> TierEntry:
        view = TierEntry(self, slot)
        view._snap = self._snapshot(slot)
        return view

    def _detach(self, slot: int) -> TierEntry | None:
        """Freeze the live view of ``slot`` (if any) with its current values."""
        ref = self._views.pop(slot, None)
        view = ref() if ref is not None else None
        if view is not None:
            view._snap = self._snapshot(slot)
        return view

    def _snapshot(self, slot: int) -> list[Any]:
        flags = self._flags[slot]
        parent = self._parent[slot]
        eh = self._eh[slot]
        if flags & _PEH_NONE:
            peh = None
        else:
            peh = self._peh[slot]
            if flags & _PEH_NEG:
                peh -= 1 << 64
        if flags & _ODD_TOKENS:
            tokens: Any = self._odd_tokens[slot]
        else:
            width = max(self._width, 0)
            tokens = self._tok[slot * width:(slot + 1) * width]  # a tuple when read
        return [self._key[slot], eh - (1 << 64) if flags & _EH_NEG else eh, peh, tokens,
                None if parent < 0 else self._key[parent], bool(flags & _RESIDENT),
                self._pins[slot], self._tick[slot],
                self._signatures(slot) if self._sig else {}, self._scopes[self._scope[slot]]]

    def _grow(self) -> int:
        """A never-used slot: one more row in every column."""
        slot = len(self._key)
        for column in (self._key, self._eh, self._peh, self._tick):
            column.append(0)
        for column in (self._parent, self._child, self._next, self._prev):
            column.append(-1)
        self._flags.append(0)
        self._pins.append(0)
        self._scope.append(0)
        if self._width > 0:
            self._tok.extend(_ZEROS[:self._width] if self._width <= len(_ZEROS)
                             else array("i", bytes(4 * self._width)))
        for sig in self._sig.values():
            sig.extend(_NO_SIG)
        return slot

    def _store_tokens(self, slot: int, token_ids: Sequence[int]) -> bool:
        """Put the tokens in the flat int32 column; False when they do not fit it."""
        if self._width < 0:
            self._width = len(token_ids)
            self._tok.extend(array("i", bytes(4 * self._width * len(self._key))))
        width = self._width
        if len(token_ids) != width or width == 0:
            return width == 0 and not token_ids
        try:
            row = array("i", token_ids)
        except (OverflowError, TypeError):
            return False
        self._tok[slot * width:(slot + 1) * width] = row
        return True

    def _tokens(self, slot: int) -> tuple[int, ...]:
        flags = self._flags[slot]
        if flags & _ODD_TOKENS:
            return self._odd_tokens[slot]
        if flags & _NO_TOKENS:
            raise LookupError(f"{self.name} tier: the token ids of block {self._key[slot]:#x} "
                              "were dropped once its STORE was registered")
        width = max(self._width, 0)
        return tuple(self._tok[slot * width:(slot + 1) * width])

    def _drop_tokens(self, slot: int) -> None:
        flags = self._flags[slot]
        if not self.keeps_tokens and flags & _ODD_TOKENS:
            del self._odd_tokens[slot]
            self._flags[slot] = (flags & ~_ODD_TOKENS) | _NO_TOKENS

    def _event_hash(self, slot: int) -> int:
        value = self._eh[slot]
        return value - (1 << 64) if self._flags[slot] & _EH_NEG else value

    def _set_event_hash(self, slot: int, value: int) -> None:
        bits, negative = _u64(value, "event_hash")
        self._eh[slot] = bits
        self._flags[slot] = (self._flags[slot] & ~_EH_NEG) | (_EH_NEG if negative else 0)

    def _parent_event_hash(self, slot: int) -> int | None:
        flags = self._flags[slot]
        if flags & _PEH_NONE:
            return None
        value = self._peh[slot]
        return value - (1 << 64) if flags & _PEH_NEG else value

    def _set_parent_event_hash(self, slot: int, value: int | None) -> None:
        flags = self._flags[slot] & ~(_PEH_NEG | _PEH_NONE)
        if value is None:
            self._peh[slot] = 0
            flags |= _PEH_NONE
        else:
            bits, negative = _u64(value, "parent_event_hash")
            self._peh[slot] = bits
            flags |= _PEH_NEG if negative else 0
        self._flags[slot] = flags

    def _signatures(self, slot: int) -> dict[int, Signature]:
        return {rank: (column[2 * slot], column[2 * slot + 1])
                for rank, column in self._sig.items() if column[2 * slot] >= 0}

    def _set_scope(self, slot: int, scope: tuple[int | None, int | None]) -> None:
        """Scopes are interned (one per distinct (LoRA, salt), counted by use)."""
        sid = self._scope_ids.get(scope)
        if sid is None:
            scope = (scope[0], scope[1])
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
        self._release_scope(self._scope[slot])
        self._scope[slot] = sid

    def _release_scope(self, sid: int) -> None:
        if sid:
            self._scope_refs[sid] -= 1
            if self._scope_refs[sid] == 0:
                scope = self._scopes[sid]
                del self._scope_ids[scope]  # type: ignore[arg-type]
                self._scopes[sid] = None
                self._scope_free.append(sid)

    def _remove(self, slot: int) -> TierEntry:
        """Take ``slot``'s entry (a leaf now) out of the tier; returns it detached."""
        ref = self._views.pop(slot, None)
        view = ref() if ref is not None else None
        if view is None:
            view = TierEntry(self, slot)
        view._snap = self._snapshot(slot)
        flags = self._flags[slot]
        if flags & _QUEUED:
            self._order.remove(self._tick[slot])
        parent = self._parent[slot]
        if parent >= 0:
            prev, nxt = self._prev[slot], self._next[slot]
            if prev >= 0:
                self._next[prev] = nxt
            else:
                self._child[parent] = nxt
            if nxt >= 0:
                self._prev[nxt] = prev
            if self._child[parent] < 0:
                self._offer(parent)  # its last child left: a leaf again, at its own age
        self._table.delete(self._key[slot])
        if flags & _RESIDENT:
            self._resident -= 1
        if flags & _ODD_TOKENS:
            del self._odd_tokens[slot]
        if self._scope[slot]:
            self._release_scope(self._scope[slot])
            self._scope[slot] = 0
        self._flags[slot] = 0
        self._used -= 1
        return view

    def _touch(self, slot: int) -> None:
        flags = self._flags[slot]
        if flags & _QUEUED:
            self._order.remove(self._tick[slot])
            flags &= ~_QUEUED
        self._clock += 1
        tick = self._tick[slot] = self._clock
        if flags & _RESIDENT and not self._pins[slot] and self._child[slot] < 0:
            self._order.add(tick, slot)  # the newest: appended
            flags |= _QUEUED
        self._flags[slot] = flags

    def _offer(self, slot: int) -> None:
        """Queue ``slot`` in the eviction order if it is evictable now."""
        flags = self._flags[slot]
        if (flags & (_RESIDENT | _QUEUED)) == _RESIDENT and not self._pins[slot] \
                and self._child[slot] < 0:
            self._order.add(self._tick[slot], slot)
            self._flags[slot] = flags | _QUEUED

    def _dequeue(self, slot: int) -> None:
        flags = self._flags[slot]
        if flags & _QUEUED:
            self._order.remove(self._tick[slot])
            self._flags[slot] = flags & ~_QUEUED


_ZEROS = array("i", bytes(4 * 64))
_NO_SIG = array("q", (-1, 0))

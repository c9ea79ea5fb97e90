"""The rows of the leader's tier index, and the :class:`TierEntry` views onto them.

:class:`TierRows` is the storage half of :class:`~kvbm_plugin.tiers.index.TierIndex` (its base
class): one row of ``array`` columns per block (key, hashes, tree links, tick, pins, scope,
tokens as int32, disk signatures), its :class:`~._rows.KeyTable` bucket and its place in the
:class:`~._rows.LeafOrder` of evictable leaves; how a row is grown, written, read back
(:class:`TierEntry` views, live or frozen) and taken out. The index decides when (reserve,
commit, discard, pins); :class:`TierEntry` reads and writes a block's fields through these
methods. Called like the index: on rank 0's executor thread only (TensorRT-LLM's scheduler
thread), no locks. Pure Python, no torch.
"""

from __future__ import annotations

import weakref
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvbm_plugin.tiers._entry import (
    _EH_NEG,
    _NO_TOKENS,
    _ODD_TOKENS,
    _PEH_NEG,
    _PEH_NONE,
    _QUEUED,
    _RESIDENT,
    COMPILED_VIEWS,
    TierEntry,
)
from kvbm_plugin.tiers._rows import LeafOrder, key_table
from kvbm_plugin.tiers.content_keys import Signature, TierName

# Same bits as content_keys' mask: a hash is accepted signed or unsigned.
_U64_MASK = (1 << 64) - 1
_I64_MIN = -(1 << 63)


def _u64(value: int, what: str) -> tuple[int, bool]:
    """``value`` (a signed or unsigned 64-bit hash) as (u64 bits, negative)."""
    if 0 <= value <= _U64_MASK:
        return value, False
    if _I64_MIN <= value < 0:
        return value & _U64_MASK, True
    raise ValueError(f"{what} {value!r} is not a 64-bit hash")


GROW_ROWS = 256  # rows added to every column at once (_grow)
_NO_SIG = array("q", (-1, 0))


class TierRows:
    """A tier index's rows and views (see the module docstring); set up by ``_init_rows``,
    which :class:`~kvbm_plugin.tiers.index.TierIndex` (the only subclass) calls from its
    constructor and ``clear``."""

    __slots__ = ("name", "capacity", "keeps_tokens", "_table", "_order", "_clock", "_free",
                 "_used", "_rows", "_resident", "_width", "_key", "_eh", "_peh", "_flags",
                 "_parent", "_child", "_next", "_prev", "_tick", "_pins", "_scope", "_tok", "_sig",
                 "_odd_tokens", "_scopes", "_scope_ids", "_scope_refs", "_scope_free", "_views",
                 "_views_purge_at")
    if TYPE_CHECKING:
        name: TierName

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
        # (LoRA id, salt id[, multimodal digests]) of a block's tier events
        self._scopes: list[tuple[Any, ...] | None] = [(None, None)]
        self._scope_ids: dict[tuple[Any, ...], int] = {(None, None): 0}
        self._scope_refs: list[int] = [0]
        self._scope_free: list[int] = []
        self._table = key_table(self.capacity, self._key)
        self._order = LeafOrder()
        self._clock = 0
        self._free: array[int] = array("i")  # freed slots, reused last-in first-out
        self._rows = 0  # rows handed out; the columns hold up to GROW_ROWS more, never used
        self._used = 0
        self._resident = 0

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
            self._purge_views()
        return view

    def _views_of(self, slots: list[int]) -> list[TierEntry]:
        """:meth:`_view` of each of ``slots`` (a list), in one call: the compiled loop
        (``tiers/_entry_views.c``) where the views and the key table are compiled, else this
        loop, its reference."""
        views = self._views
        views_of = getattr(self._table, "views_of", None) if COMPILED_VIEWS else None
        if views_of is not None:
            out = views_of(views, slots, TierEntry, self)
        else:
            out = []
            for slot in slots:
                ref = views.get(slot)
                view = ref() if ref is not None else None
                if view is None:
                    view = TierEntry(self, slot)
                    views[slot] = weakref.ref(view)
                out.append(view)
        if len(views) > self._views_purge_at:
            self._purge_views()
        return out

    def _purge_views(self) -> None:
        """Views live as long as the leader holds them (an op in flight, a load's plan): drop
        the references that died, amortised O(1) per view made."""
        views = self._views
        for dead in [s for s, r in views.items() if r() is None]:
            del views[dead]
        self._views_purge_at = 2 * len(views) + 64

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

    def _hashes(self, slot: int, flags: int) -> tuple[int, int | None]:
        """(event hash, parent event hash) of ``slot`` (whose flags are ``flags``), signed as
        written: the row's two hash columns read together (a snapshot, a STORE's fields)."""
        eh = self._eh[slot]
        if flags & _EH_NEG:
            eh -= 1 << 64
        if flags & _PEH_NONE:
            return eh, None
        peh = self._peh[slot]
        return eh, peh - (1 << 64) if flags & _PEH_NEG else peh

    def _snapshot(self, slot: int) -> list[Any]:
        flags = self._flags[slot]
        parent = self._parent[slot]
        eh, peh = self._hashes(slot, flags)
        if flags & _ODD_TOKENS:
            tokens: Any = self._odd_tokens[slot]
        else:
            width = max(self._width, 0)
            tokens = self._tok[slot * width:(slot + 1) * width]  # a tuple when read
        return [self._key[slot], eh, peh, tokens,
                None if parent < 0 else self._key[parent], bool(flags & _RESIDENT),
                self._pins[slot], self._tick[slot],
                self._signatures(slot) if self._sig else {}, self._scopes[self._scope[slot]]]

    def _grow(self) -> int:
        """A never-used slot. The columns grow by up to :data:`GROW_ROWS` rows at a time
        (never past the capacity): a dozen appends per new row cost about 1.5 us of the
        executor thread's time while a tier fills; a chunk's extends cost a few us per
        chunk. Every row is written in full by ``reserve`` before it is used."""
        slot = self._rows
        if slot == len(self._key):
            self._extend(min(GROW_ROWS, self.capacity - slot) or 1)
        self._rows = slot + 1
        return slot

    def _extend(self, n: int) -> None:
        """``n`` more rows in every column (zeros; -1 for the tree links, no signature)."""
        zeros = array("Q", bytes(8 * n))
        for column in (self._key, self._eh, self._peh, self._tick):
            column.extend(zeros)
        links = array("i", [-1]) * n
        for column in (self._parent, self._child, self._next, self._prev):
            column.extend(links)
        self._flags.frombytes(bytes(n))
        small = array("I", bytes(4 * n))
        self._pins.extend(small)
        self._scope.extend(small)
        if self._width > 0:
            self._tok.extend(array("i", bytes(4 * self._width * n)))
        for sig in self._sig.values():
            sig.extend(_NO_SIG * n)

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

    def _set_scope(self, slot: int, scope: tuple[Any, ...]) -> None:
        """Scopes are interned (one per distinct (LoRA, salt[, multimodal digests]), counted
        by use)."""
        sid = self._scope_ids.get(scope)
        if sid is None:
            scope = tuple(scope)
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
        view = self._detach(slot)
        if view is None:
            view = self._copy(slot)
        self._unlink(slot)
        return view

    def _unlink(self, slot: int) -> None:
        """Take ``slot``'s row (a leaf now) out of the tier: out of the eviction order, its
        parent's children, the key table and the counts. A live view must be detached
        first."""
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

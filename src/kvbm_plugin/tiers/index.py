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
from collections.abc import Callable, Sequence
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
from kvbm_plugin.tiers.content_keys import Signature, TierName
from kvbm_plugin.tiers.index_rows import _I64_MIN, _U64_MASK, TierRows, _u64

_SIG_MAX = (1 << 63) - 1


class TierFullError(RuntimeError):
    """No slot can be freed: every entry is pending, pinned or the parent of another entry."""


class TierIndex(TierRows):
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

    **Rows, not objects** (:class:`~.index_rows.TierRows`, this class's base, in
    ``tiers/index_rows.py``). Per block the index keeps a row of ``array`` columns indexed by slot
    (key, hashes, parent and sibling links, tick, pins, tokens as int32, disk signatures) and
    one bucket of a :class:`~._rows.KeyTable`: about 150 bytes for a 16-token block and no
    Python object the garbage collector would traverse. :class:`TierEntry` objects are views,
    made on demand. ``keep_tokens=False`` (the leader's disk tier: nothing copies its blocks
    to another tier) keeps a block's tokens only until :meth:`TierEntry.drop_tokens`, called
    once its STORE is registered: no token column, 64 bytes less per 16-token block.
    """

    __slots__ = ("evictions",)

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

    def __repr__(self) -> str:
        return (f"TierIndex({self.name!r}, capacity={self.capacity}, used={self._used}, "
                f"resident={self._resident})")

    def __len__(self) -> int:
        return self._used

    def __contains__(self, key: int) -> bool:
        return self._find(key) >= 0

    def resident(self, key: int) -> bool:
        """Whether ``key`` is here and committed (no view made, no use marked)."""
        slot = self._find(key)
        return slot >= 0 and bool(self._flags[slot] & _RESIDENT)

    def get(self, key: int) -> TierEntry | None:
        """The entry for ``key``, pending or resident."""
        slot = self._find(key)
        return None if slot < 0 else self._view(slot)

    def lookup(self, key: int) -> TierEntry | None:
        """The resident entry for ``key`` (and mark it most recently used), or None."""
        return self.probe(key)[0]

    def store_fields(self, entry: TierEntry) -> tuple[int, int | None, list[int], Any]:
        """(event hash, parent event hash, token ids, scope) of ``entry``, read from its row in
        one call: what its tier STORE registration carries (``OffloadTiers.announce``, once
        per committed block on the executor thread). A detached view's own values."""
        if entry._snap is not None or entry._index is not self:
            return (entry.event_hash, entry.parent_event_hash, list(entry.token_ids),
                    entry.scope)
        return self._store_row(entry.slot)

    def _store_row(self, slot: int) -> tuple[int, int | None, list[int], Any]:
        """:meth:`store_fields` of a live row."""
        flags = self._flags[slot]
        if flags & (_ODD_TOKENS | _NO_TOKENS):
            tokens = list(self._tokens(slot))
        else:
            width = self._width
            tokens = self._tok[slot * width:(slot + 1) * width].tolist() if width > 0 else []
        return (*self._hashes(slot, flags), tokens, self._scopes[self._scope[slot]])

    def probe(self, key: int) -> tuple[TierEntry | None, bool]:
        """``(the resident entry for ``key``, marked most recently used, or None; whether
        ``key`` is here at all, pending included)``: :meth:`lookup` and ``key in self`` with
        one key lookup."""
        slot = self._find(key)
        if slot < 0:
            return None, False
        if not self._flags[slot] & _RESIDENT:
            return None, True
        self._touch(slot)
        return self._view(slot), True

    def take_resident(self, keys: Sequence[int], start: int, stop: int) -> list[TierEntry]:
        """The entries of ``keys[start:stop]`` resident here, up to the first that is not,
        each marked most recently used and pinned: :meth:`lookup` and :meth:`pin` of each in
        one call (the leader's match, executor thread)."""
        take_run = getattr(self._table, "take_run", None)
        if take_run is not None:
            # The compiled loop (tiers/_keytable_rows.c): the slots and their rows as the
            # loop below leaves them, and the old ticks of those that were evictable.
            slots, queued = take_run(keys, start, stop, self._columns(), self._clock)
            self._clock += len(slots)
            for tick in queued:
                self._order.remove(tick)
            return self._views_of(slots)
        find, flags_of, pins, tick_of = self._table.find, self._flags, self._pins, self._tick
        out: list[TierEntry] = []
        for i in range(start, stop):
            key = keys[i]
            slot = find(key) if 0 <= key <= _U64_MASK else -1
            if slot < 0:
                break
            flags = flags_of[slot]
            if not flags & _RESIDENT:
                break
            if flags & _QUEUED:
                self._order.remove(tick_of[slot])
                flags_of[slot] = flags & ~_QUEUED
            self._clock += 1
            tick_of[slot] = self._clock
            pins[slot] += 1
            out.append(self._view(slot))
        return out

    def skip_present(self, keys: Sequence[int], start: int, stop: int) -> int:
        """How many of ``keys[start:stop]`` are here (pending or resident), up to the first
        that is not; each resident one is marked most recently used: :meth:`probe` of each
        where nothing else is wanted of it (the offload planner, executor thread)."""
        find, flags_of, touch = self._table.find, self._flags, self._touch
        i = start
        while i < stop:
            key = keys[i]
            slot = find(key) if 0 <= key <= _U64_MASK else -1
            if slot < 0:
                break
            if flags_of[slot] & _RESIDENT:
                touch(slot)
            i += 1
        return i - start

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

    def unpin_live(self, entry: TierEntry) -> bool:
        """:meth:`unpin` of ``entry`` where it is this tier's live view and pinned, in one
        call (a finished load, executor thread); False, and nothing done, for any other."""
        if entry._snap is not None or entry._index is not self:
            return False
        slot = entry.slot
        pins = self._pins[slot]
        if pins <= 0:
            return False
        self._pins[slot] = pins - 1
        if pins == 1:
            self._offer(slot)
        return True

    def unpin_live_all(self, entries: Sequence[TierEntry]) -> list[int]:
        """:meth:`unpin_live` of each of ``entries`` in one call (a finished run of loads from
        this tier, executor thread); returns the positions of those it did not unpin (not
        this tier's live view, or not pinned), for the caller's own path."""
        pins_of, flags_of, child_of = self._pins, self._flags, self._child
        missed: list[int] = []
        for k, entry in enumerate(entries):
            if entry._snap is not None or entry._index is not self:
                missed.append(k)
                continue
            slot = entry.slot
            pins = pins_of[slot]
            if pins <= 0:
                missed.append(k)
                continue
            pins_of[slot] = pins - 1
            # _offer inline: the last pin gone, a resident leaf re-enters the eviction order
            # at its own age.
            if pins == 1 and child_of[slot] < 0:
                flags = flags_of[slot]
                if (flags & (_RESIDENT | _QUEUED)) == _RESIDENT:
                    self._order.add(self._tick[slot], slot)
                    flags_of[slot] = flags | _QUEUED
        return missed

    def holds(self, entry: TierEntry) -> bool:
        """Whether ``entry`` is this tier's live view of a block still in it (the same as
        ``index.get(entry.key) is entry`` while the caller keeps the view, without the key
        lookup: a view is detached when its block leaves the tier)."""
        return entry._snap is None and entry._index is self

    def commit_row(self, entry: TierEntry, signatures: dict[int, Signature] | None = None,
                   ) -> tuple[int, int | None, int, int | None, list[int], Any] | None:
        """Where ``entry`` is this tier's live view and a root block or a block whose parent
        is resident: mark it resident (:meth:`commit` without the key lookup) and return the
        committed row as its STORE needs it, in one call (``OffloadTiers.finish_writes``,
        once per committed block): (key, parent key, event hash, parent event hash, token
        ids, scope). Else None, and nothing done: the caller does not commit that write."""
        if entry._snap is not None or entry._index is not self:
            return None
        slot = entry.slot
        parent = self._parent[slot]
        if parent >= 0 and not self._flags[parent] & _RESIDENT:
            return None
        flags_of = self._flags
        if signatures:
            self._commit_slot(slot, signatures)
            flags = flags_of[slot]
        else:
            # _commit_slot and _touch inline, then _store_row's reads (once per committed
            # block, executor thread: 0.82 against 0.96 us with the calls, warm;
            # tests/tiers/test_tiers.py holds the two paths to the same result).
            flags = flags_of[slot]
            if not flags & _RESIDENT:
                flags |= _RESIDENT
                self._resident += 1
            if flags & _QUEUED:
                self._order.remove(self._tick[slot])
                flags &= ~_QUEUED
            self._clock = tick = self._clock + 1
            self._tick[slot] = tick
            if not self._pins[slot] and self._child[slot] < 0:
                self._order.add(tick, slot)  # the newest: appended
                flags |= _QUEUED
            flags_of[slot] = flags
        if flags & (_ODD_TOKENS | _NO_TOKENS):
            tokens = list(self._tokens(slot))
        else:
            width = self._width
            tokens = self._tok[slot * width:(slot + 1) * width].tolist() if width > 0 else []
        key_of = self._key
        return (key_of[slot], None if parent < 0 else key_of[parent], *self._hashes(slot, flags),
                tokens, self._scopes[self._scope[slot]])

    def commit_named(self, entries: Sequence[TierEntry], tokens: list[int] | None = None,
                     run_width: int = 0) -> list[tuple[Any, ...]]:
        """:meth:`commit_row` of each of ``entries`` in order (a run of saves every rank
        wrote, ``OffloadTiers.finish_writes``, executor thread), while each is a named block
        (its event hash is not its key; its parent's, where it has one, not the parent's key)
        that :meth:`commit_row` would commit: the (event hash, parent event hash, token ids,
        scope) of each committed, in order. Stops before the first other one, committing
        nothing from there: the caller takes the rest block by block. ``tokens``: the token
        ids the run's rows were reserved with (``reserve_chain``'s ``tokens``, ``run_width``
        per block), sliced for each block instead of read back from the rows: the same
        values, without making an int object per token."""
        flags_of, key_of, eh_of, peh_of = self._flags, self._key, self._eh, self._peh
        parent_of, tick_of, pins_of, child_of = self._parent, self._tick, self._pins, self._child
        tok, width, scopes, scope_of = self._tok, self._width, self._scopes, self._scope
        order = self._order
        out: list[tuple[Any, ...]] = []
        at = 0  # block k's tokens in ``tokens``: at = k * run_width
        commit_run = getattr(self._table, "commit_run", None)
        if commit_run is not None and type(tokens) is list and type(entries) is list:
            # The compiled loop (tiers/_keytable_rows.c) commits the run up to its first
            # block that stops it or is in the eviction order already; the blocks that join
            # the order (the leaf, usually) are added here; the loop below goes on from there.
            out, self._clock, added, queue = commit_run(
                entries, self, tokens, run_width, self._columns(), scopes, self._clock)
            self._resident += added
            for tick, slot in queue:
                order.add(tick, slot)  # the newest: appended
            if len(out) == len(entries):
                return out
            at = len(out) * run_width
            entries = entries[len(out):]
        for entry in entries:
            if entry._snap is not None or entry._index is not self:
                break
            slot = entry.slot
            flags = flags_of[slot]
            eh = eh_of[slot]
            if flags & _EH_NEG:
                eh -= 1 << 64
            if eh == key_of[slot]:
                break  # unnamed (reserved under its content key)
            parent = parent_of[slot]
            if parent >= 0:
                if not flags_of[parent] & _RESIDENT:
                    break
                peh = peh_of[slot]
                if flags & _PEH_NEG:
                    peh -= 1 << 64
                if flags & _PEH_NONE or peh == key_of[parent]:
                    break  # its parent's name is not known in its row
            else:
                peh = None if flags & _PEH_NONE else (
                    peh_of[slot] - (1 << 64) if flags & _PEH_NEG else peh_of[slot])
            # commit_row's commit, inline
            if not flags & _RESIDENT:
                flags |= _RESIDENT
                self._resident += 1
            if flags & _QUEUED:
                order.remove(tick_of[slot])
                flags &= ~_QUEUED
            self._clock = tick = self._clock + 1
            tick_of[slot] = tick
            if not pins_of[slot] and child_of[slot] < 0:
                order.add(tick, slot)  # the newest: appended
                flags |= _QUEUED
            flags_of[slot] = flags
            if tokens is not None and at + run_width <= len(tokens):
                row_tokens = tokens[at:at + run_width]  # a new list
                at += run_width
            elif flags & (_ODD_TOKENS | _NO_TOKENS):
                row_tokens = list(self._tokens(slot))
            else:
                row_tokens = tok[slot * width:(slot + 1) * width].tolist() if width > 0 else []
            out.append((eh, peh, row_tokens, scopes[scope_of[slot]]))
        return out

    def evicting(self, slot: int) -> tuple[int, int]:
        """(content key, event hash) of the block in ``slot``: what ``on_evict`` of
        :meth:`reserve_chain` reads of the block it is told leaves (executor thread)."""
        eh = self._eh[slot]
        return self._key[slot], eh - (1 << 64) if self._flags[slot] & _EH_NEG else eh

    def at(self, slot: int) -> TierEntry:
        """The live view of the block in ``slot`` (``on_evict`` of :meth:`reserve_chain`, to
        demote it: detached with its values when it leaves)."""
        return self._view(slot)

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
        return bool(self._free) or self._rows < self.capacity or len(self._order) > 0

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
        order before a victim is chosen, so the eviction can never take it. One block of
        :meth:`reserve_chain`.
        """
        evicted: list[TierEntry] = []
        entries = self.reserve_chain((key,), (event_hash,), parent_event_hash, token_ids,
                                     len(token_ids), parent_key,
                                     lambda _index, slot: evicted.append(self.at(slot)))
        if not entries:
            raise TierFullError(f"{self.name} tier: all {self.capacity} slots are pending, "
                                "pinned or parents of other blocks")
        return entries[0], evicted[0] if evicted else None

    def reserve_chain(self, keys: Sequence[int], event_hashes: Sequence[int],
                      parent_event_hash: int | None, tokens: Sequence[int], width: int,
                      parent_key: int | None,
                      on_evict: Callable[[TierIndex, int], Any],
                      scope: tuple[Any, ...] | None = None) -> list[TierEntry]:
        """Pending entries for a chain of blocks, in order: block ``k`` has key ``keys[k]``,
        event hash ``event_hashes[k]`` and tokens ``tokens[k * width:(k + 1) * width]``; its
        parent is block ``k - 1`` (the first block's is ``parent_key``, with
        ``parent_event_hash``). :meth:`reserve` of each in one call (the offload planner's run
        of a request's newly full blocks, executor thread). Each block evicted to make room
        goes to ``on_evict(self, slot)`` at once, while its row is still in ``slot``
        (:meth:`evicting` reads it, :meth:`at` views it; its ancestors are here too, for a
        demotion), before its slot is reused. Fewer entries than keys when the tier is
        full; ``scope`` (None: unscoped) is every entry's."""
        # Every key and event hash is checked before anything changes: a bad one raises with
        # no block of the run reserved (none left pending with no op to finish it). In bulk
        # (min and max), and one by one only to name the bad one.
        if len(event_hashes) != len(keys):
            raise ValueError(f"{self.name} tier: {len(event_hashes)} event hashes for "
                             f"{len(keys)} blocks")
        if not keys:
            return []
        if min(keys) < 0 or max(keys) > _U64_MASK:
            for key in keys:
                if not 0 <= key <= _U64_MASK:
                    raise ValueError(f"{self.name} tier: content key {key!r} is not a u64")
        if min(event_hashes) < _I64_MIN or max(event_hashes) > _U64_MASK:
            for h in event_hashes:
                _u64(h, "event_hash")
        if parent_key is None:
            parent = -1
        else:
            parent = self._find(parent_key)
            if parent < 0:
                raise ValueError(f"{self.name} tier: parent {parent_key:#x} of block "
                                 f"{keys[0]:#x} is not in the tier (a tier holds "
                                 "prefix-closed chains only)")
        if parent_event_hash is None:
            peh, peh_flags = 0, _PEH_NONE
        else:
            peh, negative = _u64(parent_event_hash, "parent_event_hash")
            peh_flags = _PEH_NEG if negative else 0
        # The tokens go into the flat column, sliced per block; a run the column cannot hold
        # (another width, a value past int32) goes block by block.
        fits = width > 0 and width == self._width and len(tokens) == width * len(keys)
        # The parent leaves the eviction order first and is held (it is about to gain a
        # child): no eviction below may take it, not even once its last other child went.
        if parent >= 0:
            self._dequeue(parent)
            self._pins[parent] += 1
            try:
                slots = self._claim_run(parent, len(keys), on_evict)
            finally:  # (an on_evict that raises leaves no pin behind)
                self._pins[parent] -= 1
            if not slots:
                self._offer(parent)  # nothing was reserved: the parent is as it was
                return []
        else:
            slots = self._claim_run(parent, len(keys), on_evict)
            if not slots:
                return []
        write_rows = getattr(self._table, "write_rows", None)
        done = None
        if write_rows is not None and fits and not self._sig:
            # The compiled loop (tiers/_keytable_rows.c): the rows _write_run writes, the
            # tokens read from the caller's list (None: one is not an int32, nothing written).
            done = write_rows(slots, keys, event_hashes, parent, peh, peh_flags, tokens,
                              width, self._columns())
            if done is not None:
                self._used += done
        if done is None:
            run_tokens = None
            if fits:
                try:
                    run_tokens = array("i", tokens)
                except (OverflowError, TypeError):
                    run_tokens = None
            done = self._write_run(slots, keys, event_hashes, parent, peh, peh_flags,
                                   tokens, run_tokens, width)
        if done < len(slots):
            # A 64-bit key collision: keys[done] is here already. The blocks before it stay
            # reserved (their ops go out), the rest of the claimed slots return.
            self._free.extend(reversed(slots[done:]))
            raise RuntimeError(f"{self.name} tier: block {keys[done]:#x} is already present")
        if scope is not None and scope != (None, None):
            for slot in slots:
                self._set_scope(slot, scope)
        return self._views_of(slots)

    def _claim_run(self, parent: int, n: int, on_evict: Callable[[TierIndex, int], Any],
                   ) -> list[int]:
        """Slots for ``n`` new rows, the first a child of ``parent`` (out of the eviction
        order by now), each next one the child of the one before: freed ones, rows the
        columns hold, else the least recently used evictable leaves', each victim handed to
        ``on_evict(self, slot)`` while its row is still in place and then taken out. Fewer
        when the tier is full. The new rows are pending (never evictable), so the victims are
        those that reserving the run block by block would take, in the same order."""
        free, capacity, rows = self._free, self.capacity, self._rows
        room = min(capacity, len(self._key)) - rows
        if not free and room >= n:  # (as the tier fills: new rows, one extend at most)
            self._rows = rows + n
            return list(range(rows, rows + n))
        slots: list[int] = []
        order = self._order
        for _ in range(n):
            rows = self._rows
            if free:
                slots.append(free.pop())
                continue
            if rows < capacity:
                if rows < len(self._key):
                    self._rows = rows + 1
                    slots.append(rows)
                else:
                    slots.append(self._grow())
                continue
            # The tier is full: the victim is the eviction order's first. The new row's parent
            # is out of that order (the run's parent was dequeued and is held by the caller;
            # each next one is a pending row of this run), so it is never the victim.
            if not order:
                break  # every row is pending, pinned or a parent
            slots.append(self._evict_first(on_evict))
        return slots

    def _evict_first(self, on_evict: Callable[[TierIndex, int], Any]) -> int:
        """Evict the eviction order's first row (the order is not empty) and return its slot,
        now empty: popped, not bisected for (before ``on_evict``, so nothing it does can
        choose it again), handed to ``on_evict(self, slot)`` while its row is in place, then
        taken out; its row is copied only where someone holds a view of it (most evictions:
        no one). The one eviction step of :meth:`_claim_run` and :meth:`evict_ahead`."""
        slot = self._order.pop_first()
        self._flags[slot] &= ~_QUEUED
        on_evict(self, slot)
        if self._views.get(slot) is not None:
            self._detach(slot)
        self._unlink(slot)
        self.evictions += 1
        return slot

    def next_victims(self, n: int, spare: int) -> list[int]:
        """The slots of the next ``n`` blocks evictions would take (least recently used
        leaves first) while fewer than ``spare`` slots are free (rows not allocated yet count
        as free), else []. Changes nothing; O(n)."""
        if len(self._free) + self.capacity - self._rows >= spare:
            return []
        return self._order.peek(n)

    def evict_ahead(self, spare: int, most: int, on_evict: Callable[[TierIndex, int], Any],
                    ready: Callable[[int], bool] | None = None) -> int:
        """Evict least recently used leaves until ``spare`` slots are free (rows not
        allocated yet count as free), at most ``most`` of them; how many. Each victim goes to
        ``on_evict(self, slot)`` while its row is in place, as in :meth:`reserve_chain`, and
        its slot to the free list, where the next reservations find it without evicting.
        ``ready(slot)``: whether the next victim may go now (the host tier in front of a disk
        tier: only once the disk holds it); the first that may not stops the call, so the
        victims stay those, and in the order, the saves would take.
        Called off the executor thread (the leader's keeper, under the leader's lock), so that
        a full tier's saves cost the executor thread what saves into room cost."""
        want = min(spare - len(self._free) - (self.capacity - self._rows), most)
        order, free = self._order, self._free
        done = 0
        while done < want and order:
            if ready is not None and not ready(order.first()):
                break
            free.append(self._evict_first(on_evict))
            done += 1
        return done

    def _write_run(self, slots: list[int], keys: Sequence[int], event_hashes: Sequence[int],
                   parent: int, peh: int, peh_flags: int, tokens: Sequence[int],
                   run_tokens: array[int] | None, width: int) -> int:
        """Write the rows of a run into ``slots`` (claimed; ``parent`` the first's parent,
        out of the eviction order) and map their keys; how many, stopping before a key that
        is here already. The reference of the compiled ``KeyTable.write_rows``, and the way
        for a run the token column cannot hold or a tier with disk signatures."""
        key_of, eh_of, peh_of, tick_of, pins_of, scope_of = (
            self._key, self._eh, self._peh, self._tick, self._pins, self._scope)
        child_of, parent_of, next_of, prev_of, flags_of = (
            self._child, self._parent, self._next, self._prev, self._flags)
        tok, sig, table = self._tok, self._sig, self._table
        find = table.find
        for k, slot in enumerate(slots):
            key = keys[k]
            if find(key) >= 0:  # (past the first block only on a 64-bit key collision)
                return k
            h = event_hashes[k]
            if h < 0:
                eh = h & _U64_MASK
                flags = _USED | _EH_NEG | peh_flags
            else:
                eh = h
                flags = _USED | peh_flags
            key_of[slot] = key
            eh_of[slot] = eh
            peh_of[slot] = peh
            tick_of[slot] = 0
            pins_of[slot] = 0
            scope_of[slot] = 0
            child_of[slot] = -1
            parent_of[slot] = parent
            prev_of[slot] = -1
            next_of[slot] = -1
            if parent >= 0:
                if k:  # the block before, written just now: pending and childless
                    child_of[parent] = slot
                else:
                    first = child_of[parent]
                    next_of[slot] = first
                    if first >= 0:
                        prev_of[first] = slot
                    child_of[parent] = slot
            if sig:
                for column in sig.values():
                    column[2 * slot] = -1
            if run_tokens is not None:
                tok[slot * width:(slot + 1) * width] = run_tokens[k * width:(k + 1) * width]
            else:
                row = tokens[k * width:(k + 1) * width]
                if not self._store_tokens(slot, row):
                    flags |= _ODD_TOKENS
                    self._odd_tokens[slot] = tuple(row)
            flags_of[slot] = flags
            table.insert(key, slot)
            self._used += 1
            # The next block's parent: this one.
            parent, peh = slot, eh
            peh_flags = _PEH_NEG if flags & _EH_NEG else 0
        return len(slots)

    def _columns(self) -> tuple[array[int], ...]:
        """The row columns the compiled loops (``KeyTable.write_rows``, ``take_run``,
        ``commit_run``) take, in their order (the key column is the table's own)."""
        return (self._eh, self._peh, self._flags, self._parent, self._child, self._next,
                self._prev, self._tick, self._pins, self._scope, self._tok)

    def commit(self, key: int, signatures: dict[int, Signature] | None = None) -> TierEntry:
        """Mark ``key`` resident: every rank reported its bytes written."""
        slot = self._table.find(key) if 0 <= key <= _U64_MASK else -1
        if slot < 0:
            raise KeyError(key)
        self._commit_slot(slot, signatures)
        ref = self._views.get(slot)
        view = ref() if ref is not None else None
        return view if view is not None else self._view(slot)

    def _commit_slot(self, slot: int, signatures: dict[int, Signature] | None) -> None:
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



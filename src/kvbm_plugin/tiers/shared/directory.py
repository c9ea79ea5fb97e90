"""The leader's shared-tier directory: which blocks of the shared store this engine can load now.

Who calls what, on which thread:

* TensorRT-LLM's executor thread (rank 0's leader, at match and load time): :meth:`lookup`,
  :meth:`pin`, :meth:`unpin`, :meth:`is_tracked`, ``len()``, :meth:`stats`. Each is a table
  probe under a short lock: no I/O, no allocation proportional to the directory.
* The :class:`~.agent.SharedAgent` thread (same process), which keeps the directory true by
  asking the store: everything else (:meth:`enqueue`, :meth:`take_pending`, :meth:`admit`,
  :meth:`renew`, :meth:`drop`, :meth:`expire`, :meth:`renewal_chunk`, :meth:`set_available`).
  The agent calls the store between these calls, never under the lock.

**Two kinds of tracked blocks.** A *pending* block was committed here (every rank reported its
put) or announced by another engine and awaits the agent's ``exists()`` check; a *resident*
block passed it: its object is in the store on every rank, leased until ``deadline``
(``exists()`` call start + ``lease_s``). Only resident blocks take a slot and are advertised.

**Offerable** (what :meth:`lookup` answers): resident, ``deadline - now >= margin_s`` and the
store available. So a block promised to a load keeps its lease for at least ``margin_s``, and a
pinned block keeps being renewed while the load runs.

**Prefix-closed.** A block is resident only while its parent (``parent_digest``) is, or it is a
root (``parent_digest`` None): :meth:`admit` refuses an orphan, :meth:`drop` and
:meth:`expire` take a block's descendants with it, and bounding (``capacity``) drops the least
recently used *leaf* that is not pinned. So every block this leader advertises is loadable
together with its whole prefix.

**Rows, not objects** (:class:`~.rows.SharedRows`, the directory's base class, in
``tiers/shared/rows.py``). Per resident block the directory keeps one row of ``array`` columns
indexed by slot (digest halves, event hashes, tree links, last use, pins, deadline, tokens as
int32; the columns a lookup reads together interleaved, so that a lookup in a million rows
touches a few cache lines, not one per column) and one bucket of a
:class:`~kvbm_plugin.tiers._rows.KeyTable` keyed by the digest's first 8 bytes (the other 8
are compared on every probe): about 210 bytes per 16-token block (``tracemalloc``, 100k and
1M), and no per-block Python object for the garbage collector. :class:`SharedBlock` values
(``tiers/shared/block.py``, re-exported here) are made on demand.
"""

from __future__ import annotations

import heapq
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from kvbm_plugin.tiers.shared.block import SharedBlock, check_block
from kvbm_plugin.tiers.shared.rows import _HALVES, _USED, SharedRows

__all__ = ["Admitted", "SharedBlock", "SharedDirectory", "check_block"]

@dataclass(frozen=True, slots=True)
class Admitted:
    """What :meth:`SharedDirectory.admit` did with each block of a batch."""

    resident: list[SharedBlock]  # now resident, in the order given (parents first)
    known: list[SharedBlock]  # were resident already (deadline renewed)
    waiting: list[SharedBlock]  # parent still pending: still pending, to be checked again
    refused: list[tuple[SharedBlock, str]]  # dropped from pending, with why
    evicted: list[SharedBlock]  # least recently used leaves dropped to make room


class SharedDirectory(SharedRows):
    """Residency of shared-tier blocks as the leader knows it (see the module docstring).

    ``capacity``: the most resident blocks (``DYN_KVBM_SHARED_TRACKED_BLOCKS``); ``lease_s``:
    how long an ``exists()`` keeps an object from eviction; ``margin_s``: the lease a block
    must have left to be offered; ``clock``: seconds, monotonic (the agent's deadlines are on
    it); ``pending_limit``: the most blocks awaiting their check (more are refused, counted).
    """

    __slots__ = ("lease_s", "margin_s", "pending_limit", "_clock", "_lock", "_available",
                 "_available_source", "_heap", "_heap_seq", "_pending", "_queue", "_ghost_pins",
                 "_n")

    def __init__(self, capacity: int, lease_s: float, margin_s: float,
                 clock: Callable[[], float] = time.monotonic, *,
                 pending_limit: int = 65536) -> None:
        if not 1 <= capacity < 1 << 31:
            raise ValueError(f"SharedDirectory capacity {capacity!r} must be 1..2**31-1 blocks")
        if not lease_s > 0:
            raise ValueError(f"SharedDirectory lease_s {lease_s!r} must be > 0")
        if not 0 <= margin_s < lease_s:
            raise ValueError(f"SharedDirectory margin_s {margin_s!r} must be >= 0 and below "
                             f"lease_s {lease_s!r}")
        if pending_limit < 1:
            raise ValueError(f"SharedDirectory pending_limit {pending_limit!r} must be >= 1")
        super().__init__(capacity)
        self.lease_s: Final = float(lease_s)
        self.margin_s: Final = float(margin_s)
        self.pending_limit: Final = pending_limit
        self._clock = clock
        self._lock = threading.Lock()
        self._available = True
        self._available_source: Callable[[], bool] | None = None
        # Deadline batches: (deadline, seq, slots given that deadline). A slot whose deadline
        # changed since is skipped when its batch comes due.
        self._heap: list[tuple[float, int, array[int]]] = []
        self._heap_seq = 0
        # Pending: digest -> (block, own, tries); _queue orders the digests to check.
        self._pending: dict[bytes, tuple[SharedBlock, bool, int]] = {}
        self._queue: deque[bytes] = deque()
        # Pins of blocks dropped while pinned: their unpins must not unpin a later entry.
        self._ghost_pins: dict[bytes, int] = {}
        self._n = dict.fromkeys(
            ("hits", "misses", "late", "unavailable", "pins", "pin_misses",
             "unpins", "admitted", "refused_orphan", "refused_full", "refused_collision",
             "refused_pending_full", "dropped_lru", "dropped_absent", "dropped_expired",
             "dropped_descendants", "renewed"), 0)

    # ---- executor thread -------------------------------------------------------------

    def lookup(self, digest: bytes) -> SharedBlock | None:
        """The block if it can be offered for a load now (resident, ``margin_s`` of lease
        left, store available), marking it most recently used; else None."""
        now = self._clock()
        n = self._n
        with self._lock:
            slot = self._find(digest)
            if slot < 0:
                n["misses"] += 1
                return None
            source = self._available_source
            if not self._available or (source is not None and not source()):
                n["unavailable"] += 1
                return None
            if self._deadline[slot] - now < self.margin_s:
                n["late"] += 1
                return None
            n["hits"] += 1
            self._touch(slot)
            return self._block(slot, digest)

    def pin(self, digest: bytes) -> bool:
        """Keep the resident block from being dropped as least recently used (it is renewed
        as long as it is present) until :meth:`unpin`. False if it is not resident (dropped
        since the lookup): nothing was pinned."""
        with self._lock:
            slot = self._find(digest)
            if slot < 0:
                self._n["pin_misses"] += 1
                return False
            self._n["pins"] += 1
            self._dequeue(slot)
            if not self._l[6 * slot + 4]:
                self._pinned += 1
            self._l[6 * slot + 4] += 1
            return True

    def unpin(self, digest: bytes) -> None:
        """Undo one successful :meth:`pin` (the load was reported). A block dropped meanwhile
        (absent, expired) is no longer here: its pin is just forgotten."""
        with self._lock:
            self._n["unpins"] += 1
            ghost = self._ghost_pins.get(digest)
            if ghost is not None:
                if ghost <= 1:
                    del self._ghost_pins[digest]
                else:
                    self._ghost_pins[digest] = ghost - 1
                return
            slot = self._find(digest)
            if slot < 0 or self._l[6 * slot + 4] == 0:
                raise RuntimeError(f"SharedDirectory.unpin of block {digest.hex()} that is not "
                                   "pinned")
            self._l[6 * slot + 4] -= 1
            if not self._l[6 * slot + 4]:
                self._pinned -= 1
                self._offer(slot)

    def is_tracked(self, digest: bytes) -> bool:
        """Resident, or pending (awaiting the agent's check)."""
        with self._lock:
            return digest in self._pending or self._find(digest) >= 0

    def tracked(self, digests: Sequence[bytes]) -> list[bool]:
        """:meth:`is_tracked` of each of ``digests``, under one hold of the lock (a run of
        write-throughs, executor thread)."""
        pending = self._pending
        with self._lock:
            slots = self._find_all(digests)
            if not pending:  # (most runs: nothing awaits the agent's check)
                return [slot >= 0 for slot in slots]
            return [digest in pending or slot >= 0
                    for digest, slot in zip(digests, slots, strict=True)]

    def __len__(self) -> int:
        """Resident blocks."""
        return self._used

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._n)
            out["lookups"] = out["hits"] + out["misses"] + out["late"] + out["unavailable"]
            out["resident"] = self._used
            out["pending"] = len(self._pending)
            out["pinned"] = self._pinned
            out["capacity"] = self.capacity
            out["available"] = int(self._available)
        return out

    # ---- agent thread ----------------------------------------------------------------

    def set_available(self, available: bool) -> None:
        """The agent's view of the store: while False nothing is offered."""
        self._available = bool(available)

    def set_available_source(self, source: Callable[[], bool] | None) -> None:
        """A second say on availability, asked at every lookup (no I/O, no lock: e.g. the
        circuit breaker's ``available``, which another thread's failed call may open first)."""
        self._available_source = source

    @property
    def available(self) -> bool:
        """The agent's view and the source's (see :meth:`set_available_source`)."""
        source = self._available_source
        return self._available and (source is None or bool(source()))

    @property
    def clock(self) -> Callable[[], float]:
        """The clock deadlines are on."""
        return self._clock

    def enqueue_many(self, blocks: Sequence[SharedBlock], own: bool) -> list[bool]:
        """:meth:`enqueue` of each of ``blocks`` in order, under one hold of the lock (the
        leader's commits of one batch of reports)."""
        with self._lock:
            return [self._enqueue(block, own) for block in blocks]

    def enqueue(self, block: SharedBlock, own: bool) -> bool:
        """Add ``block`` (checked: :func:`check_block`) to the pending blocks; ``own``: written
        by this engine (else announced by another). False when it is tracked already, or the
        pending blocks are at ``pending_limit`` (counted). An own block replaces an announced
        one still pending (True): this engine's own names for the block win over a peer's."""
        with self._lock:
            return self._enqueue(block, own)

    def _enqueue(self, block: SharedBlock, own: bool) -> bool:
        digest = block.digest
        held = self._pending.get(digest)
        if held is not None:
            if own and not held[1]:
                self._pending[digest] = (block, True, held[2])
                return True
            return False
        if self._find(digest) >= 0:
            return False
        if len(self._pending) >= self.pending_limit:
            self._n["refused_pending_full"] += 1
            return False
        self._pending[digest] = (block, own, 0)
        self._queue.append(digest)
        return True

    def take_pending(self, limit: int) -> list[tuple[SharedBlock, bool, int]]:
        """Up to ``limit`` pending blocks to check, oldest first, as (block, own, tries).
        They stay pending (tracked) until :meth:`admit` or :meth:`forget` settles them."""
        out = []
        seen: set[bytes] = set()
        with self._lock:
            queue, pending = self._queue, self._pending
            while queue and len(out) < limit:
                digest = queue.popleft()
                item = pending.get(digest)
                if item is not None and digest not in seen:
                    seen.add(digest)
                    out.append(item)
        return out

    def has_pending(self) -> bool:
        return bool(self._queue)

    def requeue(self, block: SharedBlock, own: bool, tries: int) -> None:
        """Check a pending block again later (``tries`` so far). The pending entry keeps its
        block and origin: an own block that replaced an announced one meanwhile stays."""
        with self._lock:
            held = self._pending.get(block.digest)
            if held is not None:
                self._pending[block.digest] = (held[0], held[1], tries)
                self._queue.append(block.digest)

    def forget(self, digests: Iterable[bytes]) -> None:
        """Settle pending blocks without admitting them (absent in the store, failed checks)."""
        with self._lock:
            for digest in digests:
                self._pending.pop(digest, None)

    def admit(self, blocks: Sequence[SharedBlock], deadline: float) -> Admitted:
        """Make checked blocks resident with ``deadline``, parents first: a block whose parent
        is pending waits; one whose parent is neither pending nor resident is refused (an
        orphan). At capacity, the least recently used unpinned leaf is dropped (``evicted``);
        with none, the block is refused."""
        resident: list[SharedBlock] = []
        known: list[SharedBlock] = []
        waiting: list[SharedBlock] = []
        refused: list[tuple[SharedBlock, str]] = []
        evicted: list[SharedBlock] = []
        slots = array("i")
        n = self._n
        with self._lock:
            todo = list(blocks)
            while todo:
                later: list[SharedBlock] = []
                for block in todo:
                    digest = block.digest
                    slot = self._find(digest)
                    if slot >= 0:
                        self._pending.pop(digest, None)
                        self._deadline[slot] = max(self._deadline[slot], deadline)
                        slots.append(slot)
                        known.append(block)
                        continue
                    if digest not in self._pending:
                        continue  # settled meanwhile (admitted twice in one batch)
                    parent = -1
                    if block.parent_digest is not None:
                        parent = self._find(block.parent_digest)
                        if parent < 0:
                            if block.parent_digest in self._pending:
                                later.append(block)
                            else:
                                del self._pending[digest]
                                n["refused_orphan"] += 1
                                refused.append((block, "orphan"))
                            continue
                    why, victim = self._insert(block, parent, deadline)
                    if victim is not None:
                        evicted.append(victim)
                    del self._pending[digest]
                    if why:
                        n[f"refused_{why}"] += 1
                        refused.append((block, why))
                        continue
                    slots.append(self._find(digest))
                    resident.append(block)
                if len(later) == len(todo):  # no parent of these became resident
                    waiting.extend(later)
                    break
                todo = later
            n["admitted"] += len(resident)
            n["dropped_lru"] += len(evicted)
            self._schedule(deadline, slots)
        return Admitted(resident, known, waiting, refused, evicted)

    def renewal_chunk(self, cursor: int, limit: int) -> tuple[int, list[bytes]]:
        """Digests of up to ``limit`` resident blocks from slot ``cursor`` on, and the cursor
        to continue from (the renewal sweep walks the slots in chunks, taking the lock once
        per chunk). An empty list: the sweep is done."""
        out: list[bytes] = []
        with self._lock:
            flags, lo, q = self._flags, self._lo, self._q
            end = len(flags)
            pack = _HALVES.pack
            while cursor < end and len(out) < limit:
                if flags[cursor] & _USED:
                    out.append(pack(lo[cursor], q[4 * cursor]))
                cursor += 1
        return cursor, out

    def renew(self, digests: Iterable[bytes], deadline: float) -> int:
        """Extend the leases of these resident blocks to ``deadline`` (an ``exists()`` found
        them on every rank); returns how many were resident."""
        slots = array("i")
        with self._lock:
            for digest in digests:
                slot = self._find(digest)
                if slot >= 0:
                    if deadline > self._deadline[slot]:
                        self._deadline[slot] = deadline
                    slots.append(slot)
            self._n["renewed"] += len(slots)
            self._schedule(deadline, slots)
        return len(slots)

    def drop(self, digests: Iterable[bytes], why: str = "absent") -> list[SharedBlock]:
        """Drop these resident blocks (``why``: "absent" in the store on some rank, or
        "expired") with their descendants; returns the blocks dropped, every descendant
        before its ancestors (REMOVE order for a prefix-closed stream)."""
        with self._lock:
            return self._drop_many((self._find(d) for d in digests), why)

    def expire(self, now: float | None = None) -> list[SharedBlock]:
        """Drop (with descendants) every resident block that can no longer be offered
        (``deadline - margin_s <= now``): its lease was not renewed in time."""
        now = self._clock() if now is None else now
        due: list[int] = []
        with self._lock:
            heap, deadlines, flags, margin = self._heap, self._deadline, self._flags, self.margin_s
            while heap and heap[0][0] - margin <= now:
                deadline, _, slots = heapq.heappop(heap)
                due.extend(s for s in slots if flags[s] & _USED and deadlines[s] == deadline)
            return self._drop_many(due, "expired")

    def next_expiry(self) -> float | None:
        """When :meth:`expire` next has something to check (clock time), or None."""
        with self._lock:
            return self._heap[0][0] - self.margin_s if self._heap else None

    def blocks(self) -> list[SharedBlock]:
        """Every resident block, parents before children (introspection, tests, a replay of
        the directory to a new consumer)."""
        with self._lock:
            out: list[SharedBlock] = []
            stack = [s for s in range(len(self._flags))
                     if self._flags[s] & _USED and self._l[6 * s] < 0]
            while stack:
                slot = stack.pop()
                out.append(self._block(slot))
                child = self._l[6 * slot + 1]
                while child >= 0:
                    stack.append(child)
                    child = self._l[6 * child + 2]
            return out

    def deadline_of(self, digest: bytes) -> float | None:
        """The lease deadline of a resident block, or None (tests, introspection)."""
        with self._lock:
            slot = self._find(digest)
            return None if slot < 0 else self._deadline[slot]

    # ---- internals (under the lock) ---------------------------------------------------

    def _drop_many(self, slots: Iterable[int], why: str) -> list[SharedBlock]:
        gone: list[SharedBlock] = []
        n = self._n
        for slot in slots:
            if slot < 0 or not self._flags[slot] & _USED:
                continue  # not resident, or dropped already as a descendant
            subtree: list[int] = []
            stack = [slot]
            while stack:  # iterative: a long chain must not hit the recursion limit
                node = stack.pop()
                subtree.append(node)
                child = self._l[6 * node + 1]
                while child >= 0:
                    stack.append(child)
                    child = self._l[6 * child + 2]
            for node in reversed(subtree):  # descendants before their ancestors
                block = self._block(node)
                if self._l[6 * node + 4]:
                    self._ghost_pins[block.digest] = \
                        self._ghost_pins.get(block.digest, 0) + self._l[6 * node + 4]
                self._remove(node)
                self._free.append(node)
                gone.append(block)
            n[f"dropped_{why}"] += 1
            n["dropped_descendants"] += len(subtree) - 1
        return gone

    def _schedule(self, deadline: float, slots: array[int]) -> None:
        if slots:
            self._heap_seq += 1
            heapq.heappush(self._heap, (deadline, self._heap_seq, slots))

"""Offload tiers: the storage interface (worker side) and the slot index (leader side).

Two halves, because in TensorRT-LLM the leader (rank 0) and the workers (every rank) may live in
different processes:

* :class:`TierIndex` is the leader's bookkeeping for one tier: which content key sits in which
  slot, whether its bytes are known to be there on every rank (``resident``) or still being
  written (``pending``), how many in-flight reads pin it, and LRU order. Pure Python, no torch.
* :class:`OffloadTier` is the storage one worker owns for its own rank: a host tensor pool or a
  directory of block files. Workers learn slot numbers only from the connector metadata, so
  every rank writes the same slot for the same block and holds its own head shard there.

Block identity is a content key: a chained hash over full blocks of token ids (``cache_salt``
mixed in). The hash TRT-LLM's KV events use for the same block (``RequestData.block_hashes``)
is stored next to it as ``event_hash`` and is what the tier events advertise.
"""

from __future__ import annotations

import hashlib
import heapq
import os
import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    import torch

TierName = Literal["host", "disk"]
TIER_HOST: TierName = "host"
TIER_DISK: TierName = "disk"

# Signature of one rank's copy of a disk block: (file size, mtime in ns). Cheap to re-check with
# one stat() call; any rewrite or truncation of the file changes it.
Signature = tuple[int, int]

_U64_MASK = (1 << 64) - 1


def chain_key(parent: int | None, tokens: Sequence[int], salt: str | None = None) -> int:
    """Content key (u64) of one full block given its parent block's key, tokens and salt."""
    h = hashlib.blake2b(digest_size=8, person=b"kvbm-blk")
    h.update(struct.pack("<Q", 0 if parent is None else parent & _U64_MASK))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    if salt:
        h.update(b"\x00salt\x00" + salt.encode("utf-8"))
    return int.from_bytes(h.digest(), "little")


def block_keys(tokens: Sequence[int], block_size: int, salt: str | None = None, *,
               start: int = 0, parent: int | None = None) -> list[int]:
    """Content keys of the full blocks ``start..`` of ``tokens`` (``parent`` = key of block
    ``start - 1``)."""
    keys: list[int] = []
    for i in range(start, len(tokens) // block_size):
        parent = chain_key(parent, tokens[i * block_size:(i + 1) * block_size], salt)
        keys.append(parent)
    return keys


def block_path(directory: str, rank: int, slot: int) -> str:
    """Where rank ``rank`` keeps disk slot ``slot`` (shared by the disk tier and the leader)."""
    return os.path.join(directory, f"rank{rank}", f"slot{slot:08d}.kvblk")


def stat_signature(path: str) -> Signature | None:
    """The (size, mtime_ns) of ``path``, or None when it is missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns)


# --------------------------------------------------------------------------------------------
# Leader side
# --------------------------------------------------------------------------------------------

@dataclass(slots=True)
class TierEntry:
    """One block in one tier, as the leader sees it."""

    key: int  # content key (chain over token ids)
    slot: int  # slot number every rank uses
    event_hash: int  # the hash KV events advertise (TRT-LLM's u64 when known)
    parent_event_hash: int | None  # event hash of the previous block of the chain
    token_ids: tuple[int, ...]  # the block's tokens, for the tier STORE registration
    parent_key: int | None = None  # content key of the previous block (None: a root block)
    resident: bool = False  # True once every rank reported the bytes written
    pins: int = 0  # in-flight reads from this slot; a pinned entry is never evicted
    tick: int = 0  # last use (the index's clock); the LRU order
    signatures: dict[int, Signature] = field(default_factory=dict)  # disk: rank -> signature
    scope: tuple[int | None, int | None] = (None, None)  # (LoRA id, salt id), for tier events


class TierFullError(RuntimeError):
    """No slot can be freed: every entry is pending, pinned or the parent of another entry."""


class TierIndex:
    """Slot allocation, residency, pinning and leaf-first LRU for one tier; owned by the leader.

    Called on the executor thread of rank 0 only (TensorRT-LLM's scheduler thread), so it takes
    no locks.

    **Prefix-closed.** The index never holds a block whose parent (``parent_key``) it does not
    hold too: :meth:`reserve` refuses an entry whose parent is absent, eviction takes only
    *leaves* (entries no other entry of this tier names as parent), and :meth:`discard` takes
    the entry's descendants with it. Every block a tier keeps can therefore be reused on its own
    (TensorRT-LLM matches a prefix contiguously) and every tier's event stream is prefix-closed.

    **Eviction** takes the least recently used leaf that is resident and unpinned (pending
    entries, a write in flight, are implicitly pinned). Evictable entries sit in a heap keyed by
    their last use; an entry's key is pushed again whenever it may have become evictable (used,
    committed, unpinned, its last child left), and stale heap items are skipped when popped:
    O(log n) amortised per operation, no scan of the tier.
    """

    __slots__ = ("name", "capacity", "_by_key", "_children", "_heap", "_clock", "_free",
                 "_resident", "evictions")

    def __init__(self, name: TierName, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"{name} tier capacity {capacity} must be >= 0")
        self.name: TierName = name
        self.capacity = capacity
        self._by_key: dict[int, TierEntry] = {}
        # parent key -> keys of the entries (pending or resident) whose parent it is
        self._children: dict[int, set[int]] = {}
        self._heap: list[tuple[int, int]] = []  # (tick, key) of possibly evictable entries
        self._clock = 0
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._resident = 0
        self.evictions = 0

    def __repr__(self) -> str:
        return (f"TierIndex({self.name!r}, capacity={self.capacity}, used={len(self._by_key)}, "
                f"resident={self._resident})")

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: int) -> bool:
        return key in self._by_key

    def get(self, key: int) -> TierEntry | None:
        """The entry for ``key``, pending or resident."""
        return self._by_key.get(key)

    def lookup(self, key: int) -> TierEntry | None:
        """The resident entry for ``key`` (and mark it most recently used), or None."""
        entry = self._by_key.get(key)
        if entry is None or not entry.resident:
            return None
        self._touch(entry)
        return entry

    def pin(self, entry: TierEntry) -> None:
        entry.pins += 1

    def unpin(self, entry: TierEntry) -> None:
        if entry.pins <= 0:
            raise RuntimeError(f"{self.name} tier: unpin of unpinned block {entry.key:#x}")
        entry.pins -= 1
        if entry.pins == 0:
            self._offer(entry)

    def children_of(self, key: int) -> set[int]:
        """Keys of this tier's entries whose parent is ``key`` (a copy)."""
        return set(self._children.get(key, ()))

    def is_leaf(self, key: int) -> bool:
        return not self._children.get(key)

    def can_reserve(self) -> bool:
        return bool(self._free) or self._victim(pop=False) is not None

    def reserve(self, key: int, event_hash: int, parent_event_hash: int | None,
                token_ids: Sequence[int], parent_key: int | None = None,
                ) -> tuple[TierEntry, TierEntry | None]:
        """A pending entry for ``key`` in a free slot, evicting the LRU evictable leaf if needed.

        Returns ``(entry, evicted)``; the caller must register the eviction's REMOVE before the
        metadata that reuses the slot leaves the leader. Raises TierFullError when nothing can be
        evicted. ``key`` must not be present; ``parent_key`` (None for a root block) must be
        (pending or resident): a tier never holds an orphan. The parent is linked before a
        victim is chosen, so the eviction can never take it.
        """
        if key in self._by_key:
            raise RuntimeError(f"{self.name} tier: block {key:#x} is already present")
        if parent_key is not None and parent_key not in self._by_key:
            raise ValueError(f"{self.name} tier: parent {parent_key:#x} of block {key:#x} is "
                             "not in the tier (a tier holds prefix-closed chains only)")
        self._link(key, parent_key)
        evicted: TierEntry | None = None
        if self._free:
            slot = self._free.pop()
        else:
            evicted = self._victim(pop=True)
            if evicted is None:
                self._unlink(key, parent_key)
                raise TierFullError(f"{self.name} tier: all {self.capacity} slots are pending, "
                                    "pinned or parents of other blocks")
            self._remove(evicted)
            self.evictions += 1
            slot = evicted.slot
        entry = TierEntry(key, slot, event_hash, parent_event_hash, tuple(token_ids),
                          parent_key)
        self._by_key[key] = entry
        return entry, evicted

    def commit(self, key: int, signatures: dict[int, Signature] | None = None) -> TierEntry:
        """Mark ``key`` resident: every rank reported its bytes written."""
        entry = self._by_key[key]
        if not entry.resident:
            entry.resident = True
            self._resident += 1
        if signatures:
            entry.signatures.update(signatures)
        self._touch(entry)
        return entry

    def discard(self, key: int) -> list[TierEntry]:
        """Forget ``key`` and its descendants in this tier, freeing their slots (a failed write,
        a corrupt or stale block). Returns the entries forgotten, children before parents; the
        caller registers a REMOVE for each resident one. Empty when ``key`` is absent."""
        entry = self._by_key.get(key)
        if entry is None:
            return []
        order: list[TierEntry] = []
        stack = [(entry, False)]
        while stack:  # iterative post-order: a long chain must not hit the recursion limit
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            stack.append((node, True))
            for child in self._children.get(node.key, ()):
                stack.append((self._by_key[child], False))
        for node in order:
            self._remove(node)
            self._free.append(node.slot)
        return order

    def resident_entries(self) -> list[TierEntry]:
        return [e for e in self._by_key.values() if e.resident]

    def entries(self) -> list[TierEntry]:
        """Every entry, pending or resident (tests and invariant checks)."""
        return list(self._by_key.values())

    def clear(self) -> None:
        self._by_key.clear()
        self._children.clear()
        self._heap.clear()
        self._resident = 0
        self._free = list(range(self.capacity - 1, -1, -1))

    # ---- internals ---------------------------------------------------------------------

    def _link(self, key: int, parent_key: int | None) -> None:
        if parent_key is not None:
            kids = self._children.get(parent_key)
            if kids is None:
                self._children[parent_key] = {key}
            else:
                kids.add(key)

    def _unlink(self, key: int, parent_key: int | None) -> None:
        if parent_key is None:
            return
        kids = self._children.get(parent_key)
        if kids is None:
            return
        kids.discard(key)
        if not kids:
            del self._children[parent_key]
            parent = self._by_key.get(parent_key)
            if parent is not None:
                self._offer(parent)  # its last child left: a leaf again, at its own age

    def _remove(self, entry: TierEntry) -> None:
        del self._by_key[entry.key]
        if entry.resident:
            self._resident -= 1
        self._unlink(entry.key, entry.parent_key)

    def _touch(self, entry: TierEntry) -> None:
        self._clock += 1
        entry.tick = self._clock
        self._offer(entry)

    def _offer(self, entry: TierEntry) -> None:
        """Push ``entry`` on the heap if it is evictable now (stale items are skipped later)."""
        if entry.resident and entry.pins == 0 and entry.key not in self._children:
            heapq.heappush(self._heap, (entry.tick, entry.key))
            if len(self._heap) > 2 * len(self._by_key) + 64:
                self._compact()

    def _compact(self) -> None:
        self._heap = [(e.tick, e.key) for e in self._by_key.values()
                      if e.resident and e.pins == 0 and e.key not in self._children]
        heapq.heapify(self._heap)

    def _victim(self, *, pop: bool) -> TierEntry | None:
        """The least recently used evictable leaf (taken off the heap when ``pop``)."""
        heap = self._heap
        while heap:
            tick, key = heap[0]
            entry = self._by_key.get(key)
            if (entry is None or entry.tick != tick or not entry.resident or entry.pins
                    or key in self._children):
                heapq.heappop(heap)  # stale: re-pushed whenever it becomes evictable again
                continue
            if pop:
                heapq.heappop(heap)
            return entry
        return None


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TierSpec:
    """What a worker's tier storage is built from (one per rank)."""

    capacity: int  # number of block slots (the leader's index has the same count)
    block_shape: tuple[int, ...]  # one block of the device pool: (layers, kv_factor, elements)
    dtype: Any  # torch.dtype of the device pool
    rank: int  # this worker's rank (disk files live under rank{rank}/)
    pin_memory: bool = False  # page-locked host memory (CUDA pools)
    directory: str | None = None  # disk tier base directory


@dataclass(frozen=True)
class WriteResult:
    ok: bool
    signature: Signature | None = None  # disk: the written file's (size, mtime_ns)
    error: str | None = None


class OffloadTier(ABC):
    """Storage for one tier on one rank. Built by the worker in ``register_kv_caches``.

    ``write``/``read`` move one whole block between a CPU tensor of ``spec.block_shape`` and
    slot ``slot``. They are called from the worker's transfer or disk thread, never from the
    executor thread, and may block on I/O. ``read`` returns False for a block that is absent,
    torn or corrupt: such a block is never served.
    """

    name: ClassVar[TierName]
    medium: ClassVar[str]

    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec

    @property
    def capacity(self) -> int:
        return self.spec.capacity

    @abstractmethod
    def write(self, slot: int, key: int, block: torch.Tensor) -> WriteResult:
        """Store ``block`` (CPU, contiguous) in ``slot`` under content key ``key``."""

    @abstractmethod
    def read(self, slot: int, key: int, out: torch.Tensor) -> bool:
        """Fill ``out`` (CPU, contiguous) from ``slot`` if it holds ``key`` intact."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; idempotent."""

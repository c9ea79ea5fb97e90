"""One data-parallel rank's batch in the event sink, in Python and in its compiled form.

Owned by :class:`kvbm_plugin.event_sink.KvEventSink`, read and changed under the sink's lock
(or on the executor thread by the V2 hooks); no torch or TensorRT-LLM import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbm_plugin._util.bounded import EvictionOrder
from kvbm_plugin.wire.publisher_base import WireEvent


def add_child(kids: dict[int, Any], parent: int, h: int) -> None:
    """Record published block ``h`` under ``parent`` in ``kids`` (parent -> its one published
    child's hash, or the set of them when there are more): the common chain costs no set,
    and a cascade finds a block's children without scanning the published blocks. The
    compiled loop (``_sink_c.c``, ``add_child``) keeps the same form."""
    cur = kids.get(parent)
    if cur is None:
        kids[parent] = h
    elif type(cur) is set:
        cur.add(h)
    else:
        kids[parent] = {cur, h}


def children(kids: dict[int, Any], h: int) -> tuple[int, ...] | set[int]:
    """The published children of ``h`` (read from ``kids``; see :func:`add_child`)."""
    cur = kids.get(h)
    if cur is None:
        return ()
    return cur if type(cur) is set else (cur,)


@dataclass
class Rank:
    """Per data-parallel rank: the batch being built and the hashes never published."""

    events: list[WireEvent] = field(default_factory=list)
    last: WireEvent | None = None  # last event appended, for coalescing (None after a flush)
    suppressed: dict[int, None] = field(default_factory=dict)  # unpublished: partial/filtered
    # The order of ``suppressed``'s keys, for evicting the oldest in O(1) at the cap.
    suppressed_order: EvictionOrder = field(default_factory=EvictionOrder)
    # V2 path: published and not yet removed, both ways (wire hash -> radix key or None).
    live: dict[int, bytes | None] = field(default_factory=dict)
    live_keys: dict[bytes, int] = field(default_factory=dict)
    # Buffered path: the prefix-closed published state (wire hash -> parent wire hash, and
    # parent -> its published children, see add_child). A store under an unpublished parent is
    # dropped, a removal of a block never published too, and a removal of a block with
    # published children removes those first (TensorRT-LLM never sends either; lost events
    # could).
    published: dict[int, int | None] = field(default_factory=dict)
    kids: dict[int, Any] = field(default_factory=dict)

    def unpublish(self, h: int) -> None:
        """Forget published block ``h`` (it has no published child) and its parent's link."""
        parent = self.published.pop(h)
        if parent is not None:
            kids = self.kids
            cur = kids[parent]
            if type(cur) is set:
                cur.discard(h)
                if len(cur) == 1:
                    kids[parent] = next(iter(cur))  # back to the one-child form
            else:
                del kids[parent]

    def suppress(self, h: int, cap: int) -> bool:
        """Remember unpublished hash ``h`` (its removal is then dropped); True when that put
        the map over ``cap`` and its oldest hash was forgotten. O(1)."""
        return self.suppressed_order.put(self.suppressed, h, None, cap)

    def forget_suppressed(self) -> None:
        """Forget every suppressed hash (the pool was cleared)."""
        self.suppressed.clear()
        self.suppressed_order.clear()

    @property
    def pending(self) -> int:
        """Events in the batch (any thread: reads, never changes it)."""
        return len(self.events)

    def take(self) -> list[WireEvent]:
        """The batch, handed over; a new one starts (flush)."""
        events = self.events
        self.events = []
        self.last = None
        return events


_native_rank_types: dict[Any, type] = {}


def native_rank_type(module: Any) -> type:
    """``Rank``'s compiled form (``RankBatch``: the open event kept as C arrays and written out
    as wire bytes), with the methods and the eviction order it shares with ``Rank``."""
    cls = _native_rank_types.get(module)
    if cls is None:
        base = module.RankBatch

        def __init__(self: Any, block_size: int) -> None:
            base.__init__(self, block_size)
            self.suppressed_order = EvictionOrder()

        cls = _native_rank_types[module] = type(
            "_NativeRank", (base,), {
                "__slots__": ("suppressed_order",), "__init__": __init__,
                "unpublish": Rank.unpublish, "suppress": Rank.suppress,
                "forget_suppressed": Rank.forget_suppressed})
    return cls

"""One data-parallel rank's batch in the event sink, in Python and in its compiled form.

Owned by :class:`kvbm_plugin.event_sink.KvEventSink`, read and changed under the sink's lock
(or on the executor thread by the V2 hooks); no torch or TensorRT-LLM import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbm_plugin.wire.publisher_base import WireEvent


@dataclass
class Rank:
    """Per data-parallel rank: the batch being built and the hashes never published."""

    events: list[WireEvent] = field(default_factory=list)
    last: WireEvent | None = None  # last event appended, for coalescing (None after a flush)
    suppressed: dict[int, None] = field(default_factory=dict)  # unpublished: partial/filtered
    # V2 path: published and not yet removed, both ways (wire hash -> radix key or None).
    live: dict[int, bytes | None] = field(default_factory=dict)
    live_keys: dict[bytes, int] = field(default_factory=dict)
    # Buffered path: the prefix-closed published state (wire hash -> parent wire hash, and
    # parent -> number of published children). A store under an unpublished parent is dropped,
    # a removal of a block never published too, and a removal of a block with published
    # children removes those first (TensorRT-LLM never sends either; lost events could).
    published: dict[int, int | None] = field(default_factory=dict)
    kids: dict[int, int] = field(default_factory=dict)

    def unpublish(self, h: int) -> None:
        """Forget published block ``h`` (it has no published child) and its parent's link."""
        parent = self.published.pop(h)
        if parent is not None:
            kids = self.kids
            if kids[parent] == 1:
                del kids[parent]
            else:
                kids[parent] -= 1

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
    as wire bytes), with the methods it shares with ``Rank``."""
    cls = _native_rank_types.get(module)
    if cls is None:
        cls = _native_rank_types[module] = type(
            "_NativeRank", (module.RankBatch,), {"__slots__": (), "unpublish": Rank.unpublish})
    return cls

"""Insertion order of a bounded dict's keys, so that evicting the oldest costs O(1).

``d.pop(next(iter(d)))`` finds a dict's oldest key by walking its entry table from the start,
past the slots of every key deleted since the table was last compacted: on a dict kept full by
evicting at the front that walk grows with the cap (at 100k entries each eviction cost ~200 us
instead of ~1 us). :class:`EvictionOrder` keeps the keys in a deque beside the dict instead.

Used by the naming tables (:mod:`kvbm_plugin.naming.names`: the names learned from events, on
the leader's executor thread; the LoRA adapters of stored chains, under the event sink's lock)
and by the event sink's suppressed-hash map (:class:`kvbm_plugin.events.rank.Rank`, under
the sink's lock or on the executor thread). Not thread-safe on its own; no torch import.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, MutableMapping
from typing import Any

# Stale keys (deleted from the dict by others) kept before the deque is rebuilt from the
# dict: at most about as many as live ones, so the rebuild's O(len) is paid once per as many
# insertions (amortised O(1)).
_SLACK = 64


class EvictionOrder:
    """The keys of one dict in the order they were added, oldest first.

    The owner calls :meth:`put` (or :meth:`added` after inserting a key that was absent, and
    :meth:`evict_oldest` when the dict is over its cap). Keys the owner (or compiled code)
    deletes directly stay in the deque as stale entries and are skipped when met; a key
    deleted and added again may then be met first at its earlier place, and is evicted that
    early (the maps bounded this way are guards against a producer that never cleans up, so
    exact age does not matter there).
    """

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: deque[Hashable] = deque()

    def added(self, d: MutableMapping[Any, Any], key: Hashable) -> None:
        """``key`` was just inserted into ``d`` (it was absent). O(1) amortised."""
        order = self._order
        order.append(key)
        if len(order) > 2 * len(d) + _SLACK:
            self._order = deque(d)  # drop the stale keys; dict order = insertion order

    def put(self, d: MutableMapping[Any, Any], key: Hashable, value: Any, cap: int) -> bool:
        """``d[key] = value``; a new key is recorded and, once ``d`` holds more than ``cap``
        keys, the oldest is evicted (True: one was). A key already there keeps its place, as
        in a dict. O(1) amortised."""
        if key in d:
            d[key] = value
            return False
        d[key] = value
        order = self._order  # added(), inlined: this runs once per block on hot paths
        order.append(key)
        if len(order) > 2 * len(d) + _SLACK:
            self._order = deque(d)
        if len(d) > cap:
            self.evict_oldest(d)
            return True
        return False

    def evict_oldest(self, d: MutableMapping[Any, Any]) -> Any:
        """Delete ``d``'s oldest key and return it (None when ``d`` is empty). O(1)
        amortised: each stale key is skipped once."""
        order = self._order
        while order:
            key = order.popleft()
            if key in d:
                del d[key]
                return key
        if d:  # keys added without added(): fall back to the dict's own order
            key = next(iter(d))
            del d[key]
            return key
        return None

    def clear(self) -> None:
        """The dict was cleared."""
        self._order.clear()

    def __len__(self) -> int:
        """Keys held, stale ones included (for tests of the bound)."""
        return len(self._order)

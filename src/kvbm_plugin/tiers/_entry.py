"""A :class:`TierEntry`: the view of one row of a :class:`~.index.TierIndex`, and the row flags.

Views are made by the index (``TierIndex.get``, ``reserve`` and the others) on the leader's
executor thread and read there; the index detaches a view when its entry leaves the tier.
A view's fields are stored by :class:`_EntryStorage`, or by its compiled form
(``tiers/_entry_views.c``, which also makes a run's views in one call) where that is built and
``DYN_KVBM_NATIVE`` does not switch it off, read once at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin.consolidator_config import ConfigError

if TYPE_CHECKING:
    from kvbm_plugin.tiers.content_keys import Signature
    from kvbm_plugin.tiers.index import TierIndex

# Row flags (TierIndex._flags)
_USED = 1  # the slot holds an entry
_RESIDENT = 2  # every rank reported the bytes written
_QUEUED = 4  # in the leaf order: resident, unpinned, no child
_EH_NEG = 8  # event_hash is negative (stored as its 64-bit two's complement)
_PEH_NEG = 16  # parent_event_hash likewise
_PEH_NONE = 32  # parent_event_hash is None
_ODD_TOKENS = 64  # token ids kept in TierIndex._odd_tokens (not the flat column)
_NO_TOKENS = 128  # token ids dropped (an index that keeps them only until announced)

# Where a detached TierEntry keeps each value (TierEntry._snap)
_S_KEY = 0
_S_EVENT_HASH = 1
_S_PARENT_EVENT_HASH = 2
_S_TOKEN_IDS = 3
_S_PARENT_KEY = 4
_S_RESIDENT = 5
_S_PINS = 6
_S_TICK = 7
_S_SIGNATURES = 8
_S_SCOPE = 9


class _EntryStorage:
    """A view's fields (the reference of ``_entry_views.c``'s ``EntryStorage``): the index,
    the slot number every rank uses, and the values (``_S_*``) once detached (None before)."""

    __slots__ = ("_index", "slot", "_snap", "__weakref__")

    def __init__(self, index: TierIndex, slot: int) -> None:
        self._index = index
        self.slot = slot
        self._snap: list[Any] | None = None


def _compiled_views() -> Any:
    """``_keytable_c`` where it is built and ``DYN_KVBM_NATIVE`` does not switch it off, else
    None (also for a value of the switch that is not a boolean: start-up refuses that value
    with its own error, and both forms behave the same)."""
    try:
        return _compiled.loops("tier_keys")
    except ConfigError:
        return None


_VIEWS_C = _compiled_views()


class TierEntry(_VIEWS_C.EntryStorage if _VIEWS_C is not None  # type: ignore[misc]
                else _EntryStorage):
    """One block in one tier, as the leader sees it: a view of the index's row for it.

    The index hands out one view per live entry at a time (``index.get(k) is entry`` holds
    while the entry is in the tier and someone keeps the view). Writable: ``event_hash``,
    ``parent_event_hash`` and ``scope``. Once the entry leaves the tier (evicted, discarded)
    the view is detached: it keeps the values it had, and changing them touches no tier.
    Made as ``TierEntry(index, slot)``.
    """

    __slots__ = ()
    if TYPE_CHECKING:
        _index: TierIndex
        slot: int
        _snap: list[Any] | None

    def __repr__(self) -> str:
        state = "detached" if self._snap is not None else self._index.name
        return (f"TierEntry({state}, key={self.key:#x}, slot={self.slot}, "
                f"event_hash={self.event_hash:#x}, resident={self.resident}, pins={self.pins})")

    @property
    def key(self) -> int:
        """Content key (chain over token ids)."""
        if self._snap is not None:
            return self._snap[_S_KEY]
        return self._index._key[self.slot]

    @property
    def event_hash(self) -> int:
        """The hash KV events advertise (TRT-LLM's when known)."""
        if self._snap is not None:
            return self._snap[_S_EVENT_HASH]
        return self._index._event_hash(self.slot)

    @event_hash.setter
    def event_hash(self, value: int) -> None:
        if self._snap is not None:
            self._snap[_S_EVENT_HASH] = value
        else:
            self._index._set_event_hash(self.slot, value)

    @property
    def parent_event_hash(self) -> int | None:
        """Event hash of the previous block of the chain (None: a root block)."""
        if self._snap is not None:
            return self._snap[_S_PARENT_EVENT_HASH]
        return self._index._parent_event_hash(self.slot)

    @parent_event_hash.setter
    def parent_event_hash(self, value: int | None) -> None:
        if self._snap is not None:
            self._snap[_S_PARENT_EVENT_HASH] = value
        else:
            self._index._set_parent_event_hash(self.slot, value)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The block's tokens, for the tier STORE registration (LookupError once dropped,
        see :meth:`drop_tokens`; a detached view's are empty then)."""
        if self._snap is not None:
            return tuple(self._snap[_S_TOKEN_IDS])
        return self._index._tokens(self.slot)

    def drop_tokens(self) -> None:
        """Forget the block's tokens, once its tier STORE is registered, in an index made
        with ``keep_tokens=False``; ``token_ids`` raises LookupError afterwards. Called by
        the leader on its executor thread. A no-op for a detached view."""
        if self._snap is None:
            self._index._drop_tokens(self.slot)

    @property
    def parent_key(self) -> int | None:
        """Content key of the previous block (None: a root block)."""
        if self._snap is not None:
            return self._snap[_S_PARENT_KEY]
        parent = self._index._parent[self.slot]
        return None if parent < 0 else self._index._key[parent]

    @property
    def resident(self) -> bool:
        """True once every rank reported the bytes written."""
        if self._snap is not None:
            return self._snap[_S_RESIDENT]
        return bool(self._index._flags[self.slot] & _RESIDENT)

    @property
    def pins(self) -> int:
        """In-flight reads from this slot; a pinned entry is never evicted."""
        if self._snap is not None:
            return self._snap[_S_PINS]
        return self._index._pins[self.slot]

    @property
    def tick(self) -> int:
        """Last use (the index's clock); the LRU order."""
        if self._snap is not None:
            return self._snap[_S_TICK]
        return self._index._tick[self.slot]

    @property
    def signatures(self) -> dict[int, Signature]:
        """Disk: rank -> (size, mtime_ns) of that rank's file, as written (a copy)."""
        if self._snap is not None:
            return dict(self._snap[_S_SIGNATURES])
        return self._index._signatures(self.slot)

    @property
    def scope(self) -> tuple[Any, ...]:
        """(LoRA id, salt id), and the digests of the multimodal items the block overlaps
        where there are any (``naming.names.block_scope``), for tier events."""
        if self._snap is not None:
            return self._snap[_S_SCOPE]
        return self._index._scopes[self._index._scope[self.slot]]

    @scope.setter
    def scope(self, value: tuple[Any, ...]) -> None:
        if self._snap is not None:
            self._snap[_S_SCOPE] = value
        else:
            self._index._set_scope(self.slot, value)


# Whether the views are the compiled form's: only then may an index on the compiled key table
# make them with its ``views_of`` (TierRows._views_of).
COMPILED_VIEWS = _VIEWS_C is not None

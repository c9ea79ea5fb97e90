"""The leader's unnamed tier stores: committed host/disk blocks whose STORE waits for a name.

A private part of :mod:`kvbm_plugin.naming.names` (import :class:`UnnamedStores` from there).

A tier STORE is announced under TensorRT-LLM's name for the block, never under a second one
(:class:`~kvbm_plugin.naming.names.BlockNaming`). A block committed to a tier while that name is
not known yet (a multimodal or prompt-tuning request, a KVCacheManagerV2, a distrusted hasher,
TensorRT-LLM's own stream not read yet) carries the plugin's content key as a placeholder
(``entry.event_hash == entry.key``) and waits here, with every block committed under it
(prefix-closed), until the events name it: then it is announced, in commit order, parents
first. A waiting block was never announced, so its later eviction registers no REMOVE.

Bounded: past :attr:`UnnamedStores.MAX_WAITING` blocks the oldest leaves its tier unannounced
(``tier_stores_unnamed_dropped``, logged rate-limited). Counters, in the leader's stats:
``tier_stores_unnamed`` (blocks that had to wait), ``tier_stores_unnamed_dropped``.

Owned by the leader (``KvbmConnectorLeader``, through its ``BlockNaming``); every call runs
under the leader's lock (executor thread or its idle keeper's thread). No I/O.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from kvbm_plugin._util.ratelimit import RateLimitedLog

if TYPE_CHECKING:
    from kvbm_plugin.naming._learned import BlockNames, ContentKey
    from kvbm_plugin.tiers._entry import TierEntry
    from kvbm_plugin.tiers.index import TierIndex

logger = logging.getLogger("kvbm_plugin.connector_leader")


def named(entry: TierEntry) -> bool:
    """Whether ``entry`` and its parent carry TRT-LLM's names (not placeholders)."""
    return entry.event_hash != entry.key and (
        entry.parent_key is None or entry.parent_event_hash != entry.parent_key)


def content_may_name(entry: TierEntry) -> bool:
    """Whether a GPU event's content (parent name, tokens, adapter) can name ``entry``: a
    placeholder whose parent is named, or an unscoped root; never a multimodal block (a third
    scope item: its placeholder tokens are every image's), nor a scoped root (its tokens are
    not enough)."""
    scope = entry.scope
    return entry.event_hash == entry.key and len(scope) == 2 and (
        entry.parent_event_hash != entry.parent_key if entry.parent_key is not None
        else scope == (None, None))


def _leave(groups: dict[Any, set[Any]], group: Any, member: Any) -> None:
    """Take ``member`` out of ``groups[group]``, and the group out once it is empty."""
    same = groups.get(group)
    if same is not None:
        same.discard(member)
        if not same:
            del groups[group]


class UnnamedStores:
    """Committed tier blocks waiting for TensorRT-LLM's name, by ``(tier, content key)``, in
    commit order (see the module docstring)."""

    # Blocks waiting at most (the oldest is dropped from its tier past it, never named twice).
    MAX_WAITING = 4096

    def __init__(self, names: BlockNames, stats: dict[str, int]) -> None:
        self._names = names
        self._stats = stats
        for counter in ("tier_stores_unnamed", "tier_stores_unnamed_dropped"):
            stats.setdefault(counter, 0)
        # (tier, content key) -> entry of each block waiting for its name, in commit order;
        # read, never changed, outside this class (the leader asks ``bool(waiting)`` once per
        # iteration, without a call)
        self.waiting: dict[tuple[str, int], TierEntry] = {}
        # What can name a waiting block, so that :meth:`named_now` looks only at the blocks
        # the names learned since can name (O(new names) per iteration, never O(waiting)):
        # each block's commit number and parent key; the waiting children of each
        # (tier, parent key); the blocks an event's content can name (content_may_name), by
        # that content's key in the names table, and each such block's key there.
        self._order: dict[tuple[str, int], tuple[int, int | None]] = {}
        self._children: dict[tuple[str, int], set[int]] = {}
        self._by_content: dict[ContentKey, set[tuple[str, int]]] = {}
        self._content_of: dict[tuple[str, int], ContentKey] = {}
        self._commits = 0
        self._log = RateLimitedLog(logger)

    def __len__(self) -> int:
        return len(self.waiting)

    def __contains__(self, tier_and_key: tuple[str, int]) -> bool:
        """Whether the block of content key ``key`` waits in tier ``tier`` (never announced)."""
        return tier_and_key in self.waiting

    def forget(self, tier: str, key: int) -> bool:
        """The block left its tier: True when it was waiting (never announced: no REMOVE)."""
        if (tier, key) not in self.waiting:
            return False
        self._unwait((tier, key))
        return True

    def _wait(self, tier: str, entry: TierEntry) -> None:
        """``entry`` waits from now on (in commit order)."""
        tk = (tier, entry.key)
        parent_key = entry.parent_key
        self.waiting[tk] = entry
        self._order[tk] = (self._commits, parent_key)
        self._commits += 1
        if parent_key is not None:
            self._children.setdefault((tier, parent_key), set()).add(entry.key)
        self._content_key(tk, entry)
        self._names.tracking(True)  # what is named from now on may name it

    def _unwait(self, tk: tuple[str, int]) -> None:
        """``tk`` waits no longer (announced, or gone from its tier)."""
        del self.waiting[tk]
        _, parent_key = self._order.pop(tk)
        self._content_key(tk, None)
        if parent_key is not None:
            _leave(self._children, (tk[0], parent_key), tk[1])
        if not self.waiting:  # nothing to name: stop recording names
            self._names.tracking(False)

    def _content_key(self, tk: tuple[str, int], entry: TierEntry | None) -> None:
        """File waiting block ``tk`` under the key an event's content names it by (the names
        table's), or under none (``entry`` None, or no content can name it)."""
        old = self._content_of.pop(tk, None)
        if old is not None:
            _leave(self._by_content, old, tk)
        if entry is not None and content_may_name(entry):
            key = (entry.parent_event_hash, tuple(entry.token_ids), entry.scope[0])
            self._content_of[tk] = key
            self._by_content.setdefault(key, set()).add(tk)

    def name(self, entry: TierEntry, index: TierIndex | None = None) -> None:
        """Before a block's tier STORE is announced: if it was reserved under the plugin's
        content key (TRT-LLM's hash unknown then) and TRT-LLM's is known now, use that. The
        parent's name may also come from the parent's own entry in ``index``, named first
        (waiting blocks are announced parents first): a chain whose request was forgotten
        before its GPU events came back (TensorRT-LLM's own stream arrives on the
        consolidator's thread) is named block by block through its content, not only at its
        root."""
        names = self._names
        if entry.event_hash == entry.key:
            h = names.hash_of_key(entry.key)
            if h is not None:
                entry.event_hash = h
        parent = entry.parent_event_hash
        if parent is not None and parent == entry.parent_key:
            h = names.hash_of_key(parent)
            if h is None and index is not None:
                above = index.get(parent)
                if above is not None and above.event_hash != above.key:
                    h = above.event_hash
            if h is not None:
                entry.parent_event_hash = h
        if content_may_name(entry):
            # Named by its GPU event after its request was forgotten (its event can come
            # later than the request's end: attention DP ranks > 0 read it off their stream).
            h = names.hash_of_content(entry.parent_event_hash, entry.token_ids, entry.scope[0])
            if h is not None:
                entry.event_hash = h

    def named_ready(self, tier: str, key: int, parent_key: int | None, event_hash: int,
                    parent_event_hash: int | None) -> bool:
        """The common case of :meth:`ready`, from a committed block's row as read already
        (``TierIndex.commit_row``): it and its parent are named, its parent is not
        waiting. False says only that :meth:`ready` must decide."""
        return event_hash != key and (parent_key is None or (
            parent_event_hash != parent_key
            and (not self.waiting or (tier, parent_key) not in self.waiting)))

    def ready(self, index: TierIndex, entry: TierEntry) -> bool:
        """A block just committed to ``index``: named as far as known now; True when its STORE
        can be announced (it and its parent are named, its parent is not waiting), else it
        waits here. Past :attr:`MAX_WAITING` the caller drops :meth:`overflow`'s blocks."""
        parent_key = entry.parent_key
        if entry.event_hash != entry.key and (
                parent_key is None or entry.parent_event_hash != parent_key):
            # Named already, so name() would change nothing: the common case (executor
            # thread, once per committed block), four reads of the entry's row.
            if parent_key is None or not self.waiting \
                    or (index.name, parent_key) not in self.waiting:
                return True
        else:
            self.name(entry, index)
        parent_waiting = parent_key is not None and (index.name, parent_key) in self.waiting
        if named(entry) and not parent_waiting:
            return True
        self._wait(index.name, entry)
        self._stats["tier_stores_unnamed"] += 1
        return False

    def overflow(self) -> Iterator[tuple[str, TierEntry]]:
        """The oldest waiting block, one at a time, while more than :attr:`MAX_WAITING` wait:
        the caller drops each from its tier (which calls :meth:`forget`) before the next."""
        while len(self.waiting) > self.MAX_WAITING:
            (tier, _), oldest = next(iter(self.waiting.items()))
            self._stats["tier_stores_unnamed_dropped"] += 1
            self._log.log(logging.WARNING, "unnamed", "kvbm_plugin: %d tier blocks wait for "
                          "TensorRT-LLM's name; the oldest leaves the %s tier unadvertised",
                          len(self.waiting), tier)
            yield tier, oldest

    def named_now(self, indexes: Mapping[str, TierIndex | None]
                  ) -> Iterator[tuple[TierIndex, TierEntry]]:
        """The waiting blocks whose names are known now, in commit order (parents first), each
        taken out before it is handed over for its STORE; a block its tier (``indexes[tier]``)
        no longer holds is forgotten when looked at. Looks only at the blocks something
        named since the last call may name (:meth:`ready` tried each when it started to
        wait): those whose own or whose parent's content key was named since, those whose
        content (parent name, tokens, adapter) an event named since, and the children of each
        block named or handed over here. O(those), not O(waiting): a block whose name never
        comes costs nothing per call."""
        waiting = self.waiting
        if not waiting:
            return
        names, order, children = self._names, self._order, self._children
        candidates: set[tuple[str, int]] = set()
        fresh, contents = names.take_fresh()
        for key in fresh:
            for tier in indexes:
                tk = (tier, key)
                if tk in waiting:
                    candidates.add(tk)
                below = children.get(tk)
                if below:
                    candidates.update((tier, child) for child in below)
        by_content = self._by_content
        for content in contents:
            same = by_content.get(content)
            if same:
                candidates |= same
        todo = [(order[tk][0], tk) for tk in candidates if tk in order]
        heapq.heapify(todo)
        while todo:
            _, tk = heapq.heappop(todo)
            entry = waiting.get(tk)
            if entry is None:
                continue  # handed over or forgotten since it was queued
            tier, key = tk
            index = indexes.get(tier)
            if index is None or index.get(key) is not entry:
                self._unwait(tk)
                continue
            before = entry.event_hash
            self.name(entry, index)
            parent_key = entry.parent_key
            if named(entry) and (parent_key is None or (tier, parent_key) not in waiting):
                self._unwait(tk)
                freed = True
            else:
                freed = False
                self._content_key(tk, entry)  # (its parent may be named now)
            if freed or entry.event_hash != before:
                # Its children may be named through it now, or no longer wait for it
                for child in children.get(tk, ()):
                    heapq.heappush(todo, (order[(tier, child)][0], (tier, child)))
            if freed:
                yield index, entry


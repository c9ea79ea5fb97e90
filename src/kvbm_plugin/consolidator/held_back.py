"""Prefix closure of the consolidator's output: blocks held back, released and cascaded.

A strict router skips a store whose parent it does not hold and cuts a subtree at a removed
block, so :class:`~kvbm_plugin.consolidator.core.ConsolidatorCore` publishes a block (per
medium in passthrough) only while its parent is published:

* A block that becomes resident under a parent that is not published is *held back*: kept in
  :class:`HeldBack` with its tokens (``held_back_stores``), and published after its parent
  when the parent is (``released_stores``). Held-back blocks are indexed by the parent they
  wait for, so a release costs what it releases: O(the released chain), whatever else is held
  back. A block stored under a parent hash no source knows (an orphan) is held back until
  removed: its parent can never be published.
* When a published block stops being resident while descendants still are (an engine that
  evicts a middle block), those descendants are removed first, in the same output event
  (``cascade_removes``), and held back with their tokens unknown: a source's next store of one
  brings them. The walk follows each block's own children (``blocks.KIDS``): O(descendants).
* What one source's stores hold back is bounded per dp rank (``max_held_back`` per medium
  group): a store past the bound is refused, counted in ``held_back_dropped``. A refused block
  is forgotten as if its source had not stored it: it stays unpublished, a later removal of it
  counts in ``unknown_removes``, and a later store of it is taken as new. Blocks cut by a
  cascade are not bounded here: they were published, so the sources' own capacity bounds them.

The tiers and TensorRT-LLM's own pool are prefix-closed, so with them nothing is ever held
back or cascaded. The compiled loops keep running while blocks are held back: they leave to
the Python code here only the events that touch a held-back block, its parent, or a cascade.
"""

from __future__ import annotations

from typing import Any, Final

from kvbm_plugin.consolidator.blocks import (
    CHILDREN,
    COUNTS,
    HELD_BACK,
    IDENT,
    PARENT,
    TOTAL,
    WIRE,
    Block,
    _Rank,
    kids_of,
)

# A held-back block: (block, its tokens or None, block_size, lora_id, lora_name, its
# extra_keys entry or None, the source whose store held it back or None). Tokens are None for
# a block cut by a cascade: it is published again only by a later store that brings them.
HeldBackEntry = tuple[Block, "list[int] | None", int, Any, Any, Any, "int | None"]
_SOURCE: Final = 6

DEFAULT_MAX_HELD_BACK: Final = 65536


class HeldBack:
    """The held-back blocks of one dp rank and medium group, indexed by the parent they wait
    for. Owned by the core's thread; the compiled loops read ``entries`` and ``waiting``
    (only to leave an event that touches them to the Python code)."""

    __slots__ = ("entries", "waiting", "by_source", "limit")

    def __init__(self, limit: int) -> None:
        self.entries: dict[int, HeldBackEntry] = {}  # identity -> entry, in hold order
        # Parent identity -> the identities of its held-back children (dict: ordered, O(1)
        # removal). Orphans (no parent block) wait for nothing and are not in it.
        self.waiting: dict[int, dict[int, None]] = {}
        self.by_source = [0, 0]  # entries held back by each source's stores
        self.limit = limit

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, ident: object) -> bool:
        return ident in self.entries

    def hold(self, entry: HeldBackEntry) -> bool:
        """Hold ``entry`` back; False (nothing kept) when its source is at the bound."""
        source = entry[_SOURCE]
        if source is not None:
            if self.by_source[source] >= self.limit:
                return False
            self.by_source[source] += 1
        block = entry[0]
        ident = block[IDENT]
        self.entries[ident] = entry
        block[HELD_BACK] += 1
        parent = block[PARENT]
        if parent is not None:
            waiting = self.waiting.get(parent[IDENT])
            if waiting is None:
                self.waiting[parent[IDENT]] = {ident: None}
            else:
                waiting[ident] = None
        return True

    def pop(self, ident: int) -> HeldBackEntry:
        """Stop holding ``ident`` back (it is published now, or resident nowhere)."""
        entry = self.entries.pop(ident)
        entry[0][HELD_BACK] -= 1
        source = entry[_SOURCE]
        if source is not None:
            self.by_source[source] -= 1
        parent = entry[0][PARENT]
        if parent is not None:
            key = parent[IDENT]
            waiting = self.waiting[key]
            del waiting[ident]
            if not waiting:
                del self.waiting[key]
        return entry

    def ready(self, parent_ident: int) -> list[HeldBackEntry]:
        """The held-back children of a block just published that carry their tokens, in hold
        order (children cut by a cascade wait for a store)."""
        waiting = self.waiting.get(parent_ident)
        if not waiting:
            return []
        entries = self.entries
        return [entries[ident] for ident in waiting if entries[ident][1] is not None]


class PrefixClosure:
    """What keeps the core's output prefix-closed (the module docstring): which blocks are
    published, the STOREs of released blocks, the cascade of a block's descendants and the
    REMOVE events. Owned by :class:`~kvbm_plugin.consolidator.core.ConsolidatorCore` (one per
    core) and called on its owner's thread, for the rare paths only (never the compiled
    loops). It appends to each rank's output and counts what it emitted; the core's
    ``stats`` adds these counts to its own."""

    COUNTERS: Final = ("released_stores", "cascade_removes", "stores_out",
                       "store_blocks_out", "removes_out", "remove_blocks_out")

    def __init__(self, dedup: bool) -> None:
        self._dedup = dedup  # dedup mode: one residency for every medium
        self.released_stores = 0  # held-back blocks published after their parent
        self.cascade_removes = 0  # descendants removed because a block left
        self.stores_out = self.store_blocks_out = 0  # what it emitted
        self.removes_out = self.remove_blocks_out = 0

    def counts(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.COUNTERS}

    def shown(self, rank: _Rank, block: Block, group: int) -> bool:
        """Whether ``block`` is published in medium group ``group``."""
        held = block[TOTAL] if self._dedup else block[COUNTS][group]
        return bool(held) and block[IDENT] not in rank.hidden[group].entries

    def parent_shown(self, rank: _Rank, block: Block, group: int) -> bool:
        """Whether ``block`` may be published: a root, or its parent is published."""
        parent = block[PARENT]
        if parent is None:
            return block[IDENT] not in rank.orphans
        return self.shown(rank, parent, group)

    def publish(self, rank: _Rank, block: Block, tokens: list[int], bs: int, lora_id: Any,
                lora_name: Any, extra: Any, medium: str) -> None:
        """STORE one held-back block whose parent is published now (``extra``: the block's
        ``extra_keys`` entry, or None)."""
        parent = block[PARENT]
        event = {"type": "BlockStored", "block_hashes": [block[WIRE]],
                 "parent_block_hash": None if parent is None else parent[WIRE],
                 "token_ids": tokens, "block_size": bs, "lora_id": lora_id,
                 "medium": medium, "lora_name": lora_name}
        if extra is not None:
            event["extra_keys"] = [extra]
        rank.out.append(event)
        rank.last_remove = None
        rank.visible += 1
        self.stores_out += 1
        self.store_blocks_out += 1

    def release_children(self, rank: _Rank, block: Block, group: int, medium: str) -> None:
        """Publish the held-back descendants of ``block`` (just published), parents first:
        through the index of who waits for whom, so O(what is released)."""
        held_back = rank.hidden[group]
        if not held_back.waiting:
            return
        stack = [block]
        while stack:
            parent = stack.pop()
            for child, tokens, bs, lora_id, lora_name, extra, _ in held_back.ready(
                    parent[IDENT]):
                held_back.pop(child[IDENT])
                self.publish(rank, child, tokens, bs, lora_id, lora_name,  # type: ignore[arg-type]
                             extra, medium)
                self.released_stores += 1
                stack.append(child)

    def cascade(self, rank: _Rank, block: Block, group: int) -> list[int]:
        """``block`` (published, with live children) is about to be unpublished: hold back
        its published descendants (tokens unknown) and return their wire hashes, children
        before parents, for the same REMOVE event. Walks the descendants only."""
        blocks = rank.blocks
        held_back = rank.hidden[group]
        wires: list[int] = []
        stack: list[tuple[Block, bool]] = [(block, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                if node is not block:
                    wires.append(node[WIRE])
                    held_back.hold((node, None, 0, None, None, None, None))
                continue
            stack.append((node, True))
            if node[CHILDREN]:
                for child in kids_of(blocks, node):
                    if self.shown(rank, child, group):
                        stack.append((child, False))
        self.cascade_removes += len(wires)
        return wires

    def emit_removes(self, rank: _Rank, wires: list[int], medium: str) -> None:
        last = rank.last_remove
        out = rank.out
        if last is not None and out and out[-1] is last and last["medium"] == medium:
            last["block_hashes"].extend(wires)
        else:
            out.append({"type": "BlockRemoved", "block_hashes": wires, "medium": medium})
            rank.last_remove = out[-1]
            self.removes_out += 1
        self.remove_blocks_out += len(wires)

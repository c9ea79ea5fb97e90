"""The trees a KV-aware router keeps, with NVIDIA Dynamo's indexer's rules (ai-dynamo-runtime
1.6.1, ``--threads 1``): a content-keyed compressed radix tree shared by every worker for the
device tier, and a flat map per lower tier.

Pure data structures, no I/O: :class:`~kvbm_plugin.routers.router_view.RouterView` owns one
:class:`DeviceTree` and one :class:`LowerTier` per lower medium and calls them from its one
thread. A *worker* here is ``(name, dp rank)``; a *key* is a block's content key (its tokens
mixed with ``lora_name``, the cache namespace and multimodal hashes, see
:func:`~kvbm_plugin.routers.router_view.content_key`); a *hash* is a published block hash.

The device tree (Dynamo's ``lib/kv-router/src/indexer/radix_tree.rs`` and
``compressed_radix.rs``, read at commit 049a8f48 and checked against 1.6.1's behaviour):

- A node holds an *edge*, a run of ``(key, hash)`` pairs, and which workers cover all of it or
  only a prefix (a cutoff). Children are keyed by the first key of their edge. Every worker
  shares the nodes: the hash a node shows is the one stored first for that content position.
- Each worker has a lookup ``hash -> node`` of the hashes it stored. A store names its parent
  by hash: it is skipped whole (:data:`PARENT_MISSING`) when the parent is not in the worker's
  lookup, when the node it points to does not hold that hash in its edge (an alias, or a hash
  that moved away), or when the worker no longer covers that position (then the lookup entry
  goes too).
- Stored blocks walk down by content from the parent: an existing node gets the worker's
  coverage and its lookup entries under the worker's own hashes (so a second name for the
  same content is an alias: accepted silently, usable neither as a parent nor for a removal),
  a missing one is created, or appended to the parent's edge when the parent is a leaf that
  never had children and the worker covers its tail. A hash already in the lookup is
  repointed to the node it was stored at last: a re-store elsewhere *moves* it.
- A removal looks the hash up in the worker's lookup (missing: :data:`BLOCK_MISSING`); when
  the node does not hold that hash (an alias) nothing happens. Otherwise the worker's coverage
  of the edge is cut at that position and the hashes after it on the edge leave its lookup;
  children of a node no worker covers fully are dropped from the tree (their hashes stay in
  the lookups: later stores under them, and removals of them, pass silently and show nowhere).
  A node no worker covers and without children is removed (1.6.1: a later store of the same
  content starts a new node under its own hash).
- ``AllBlocksCleared`` drops one worker (name and dp rank) from every node it covers.

A lower tier (host, disk, external) is not a tree in 1.6.1 and checks no parent: each block is
keyed by ``(parent hash, key)``; the first hash stored for a key is the only one (a later
store of the key under another hash is dropped silently, for every worker); a removal drops the
worker from every entry of that hash, and an unknown removal is silent.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence

Worker = tuple[str, int]  # (worker name, dp rank)
Block = tuple[Hashable, int]  # (content key, published hash)

# The warnings Dynamo's indexer logs (kvbm_plugin.routers.dynamo_indexer reads its log).
PARENT_MISSING = "parent missing"
BLOCK_MISSING = "block missing"


class _Node:
    __slots__ = ("edge", "index", "full", "cutoff", "children", "internal", "parent")

    def __init__(self, edge: list[Block], parent: _Node | None) -> None:
        self.edge = edge
        self.index = {h: i for i, (_, h) in enumerate(edge)}
        self.full: set[Worker] = set()
        self.cutoff: dict[Worker, int] = {}  # 0 < cutoff < len(edge): covers edge[:cutoff]
        self.children: dict[Hashable, _Node] = {}
        self.internal = parent is None  # once it had a child, never extended again
        self.parent = parent

    def covered(self, w: Worker) -> int:
        return len(self.edge) if w in self.full else self.cutoff.get(w, 0)

    def covers(self, w: Worker, pos: int) -> bool:
        return pos < self.covered(w)

    def promote(self, w: Worker) -> bool:
        if w in self.full:
            return False
        self.cutoff.pop(w, None)
        self.full.add(w)
        return True

    def cover_prefix(self, w: Worker, n: int) -> bool:
        if n >= len(self.edge):
            return self.promote(w)
        if n <= 0 or w in self.full or self.cutoff.get(w, 0) >= n:
            return False
        self.cutoff[w] = n
        return True

    def append(self, w: Worker, blocks: Sequence[Block]) -> None:
        """Extend a leaf's edge: the other workers keep only the part they had."""
        old = len(self.edge)
        for other in [x for x in self.full if x != w]:
            self.full.discard(other)
            self.cutoff[other] = old
        self.promote(w)
        for i, (key, h) in enumerate(blocks):
            self.edge.append((key, h))
            self.index[h] = old + i

    def drop(self, w: Worker) -> None:
        self.full.discard(w)
        self.cutoff.pop(w, None)

    def has_workers(self) -> bool:
        return bool(self.full or self.cutoff)


class DeviceTree:
    """The device tier's compressed radix tree, shared by every worker (module docstring)."""

    def __init__(self) -> None:
        self.root = _Node([], None)
        self.lookup: dict[Worker, dict[int, _Node]] = {}

    # ---------------------------------------------------------------- events

    def store(self, w: Worker, parent_hash: int | None, blocks: Sequence[Block]) -> str | None:
        """Apply one store; returns :data:`PARENT_MISSING` when it was skipped, else None."""
        lookup = self.lookup.setdefault(w, {})
        if parent_hash is None:
            self._descend(w, self.root, list(blocks))
            return None
        node = lookup.get(parent_hash)
        pos = None if node is None else node.index.get(parent_hash)
        if node is None or pos is None:
            return PARENT_MISSING
        if not node.covers(w, pos):
            del lookup[parent_hash]
            return PARENT_MISSING
        suffix = node.edge[pos + 1:]
        n = min(len(suffix), len(blocks))
        if list(suffix[:n]) == list(blocks[:n]):
            if len(blocks) <= len(suffix):  # the edge already goes on with these blocks
                node.cover_prefix(w, pos + 1 + len(blocks))
                self._point(w, blocks, node)
                return None
            if not node.internal:  # a leaf continued: the rest extends its edge
                node.append(w, blocks[len(suffix):])
                self._point(w, blocks, node)
                return None
        if pos + 1 < len(node.edge):
            self._split(node, pos + 1)
        self._descend(w, node, list(blocks))
        return None

    def _descend(self, w: Worker, parent: _Node, remaining: list[Block]) -> None:
        while remaining:
            child = parent.children.get(remaining[0][0])
            if child is None:
                if parent.edge and not parent.internal and parent.covers(w, len(parent.edge) - 1):
                    parent.append(w, remaining)
                    self._point(w, remaining, parent)
                    return
                child = _Node(list(remaining), parent)
                child.full.add(w)
                parent.internal = True
                parent.children[remaining[0][0]] = child
                self._point(w, remaining, child)
                return
            match = 0
            for (key, _), (want, _) in zip(child.edge, remaining, strict=False):
                if key != want:
                    break
                match += 1
            if match < len(child.edge):
                if match == len(remaining):
                    child.cover_prefix(w, match)
                    self._point(w, remaining, child)
                    return
                self._split(child, match)
                child.promote(w)
                self._point(w, remaining[:match], child)
                tail = _Node(remaining[match:], child)
                tail.full.add(w)
                child.children[tail.edge[0][0]] = tail
                self._point(w, remaining[match:], tail)
                return
            child.promote(w)
            self._point(w, remaining[:match], child)
            remaining = remaining[match:]
            parent = child

    def _point(self, w: Worker, blocks: Sequence[Block], node: _Node) -> None:
        lookup = self.lookup[w]
        for _, h in blocks:
            lookup[h] = node

    def _split(self, node: _Node, pos: int) -> None:
        """Cut ``node``'s edge at ``pos``: the rest becomes its only child."""
        tail = _Node(node.edge[pos:], node)
        for _, h in tail.edge:
            node.index.pop(h, None)
        del node.edge[pos:]
        tail.full = set(node.full)
        for w, cut in list(node.cutoff.items()):
            if cut >= pos:
                del node.cutoff[w]
                node.full.add(w)
                if cut > pos:
                    tail.cutoff[w] = cut - pos
        tail.children, node.children = node.children, {tail.edge[0][0]: tail}
        for child in tail.children.values():
            child.parent = tail
        tail.internal, node.internal = node.internal, True
        for w in tail.full:
            self._point(w, tail.edge, tail)
        for w, cut in tail.cutoff.items():
            self._point(w, tail.edge[:cut], tail)

    def remove(self, w: Worker, hashes: Sequence[int]) -> int:
        """Apply one removal; returns how many hashes were not in the worker's lookup."""
        lookup = self.lookup.setdefault(w, {})
        missing = 0
        stale: set[int] = set()
        for h in hashes:
            node = lookup.pop(h, None)
            if node is None:
                if h not in stale:
                    missing += 1
                continue
            pos = node.index.get(h)
            if pos is None:  # an alias, or a hash that moved on: nothing to remove
                lookup[h] = node
                continue
            if pos < node.covered(w):
                for _, gone in node.edge[pos:]:
                    lookup.pop(gone, None)
                    stale.add(gone)
                if pos == 0:
                    node.drop(w)
                else:
                    node.full.discard(w)
                    node.cutoff[w] = pos
            self._tidy(node)
        return missing

    def clear(self, w: Worker) -> None:
        """``AllBlocksCleared`` of one worker's dp rank."""
        for node in {id(n): n for n in self.lookup.pop(w, {}).values()}.values():
            node.drop(w)
            self._tidy(node)

    def _tidy(self, node: _Node) -> None:
        if not node.full:
            node.children.clear()
        while node.parent is not None and not node.has_workers() and not node.children:
            parent = node.parent
            if parent.children.get(node.edge[0][0]) is node:
                del parent.children[node.edge[0][0]]
            node.parent = None
            node = parent

    # ---------------------------------------------------------------- reading

    def nodes(self) -> Iterator[tuple[_Node, int | None]]:
        """Every node in the tree with the hash its edge hangs under."""
        stack: list[tuple[_Node, int | None]] = [(c, None) for c in self.root.children.values()]
        while stack:
            node, parent_hash = stack.pop()
            yield node, parent_hash
            tail = node.edge[-1][1]
            stack.extend((c, tail) for c in node.children.values())

    def edges(self) -> dict[Worker, set[tuple[int | None, int]]]:
        """``(parent hash, hash)`` of every block a worker covers in the tree."""
        out: dict[Worker, set[tuple[int | None, int]]] = {}
        for node, parent_hash in self.nodes():
            for w in [*node.full, *node.cutoff]:
                mine = out.setdefault(w, set())
                prev = parent_hash
                for _, h in node.edge[:node.covered(w)]:
                    mine.add((prev, h))
                    prev = h
        return out

    def match(self, keys: Sequence[Hashable]) -> dict[Worker, list[int]]:
        """Per worker, the hashes of the prompt's blocks it covers, from the root on."""
        out: dict[Worker, list[int]] = {}
        active: set[Worker] | None = None
        node = self.root.children.get(keys[0]) if keys else None
        pos = 0
        path: list[int] = []
        while node is not None and pos < len(keys):
            n = 0
            for (key, _), want in zip(node.edge, keys[pos:], strict=False):
                if key != want:
                    break
                n += 1
            hashes = [h for _, h in node.edge[:n]]
            workers = (set(node.full) | set(node.cutoff)) if active is None else active
            still: set[Worker] = set()
            for w in workers:
                got = min(node.covered(w), n)
                out[w] = path + hashes[:got]
                if w in node.full and n == len(node.edge):
                    still.add(w)
            active = still
            path += hashes
            pos += n
            if not active or n < len(node.edge) or pos >= len(keys):
                break
            node = node.children.get(keys[pos])
        return out


class LowerTier:
    """One lower tier (host, disk or external): blocks keyed by ``(parent hash, key)``, shared
    by every worker, first hash wins, no parent check (module docstring).

    It also keeps, per worker, the chains as published (``hash -> parent``), for what Dynamo
    accepts silently but a prefix-closed stream never does: :meth:`store` and :meth:`remove`
    return those counts."""

    def __init__(self) -> None:
        self.entries: dict[tuple[int | None, Hashable], tuple[int, set[Worker]]] = {}
        self.by_hash: dict[int, set[tuple[int | None, Hashable]]] = {}
        self.chains: dict[Worker, dict[int, int | None]] = {}  # hash -> parent, as stored
        self.kids: dict[Worker, dict[int, int]] = {}  # hash -> children held

    def store(self, w: Worker, parent_hash: int | None,
              blocks: Sequence[Block]) -> dict[str, int]:
        """Apply one store; returns ``orphan`` (1 when the worker does not hold the parent),
        ``duplicate`` (hashes it held already) and ``alias`` (blocks dropped: another hash
        holds their key)."""
        chains = self.chains.setdefault(w, {})
        kids = self.kids.setdefault(w, {})
        notes = {"orphan": int(parent_hash is not None and parent_hash not in chains),
                 "duplicate": 0, "alias": 0}
        parent = parent_hash
        for key, h in blocks:
            slot = (parent, key)
            entry = self.entries.get(slot)
            if entry is None:
                self.entries[slot] = (h, {w})
                self.by_hash.setdefault(h, set()).add(slot)
            elif entry[0] == h:
                entry[1].add(w)
            else:
                notes["alias"] += 1
            if h in chains:
                notes["duplicate"] += 1
            else:
                chains[h] = parent
                if parent is not None:
                    kids[parent] = kids.get(parent, 0) + 1
            parent = h  # the next block hangs under this one's hash, as published
        return notes

    def remove(self, w: Worker, hashes: Sequence[int]) -> dict[str, int]:
        """Apply one removal; returns ``unknown`` (hashes the worker did not hold) and ``cut``
        (hashes it still held children of)."""
        chains = self.chains.setdefault(w, {})
        kids = self.kids.setdefault(w, {})
        notes = {"unknown": 0, "cut": 0}
        for h in hashes:
            if h not in chains:
                notes["unknown"] += 1
            else:
                if kids.pop(h, 0):
                    notes["cut"] += 1
                parent = chains.pop(h)
                if parent is not None and parent in kids:
                    kids[parent] -= 1
                    if not kids[parent]:
                        del kids[parent]
            for slot in list(self.by_hash.get(h, ())):
                workers = self.entries[slot][1]
                workers.discard(w)
                if not workers:
                    del self.entries[slot]
                    self.by_hash[h].discard(slot)
            if not self.by_hash.get(h, True):
                del self.by_hash[h]
        return notes

    def clear(self, w: Worker) -> None:
        self.chains.pop(w, None)
        self.kids.pop(w, None)
        for slot, (h, workers) in list(self.entries.items()):
            workers.discard(w)
            if not workers:
                del self.entries[slot]
                self.by_hash[h].discard(slot)
                if not self.by_hash[h]:
                    del self.by_hash[h]

    def edges(self) -> dict[Worker, set[tuple[int | None, int]]]:
        out: dict[Worker, set[tuple[int | None, int]]] = {}
        for (parent, _), (h, workers) in self.entries.items():
            for w in workers:
                out.setdefault(w, set()).add((parent, h))
        return out

    def holds(self, w: Worker, parent_hash: int | None, key: Hashable) -> int | None:
        """The hash the worker holds for ``key`` under ``parent_hash``, or None."""
        entry = self.entries.get((parent_hash, key))
        return entry[0] if entry is not None and w in entry[1] else None


__all__ = ["BLOCK_MISSING", "PARENT_MISSING", "DeviceTree", "LowerTier", "Worker"]

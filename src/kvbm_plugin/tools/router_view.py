"""A strict router's view of KV-event streams: radix trees, the rules a router applies, and the
question a router asks ("how many tokens of this prompt are cached on this worker?").

Two layers:

* :class:`RouterView` — pure and socket-free. It applies decoded batches the way a strict
  KV-aware router's indexer does (the rules of NVIDIA Dynamo's radix tree; llm-d's are close),
  counts every rule it had to apply (:class:`RuleCounts`) and answers prefix queries. Per
  ``(worker, dp rank, medium)`` it keeps a tree keyed by published block hashes:

  - a batch whose ``seq`` is not greater than the last applied one for that worker is dropped
    (``stale_batches``); a forward jump is counted as a gap (``gaps``) and the batch is applied;
  - a store whose medium is not ``GPU``/``CPU``/``DISK`` (case-sensitive) is not indexed
    (``unknown_medium``), nor one whose ``block_size`` differs from the router's or whose
    ``token_ids`` are not ``len(block_hashes) * block_size`` long (``size_mismatch``);
  - a store that repeats a hash within the event (its parent counts) is dropped
    (``duplicate_hash_drops``);
  - a store whose parent is not in that tree is skipped whole (``skipped_stores``);
  - a store of a hash the tree already holds keeps the existing node (``duplicate_stores``);
  - removing a block not in the tree is a warning (``unknown_removes``); removing one with
    descendants cuts its subtree (``cut_subtrees``, ``cut_blocks``);
  - ``AllBlocksCleared`` clears only that worker's dp rank (every medium).

  Queries key on the *content* of each block (a hash of its token ids, as the router hashes
  the u32 tokens with xxh3; only this view queries its keys, so Python's hash of the token
  tuple serves) together with the block's ``extra_keys`` entry when the stream carries one (a
  cache salt, multimodal keys: blocks of two tenants with the same tokens are not the same
  block; a query names its salt through the same entries), walking the prompt's full blocks
  from the root: the answer is a contiguous prefix, per medium and, across media, "any tier"
  (the longest of them: a tree holds a block only with all its ancestors, so a position
  covered by some medium's tree is covered with its whole prefix).

* :class:`TreeSubscriber` — the thin adapter: a
  :class:`~kvbm_plugin.wire.subscriber.StreamSubscriber` (decoding, gap detection, replay)
  that also feeds every batch it applies, in order, to a
  :class:`RouterView` under the subscriber's endpoint as the worker name. It sees events as the
  project's tolerant decoder returns them: a medium alias (``cpu``, ``CPU_PINNED``) arrives
  already normalised, where a router would not index it, and an unknown medium makes the whole
  message malformed (counted by the subscriber) rather than one event unindexed. Both only
  matter for streams other than ours, which publish ``GPU``/``CPU``/``DISK``.

Who calls it: ``kvbm-plugin subscribe --tree``, the demo and the benchmarks' router-accuracy
measurement (:mod:`kvbm_plugin.tools.chat_workload`). Not thread-safe: one thread applies and
queries.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from kvbm_plugin.wire.events import (
    MEDIA,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from kvbm_plugin.wire.subscriber import StreamSubscriber

# Counters that mean the stream broke a rule a strict router relies on: each is a warning (or a
# silently lost prefix) in a real router's log. ``cut_blocks`` and the informational counters
# are not in the sum.
WARNING_RULES = ("skipped_stores", "unknown_removes", "cut_subtrees", "duplicate_hash_drops",
                 "duplicate_stores", "stale_batches", "gaps", "unknown_medium", "size_mismatch")


@dataclass
class RuleCounts:
    """How often each rule of a strict router applied (see the module docstring)."""

    batches: int = 0
    stores: int = 0
    removes: int = 0
    clears: int = 0
    skipped_stores: int = 0  # store events skipped whole: parent not in the tree
    skipped_blocks: int = 0  # blocks in those events
    unknown_removes: int = 0  # removed hashes the tree did not hold
    cut_subtrees: int = 0  # removals of a block that still had descendants
    cut_blocks: int = 0  # descendants made unreachable by those removals
    duplicate_hash_drops: int = 0  # store events that repeated a hash (parent included)
    duplicate_stores: int = 0  # stored hashes the tree already held
    stale_batches: int = 0  # seq not above the last applied one: dropped
    gaps: int = 0  # forward seq jumps
    missing_batches: int = 0  # batches those jumps skipped
    unknown_medium: int = 0  # events whose medium is not GPU/CPU/DISK: not indexed
    size_mismatch: int = 0  # stores with another block_size or a wrong token count

    @property
    def warnings(self) -> int:
        """The sum of the rules a well-formed, prefix-closed, gap-free stream never triggers."""
        return sum(getattr(self, name) for name in WARNING_RULES)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _Node:
    """One block in one tree: its published hash, parent, content key and children."""

    __slots__ = ("block_hash", "parent", "key", "children")

    def __init__(self, block_hash: int | None, parent: _Node | None, key: int) -> None:
        self.block_hash = block_hash
        self.parent = parent
        self.key = key
        # content key -> {published hash -> node}: two streams may publish the same tokens
        # under different hashes; a query matches either.
        self.children: dict[int, dict[int, _Node]] = {}


class _Tree:
    """The radix tree of one (worker, dp rank, medium)."""

    __slots__ = ("root", "nodes")

    def __init__(self) -> None:
        self.root = _Node(None, None, 0)
        self.nodes: dict[int, _Node] = {}

    def depth(self, keys: Sequence[int]) -> int:
        """How many of ``keys`` (content keys of a prompt's blocks) match from the root."""
        frontier = [self.root]
        for i, key in enumerate(keys):
            nxt = [child for node in frontier for child in node.children.get(key, {}).values()]
            if not nxt:
                return i
            frontier = nxt
        return len(keys)


def content_key(tokens: Sequence[int], extra: Sequence[Any] | None = None) -> int:
    """The key of one block: its token ids and its ``extra_keys`` entry (cache salt, multimodal
    keys), stable within a process (only this view compares it)."""
    return hash((tuple(tokens), None if not extra else tuple(extra)))


def block_keys(tokens: Sequence[int], block_size: int,
               extra_keys: Sequence[Sequence[Any] | None] | None = None) -> list[int]:
    """Content keys of the full blocks of ``tokens`` (a trailing partial block is not keyed, as
    a router hashes only full blocks); ``extra_keys``: one entry per block, or None."""
    n = len(tokens) // block_size
    return [content_key(tokens[i * block_size:(i + 1) * block_size],
                        None if extra_keys is None or i >= len(extra_keys) else extra_keys[i])
            for i in range(n)]


@dataclass
class PrefixMatch:
    """A query's answer for one (worker, dp rank): matched blocks per medium and any tier."""

    worker: str
    dp_rank: int
    blocks_by_medium: dict[str, int]
    block_size: int

    @property
    def blocks(self) -> int:
        return max(self.blocks_by_medium.values(), default=0)

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size


@dataclass
class RouterView:
    """Radix trees per (worker, dp rank, medium) as a strict router keeps them; see the module
    docstring for the rules. ``block_size`` is the router's block size."""

    block_size: int
    counts: RuleCounts = field(default_factory=RuleCounts)

    def __post_init__(self) -> None:
        if type(self.block_size) is not int or self.block_size <= 0:
            raise ValueError(f"RouterView: block_size={self.block_size!r} must be a positive "
                             "integer")
        self._trees: dict[tuple[str, int, str], _Tree] = {}
        self._last_seq: dict[str, int] = {}
        # medium -> rule -> count, for the per-event rules (where a stream broke them)
        self.by_medium: dict[str, dict[str, int]] = {}

    def _bump(self, medium: str, rule: str, n: int = 1) -> None:
        setattr(self.counts, rule, getattr(self.counts, rule) + n)
        per = self.by_medium.setdefault(medium, {})
        per[rule] = per.get(rule, 0) + n

    # ------------------------------------------------------------------ applying events

    def apply_batch(self, batch: EventBatch, worker: str = "") -> bool:
        """Apply one decoded batch from ``worker``'s stream; False when the seq watermark
        dropped it."""
        if batch.seq is not None:
            last = self._last_seq.get(worker)
            if last is not None and batch.seq <= last:
                self.counts.stale_batches += 1
                return False
            if last is not None and batch.seq > last + 1:
                self.counts.gaps += 1
                self.counts.missing_batches += batch.seq - last - 1
            self._last_seq[worker] = batch.seq
        self.counts.batches += 1
        rank = batch.data_parallel_rank or 0
        for event in batch.events:
            self.apply_event(event, worker, rank)
        return True

    def apply_event(self, event: Any, worker: str = "", dp_rank: int = 0) -> None:
        """Apply one decoded event (no seq rule: that is per batch)."""
        if isinstance(event, BlockStored):
            self._store(event, worker, dp_rank)
        elif isinstance(event, BlockRemoved):
            self._remove(event, worker, dp_rank)
        elif isinstance(event, AllBlocksCleared):
            self.counts.clears += 1
            for key in [k for k in self._trees if k[0] == worker and k[1] == dp_rank]:
                del self._trees[key]

    def _tree(self, worker: str, dp_rank: int, medium: str) -> _Tree:
        key = (worker, dp_rank, medium)
        tree = self._trees.get(key)
        if tree is None:
            tree = self._trees[key] = _Tree()
        return tree

    def _store(self, event: BlockStored, worker: str, dp_rank: int) -> None:
        c = self.counts
        c.stores += 1
        medium = MEDIUM_GPU if event.medium is None else event.medium
        if medium not in MEDIA:
            self._bump(str(medium), "unknown_medium")
            return
        hashes = event.block_hashes
        bs = self.block_size
        if event.block_size != bs or len(event.token_ids) != len(hashes) * bs:
            self._bump(medium, "size_mismatch")
            return
        named = list(hashes) if event.parent_block_hash is None else \
            [event.parent_block_hash, *hashes]
        if len(set(named)) != len(named):
            self._bump(medium, "duplicate_hash_drops")
            return
        tree = self._tree(worker, dp_rank, medium)
        if event.parent_block_hash is None:
            parent = tree.root
        else:
            found = tree.nodes.get(event.parent_block_hash)
            if found is None:
                self._bump(medium, "skipped_stores")
                self._bump(medium, "skipped_blocks", len(hashes))
                return
            parent = found
        tokens = event.token_ids
        extra = getattr(event, "extra_keys", None)
        for i, h in enumerate(hashes):
            existing = tree.nodes.get(h)
            if existing is not None:
                self._bump(medium, "duplicate_stores")
                parent = existing
                continue
            key = content_key(tokens[i * bs:(i + 1) * bs],
                              None if extra is None or i >= len(extra) else extra[i])
            node = _Node(h, parent, key)
            parent.children.setdefault(key, {})[h] = node
            tree.nodes[h] = node
            parent = node

    def _remove(self, event: BlockRemoved, worker: str, dp_rank: int) -> None:
        self.counts.removes += 1
        medium = MEDIUM_GPU if event.medium is None else event.medium
        if medium not in MEDIA:
            self._bump(str(medium), "unknown_medium")
            return
        tree = self._trees.get((worker, dp_rank, medium))
        for h in event.block_hashes:
            node = None if tree is None else tree.nodes.get(h)
            if node is None:
                self._bump(medium, "unknown_removes")
                continue
            assert tree is not None and node.parent is not None
            siblings = node.parent.children[node.key]
            del siblings[h]
            if not siblings:
                del node.parent.children[node.key]
            del tree.nodes[h]
            if node.children:
                self._bump(medium, "cut_subtrees")
                self._bump(medium, "cut_blocks", self._drop_subtree(tree, node))

    @staticmethod
    def _drop_subtree(tree: _Tree, node: _Node) -> int:
        """Forget every descendant of ``node``; returns how many there were."""
        dropped = 0
        stack = [child for group in node.children.values() for child in group.values()]
        while stack:
            child = stack.pop()
            del tree.nodes[child.block_hash]  # type: ignore[arg-type]
            dropped += 1
            stack.extend(c for group in child.children.values() for c in group.values())
        node.children.clear()
        return dropped

    # ------------------------------------------------------------------ queries

    def match(self, tokens: Sequence[int],
              extra_keys: Sequence[Sequence[Any] | None] | None = None) -> list[PrefixMatch]:
        """Per (worker, dp rank) the prompt's cached prefix in blocks, per medium and any tier;
        ``extra_keys``: the prompt's per-block extra keys (e.g. its cache salt), as published."""
        keys = block_keys(tokens, self.block_size, extra_keys)
        out: dict[tuple[str, int], PrefixMatch] = {}
        for (worker, rank, medium), tree in self._trees.items():
            m = out.get((worker, rank))
            if m is None:
                m = out[(worker, rank)] = PrefixMatch(worker, rank, {}, self.block_size)
            m.blocks_by_medium[medium] = tree.depth(keys)
        return list(out.values())

    def cached_tokens(self, tokens: Sequence[int], worker: str | None = None,
                      dp_rank: int | None = None,
                      extra_keys: Sequence[Sequence[Any] | None] | None = None) -> int:
        """Tokens of ``tokens`` a router would say are cached (any tier) on the best matching
        worker/dp rank, or on the given one."""
        best = 0
        for m in self.match(tokens, extra_keys):
            if (worker is None or m.worker == worker) and (dp_rank is None or
                                                           m.dp_rank == dp_rank):
                best = max(best, m.tokens)
        return best

    def blocks(self) -> dict[tuple[str, int, str], int]:
        """Blocks held per (worker, dp rank, medium)."""
        return {key: len(tree.nodes) for key, tree in self._trees.items()}

    def held(self, worker: str | None = None) -> set[tuple[int, int, str]]:
        """``(dp rank, published hash as held, medium)`` of every block in the trees."""
        return {(rank, h, medium) for (w, rank, medium), tree in self._trees.items()
                if worker is None or w == worker for h in tree.nodes}

    def summary_lines(self) -> list[str]:
        """Per tree: blocks and roots; then the rule counts (non-zero ones, warnings first)."""
        lines = []
        for (worker, rank, medium), tree in sorted(self._trees.items()):
            roots = sum(len(g) for g in tree.root.children.values())
            lines.append(f"tree {worker or '-'} dp={rank} {medium}: {len(tree.nodes)} blocks, "
                         f"{roots} roots")
        c = self.counts
        lines.append(f"rule warnings: {c.warnings}" + "".join(
            f", {name} {getattr(c, name)}" for name in WARNING_RULES if getattr(c, name)))
        for medium, per in sorted(self.by_medium.items()):
            named = [f"{name} {per[name]}" for name in WARNING_RULES if per.get(name)]
            if named:
                lines.append(f"  {medium}: " + ", ".join(named))
        lines.append(f"applied: {c.batches} batches, {c.stores} stores, {c.removes} removes, "
                     f"{c.clears} clears; {c.skipped_blocks} blocks in skipped stores, "
                     f"{c.cut_blocks} blocks cut, {c.missing_batches} batches missing")
        return lines


class TreeSubscriber(StreamSubscriber):
    """A :class:`StreamSubscriber` that also keeps a :class:`RouterView` of what it applies.

    Construct with ``view=RouterView(block_size)`` (keyword); every batch the subscriber
    applies (live or replayed, in seq order) goes to the view under ``worker`` (default: the
    endpoint). Not thread-safe: one thread polls and queries.
    """

    def __init__(self, *args: Any, view: RouterView, worker: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.view = view
        self.worker = self.endpoint if worker is None else worker

    def apply(self, batch: EventBatch) -> None:
        super().apply(batch)
        self.view.apply_batch(batch, self.worker)


def apply_all(view: RouterView, batches: Iterable[EventBatch], worker: str = "") -> None:
    """Apply ``batches`` in order (tests and offline replays)."""
    for batch in batches:
        view.apply_batch(batch, worker)



class LazyTreeSubscriber(TreeSubscriber):
    """A :class:`TreeSubscriber` whose router block size is given, or taken from the first
    store it applies when ``block_size`` is None (``kvbm-plugin subscribe --tree``)."""

    def __init__(self, *args: Any, block_size: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, view=RouterView(block_size or 1), **kwargs)
        self._sized = block_size is not None

    def apply(self, batch: EventBatch) -> None:
        if not self._sized:
            size = next((e.block_size for e in batch.events if isinstance(e, BlockStored)), None)
            if size is not None:
                # Nothing was indexed before (no store yet): only the size changes.
                self.view.block_size = size
                self._sized = True
        super().apply(batch)

    def summary_lines(self) -> list[str]:
        size = (f"block size {self.view.block_size}" if self._sized
                else "block size not yet known")
        return [size, *self.view.summary_lines()]


__all__ = ["WARNING_RULES", "LazyTreeSubscriber", "PrefixMatch", "RouterView", "RuleCounts",
           "TreeSubscriber", "apply_all", "block_keys", "content_key"]

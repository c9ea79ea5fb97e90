"""A strict router's view of KV-event streams: the trees a router keeps, the rules it applies,
and the question it asks ("how many tokens of this prompt are cached on this worker?").

Two layers:

* :class:`RouterView` — pure and socket-free. It applies decoded batches the way NVIDIA
  Dynamo's KV indexer does (ai-dynamo-runtime 1.6.1, ``--threads 1``; the trees and their rules
  are in :mod:`kvbm_plugin.routers.router_tree`), counts every rule it had to apply
  (:class:`RuleCounts`) and answers prefix queries. In short:

  - a block is keyed by its *content*: its token ids mixed only with ``lora_name``, the cache
    namespace (a top-level ``cache_salt``, or the ``dynamo-cache-salt:`` item in the first
    block's ``extra_keys``) and its multimodal hashes (64-hex strings or ``(id, offset)`` pairs
    in its ``extra_keys``); ``lora_id`` and any other item are ignored;
  - the device tier is one tree shared by every worker and dp rank: one published hash per
    content position, the first one stored wins; a later store of the same content under
    another hash is an alias (accepted silently; a store under an alias is skipped as if its
    parent were missing, removing an alias does nothing, removing the first hash ends the
    alias's coverage too); a re-store of a held hash at another position moves it;
  - a store whose parent the worker and dp rank does not hold is skipped whole
    (``skipped_stores``: Dynamo's "Failed to find parent block"); removing a block the worker
    does not hold is ``unknown_removes`` ("Failed to find block to remove");
  - lower tiers (host, disk, external) are flat maps keyed by parent hash and content, with
    no parent check; media map to tiers as Dynamo maps them (``GPU``/``DEVICE`` device;
    ``CPU``, ``CPU_PINNED``, ``CPU_TIER1`` host; ``CPU_TIER2``, ``DISK``, ``NVME`` disk;
    ``EXTERNAL``, ``NETWORK``, ``REMOTE``, ``SHARED`` external); any other medium is not
    indexed (``unknown_medium``; Dynamo drops it silently);
  - a store that repeats a hash within the event (its parent counts) is dropped
    (``duplicate_hash_drops``), and so is one whose ``block_size`` differs from the router's or
    that has too few ``token_ids`` (``size_mismatch``);
  - ``AllBlocksCleared`` clears only that worker's dp rank;
  - a batch whose ``seq`` is not above the last applied one for that worker is dropped
    (``stale_batches``); a forward jump is counted as a gap (``gaps``) and the batch applied.

  Dynamo applies aliases, moved hashes, cut subtrees and re-stores silently, each a block a
  router then matches wrongly or can no longer remove; the view counts them as warnings too
  (``alias_blocks``, ``alias_removes``, ``duplicate_stores``, ``cut_subtrees``,
  ``unreachable_stores``), and so are a lower-tier store under a parent that tier does not
  hold for the worker and a lower-tier removal of a block it does not hold
  (``tier_orphan_stores``, ``tier_unknown_removes``: each medium's stream is prefix-closed on
  its own). A stream that is prefix-closed, names each content path once and has no gap
  triggers none.

  Queries walk the prompt's full blocks by content from the root: the device tree first, then
  each lower tier continuing from the worker's prefix in that tier or a faster one (Dynamo's
  ``cpu``/``disk`` answers); "any tier" is the longest of them.

* :class:`TreeSubscriber` — the thin adapter: a
  :class:`~kvbm_plugin.wire.subscriber.StreamSubscriber` (decoding, gap detection, replay)
  that also feeds every batch it applies, in order, to a :class:`RouterView` under the
  subscriber's endpoint as the worker name. It sees events as the project's tolerant decoder
  returns them: a medium alias (``cpu``, ``CPU_PINNED``) arrives already normalised, where a
  router would not index a lower-case one, and an unknown medium makes the whole message
  malformed (counted by the subscriber) rather than one event unindexed. Both only matter for
  streams other than ours, which publish ``GPU``/``CPU``/``DISK``.

Who calls it: ``kvbm-plugin subscribe --tree``, the demo, the benchmarks' router-accuracy
measurement (:mod:`kvbm_plugin.testing.chat_workload`) and the tests' stream checks. It is
checked against Dynamo's own indexer by tests/interop/test_router_differential.py. Not
thread-safe: one thread applies and queries.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from kvbm_plugin.routers.router_tree import PARENT_MISSING, DeviceTree, LowerTier, Worker
from kvbm_plugin.wire.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from kvbm_plugin.wire.identity import salt_of_extra_keys
from kvbm_plugin.wire.subscriber import StreamSubscriber

# Counters that mean the stream broke a rule a strict router relies on: each is a warning, or a
# block a router silently matches wrongly or cannot remove. The informational counters are not
# in the sum.
WARNING_RULES = ("skipped_stores", "unknown_removes", "alias_blocks", "alias_removes",
                 "duplicate_stores", "cut_subtrees", "unreachable_stores",
                 "tier_orphan_stores", "tier_unknown_removes",
                 "duplicate_hash_drops", "stale_batches", "gaps", "unknown_medium",
                 "size_mismatch")

# Medium names a router indexes, and the tier each goes to (Dynamo's storage tiers, named as
# our streams name the media).
MEDIUM_TIERS = {
    "GPU": "GPU", "DEVICE": "GPU",
    "CPU": "CPU", "CPU_PINNED": "CPU", "CPU_TIER1": "CPU",
    "CPU_TIER2": "DISK", "DISK": "DISK", "NVME": "DISK",
    "EXTERNAL": "EXTERNAL", "NETWORK": "EXTERNAL", "REMOTE": "EXTERNAL", "SHARED": "EXTERNAL",
}
TIER_ORDER = ("GPU", "CPU", "DISK", "EXTERNAL")  # fastest first
_MM_HEX = re.compile(r"[0-9a-fA-F]{64}")


@dataclass
class RuleCounts:
    """How often each rule of a strict router applied (see the module docstring)."""

    batches: int = 0
    stores: int = 0
    removes: int = 0
    clears: int = 0
    skipped_stores: int = 0  # store events skipped whole: parent not held (Dynamo warns)
    skipped_blocks: int = 0  # blocks in those events
    unknown_removes: int = 0  # removed hashes the worker did not hold (Dynamo warns)
    alias_blocks: int = 0  # blocks stored under a second name for held content (silent)
    alias_removes: int = 0  # removals of such a second name: no effect (silent)
    duplicate_stores: int = 0  # stored hashes the worker already held (a re-store or a move)
    cut_subtrees: int = 0  # removals of a block the worker still had descendants of
    cut_blocks: int = 0  # of the worker's blocks, made unreachable by those removals
    unreachable_stores: int = 0  # stores under a cut-off block: accepted, never matched
    tier_orphan_stores: int = 0  # lower-tier stores under a parent not held there (silent)
    tier_unknown_removes: int = 0  # lower-tier removals of a block not held there (silent)
    duplicate_hash_drops: int = 0  # store events that repeated a hash (parent included)
    stale_batches: int = 0  # seq not above the last applied one: dropped
    gaps: int = 0  # forward seq jumps
    missing_batches: int = 0  # batches those jumps skipped
    unknown_medium: int = 0  # events whose medium a router does not index
    size_mismatch: int = 0  # stores with another block_size or too few token ids

    @property
    def warnings(self) -> int:
        """The sum of the rules a well-formed, prefix-closed, gap-free stream never triggers."""
        return sum(getattr(self, name) for name in WARNING_RULES)

    def broken(self) -> dict[str, int]:
        """The warning rules that applied, by name, with their counts (empty for a
        well-formed, prefix-closed, gap-free stream)."""
        return {name: n for name in WARNING_RULES if (n := getattr(self, name))}

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _mm_items(entry: Any) -> tuple[Any, ...]:
    """The multimodal hashes a router reads from one block's ``extra_keys`` entry."""
    if not isinstance(entry, (list, tuple)):
        return ()
    out: list[Any] = []
    for item in entry:
        if isinstance(item, str) and _MM_HEX.fullmatch(item):
            out.append(item.lower())
        elif (isinstance(item, (list, tuple)) and len(item) == 2
              and all(isinstance(x, int) and not isinstance(x, bool) for x in item)):
            out.append((item[0], item[1]))
    return tuple(out)


def content_key(tokens: Sequence[int], *, lora_name: str | None = None,
                namespace: str | None = None, mm: Sequence[Any] = ()) -> Hashable:
    """The key a router gives one block: its token ids mixed with ``lora_name``, the cache
    namespace and its multimodal hashes. Stable within a process (only this view compares
    it)."""
    return hash((tuple(tokens), lora_name, namespace, tuple(mm)))


def block_keys(tokens: Sequence[int], block_size: int,
               extra_keys: Sequence[Sequence[Any] | None] | None = None, *,
               namespace: str | None = None, lora_name: str | None = None) -> list[Hashable]:
    """Content keys of the full blocks of ``tokens`` (a trailing partial block is not keyed, as
    a router hashes only full blocks). ``extra_keys``: one entry per block, or None; the
    namespace is ``namespace`` or else the one the first entry names."""
    if namespace is None and extra_keys:
        namespace = salt_of_extra_keys(extra_keys[0])
    n = len(tokens) // block_size
    return [content_key(tokens[i * block_size:(i + 1) * block_size], lora_name=lora_name,
                        namespace=namespace,
                        mm=_mm_items(extra_keys[i]) if extra_keys and i < len(extra_keys)
                        else ())
            for i in range(n)]


@dataclass
class PrefixMatch:
    """A query's answer for one (worker, dp rank): matched blocks per tier and any tier."""

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
    """The trees a strict router keeps, fed decoded batches; see the module docstring for the
    rules. ``block_size`` is the router's block size."""

    block_size: int
    counts: RuleCounts = field(default_factory=RuleCounts)

    def __post_init__(self) -> None:
        if type(self.block_size) is not int or self.block_size <= 0:
            raise ValueError(f"RouterView: block_size={self.block_size!r} must be a positive "
                             "integer")
        self.device = DeviceTree()
        self.lower: dict[str, LowerTier] = {t: LowerTier() for t in TIER_ORDER[1:]}
        self._last_seq: dict[str, int] = {}
        # tier -> rule -> count, for the per-event rules (where a stream broke them)
        self.by_medium: dict[str, dict[str, int]] = {}

    def _bump(self, medium: str, rule: str, n: int = 1) -> None:
        if n <= 0:
            return
        setattr(self.counts, rule, getattr(self.counts, rule) + n)
        per = self.by_medium.setdefault(medium, {})
        per[rule] = per.get(rule, 0) + n

    # ------------------------------------------------------------------ applying events

    def apply_batch(self, batch: EventBatch, worker: str = "", stream: str | None = None) -> bool:
        """Apply one decoded batch from ``worker``'s stream; False when the seq watermark
        dropped it. ``stream`` names the seq stream when a worker has several (one per dp
        rank, as Dynamo registers them); by default it is the worker's one."""
        stream = worker if stream is None else stream
        if batch.seq is not None:
            last = self._last_seq.get(stream)
            if last is not None and batch.seq <= last:
                self.counts.stale_batches += 1
                return False
            if last is not None and batch.seq > last + 1:
                self.counts.gaps += 1
                self.counts.missing_batches += batch.seq - last - 1
            self._last_seq[stream] = batch.seq
        self.counts.batches += 1
        rank = batch.data_parallel_rank or 0
        for event in batch.events:
            self.apply_event(event, worker, rank)
        return True

    def apply_event(self, event: Any, worker: str = "", dp_rank: int = 0) -> None:
        """Apply one decoded event (no seq rule: that is per batch)."""
        w = (worker, dp_rank)
        if isinstance(event, BlockStored):
            self._store(event, w)
        elif isinstance(event, BlockRemoved):
            self._remove(event, w)
        elif isinstance(event, AllBlocksCleared):
            self.counts.clears += 1
            self.device.clear(w)
            for tier in self.lower.values():
                tier.clear(w)

    def _tier(self, medium: Any) -> str | None:
        tier = MEDIUM_TIERS.get(MEDIUM_GPU if medium is None else medium)
        if tier is None:
            self._bump(str(medium), "unknown_medium")
        return tier

    def _store(self, event: BlockStored, w: Worker) -> None:
        self.counts.stores += 1
        tier = self._tier(event.medium)
        if tier is None:
            return
        hashes = list(event.block_hashes)
        bs = self.block_size
        if event.block_size != bs or len(event.token_ids) < len(hashes) * bs:
            self._bump(tier, "size_mismatch")
            return
        parent = event.parent_block_hash
        named = hashes if parent is None else [parent, *hashes]
        if len(set(named)) != len(named):
            self._bump(tier, "duplicate_hash_drops")
            return
        extra = event.extra_keys
        namespace = getattr(event, "cache_salt", None)
        if namespace is None and extra:
            namespace = salt_of_extra_keys(extra[0])
        tokens = event.token_ids
        blocks = [(content_key(tokens[i * bs:(i + 1) * bs], lora_name=event.lora_name,
                               namespace=namespace,
                               mm=_mm_items(extra[i]) if extra and i < len(extra) else ()), h)
                  for i, h in enumerate(hashes)]
        if tier != "GPU":
            notes = self.lower[tier].store(w, parent, blocks)
            self._bump(tier, "tier_orphan_stores", notes["orphan"])
            self._bump(tier, "duplicate_stores", notes["duplicate"])
            self._bump(tier, "alias_blocks", notes["alias"])
            return
        tree = self.device
        lookup = tree.lookup.get(w, {})
        held_before = sum(h in lookup for h in hashes)
        parent_node = None if parent is None else lookup.get(parent)
        if tree.store(w, parent, blocks) == PARENT_MISSING:
            self._bump(tier, "skipped_stores")
            self._bump(tier, "skipped_blocks", len(hashes))
            return
        self._bump(tier, "duplicate_stores", held_before)
        if parent_node is not None and not _reachable(tree, parent_node):
            self._bump(tier, "unreachable_stores")
            return
        aliases = 0
        for _, h in blocks:
            at = tree.lookup[w].get(h)
            if at is not None and h not in at.index:
                aliases += 1
        self._bump(tier, "alias_blocks", aliases)

    def _remove(self, event: BlockRemoved, w: Worker) -> None:
        self.counts.removes += 1
        tier = self._tier(event.medium)
        if tier is None:
            return
        hashes = list(event.block_hashes)
        if tier != "GPU":
            notes = self.lower[tier].remove(w, hashes)
            self._bump(tier, "tier_unknown_removes", notes["unknown"])
            self._bump(tier, "cut_subtrees", notes["cut"])
            return
        tree = self.device
        lookup = tree.lookup.get(w, {})
        removing = set(hashes)
        aliases = cut = cut_blocks = 0
        for h in hashes:
            node = lookup.get(h)
            pos = None if node is None else node.index.get(h)
            if node is None:
                continue
            if pos is None:
                aliases += 1
                continue
            covered = node.covered(w)
            if pos >= covered:
                continue
            # What the worker keeps below this block, unless the same event removes it too.
            after = [x for _, x in node.edge[pos + 1:covered] if x not in removing]
            below = (sum(_covered_below(c, w, removing) for c in node.children.values())
                     if w in node.full else 0)
            if after or below:
                cut += 1
                cut_blocks += len(after) + below
        self._bump(tier, "unknown_removes", tree.remove(w, hashes))
        self._bump(tier, "alias_removes", aliases)
        self._bump(tier, "cut_subtrees", cut)
        self._bump(tier, "cut_blocks", cut_blocks)

    # ------------------------------------------------------------------ queries

    def match(self, tokens: Sequence[int],
              extra_keys: Sequence[Sequence[Any] | None] | None = None, *,
              namespace: str | None = None,
              lora_name: str | None = None) -> list[PrefixMatch]:
        """Per (worker, dp rank) the prompt's cached prefix in blocks, per tier (each tier
        counting itself and the faster ones, from the device prefix on) and any tier.
        ``namespace``/``lora_name``: the request's cache namespace and adapter as the wire
        names them (or the namespace in ``extra_keys``' first entry, as published)."""
        keys = block_keys(tokens, self.block_size, extra_keys, namespace=namespace,
                          lora_name=lora_name)
        device = self.device.match(keys) if keys else {}
        workers = set(device) | {w for tier in self.lower.values()
                                 for ws in (e[1] for e in tier.entries.values()) for w in ws}
        out = []
        for w in sorted(workers):
            path = device.get(w, [])
            by_medium = {"GPU": len(path)} if w in device else {}
            faster: list[LowerTier] = []
            for name in TIER_ORDER[1:]:
                tier = self.lower[name]
                faster.append(tier)
                if not any(w in e[1] for e in tier.entries.values()):
                    continue
                depth = len(path)
                prev = path[-1] if path else None
                while depth < len(keys):
                    h = next((x for t in faster
                              if (x := t.holds(w, prev, keys[depth])) is not None), None)
                    if h is None:
                        break
                    prev = h
                    depth += 1
                by_medium[name] = depth
            out.append(PrefixMatch(w[0], w[1], by_medium, self.block_size))
        return out

    def cached_tokens(self, tokens: Sequence[int], worker: str | None = None,
                      dp_rank: int | None = None,
                      extra_keys: Sequence[Sequence[Any] | None] | None = None, *,
                      namespace: str | None = None, lora_name: str | None = None) -> int:
        """Tokens of ``tokens`` a router would say are cached (any tier) on the best matching
        worker/dp rank, or on the given one."""
        best = 0
        for m in self.match(tokens, extra_keys, namespace=namespace, lora_name=lora_name):
            if (worker is None or m.worker == worker) and (dp_rank is None or
                                                           m.dp_rank == dp_rank):
                best = max(best, m.tokens)
        return best

    def edges(self) -> dict[tuple[str, int, str], set[tuple[int | None, int]]]:
        """``(parent hash, hash)`` of every block held, per (worker, dp rank, tier): what
        Dynamo's ``/dump`` shows (a node under the first hash stored for its content)."""
        out: dict[tuple[str, int, str], set[tuple[int | None, int]]] = {}
        for w, held in self.device.edges().items():
            out[(w[0], w[1], "GPU")] = held
        for name, tier in self.lower.items():
            for w, held in tier.edges().items():
                out[(w[0], w[1], name)] = held
        return out

    def blocks(self) -> dict[tuple[str, int, str], int]:
        """Blocks held per (worker, dp rank, tier)."""
        return {key: len(held) for key, held in self.edges().items() if held}

    def held(self, worker: str | None = None) -> set[tuple[int, int, str]]:
        """``(dp rank, hash as shown, tier)`` of every block held (by ``worker``, or any)."""
        return {(rank, h, tier) for (w, rank, tier), held in self.edges().items()
                if worker is None or w == worker for _, h in held}

    def summary_lines(self) -> list[str]:
        """Per tree: blocks and roots; then the rule counts (non-zero ones, warnings first)."""
        lines = []
        for (worker, rank, medium), held in sorted(self.edges().items()):
            if not held:
                continue
            roots = sum(parent is None for parent, _ in held)
            lines.append(f"tree {worker or '-'} dp={rank} {medium}: {len(held)} blocks, "
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


def _reachable(tree: DeviceTree, node: Any) -> bool:
    """Whether ``node`` still hangs from the tree's root (a cut drops whole subtrees)."""
    while node.parent is not None:
        if node.parent.children.get(node.edge[0][0]) is not node:
            return False
        node = node.parent
    return node is tree.root


def _covered_below(node: Any, w: Worker, removing: set[int]) -> int:
    """Blocks the worker covers in ``node``'s subtree, other than those in ``removing``."""
    total, stack = 0, [node]
    while stack:
        n = stack.pop()
        total += sum(h not in removing for _, h in n.edge[:n.covered(w)])
        stack.extend(n.children.values())
    return total


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


__all__ = ["MEDIUM_TIERS", "WARNING_RULES", "LazyTreeSubscriber", "PrefixMatch", "RouterView",
           "RuleCounts", "TreeSubscriber", "apply_all", "block_keys", "content_key"]

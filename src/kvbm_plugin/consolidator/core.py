"""The consolidator's pure core: the dedup state machine behind
:mod:`kvbm_plugin.consolidator.service`.

:class:`ConsolidatorCore` has no sockets, no threads and no clock, and imports neither zmq nor
torch. It takes GPU-tier wire events (per dp rank) and offload-tier registrations, and emits
output wire events per dp rank. Everything the router sees is decided here, so every invariant
is unit-testable in milliseconds.

Who calls what: one owner drives a core, on one thread — the socket shell
:class:`~kvbm_plugin.consolidator.service.KvEventConsolidator` on its ingest thread (decoded
GPU-tier batches through :meth:`ConsolidatorCore.apply_events`, queued tier registrations
through :meth:`ConsolidatorCore.store` / ``remove`` / ``clear``, then
:meth:`ConsolidatorCore.take_output` to publish), or a test. Callers import these names from
:mod:`kvbm_plugin.consolidator.service`, which re-exports them.

The dedup block loops also exist compiled (``consolidator/_core_c.c``, used when built): the Python
loops here are their reference, the tests compare the two, and everything the compiled loops do
not take (clears, passthrough mode, unusual or malformed input) runs here. The compiled loops
read and write the block and ``_Rank`` layouts of :mod:`~kvbm_plugin.consolidator.blocks`
directly, so the two stay in step. What input is accepted is checked in
:mod:`~kvbm_plugin.consolidator.inputs`.

Semantics (dedup mode, the default):

* **Identity** of a block is its content chain per dp rank: a 64-bit hash of (parent identity,
  token ids; its adapter and extra keys if any). Each (source, tier) keeps its own external
  hash → block map, so sources whose hash algorithms differ still agree; removals carry
  hashes only and are resolved through that map.
* **Residency** is tracked per (source, tier): the engine's GPU stream (whatever medium its
  events carry) and the registered tiers (CPU = host, DISK). A block is STOREd downstream when
  it first becomes resident anywhere and REMOVEd when it is resident nowhere, nothing otherwise.
  Output medium is ``GPU`` (a lower-tier tag would route the block to a lower-tier index).
* The output uses one stable external hash per block (the first one seen); a parent is named by
  the parent's published hash. If two blocks would publish the same hash (a source whose hash
  ignores something the content chain sees), the later one gets a derived hash, counted.
* **Passthrough** mode keeps residency per medium instead: a block is STOREd with medium ``m``
  when it becomes resident in tier ``m`` (from any source) and REMOVEd with medium ``m`` when it
  leaves it, so each tier's events are forwarded with their own medium.
* **Clear** from one (source, tier) drops only that residency; downstream gets the REMOVEs this
  implies, or one ``AllBlocksCleared`` when nothing is left for that dp rank.
* **Prefix-closed output**, whatever the sources send: a block is published (per medium in
  passthrough) only while its parent is. Blocks are held back, released and cascaded as
  :mod:`kvbm_plugin.consolidator.held_back` describes (its ``PrefixClosure``, which the core
  owns); the block layout and per-rank maps are in :mod:`kvbm_plugin.consolidator.blocks`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin.consolidator.blocks import (
    CHILDREN,
    COUNTS,
    HELD_BACK,
    I64_MAX,
    IDENT,
    KIDS,
    MASK,
    MORE_ALIASES,
    PARENT,
    PUB,
    ROOT,
    SOURCE_ENGINE,
    SOURCE_TIERS,
    TIER_INDEX,
    TOTAL,
    U64,
    UNKNOWN_PARENT,
    WIRE,
    Block,
    _Rank,
    collect,
    pub_taken,
    set_known,
    slot_of,
    wire_hash,
)
from kvbm_plugin.consolidator.held_back import DEFAULT_MAX_HELD_BACK, HeldBack, PrefixClosure
from kvbm_plugin.consolidator.inputs import (
    chain_identities,
    scopes,
    stored_fields,
    u64_hashes,
)
from kvbm_plugin.consolidator_config import ConsolidatorMode
from kvbm_plugin.wire.events import (
    MAX_DP_RANKS,
    MEDIA,
    MEDIUM_GPU,
    WireFormatError,
    normalize_medium,
)
from kvbm_plugin.wire.publisher_base import WireEvent

__all__ = [
    "SOURCE_ENGINE",
    "SOURCE_TIERS",
    "UnknownMediumError",
    "UnknownDpRankError",
    "ConsolidatorCore",
]


class UnknownMediumError(WireFormatError):
    """An event's medium is none of the known names or aliases (never guessed as GPU)."""


class UnknownDpRankError(WireFormatError):
    """A data-parallel rank the core refuses (not below its ``max_dp_ranks``)."""


_CORE_COUNTERS: Final = (
    "stores_in", "store_blocks_in", "removes_in", "remove_blocks_in", "clears_in",
    "duplicate_stores", "unknown_removes", "unknown_parents", "hash_conflicts",
    "hash_only_stores_dropped", "resyncs", "unknown_dp_ranks_refused", "held_back_stores",
    "held_back_dropped",
    "stores_out", "store_blocks_out", "removes_out", "remove_blocks_out", "clears_out",
)


class ConsolidatorCore:
    """The pure consolidation state machine (see the module docstring for the semantics).

    Not thread-safe: one owner calls it (the shell's ingest thread, or a test). Every mutator
    appends to a per-dp-rank output list that :meth:`take_output` hands over; the events in it
    are already in wire form (signed int64 hashes, upper-case medium), ready to publish.

    Every dp rank gets state kept for the core's lifetime, so only ranks below
    ``max_dp_ranks`` are accepted: anything for another rank raises
    :class:`UnknownDpRankError`, counted in ``unknown_dp_ranks_refused``.

    ``max_held_back``: the most blocks one source's stores may hold back per dp rank (and per
    medium in passthrough); a store past it is refused and counted (``held_back_dropped``,
    see :mod:`kvbm_plugin.consolidator.held_back`).
    """

    def __init__(self, mode: ConsolidatorMode = "dedup", *, native: bool | None = None,
                 max_dp_ranks: int = MAX_DP_RANKS,
                 max_held_back: int = DEFAULT_MAX_HELD_BACK) -> None:
        if mode not in ("dedup", "passthrough"):
            raise ValueError(f"{type(self).__name__}: mode {mode!r} is not dedup | passthrough")
        if type(max_dp_ranks) is not int or max_dp_ranks < 1:
            raise ValueError(f"{type(self).__name__}: max_dp_ranks={max_dp_ranks!r} must be an "
                             "integer >= 1")
        if type(max_held_back) is not int or max_held_back < 0:
            raise ValueError(f"{type(self).__name__}: max_held_back={max_held_back!r} must be "
                             "an integer >= 0")
        self.max_dp_ranks: Final = max_dp_ranks
        self.max_held_back: Final = max_held_back
        self.mode: Final = mode
        self._dedup = mode == "dedup"
        self._closure = PrefixClosure(self._dedup)  # held back, released, cascaded
        # The compiled dedup block loops (None: the Python ones). ``native`` as for KvEventSink:
        # None = when built and not switched off by DYN_KVBM_NATIVE, False = never, True = or
        # ValueError. Passthrough mode always runs the Python loops.
        module = _compiled.choose("consolidator", native, type(self).__name__)
        self._compiled = module if self._dedup else None
        if self._compiled is not None:
            self._compiled.core_constants(ROOT, UNKNOWN_PARENT, len(MEDIA), MEDIUM_GPU)
        # Where the compiled loops run, every block is their compact Block (blocks.py).
        self._make_block = None if self._compiled is None else self._compiled.Block
        self._ranks: dict[int, _Rank] = {}
        for name in _CORE_COUNTERS:
            setattr(self, "_n_" + name, 0)
        # Medium string -> tier index, filled on first sight of each spelling (hot path).
        self._medium_cache: dict[Any, int] = {None: 0}

    # ------------------------------------------------------------------ public mutators

    def apply_event(self, dp_rank: int, raw: Any, source: int = SOURCE_ENGINE) -> None:
        """Apply one wire event as msgpack decoded it (a map, or a legacy positional array).

        Called by the shell's ingest thread for every GPU-tier event. Hashes may be signed or
        unsigned. Raises :class:`WireFormatError` naming the offending value; nothing of an
        event that raises has been applied.
        """
        if type(raw) is dict:
            kind = raw.get("type")
            if kind == "BlockStored":
                self._stored(dp_rank, source, raw.get("block_hashes"),
                             raw.get("parent_block_hash"), raw.get("token_ids"),
                             raw.get("block_size"), raw.get("medium"), raw.get("lora_id"),
                             raw.get("lora_name"), raw.get("extra_keys"))
                return
            if kind == "BlockRemoved":
                self._removed(dp_rank, source, raw.get("block_hashes"), raw.get("medium"))
                return
            if kind == "AllBlocksCleared":
                self._cleared(dp_rank, source, raw.get("medium"))
                return
        elif type(raw) in (list, tuple) and raw:
            kind = raw[0]
            n = len(raw)
            if kind == "BlockStored":
                self._stored(dp_rank, source, raw[1] if n > 1 else None,
                             raw[2] if n > 2 else None, raw[3] if n > 3 else None,
                             raw[4] if n > 4 else None, raw[6] if n > 6 else None,
                             raw[5] if n > 5 else None, raw[7] if n > 7 else None,
                             raw[8] if n > 8 else None)
                return
            if kind == "BlockRemoved":
                self._removed(dp_rank, source, raw[1] if n > 1 else None,
                              raw[2] if n > 2 else None)
                return
            if kind == "AllBlocksCleared":
                self._cleared(dp_rank, source, None)
                return
        else:
            raise WireFormatError(f"event is neither a map nor an array: {raw!r:.200}")
        raise WireFormatError(f"unknown event type {kind!r:.100}")

    def apply_events(self, dp_rank: int, events: Sequence[Any],
                     on_error: Callable[[WireFormatError], None]) -> int:
        """:meth:`apply_event` for each GPU-tier event of one batch, in order.

        Called by the shell's ingest thread once per input batch. An event that raises is
        handed to ``on_error`` (any other exception as a WireFormatError naming it) and
        skipped; the others are applied. Returns how many were applied. With the compiled
        loops the common events are applied by one call; each event they leave (clears,
        unusual shapes, malformed input) goes through :meth:`apply_event`.
        """
        if not self.admit_dp_rank(dp_rank):
            on_error(UnknownDpRankError(f"batch of {len(events)} events refused: "
                                        f"data_parallel_rank {dp_rank!r:.100} is not an int in "
                                        f"0..{self.max_dp_ranks - 1}"))
            return 0
        compiled = self._compiled
        applied = 0
        i = 0
        while i < len(events):  # re-read: a caller's key object may change the list
            rank = self._ranks.get(dp_rank)
            # The compiled loops run whatever is held back; they leave to the Python code each
            # store that touches a held-back block or its parent, and finish a removal that
            # reaches one or would cascade through :meth:`_remove_rest`.
            if compiled is not None and rank is not None and type(events) is list:
                stop, counts, error = compiled.apply_events(
                    rank, events, i, SOURCE_ENGINE, self._medium_cache, self._fresh_pub,
                    self._add_alias, self._release, self._remove_rest)
                self._add_counts(rank, counts)
                applied += stop - i
                i = stop
                if error is not None:  # raised part-way through event ``stop``: consumed
                    on_error(WireFormatError(f"{type(error).__name__}: {error}"))
                    i += 1
                    continue
                if i >= len(events):
                    break
            try:
                self.apply_event(dp_rank, events[i])
                applied += 1
            except WireFormatError as exc:
                on_error(exc)
            except Exception as exc:  # anything else malformed must not stop the batch
                on_error(WireFormatError(f"{type(exc).__name__}: {exc}"))
            i += 1
        return applied

    def store(self, source: int, tier: str, dp_rank: int, block_hashes: Sequence[int],
              parent_hash: int | None, token_ids: Sequence[int], block_size: int,
              lora_id: int | None = None, lora_name: str | None = None,
              extra_keys: Sequence[Any] | None = None) -> None:
        """``(source, tier)`` now holds a chain of blocks (``block_size`` tokens each).

        ``block_hashes[0]``'s parent is ``parent_hash``; each later block's parent is the one
        before it. Hashes signed or unsigned. ``lora_id`` and ``extra_keys`` (one entry per
        block: multimodal keys, cache salt) are part of each block's identity. Raises
        WireFormatError on a bad tier or shape.
        """
        self._stored(dp_rank, source, list(block_hashes), parent_hash, token_ids, block_size,
                     tier, lora_id, lora_name,
                     None if extra_keys is None else list(extra_keys))

    def remove(self, source: int, tier: str, dp_rank: int, block_hashes: Sequence[int]) -> None:
        """``(source, tier)`` no longer holds these blocks (unknown hashes are counted)."""
        self._removed(dp_rank, source, list(block_hashes), tier)

    def clear(self, source: int, tier: str | None, dp_rank: int) -> None:
        """``(source, tier)`` holds nothing any more; ``tier=None``: every tier of ``source``."""
        if tier is None:
            for index in range(len(MEDIA)):
                self._clear_slot(self._rank(dp_rank), slot_of(source, index))
        else:
            self._cleared(dp_rank, source, tier)

    def resync(self, dp_rank: int) -> None:
        """Forget everything the engine stream said about ``dp_rank`` (its events were lost).

        Called by the shell when a seq gap cannot be filled. The blocks become resident
        nowhere unless a tier holds them, until the engine stores them again.
        """
        self._n_resyncs += 1
        rank = self._rank(dp_rank)
        for index in range(len(MEDIA)):
            self._clear_slot(rank, slot_of(SOURCE_ENGINE, index))

    def take_output(self) -> dict[int, list[WireEvent]]:
        """The output events since the last call, per dp rank, in order; then forgets them."""
        taken: dict[int, list[WireEvent]] = {}
        for dp_rank, rank in self._ranks.items():
            if rank.out:
                taken[dp_rank] = rank.out
                rank.out = []
                rank.last_remove = None
        return taken

    def admit_dp_rank(self, dp_rank: Any) -> bool:
        """Whether events for ``dp_rank`` are accepted: an int in ``0..max_dp_ranks - 1``.
        False is counted (``unknown_dp_ranks_refused``); the shell calls this before it
        remembers a rank a payload named."""
        if type(dp_rank) is int and 0 <= dp_rank < self.max_dp_ranks:
            return True
        self._n_unknown_dp_ranks_refused += 1
        return False

    # ------------------------------------------------------------------ inspection

    def visible_hashes(self, dp_rank: int, medium: str | None = None) -> set[int]:
        """Published (signed) hashes a consumer of the output holds now for ``dp_rank``.

        Passthrough: those held in ``medium`` (required there). For tests and ``doctor``.
        """
        rank = self._ranks.get(dp_rank)
        if rank is None:
            return set()
        if self._dedup:
            hidden = rank.hidden[0].entries
            return {b[WIRE] for b in rank.blocks.values()
                    if b[TOTAL] and b[IDENT] not in hidden}
        index = TIER_INDEX[normalize_medium(medium)]
        hidden = rank.hidden[index].entries
        return {b[WIRE] for b in rank.blocks.values()
                if b[COUNTS][index] and b[IDENT] not in hidden}

    def resident_in(self, source: int, tier: str, dp_rank: int) -> set[int]:
        """External hashes (u64) that ``(source, tier)`` holds now, for tests."""
        rank = self._ranks.get(dp_rank)
        if rank is None:
            return set()
        return set(rank.held[slot_of(source, TIER_INDEX[normalize_medium(tier)])])

    def stats(self) -> dict[str, int]:
        """Counters plus current sizes; cheap enough for a metrics scrape."""
        out = {name: getattr(self, "_n_" + name) for name in _CORE_COUNTERS}
        for name, count in self._closure.counts().items():  # what the closure emitted
            out[name] = out.get(name, 0) + count
        # A snapshot (list() of a dict view is atomic under the GIL): the metrics thread calls
        # this while the ingest thread may add a dp rank.
        ranks = list(self._ranks.values())
        out["blocks_tracked"] = sum(len(r.blocks) for r in ranks)
        out["blocks_visible"] = sum(r.visible for r in ranks)
        out["blocks_held_back"] = sum(len(h) for r in ranks for h in r.hidden)
        for source, name in enumerate(("engine", "tiers")):
            out[f"blocks_held_back_{name}"] = sum(h.by_source[source] for r in ranks
                                                  for h in r.hidden)
        return out

    @property
    def held_back_dropped(self) -> int:
        """Stores refused at the held-back bound so far (the shell logs when it grows)."""
        return self._n_held_back_dropped  # type: ignore[attr-defined, no-any-return]

    # ------------------------------------------------------------------ internals

    def _rank(self, dp_rank: int) -> _Rank:
        rank = self._ranks.get(dp_rank)
        if rank is None:
            if not self.admit_dp_rank(dp_rank):
                raise UnknownDpRankError(f"data_parallel_rank {dp_rank!r:.100} is not an int in "
                                         f"0..{self.max_dp_ranks - 1}")
            limit = self.max_held_back
            rank = self._ranks[dp_rank] = _Rank([HeldBack(limit) for _ in MEDIA])
        return rank

    def _tier(self, medium: Any) -> int:
        try:
            return self._medium_cache[medium]
        except (KeyError, TypeError):
            pass
        try:
            index = TIER_INDEX[normalize_medium(medium)]
        except WireFormatError as exc:
            raise UnknownMediumError(str(exc)) from None
        if isinstance(medium, str) and len(self._medium_cache) < 64:
            self._medium_cache[medium] = index
        return index

    def _hashes(self, value: Any, what: str) -> list[int]:
        return u64_hashes(value, what, self._compiled)

    def _group(self, slot: int) -> int:
        return 0 if self._dedup else slot % len(MEDIA)

    def _medium_out(self, group: int) -> str:
        return MEDIUM_GPU if self._dedup else MEDIA[group]

    def _stored(self, dp_rank: int, source: int, hashes_raw: Any, parent_raw: Any,
                tokens: Any, block_size: Any, medium: Any, lora_id: Any,
                lora_name: Any, extra_keys: Any = None) -> None:
        # Validate everything before the first mutation, so a bad event changes nothing.
        hashes = self._hashes(hashes_raw, "BlockStored block_hashes")
        parent_raw, tokens = stored_fields(parent_raw, tokens, block_size, lora_id, lora_name)
        slot = slot_of(source, self._tier(medium))
        rank = self._rank(dp_rank)
        n = len(hashes)
        if len(tokens) != n * block_size and tokens:
            raise WireFormatError(f"BlockStored has {len(tokens)} token ids for {n} blocks "
                                  f"of {block_size}")
        scope = None
        if extra_keys is not None or lora_id is not None or lora_name is not None:
            scope = scopes(lora_id, lora_name, extra_keys, n)
        if not tokens:
            self._store_hash_only(rank, slot, hashes)
        else:
            self._store_chain(rank, slot, hashes, parent_raw, tokens, block_size, lora_id,
                              lora_name, scope, extra_keys)
        # Counted once applied (an unhashable token raises before anything changed).
        self._n_stores_in += 1
        self._n_store_blocks_in += n

    @staticmethod
    def _resolve(rank: _Rank, slot: int, ext: int) -> Block | None:
        """The live block ``ext`` names: the slot's own map first, then any other slot's."""
        block = rank.known[slot].get(ext)
        if block is None:
            for known in rank.known:
                block = known.get(ext)
                if block is not None:
                    break
        return block

    def _add_counts(self, rank: _Rank, counts: tuple[int, ...]) -> None:
        """Counter deltas of events applied by the compiled loops (N_* order in the C file)."""
        (stores_in, store_blocks_in, unknown_parents, duplicates, stores_out, store_blocks_out,
         removes_in, remove_blocks_in, unknown_removes, removes_out, remove_blocks_out,
         visible) = counts
        self._n_stores_in += stores_in
        self._n_store_blocks_in += store_blocks_in
        self._n_unknown_parents += unknown_parents
        self._n_duplicate_stores += duplicates
        self._n_stores_out += stores_out
        self._n_store_blocks_out += store_blocks_out
        self._n_removes_in += removes_in
        self._n_remove_blocks_in += remove_blocks_in
        self._n_unknown_removes += unknown_removes
        self._n_removes_out += removes_out
        self._n_remove_blocks_out += remove_blocks_out
        rank.visible += visible

    def _store_chain(self, rank: _Rank, slot: int, hashes: list[int], parent_ext: int | None,
                     tokens: list[int], bs: int, lora_id: Any, lora_name: Any,
                     scope: list[Any] | None = None, extra_keys: Any = None) -> None:
        # Hot path (one iteration per stored block): locals only; a block is created inline.
        blocks = rank.blocks
        blocks_get = blocks.get
        known = rank.known[slot]
        known_get = known.get
        held = rank.held[slot]
        held_get = held.get
        unlisted = rank.unlisted
        dedup = self._dedup
        group = 0 if dedup else slot % len(MEDIA)
        medium = MEDIUM_GPU if dedup else MEDIA[group]
        out = rank.out
        parent: Block | None = None
        parent_wire: int | None = None
        pident = ROOT
        unknown_parent = False
        if parent_ext is not None:
            parent = self._resolve(rank, slot, parent_ext)
            if parent is None:
                unknown_parent = True  # counted once the chain is applied
                pident = hash((UNKNOWN_PARENT, parent_ext))
                parent_wire = wire_hash(parent_ext)
            else:
                pident = parent[IDENT]
                parent_wire = parent[WIRE]
        compiled = self._compiled if scope is None else None  # the compiled loop knows no scope
        make_block = self._make_block
        held_back = rank.hidden[group]
        hidden = held_back.entries
        if compiled is not None and not unknown_parent \
                and (parent is None or (parent[TOTAL] and not parent[HELD_BACK])):
            result = compiled.store_chain(
                rank, blocks, known, held, unlisted, out, hashes, tokens, bs, parent,
                pident, parent_wire, slot, lora_id, lora_name, medium, group, self._fresh_pub,
                self._add_alias, self._release, held_back)
            # None: a hash released mid-chain, or a block of the chain held back or waited
            # for by a held-back child; decided below.
            if result is not None:
                visible, duplicates, n_runs, n_run_blocks = result
                rank.visible += visible
                self._n_duplicate_stores += duplicates
                if n_runs:
                    self._n_stores_out += n_runs
                    self._n_store_blocks_out += n_run_blocks
                    rank.last_remove = None
                return
        # Identities first: an unhashable token raises before anything changed.
        idents = chain_identities(pident, tokens, bs, scope)
        self._n_unknown_parents += unknown_parent
        runs: list[tuple[dict[str, Any], int]] = []  # (output event, first block index)
        run_hashes: list[int] = []
        run_end = -1
        i = 0
        source = slot // len(MEDIA)
        refused: list[Block] = []  # held back past the bound: collected after the loop
        if unknown_parent:
            rank.orphans.add(idents[0])  # never published: its parent never can be
        for ext, ident in zip(hashes, idents, strict=True):
            block = blocks_get(ident)
            if block is None:
                pub = ext
                if pub_taken(rank, pub):
                    pub = self._fresh_pub(rank, ext, ident)
                wire = pub - U64 if pub > I64_MAX else pub
                block = [ident, pub, wire, parent, 0, 0,
                         None if dedup else [0] * len(MEDIA), slot, ext,
                         None, None, 0] if make_block is None else make_block(
                    ident, pub, wire, parent, 0, 0, None, slot, ext, None, None, 0)  # dedup
                if pub != ext:  # a derived hash: no known map names the block by it
                    unlisted[pub] = block
                blocks[ident] = block
                old = known_get(ext)  # blocks.set_known, inline
                if old is not None and old[PUB] == ext:
                    unlisted[ext] = old
                known[ext] = block
                if parent is not None:
                    parent[CHILDREN] += 1
                    kids = parent[KIDS]  # blocks.add_kid, inline
                    if kids is None:
                        parent[KIDS] = ident
                    elif type(kids) is dict:
                        kids[ident] = None
                    else:
                        parent[KIDS] = {kids: None, ident: None}
            elif known_get(ext) is not block:
                self._add_alias(rank, block, slot, ext)
            old = held_get(ext)
            if old is block:
                self._n_duplicate_stores += 1
            else:
                held[ext] = block
                total = block[TOTAL] + 1
                block[TOTAL] = total
                if dedup:
                    newly = total == 1
                else:
                    counts = block[COUNTS]
                    counts[group] += 1
                    newly = counts[group] == 1
                if old is not None:
                    # The slot's hash named other content; that holding ends now. Only after
                    # ``block`` took its holding: ``old`` may be a child of ``block`` (a source
                    # reusing one hash along a chain), whose release would otherwise collect
                    # ``block`` while it is being stored. Meanwhile ``block`` counts as held
                    # back, so a cascade from ``old`` (maybe its parent) does not unpublish a
                    # block that was never published.
                    if newly:
                        held_back.hold((block, None, bs, lora_id, lora_name, None, None))
                    self._release(rank, old, group, medium)
                    if newly:
                        held_back.pop(ident)
                if newly and not self._closure.parent_shown(rank, block, group):
                    # Held back (with its tokens) until its parent is published.
                    newly = False
                    if held_back.hold((block, tokens[i * bs:(i + 1) * bs], bs, lora_id,
                                       lora_name,
                                       None if extra_keys is None else extra_keys[i], source)):
                        self._n_held_back_stores += 1
                    else:  # the source is at its bound: this holding is refused
                        del held[ext]
                        block[TOTAL] -= 1
                        if not dedup:
                            block[COUNTS][group] -= 1
                        self._n_held_back_dropped += 1
                        refused.append(block)
                if newly:
                    rank.visible += 1
                    if run_end == i and out[-1] is runs[-1][0]:
                        run_hashes.append(block[WIRE])
                    else:
                        run_hashes = [block[WIRE]]
                        run = {"type": "BlockStored", "block_hashes": run_hashes,
                               "parent_block_hash": (parent_wire if parent is None
                                                     else parent[WIRE]),
                               "token_ids": None, "block_size": bs, "lora_id": lora_id,
                               "medium": medium, "lora_name": lora_name}
                        out.append(run)
                        runs.append((run, i))
                    run_end = i + 1
                    if held_back.waiting:
                        self._closure.release_children(rank, block, group, medium)
            if hidden and ident in hidden and hidden[ident][1] is None:
                # Held back since a cascade, tokens unknown: this store brings them.
                entry = hidden[ident]
                if self._closure.parent_shown(rank, block, group):
                    held_back.pop(ident)
                    self._closure.publish(
                        rank, block, tokens[i * bs:(i + 1) * bs], bs, lora_id, lora_name,
                        None if extra_keys is None else extra_keys[i], medium)
                    self._closure.released_stores += 1
                    self._closure.release_children(rank, block, group, medium)
                else:
                    hidden[ident] = (entry[0], tokens[i * bs:(i + 1) * bs], bs, lora_id,
                                     lora_name, None if extra_keys is None else extra_keys[i],
                                     entry[6])
            parent = block
            i += 1
        for block in reversed(refused):  # deepest first: a refused parent goes after its child
            if blocks_get(block[IDENT]) is block:
                collect(rank, block)
        if runs:
            self._n_stores_out += len(runs)
            for event, first in runs:
                count = len(event["block_hashes"])
                self._n_store_blocks_out += count
                if extra_keys is not None:
                    event["extra_keys"] = extra_keys[first:first + count]
                if first == 0 and count == i:
                    event["token_ids"] = tokens  # the whole chain: no copy
                else:
                    event["token_ids"] = tokens[first * bs:(first + count) * bs]
            rank.last_remove = None

    def _fresh_pub(self, rank: _Rank, ext: int, ident: int) -> int:
        """A published hash for a block whose first external hash another live block already
        publishes (a source whose hash ignores something the content chain sees): derived,
        unused, so the consumer never sees one hash for two blocks."""
        self._n_hash_conflicts += 1
        salt = 1
        pub = ext
        while pub_taken(rank, pub):
            pub = hash((ext, ident, salt)) & MASK
            salt += 1
        return pub

    def _store_hash_only(self, rank: _Rank, slot: int, hashes: list[int]) -> None:
        """A store without token ids (old offload events): usable only for a block that is
        already visible downstream, since a STORE we publish must carry its tokens."""
        group = self._group(slot)
        held = rank.held[slot]
        for ext in hashes:
            block = self._resolve(rank, slot, ext)
            if block is None or not (block[TOTAL] if self._dedup else block[COUNTS][group]):
                self._n_hash_only_stores_dropped += 1
                continue
            old = held.get(ext)
            if old is block:
                self._n_duplicate_stores += 1
                continue
            if old is not None:
                del held[ext]
                self._release(rank, old, group, self._medium_out(group))
            if rank.known[slot].get(ext) is not block:
                self._add_alias(rank, block, slot, ext)
            held[ext] = block
            block[TOTAL] += 1
            if not self._dedup:
                block[COUNTS][group] += 1

    @staticmethod
    def _add_alias(rank: _Rank, block: Block, slot: int, ext: int) -> None:
        set_known(rank, slot, ext, block)
        if block[MORE_ALIASES] is None:
            block[MORE_ALIASES] = [(slot, ext)]
        else:
            block[MORE_ALIASES].append((slot, ext))

    def _release(self, rank: _Rank, block: Block, group: int, medium: str) -> None:
        """One holding of ``block`` in medium group ``group`` ended (already out of ``held``)."""
        block[TOTAL] -= 1
        if self._dedup:
            gone = block[TOTAL] == 0
        else:
            counts = block[COUNTS]
            counts[group] -= 1
            gone = counts[group] == 0
        if gone:
            held_back = rank.hidden[group]
            if held_back.entries and block[IDENT] in held_back.entries:
                held_back.pop(block[IDENT])  # held back: never published, nothing to undo
            else:
                wires = self._closure.cascade(rank, block, group) if block[CHILDREN] else []
                wires.append(block[WIRE])
                rank.visible -= len(wires)
                self._closure.emit_removes(rank, wires, medium)
        if block[TOTAL] == 0 and block[CHILDREN] == 0:
            collect(rank, block)

    def _removed(self, dp_rank: int, source: int, hashes_raw: Any, medium: Any) -> None:
        hashes = self._hashes(hashes_raw, "BlockRemoved block_hashes")
        slot = slot_of(source, self._tier(medium))
        rank = self._rank(dp_rank)
        self._n_removes_in += 1
        self._n_remove_blocks_in += len(hashes)
        held_pop = rank.held[slot].pop
        if not self._dedup:
            group = slot % len(MEDIA)
            for ext in hashes:
                block = held_pop(ext, None)
                if block is None:
                    self._n_unknown_removes += 1
                else:
                    self._release(rank, block, group, MEDIA[group])
            return
        # Dedup: the blocks now resident nowhere, one output event per call. The compiled
        # loop takes the hashes up to the first one that would cascade or reaches a held-back
        # block; the Python loop takes the rest.
        if self._compiled is not None:
            wires, unknown, stop = self._compiled.remove_dedup(
                rank.blocks, rank.known, rank.held[slot], rank.unlisted, hashes, rank.orphans)
        else:
            wires, unknown, stop = [], 0, 0
        if stop < len(hashes):
            unknown += self._remove_rest(rank, rank.held[slot], hashes, stop, wires)
        if unknown:
            self._n_unknown_removes += unknown
        if wires:
            rank.visible -= len(wires)
            self._closure.emit_removes(rank, wires, MEDIUM_GPU)

    def _remove_rest(self, rank: _Rank, held: dict[int, Block], hashes: list[int],
                     start: int, wires: list[int]) -> int:
        """The dedup removal loop for ``hashes[start:]`` of one event whose blocks leave the
        slot ``held``: appends to ``wires`` the (signed) hashes now resident nowhere, returns
        how many hashes the slot did not hold. Called by :meth:`_removed`, and by the compiled
        loop where it stopped (a cascade, a held-back block)."""
        unknown = 0
        held_pop = held.pop
        hidden = rank.hidden[0].entries
        for index in range(start, len(hashes)):
            block = held_pop(hashes[index], None)
            if block is None:
                unknown += 1
                continue
            block[TOTAL] -= 1
            if not block[TOTAL]:
                if hidden and block[IDENT] in hidden:
                    rank.hidden[0].pop(block[IDENT])  # held back: nothing was published
                else:
                    if block[CHILDREN]:
                        wires += self._closure.cascade(rank, block, 0)
                    wires.append(block[WIRE])
                collect(rank, block)
        return unknown

    def _cleared(self, dp_rank: int, source: int, medium: Any) -> None:
        rank = self._rank(dp_rank)
        self._n_clears_in += 1
        if medium is None and source == SOURCE_ENGINE:
            # AllBlocksCleared carries no medium on the wire: the engine stream clears every
            # tier it reported.
            for index in range(len(MEDIA)):
                self._clear_slot(rank, slot_of(source, index))
        else:
            self._clear_slot(rank, slot_of(source, self._tier(medium)))

    def _clear_slot(self, rank: _Rank, slot: int) -> None:
        held = rank.held[slot]
        if not held:
            return
        # Deepest first: releasing a parent before its children would cascade them.
        depth: dict[int, int] = {}

        def depth_of(block: Block) -> int:
            path = []
            node: Block | None = block
            while node is not None and id(node) not in depth:
                path.append(node)
                node = node[PARENT]
            base = 0 if node is None else depth[id(node)]
            for step in reversed(path):
                base += 1
                depth[id(step)] = base
            return depth[id(block)]

        victims = sorted(held.values(), key=depth_of, reverse=True)
        held.clear()
        group = self._group(slot)
        medium = self._medium_out(group)
        before = rank.visible
        rank.last_remove = None  # this clear's REMOVEs start their own event
        mark = len(rank.out)
        for block in victims:
            self._release(rank, block, group, medium)
        if rank.visible == 0 and before > 0:
            # Nothing left downstream for this rank: one AllBlocksCleared says it all.
            removed = rank.out[mark:]
            self._n_removes_out -= len(removed)
            self._n_remove_blocks_out -= sum(len(e["block_hashes"]) for e in removed)
            del rank.out[mark:]
            rank.out.append({"type": "AllBlocksCleared"})
            rank.last_remove = None
            self._n_clears_out += 1

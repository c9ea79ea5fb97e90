"""The consolidator: one de-duplicated KV-event stream from the GPU tier and the offload tiers.

Two layers, one concept:

* :class:`ConsolidatorCore` — pure state machine (no sockets, no threads, no clock). It takes
  GPU-tier wire events (per dp rank) and offload-tier registrations, and emits output wire
  events per dp rank. Everything the router sees is decided here, so every invariant is
  unit-testable in milliseconds.
* :class:`KvEventConsolidator` — the socket shell around one core: a SUB per rank's GPU-tier
  publisher, a DEALER per rank's replay endpoint, one ingest thread that decodes, applies and
  flushes, and an :class:`~kvbm_plugin.publisher.EventPublisher` for the output (the built-in
  ZMQ one in its inline mode, run by the ingest thread itself).

The core's dedup block loops also exist compiled (``_consolidator_c.c``, used when built): the
Python loops here are their reference, the tests compare the two, and everything the compiled
loops do not take (clears, passthrough mode, unusual or malformed input) runs here.

Who calls what:

* ``KvbmConnectorLeader`` builds a :class:`KvEventConsolidator` from its
  :class:`~kvbm_plugin.consolidator_config.ConsolidatorConfig` when the consolidator is enabled,
  calls :meth:`~KvEventConsolidator.start` once at bring-up and
  :meth:`~KvEventConsolidator.shutdown` at teardown.
* The leader's host and disk tiers call :meth:`~KvEventConsolidator.register_store`,
  :meth:`~KvEventConsolidator.register_remove` and :meth:`~KvEventConsolidator.register_clear`
  from whatever thread moves blocks; each call only appends to a queue.
* ``kvbm-plugin consolidate`` runs :func:`main_consolidate` for engines whose GPU-tier events
  come from elsewhere (TRT-LLM's or vLLM's own publisher).

Semantics (dedup mode, the default):

* **Identity** of a block is its content chain per dp rank: a 64-bit hash of (parent identity,
  token ids). Each (source, tier) keeps its own external-hash → block map, so sources whose hash
  algorithms differ still agree; removals carry hashes only and are resolved through that map.
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
* **Prefix-closed output**, whatever the sources send (a strict router skips a store whose
  parent it does not hold and cuts a subtree at a removed block): a block is published (per
  medium in passthrough) only while its parent is, so the output holds the prefix-closed part
  of what is resident. A block that becomes resident under a parent that is not published is
  *held back* (kept with its tokens, counted ``held_back_stores``) and published, after its
  parent, when the parent is (``released_stores``). A block stored under a parent hash no
  source knows is held back for good (until removed): its parent can never be published.
  When a published block stops being resident while descendants are still resident (an
  engine that evicts a middle block), the descendants are removed first, in the same output
  event, and counted (``cascade_removes``); they come back when a source stores them again
  (their tokens are not kept). The tiers and TensorRT-LLM's own pool are prefix-closed, so
  with them nothing is ever held back or cascaded.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import msgpack
import zmq

from kvbm_plugin import _native
from kvbm_plugin._ratelimit import RateLimitedLog
from kvbm_plugin._reconnect import BACK, LOST, ConnectionWatch
from kvbm_plugin._saferepr import saferepr
from kvbm_plugin.consolidator_config import (
    ENABLE_CONSOLIDATOR,
    EVENTS_ENDPOINT,
    OUTPUT_ENDPOINT,
    OUTPUT_REPLAY_ENDPOINT,
    REPLAY_ENDPOINT,
    ConfigError,
    ConsolidatorConfig,
    ConsolidatorMode,
    load_consolidator_config,
)
from kvbm_plugin.events import (
    END_SEQ,
    MAX_DP_RANKS,
    MEDIA,
    MEDIUM_GPU,
    U32_MAX,
    WireFormatError,
    decode_seq,
    encode_seq,
    normalize_medium,
)
from kvbm_plugin.publisher import EventPublisher, WireEvent, ZmqEventPublisher, create_publisher
from kvbm_plugin.registry import PUBLISHERS_GROUP, get_plugin

logger = logging.getLogger(__name__)

__all__ = [
    "SOURCE_ENGINE",
    "SOURCE_TIERS",
    "UnknownMediumError",
    "UnknownDpRankError",
    "ConsolidatorCore",
    "KvEventConsolidator",
    "main_consolidate",
]

# Sources of residency. The engine's GPU-tier stream is one source whatever medium its events
# carry; the registration API (the leader's host and disk tiers) is the other.
SOURCE_ENGINE: Final = 0
SOURCE_TIERS: Final = 1
_SOURCE_NAMES: Final = ("engine", "tiers")
_TIER_INDEX: Final = {medium: i for i, medium in enumerate(MEDIA)}  # GPU 0, CPU 1, DISK 2
_NUM_SLOTS: Final = len(_SOURCE_NAMES) * len(MEDIA)  # a slot is one (source, tier)

_MASK: Final = (1 << 64) - 1
_I64_MAX: Final = (1 << 63) - 1
_U64: Final = 1 << 64
_ROOT: Final = 0  # parent identity of a root block
# Salt of the parent identity of a block whose parent hash no source knows: such a block must
# not be confused with a root block carrying the same tokens.
_UNKNOWN_PARENT: Final = 0x6B76626D5F706172


def _plain_key(value: Any) -> bool:
    """An ``extra_keys`` item the consolidator keeps: str, bytes or an int in 64 bits."""
    t = type(value)
    return t is str or t is bytes or (t is int and -(1 << 63) <= value < (1 << 64))


def _slot(source: int, tier: int) -> int:
    return source * len(MEDIA) + tier


def _slot_name(slot: int) -> str:
    return f"{_SOURCE_NAMES[slot // len(MEDIA)]}/{MEDIA[slot % len(MEDIA)]}"


def _wire_hash(value: int) -> int:
    """Signed int64 wire form of a u64 hash (the form every output event carries)."""
    return value - _U64 if value > _I64_MAX else value


class UnknownMediumError(WireFormatError):
    """An event's medium is none of the known names or aliases (never guessed as GPU)."""


class UnknownDpRankError(WireFormatError):
    """A data-parallel rank the core refuses (not below its ``max_dp_ranks``)."""


_INT_ONLY: Final = {int}


# A block is a plain list (creating one is several times cheaper than an object, and the ingest
# hot path creates one per stored block). Layout, by index:
_IDENT: Final = 0  # content-chain identity (the key in _Rank.blocks)
_PUB: Final = 1  # published hash, u64: the first external hash seen (unless it clashed)
_WIRE: Final = 2  # the published hash as signed int64, what the output carries
_PARENT: Final = 3  # parent block or None; kept alive by this block's entry in _CHILDREN
_CHILDREN: Final = 4  # live blocks whose parent this is
_TOTAL: Final = 5  # (slot, external hash) holdings; 0 = resident nowhere
_COUNTS: Final = 6  # passthrough only: holdings per medium [GPU, CPU, DISK]; None in dedup
_ALIAS_SLOT: Final = 7  # the first external hash that names this block: its slot...
_ALIAS_EXT: Final = 8  # ...and the hash (most blocks have exactly one)
_MORE_ALIASES: Final = 9  # further (slot, hash) pairs, or None
Block = list  # one block of one dp rank, alive while resident somewhere or a parent


# A held-back block: (block, its tokens or None, block_size, lora_id, lora_name, its
# extra_keys entry or None). Tokens are
# None for a block whose parent was unpublished after it (a cascade): it is published again
# only by a later store that brings its tokens.
_HeldBack = tuple[Block, "list[int] | None", int, Any, Any, Any]  # ..., the block's extra_keys


class _Rank:
    """All state of one dp rank; dp ranks never share blocks."""

    __slots__ = ("blocks", "known", "held", "published", "out", "visible", "last_remove",
                 "hidden", "orphans")

    def __init__(self) -> None:
        self.blocks: dict[int, Block] = {}  # identity -> block
        # Per slot: external hash -> block, for every alias of a live block (parent lookups
        # must work after a tier evicted the parent while a child still lives).
        self.known: list[dict[int, Block]] = [{} for _ in range(_NUM_SLOTS)]
        # Per slot: external hashes that slot holds now -> block (the residency itself).
        self.held: list[dict[int, Block]] = [{} for _ in range(_NUM_SLOTS)]
        self.published: dict[int, Block] = {}  # published u64 hash -> block
        self.out: list[dict[str, Any]] = []  # output wire events not yet taken
        # Downstream-visible units: blocks (dedup) or (block, medium) pairs (passthrough).
        self.visible = 0
        self.last_remove: dict[str, Any] | None = None  # the BlockRemoved being extended
        # Per medium group (dedup: group 0 only): identity -> held-back block, resident in
        # that group but not published because its parent is not. Empty in normal operation;
        # the compiled loops run only while group 0's is empty.
        self.hidden: list[dict[int, _HeldBack]] = [{} for _ in MEDIA]
        # Identities of blocks stored under a parent hash no source knew: never published.
        self.orphans: set[int] = set()


_CORE_COUNTERS: Final = (
    "stores_in", "store_blocks_in", "removes_in", "remove_blocks_in", "clears_in",
    "duplicate_stores", "unknown_removes", "unknown_parents", "hash_conflicts",
    "hash_only_stores_dropped", "resyncs", "unknown_dp_ranks_refused", "held_back_stores",
    "released_stores", "cascade_removes",
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
    """

    def __init__(self, mode: ConsolidatorMode = "dedup", *, native: bool | None = None,
                 max_dp_ranks: int = MAX_DP_RANKS) -> None:
        if mode not in ("dedup", "passthrough"):
            raise ValueError(f"{type(self).__name__}: mode {mode!r} is not dedup | passthrough")
        if type(max_dp_ranks) is not int or max_dp_ranks < 1:
            raise ValueError(f"{type(self).__name__}: max_dp_ranks={max_dp_ranks!r} must be an "
                             "integer >= 1")
        self.max_dp_ranks: Final = max_dp_ranks
        self.mode: Final = mode
        self._dedup = mode == "dedup"
        # The compiled dedup block loops (None: the Python ones). ``native`` as for KvEventSink:
        # None = when built and not switched off by DYN_KVBM_NATIVE, False = never, True = or
        # ValueError. Passthrough mode always runs the Python loops.
        module = _native.choose("consolidator", native, type(self).__name__)
        self._native = module if self._dedup else None
        if self._native is not None:
            self._native.core_constants(_ROOT, _UNKNOWN_PARENT, len(MEDIA), MEDIUM_GPU)
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
        native = self._native
        applied = 0
        i = 0
        while i < len(events):  # re-read: a caller's key object may change the list
            rank = self._ranks.get(dp_rank)
            # The compiled loops run while nothing is held back (always, with prefix-closed
            # sources); they leave to the Python code every event that would hold a block back
            # or cascade a removal.
            if native is not None and rank is not None and type(events) is list \
                    and not rank.hidden[0]:
                stop, counts, error = native.apply_events(
                    rank, events, i, SOURCE_ENGINE, self._medium_cache, self._fresh_pub,
                    self._add_alias, self._release)
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
                self._clear_slot(self._rank(dp_rank), _slot(source, index))
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
            self._clear_slot(rank, _slot(SOURCE_ENGINE, index))

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
            hidden = rank.hidden[0]
            return {b[_WIRE] for b in rank.blocks.values()
                    if b[_TOTAL] and b[_IDENT] not in hidden}
        index = _TIER_INDEX[normalize_medium(medium)]
        hidden = rank.hidden[index]
        return {b[_WIRE] for b in rank.blocks.values()
                if b[_COUNTS][index] and b[_IDENT] not in hidden}

    def resident_in(self, source: int, tier: str, dp_rank: int) -> set[int]:
        """External hashes (u64) that ``(source, tier)`` holds now, for tests."""
        rank = self._ranks.get(dp_rank)
        if rank is None:
            return set()
        return set(rank.held[_slot(source, _TIER_INDEX[normalize_medium(tier)])])

    def stats(self) -> dict[str, int]:
        """Counters plus current sizes; cheap enough for a metrics scrape."""
        out = {name: getattr(self, "_n_" + name) for name in _CORE_COUNTERS}
        # A snapshot (list() of a dict view is atomic under the GIL): the metrics thread calls
        # this while the ingest thread may add a dp rank.
        ranks = list(self._ranks.values())
        out["blocks_tracked"] = sum(len(r.blocks) for r in ranks)
        out["blocks_visible"] = sum(r.visible for r in ranks)
        out["blocks_held_back"] = sum(len(h) for r in ranks for h in r.hidden)
        return out

    # ------------------------------------------------------------------ internals

    def _rank(self, dp_rank: int) -> _Rank:
        rank = self._ranks.get(dp_rank)
        if rank is None:
            if not self.admit_dp_rank(dp_rank):
                raise UnknownDpRankError(f"data_parallel_rank {dp_rank!r:.100} is not an int in "
                                         f"0..{self.max_dp_ranks - 1}")
            rank = self._ranks[dp_rank] = _Rank()
        return rank

    def _tier(self, medium: Any) -> int:
        try:
            return self._medium_cache[medium]
        except (KeyError, TypeError):
            pass
        try:
            index = _TIER_INDEX[normalize_medium(medium)]
        except WireFormatError as exc:
            raise UnknownMediumError(str(exc)) from None
        if isinstance(medium, str) and len(self._medium_cache) < 64:
            self._medium_cache[medium] = index
        return index

    def _hashes(self, value: Any, what: str) -> list[int]:
        native = self._native
        if native is not None and type(value) is list:
            out = native.u64_hashes(value)
            if out is not None:
                return out  # else a non-integer: the Python loop below names it
        if not isinstance(value, (list, tuple)):
            raise WireFormatError(f"{what} is not a list: {value!r:.200}")
        # msgpack yields only ints in [-2**63, 2**64): masking is the exact u64 form. The type
        # test drops bools and anything else that is not a hash; a shorter result means one.
        out = [h & _MASK for h in value if type(h) is int]
        if len(out) != len(value):
            bad = next(h for h in value if type(h) is not int)
            raise WireFormatError(f"{what} holds a non-integer hash: {bad!r:.100}")
        return out

    def _group(self, slot: int) -> int:
        return 0 if self._dedup else slot % len(MEDIA)

    def _medium_out(self, group: int) -> str:
        return MEDIUM_GPU if self._dedup else MEDIA[group]

    def _stored(self, dp_rank: int, source: int, hashes_raw: Any, parent_raw: Any,
                tokens: Any, block_size: Any, medium: Any, lora_id: Any,
                lora_name: Any, extra_keys: Any = None) -> None:
        # Validate everything before the first mutation, so a bad event changes nothing.
        hashes = self._hashes(hashes_raw, "BlockStored block_hashes")
        if parent_raw is not None:
            if type(parent_raw) is not int:
                raise WireFormatError(f"BlockStored parent_block_hash is not an integer: "
                                      f"{parent_raw!r:.100}")
            parent_raw &= _MASK
        if type(block_size) is not int or block_size <= 0:
            raise WireFormatError(f"BlockStored block_size is invalid: {block_size!r:.100}")
        if type(tokens) is not list:
            if not isinstance(tokens, (list, tuple)):
                raise WireFormatError(f"BlockStored token_ids is not a list: {tokens!r:.100}")
            tokens = list(tokens)
        # Anything the output encoder or the router cannot take is refused here, with its own
        # event only (accepted, it would fail the encoder and lose the whole output batch).
        if tokens and (set(map(type, tokens)) != _INT_ONLY or min(tokens) < 0
                       or max(tokens) > U32_MAX):
            bad = next(t for t in tokens if type(t) is not int or not 0 <= t <= U32_MAX)
            raise WireFormatError(f"BlockStored token_ids holds a value that is not a u32 "
                                  f"integer: {bad!r:.100}")
        if lora_id is not None and (type(lora_id) is not int or not 0 <= lora_id < _U64):
            raise WireFormatError(f"BlockStored lora_id is not None or a u64 integer: "
                                  f"{lora_id!r:.100}")
        if lora_name is not None and type(lora_name) is not str:
            raise WireFormatError(f"BlockStored lora_name is not None or a string: "
                                  f"{lora_name!r:.100}")
        slot = _slot(source, self._tier(medium))
        rank = self._rank(dp_rank)
        n = len(hashes)
        if len(tokens) != n * block_size and tokens:
            raise WireFormatError(f"BlockStored has {len(tokens)} token ids for {n} blocks "
                                  f"of {block_size}")
        scope = None
        if extra_keys is not None or lora_id:
            scope = self._scopes(lora_id, extra_keys, n)
        if not tokens:
            self._store_hash_only(rank, slot, hashes)
        else:
            self._store_chain(rank, slot, hashes, parent_raw, tokens, block_size, lora_id,
                              lora_name, scope, extra_keys)
        # Counted once applied (an unhashable token raises before anything changed).
        self._n_stores_in += 1
        self._n_store_blocks_in += n

    @staticmethod
    def _scopes(lora_id: Any, extra_keys: Any, n: int) -> list[Any]:
        """Per block, what besides tokens names its content: (LoRA id, extra keys); two
        adapters' or two salts' blocks with the same tokens are different blocks."""
        if extra_keys is None:
            return [(lora_id or None, None)] * n
        if not isinstance(extra_keys, (list, tuple)) or len(extra_keys) != n:
            raise WireFormatError(f"BlockStored extra_keys must be a list of one entry per "
                                  f"block ({n}): {extra_keys!r:.100}")
        out = []
        for entry in extra_keys:
            if entry is None:
                out.append((lora_id or None, None))
                continue
            if type(entry) not in (list, tuple) or not all(map(_plain_key, entry)):
                # Refused here like any odd value: the output encoder must take what we keep.
                raise WireFormatError(f"BlockStored extra_keys entry is not a list of strings, "
                                      f"bytes or 64-bit integers: {entry!r:.100}")
            out.append((lora_id or None, tuple(entry)))
        return out

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
        published = rank.published
        dedup = self._dedup
        group = 0 if dedup else slot % len(MEDIA)
        medium = MEDIUM_GPU if dedup else MEDIA[group]
        out = rank.out
        parent: Block | None = None
        parent_wire: int | None = None
        pident = _ROOT
        unknown_parent = False
        if parent_ext is not None:
            parent = self._resolve(rank, slot, parent_ext)
            if parent is None:
                unknown_parent = True  # counted once the chain is applied
                pident = hash((_UNKNOWN_PARENT, parent_ext))
                parent_wire = _wire_hash(parent_ext)
            else:
                pident = parent[_IDENT]
                parent_wire = parent[_WIRE]
        native = self._native if scope is None else None  # the compiled loop knows no scope
        if native is not None and not unknown_parent and not rank.hidden[0] \
                and (parent is None or parent[_TOTAL]):
            result = native.store_chain(
                rank, blocks, known, held, published, out, hashes, tokens, bs, parent,
                pident, parent_wire, slot, lora_id, lora_name, medium, group, self._fresh_pub,
                self._add_alias, self._release)
            if result is not None:  # None: a hash released mid-chain, decided below
                visible, duplicates, n_runs, n_run_blocks = result
                rank.visible += visible
                self._n_duplicate_stores += duplicates
                if n_runs:
                    self._n_stores_out += n_runs
                    self._n_store_blocks_out += n_run_blocks
                    rank.last_remove = None
                return
        # Identities first: an unhashable token raises before anything changed.
        tt = tuple(tokens)
        idents = []
        if scope is None:
            for off in range(0, len(tt), bs):
                pident = hash((pident, tt[off:off + bs]))
                idents.append(pident)
        else:
            for j, off in enumerate(range(0, len(tt), bs)):
                pident = hash((pident, tt[off:off + bs], scope[j]))
                idents.append(pident)
        self._n_unknown_parents += unknown_parent
        runs: list[tuple[dict[str, Any], int]] = []  # (output event, first block index)
        run_hashes: list[int] = []
        run_end = -1
        i = 0
        hidden = rank.hidden[group]
        if unknown_parent:
            rank.orphans.add(idents[0])  # never published: its parent never can be
        for ext, ident in zip(hashes, idents, strict=True):
            block = blocks_get(ident)
            if block is None:
                pub = ext
                if pub in published:
                    pub = self._fresh_pub(published, ext, ident)
                block = [ident, pub, pub - _U64 if pub > _I64_MAX else pub, parent, 0, 0,
                         None if dedup else [0, 0, 0], slot, ext, None]
                published[pub] = block
                blocks[ident] = block
                known[ext] = block
                if parent is not None:
                    parent[_CHILDREN] += 1
            elif known_get(ext) is not block:
                self._add_alias(rank, block, slot, ext)
            old = held_get(ext)
            if old is block:
                self._n_duplicate_stores += 1
            else:
                held[ext] = block
                total = block[_TOTAL] + 1
                block[_TOTAL] = total
                if dedup:
                    newly = total == 1
                else:
                    counts = block[_COUNTS]
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
                        hidden[ident] = (block, None, bs, lora_id, lora_name, None)
                    self._release(rank, old, group, medium)
                    if newly:
                        del hidden[ident]
                if newly and not self._parent_shown(rank, block, group):
                    # Held back (with its tokens) until its parent is published.
                    newly = False
                    hidden[ident] = (block, tokens[i * bs:(i + 1) * bs], bs, lora_id,
                                     lora_name, None if extra_keys is None else extra_keys[i])
                    self._n_held_back_stores += 1
                if newly:
                    rank.visible += 1
                    if run_end == i and out[-1] is runs[-1][0]:
                        run_hashes.append(block[_WIRE])
                    else:
                        run_hashes = [block[_WIRE]]
                        run = {"type": "BlockStored", "block_hashes": run_hashes,
                               "parent_block_hash": (parent_wire if parent is None
                                                     else parent[_WIRE]),
                               "token_ids": None, "block_size": bs, "lora_id": lora_id,
                               "medium": medium, "lora_name": lora_name}
                        out.append(run)
                        runs.append((run, i))
                    run_end = i + 1
                    if hidden:
                        self._release_children(rank, block, group, medium)
            if hidden and ident in hidden and hidden[ident][1] is None:
                # Held back since a cascade, tokens unknown: this store brings them.
                entry = hidden[ident]
                if self._parent_shown(rank, block, group):
                    del hidden[ident]
                    self._publish(rank, block, tokens[i * bs:(i + 1) * bs], bs, lora_id,
                                  lora_name, None if extra_keys is None else extra_keys[i],
                                  medium)
                    self._n_released_stores += 1
                    self._release_children(rank, block, group, medium)
                else:
                    hidden[ident] = (entry[0], tokens[i * bs:(i + 1) * bs], bs, lora_id,
                                     lora_name, None if extra_keys is None else extra_keys[i])
            parent = block
            i += 1
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

    def _fresh_pub(self, published: dict[int, Block], ext: int, ident: int) -> int:
        """A published hash for a block whose first external hash another live block already
        publishes (a source whose hash ignores something the content chain sees): derived,
        unused, so the consumer never sees one hash for two blocks."""
        self._n_hash_conflicts += 1
        salt = 1
        pub = ext
        while pub in published:
            pub = hash((ext, ident, salt)) & _MASK
            salt += 1
        return pub

    def _store_hash_only(self, rank: _Rank, slot: int, hashes: list[int]) -> None:
        """A store without token ids (old offload events): usable only for a block that is
        already visible downstream, since a STORE we publish must carry its tokens."""
        group = self._group(slot)
        held = rank.held[slot]
        for ext in hashes:
            block = self._resolve(rank, slot, ext)
            if block is None or not (block[_TOTAL] if self._dedup else block[_COUNTS][group]):
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
            block[_TOTAL] += 1
            if not self._dedup:
                block[_COUNTS][group] += 1

    @staticmethod
    def _add_alias(rank: _Rank, block: Block, slot: int, ext: int) -> None:
        rank.known[slot][ext] = block
        if block[_MORE_ALIASES] is None:
            block[_MORE_ALIASES] = [(slot, ext)]
        else:
            block[_MORE_ALIASES].append((slot, ext))

    def _release(self, rank: _Rank, block: Block, group: int, medium: str) -> None:
        """One holding of ``block`` in medium group ``group`` ended (already out of ``held``)."""
        block[_TOTAL] -= 1
        if self._dedup:
            gone = block[_TOTAL] == 0
        else:
            counts = block[_COUNTS]
            counts[group] -= 1
            gone = counts[group] == 0
        if gone:
            hidden = rank.hidden[group]
            if hidden and block[_IDENT] in hidden:
                del hidden[block[_IDENT]]  # held back: never published, nothing to undo
            else:
                wires = self._cascade(rank, block, group) if block[_CHILDREN] else []
                wires.append(block[_WIRE])
                rank.visible -= len(wires)
                self._emit_removes(rank, wires, medium)
        if block[_TOTAL] == 0 and block[_CHILDREN] == 0:
            self._collect(rank, block)

    # ---- prefix closure (see the module docstring); rare paths, never the compiled ones ----

    def _shown(self, rank: _Rank, block: Block, group: int) -> bool:
        """Whether ``block`` is published in medium group ``group``."""
        held = block[_TOTAL] if self._dedup else block[_COUNTS][group]
        return bool(held) and block[_IDENT] not in rank.hidden[group]

    def _parent_shown(self, rank: _Rank, block: Block, group: int) -> bool:
        """Whether ``block`` may be published: a root, or its parent is published."""
        parent = block[_PARENT]
        if parent is None:
            return block[_IDENT] not in rank.orphans
        return self._shown(rank, parent, group)

    def _publish(self, rank: _Rank, block: Block, tokens: list[int], bs: int, lora_id: Any,
                 lora_name: Any, extra: Any, medium: str) -> None:
        """STORE one held-back block whose parent is published now (``extra``: the block's
        ``extra_keys`` entry, or None)."""
        parent = block[_PARENT]
        event = {"type": "BlockStored", "block_hashes": [block[_WIRE]],
                 "parent_block_hash": None if parent is None else parent[_WIRE],
                 "token_ids": tokens, "block_size": bs, "lora_id": lora_id,
                 "medium": medium, "lora_name": lora_name}
        if extra is not None:
            event["extra_keys"] = [extra]
        rank.out.append(event)
        rank.last_remove = None
        rank.visible += 1
        self._n_stores_out += 1
        self._n_store_blocks_out += 1

    def _release_children(self, rank: _Rank, block: Block, group: int, medium: str) -> None:
        """Publish the held-back descendants of ``block`` (just published), parents first.
        A scan of the held-back blocks per level: they exist only with misbehaving sources."""
        hidden = rank.hidden[group]
        stack = [block]
        while stack and hidden:
            parent = stack.pop()
            ready = [entry for entry in hidden.values()
                     if entry[0][_PARENT] is parent and entry[1] is not None]
            for child, tokens, bs, lora_id, lora_name, extra in ready:
                del hidden[child[_IDENT]]
                self._publish(rank, child, tokens, bs, lora_id, lora_name,  # type: ignore[arg-type]
                              extra, medium)
                self._n_released_stores += 1
                stack.append(child)

    def _cascade(self, rank: _Rank, block: Block, group: int) -> list[int]:
        """``block`` (published, with live children) is about to be unpublished: hold back
        its published descendants (tokens unknown) and return their wire hashes, children
        before parents, for the same REMOVE event. One scan of the rank's blocks: this
        happens only when a source removes a block before its descendants."""
        children: dict[int, list[Block]] = {}
        for candidate in rank.blocks.values():
            parent = candidate[_PARENT]
            if parent is not None:
                children.setdefault(id(parent), []).append(candidate)
        hidden = rank.hidden[group]
        wires: list[int] = []
        stack: list[tuple[Block, bool]] = [(block, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                if node is not block:
                    wires.append(node[_WIRE])
                    hidden[node[_IDENT]] = (node, None, 0, None, None, None)
                continue
            stack.append((node, True))
            for child in children.get(id(node), ()):
                if self._shown(rank, child, group):
                    stack.append((child, False))
        self._n_cascade_removes += len(wires)
        return wires

    def _emit_removes(self, rank: _Rank, wires: list[int], medium: str) -> None:
        last = rank.last_remove
        out = rank.out
        if last is not None and out and out[-1] is last and last["medium"] == medium:
            last["block_hashes"].extend(wires)
        else:
            out.append({"type": "BlockRemoved", "block_hashes": wires, "medium": medium})
            rank.last_remove = out[-1]
            self._n_removes_out += 1
        self._n_remove_blocks_out += len(wires)

    @staticmethod
    def _collect(rank: _Rank, block: Block | None) -> None:
        """Forget blocks resident nowhere with no live child, walking up the chain."""
        blocks = rank.blocks
        known = rank.known
        published = rank.published
        while block is not None and block[_TOTAL] == 0 and block[_CHILDREN] == 0:
            del blocks[block[_IDENT]]
            slot_map = known[block[_ALIAS_SLOT]]
            if slot_map.get(block[_ALIAS_EXT]) is block:
                del slot_map[block[_ALIAS_EXT]]
            if block[_MORE_ALIASES] is not None:
                for slot, ext in block[_MORE_ALIASES]:
                    slot_map = known[slot]
                    if slot_map.get(ext) is block:
                        del slot_map[ext]
            if published.get(block[_PUB]) is block:
                del published[block[_PUB]]
            if rank.orphans:
                rank.orphans.discard(block[_IDENT])
            parent = block[_PARENT]
            if parent is not None:
                parent[_CHILDREN] -= 1
            block = parent

    def _removed(self, dp_rank: int, source: int, hashes_raw: Any, medium: Any) -> None:
        hashes = self._hashes(hashes_raw, "BlockRemoved block_hashes")
        slot = _slot(source, self._tier(medium))
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
        # Dedup: the blocks now resident nowhere, one output event per call.
        result = None
        if self._native is not None and not rank.hidden[0]:
            # None: a removal would cascade; the Python loop below decides it.
            result = self._native.remove_dedup(rank.blocks, rank.known, rank.held[slot],
                                               rank.published, hashes)
        if result is not None:
            wires, unknown = result
        else:
            wires, unknown = [], 0
            hidden = rank.hidden[0]
            for ext in hashes:
                block = held_pop(ext, None)
                if block is None:
                    unknown += 1
                    continue
                block[_TOTAL] -= 1
                if not block[_TOTAL]:
                    if hidden and block[_IDENT] in hidden:
                        del hidden[block[_IDENT]]  # held back: nothing was published
                    else:
                        if block[_CHILDREN]:
                            wires += self._cascade(rank, block, 0)
                        wires.append(block[_WIRE])
                    self._collect(rank, block)
        if unknown:
            self._n_unknown_removes += unknown
        if wires:
            rank.visible -= len(wires)
            self._emit_removes(rank, wires, MEDIUM_GPU)

    def _cleared(self, dp_rank: int, source: int, medium: Any) -> None:
        rank = self._rank(dp_rank)
        self._n_clears_in += 1
        if medium is None and source == SOURCE_ENGINE:
            # AllBlocksCleared carries no medium on the wire: the engine stream clears every
            # tier it reported.
            for index in range(len(MEDIA)):
                self._clear_slot(rank, _slot(source, index))
        else:
            self._clear_slot(rank, _slot(source, self._tier(medium)))

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
                node = node[_PARENT]
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


# ====================================================================== socket shell


class _Replay:
    """A replay in flight for one stream: live messages wait in ``pending`` until it ends."""

    __slots__ = ("deadline", "pending", "failed", "startup", "verify")

    def __init__(self, deadline: float, startup: bool = False,
                 verify: tuple[int, bytes] | None = None) -> None:
        self.deadline = deadline
        self.pending: list[list[bytes]] = []
        self.failed = False  # a hole inside the replayed range was already resynced
        self.startup = startup  # the catch-up request sent at start (publisher may be absent)
        # (seq, payload) of a batch already applied: the first answer must repeat it byte for
        # byte, or the publisher is not the one that sent it (it restarted).
        self.verify = verify


class _Stream:
    """The GPU-tier stream of one rank: its sockets and sequence state (ingest thread only)."""

    __slots__ = ("rank", "sub", "dealer", "watch", "expected", "replay", "dp_ranks", "seen",
                 "last_payload", "anchor")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.sub: zmq.Socket | None = None
        self.dealer: zmq.Socket | None = None
        self.watch: ConnectionWatch | None = None  # the SUB's connection events
        self.expected = 0  # next seq; a first message above 0 is a gap (joined late)
        self.replay: _Replay | None = None
        self.dp_ranks: set[int] = {rank}  # dp ranks this stream's batches named
        self.seen = False
        self.last_payload: bytes | None = None  # payload of seq ``expected - 1`` (a reference)
        # (seq, payload) of the last batch applied when the connection was lost: checked by a
        # replay once it is back, to tell a restarted publisher from a network blip.
        self.anchor: tuple[int, bytes] | None = None

    def last_applied(self) -> tuple[int, bytes] | None:
        """(seq, payload) of the last batch applied with a seq, if any."""
        if not self.seen or self.expected == 0 or self.last_payload is None:
            return None
        return self.expected - 1, self.last_payload


_SHELL_COUNTERS: Final = (
    "messages_received", "batches_applied", "events_applied", "malformed", "unknown_medium",
    "gaps", "late_joins", "restarts", "reconnects", "replay_requests", "replayed_batches",
    "replay_failures",
    "unfillable_gaps", "registrations", "registration_errors", "registrations_dropped",
    "batches_out", "events_out", "output_lost", "ingest_errors", "message_errors",
)

_Registration = tuple[Any, ...]  # (kind, medium, dp_rank, ...) built by register_*


class KvEventConsolidator:
    """The consolidator with its sockets: GPU-tier SUBs in, one publisher out.

    Built by the leader (or :func:`main_consolidate`) from a :class:`ConsolidatorConfig`.
    ``publisher``: the output (default: ``create_publisher(config.publisher, config.output,
    config.output_replay)``, shut down by :meth:`shutdown`; one passed in stays its owner's).
    The built-in ZMQ publisher is created on the ingest thread in its inline mode: the thread
    that applies a batch also encodes and sends the output and answers its replay requests,
    with no publisher thread in between. ``context``: default ``zmq.Context.instance()``, never
    terminated here (other components share it). ``flush_every``: under a backlog, the ingest
    thread publishes the output of at most this many input batches as one output batch per dp
    rank (1: one output batch per input batch); without a backlog every input batch's output is
    published as soon as it is applied. ``start_timeout``: the most :meth:`start` waits for the
    ingest thread's sockets.
    """

    def __init__(self, config: ConsolidatorConfig, *, publisher: EventPublisher | None = None,
                 context: zmq.Context | None = None, replay_timeout: float = 2.0,
                 max_pending: int = 10000, flush_every: int = 16,
                 start_timeout: float = 10.0) -> None:
        if type(flush_every) is not int or flush_every < 1:
            raise ValueError(f"{type(self).__name__}: flush_every={flush_every!r} must be an "
                             "int >= 1")
        if not start_timeout > 0:
            raise ValueError(f"{type(self).__name__}: start_timeout={start_timeout!r} must be "
                             "> 0 seconds")
        self._start_timeout = start_timeout
        self.config: Final = config
        # Ranks the configuration names are always accepted, and as many as any attention-DP
        # deployment has (one stream may carry several dp ranks); beyond that a payload's
        # rank is refused, so bogus ranks cannot grow the per-rank state without limit.
        self._core = ConsolidatorCore(config.mode,
                                      max_dp_ranks=max(MAX_DP_RANKS, config.num_ranks))
        self._publisher = publisher
        self._owns_publisher = publisher is None
        self._inline_output = False  # the ingest thread owns the output publisher's sockets
        self._shutdown_deadline = math.inf
        self._ctx = context if context is not None else zmq.Context.instance()
        self._replay_timeout = replay_timeout
        self._max_pending = max_pending
        self._flush_every = flush_every
        self._log = RateLimitedLog(logger)
        # Ingest-loop failures since the last message applied cleanly: sets the back-off.
        self._loop_failures = 0
        for name in _SHELL_COUNTERS:
            setattr(self, "_n_" + name, 0)
        # Registration queue: appended by any thread, drained by the ingest thread. deque
        # append/popleft are atomic under the GIL; the counters are itertools.count (atomic).
        self._queue: collections.deque[_Registration] = collections.deque()
        self._wake_r, self._wake_w = -1, -1
        self._wake_pending = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._setup_error: BaseException | None = None
        self._idle = False
        self._published_batches = 0
        # The ingest thread's poller and DEALER -> stream map (set and used by that thread).
        self._poller = zmq.Poller()
        self._by_dealer: dict[Any, _Stream] = {}
        self._lock = threading.Lock()  # start/shutdown only
        self._state = "new"  # new -> running -> stopped

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the ingest thread (which creates the built-in output publisher; another kind is
        created here); returns once the sockets exist.

        Called once by the leader at bring-up (or by main_consolidate). Raises what socket
        setup raised, after closing whatever it had opened.
        """
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"{type(self).__name__} was already started")
            self._state = "running"
            try:
                if self._publisher is None:
                    if get_plugin(PUBLISHERS_GROUP, self.config.publisher.kind) \
                            is ZmqEventPublisher:
                        self._inline_output = True  # created by the ingest thread
                    else:
                        self._publisher = create_publisher(
                            self.config.publisher, self.config.output, self.config.output_replay)
                self._wake_r, self._wake_w = os.pipe()
                os.set_blocking(self._wake_r, False)
                os.set_blocking(self._wake_w, False)
                self._thread = threading.Thread(target=self._run, name="kvbm-consolidator",
                                                daemon=True)
                self._thread.start()
                if not self._ready.wait(self._start_timeout):
                    self._stop.set()
                    raise RuntimeError(f"{type(self).__name__}: ingest thread did not set up "
                                       f"its sockets within {self._start_timeout}s")
                if self._setup_error is not None:
                    self._thread.join(self._start_timeout)
                    raise self._setup_error
            except BaseException:
                self._state = "stopped"
                self._close_pipe()
                if self._owns_publisher and self._publisher is not None:
                    self._publisher.shutdown(1.0)
                raise

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop ingesting, apply what is queued, flush, close sockets; idempotent, bounded.

        Called by the leader at teardown (any thread but the ingest thread). Takes at most about
        ``timeout`` seconds; a thread that does not stop in time is logged and left (daemon).
        """
        with self._lock:
            if self._state == "stopped":
                return
            was_running = self._state == "running"
            self._state = "stopped"
        deadline = time.monotonic() + timeout
        self._shutdown_deadline = deadline
        stuck = False
        if was_running and self._thread is not None:
            self._stop.set()
            self._wake()
            self._thread.join(max(0.0, deadline - time.monotonic()))
            stuck = self._thread.is_alive()
            if stuck:
                logger.warning("%s: ingest thread did not stop within %.1fs; %d registrations "
                               "left unapplied", type(self).__name__, timeout, len(self._queue))
            else:
                self._close_pipe()
        if self._owns_publisher and self._publisher is not None:
            if self._inline_output and stuck:
                # Its sockets belong to the ingest thread, which closes them when it ends.
                return
            self._publisher.shutdown(max(0.1, deadline - time.monotonic()))

    def __enter__(self) -> KvEventConsolidator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ registration API

    def register_store(self, tier: str, dp_rank: int, block_hash: int, parent_hash: int | None,
                       token_ids: Sequence[int], block_size: int, *, lora_id: int | None = None,
                       extra_keys: Sequence[Any] | None = None) -> None:
        """Tier ``tier`` (CPU/DISK, aliases accepted) of dp rank ``dp_rank`` now holds a block.

        Called by the leader's host/disk tier once the block's bytes are in the tier, from any
        thread. Never blocks, no I/O in the common case: validates the arguments (raising
        ValueError for a bad tier or hash) and queues the store for the ingest thread.
        ``token_ids`` is copied (``block_size`` of them, the block's own tokens). ``lora_id``
        and ``extra_keys`` (the block's extra hash keys, e.g. its cache salt) are part of its
        identity, as for a stream event.
        """
        medium = normalize_medium(tier)
        _check_hash(block_hash)
        if parent_hash is not None:
            _check_hash(parent_hash)
        self._submit(("store", medium, dp_rank, block_hash, parent_hash, list(token_ids),
                      block_size, lora_id, None if extra_keys is None else [extra_keys]))

    def register_remove(self, tier: str, dp_rank: int, block_hashes: Sequence[int]) -> None:
        """Tier ``tier`` of dp rank ``dp_rank`` no longer holds these blocks.

        Called by the tier on eviction, from any thread; never blocks.
        """
        medium = normalize_medium(tier)
        hashes = list(block_hashes)
        for h in hashes:
            _check_hash(h)
        self._submit(("remove", medium, dp_rank, hashes))

    def register_clear(self, tier: str, dp_rank: int) -> None:
        """Tier ``tier`` of dp rank ``dp_rank`` dropped everything (e.g. reset); never blocks."""
        self._submit(("clear", normalize_medium(tier), dp_rank))

    def _submit(self, item: _Registration) -> None:
        if self._state == "stopped":
            self._n_registrations_dropped += 1
            self._log.log(logging.WARNING, "registration-after-shutdown", "%s: %s registration "
                          "after shutdown dropped", type(self).__name__, item[0])
            return
        self._queue.append(item)
        # Wake the ingest thread only if it may be asleep: one pipe write per idle period.
        if not self._wake_pending:
            self._wake_pending = True
            self._wake()

    def _wake(self) -> None:
        if self._wake_w >= 0:
            # Pipe full: a wakeup is pending anyway. Closed: shutdown raced us; nothing to wake.
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"\0")

    def _close_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    # ------------------------------------------------------------------ observation

    def stats(self) -> dict[str, int]:
        """Shell and core counters (safe to call from any thread; values may lag slightly)."""
        out = {name: getattr(self, "_n_" + name) for name in _SHELL_COUNTERS}
        publisher = self._publisher
        if publisher is not None:  # lost by a threaded publisher after publish() accepted it
            out["output_lost"] += int(publisher.stats().get("lost_after_accept", 0))
        out["registrations_queued"] = len(self._queue)
        out.update(self._core.stats())
        return out

    def wait_idle(self, timeout: float) -> bool:
        """True once every accepted input was applied and published (tests and demos).

        "Accepted": registrations submitted and messages already received from the sockets.
        Polls with a deadline; False when ``timeout`` passes first.
        """
        deadline = time.monotonic() + timeout
        while True:
            if self._is_idle():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    def _is_idle(self) -> bool:
        # The ingest thread sets _idle only right before it blocks with an empty queue, and
        # clears it as soon as it wakes; a registration in the queue keeps this False.
        if not self._idle or self._queue:
            return False
        publisher = self._publisher
        if publisher is None:
            return True
        stats = publisher.stats()
        done = stats.get("batches_published")
        if done is None:
            return True
        return done + stats.get("batches_lost", 0) + stats.get("lost_batches", 0) \
            >= self._published_batches

    # ------------------------------------------------------------------ ingest thread

    def _run(self) -> None:
        """The ingest thread: owns every input socket, the core and the output calls."""
        streams: list[_Stream] = []
        poller = zmq.Poller()
        inline: ZmqEventPublisher | None = None
        try:
            if self._inline_output:
                inline = ZmqEventPublisher(self.config.publisher, self.config.output,
                                           self.config.output_replay, inline=True)
                self._publisher = inline
                if inline.replay_socket is not None:
                    poller.register(inline.replay_socket, zmq.POLLIN)
            for rank in range(self.config.num_ranks):
                stream = _Stream(rank)
                streams.append(stream)
                sub = self._ctx.socket(zmq.SUB)
                stream.sub = sub
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.RCVHWM, self.config.publisher.hwm)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                stream.watch = ConnectionWatch(sub)
                poller.register(stream.watch.socket, zmq.POLLIN)
                sub.connect(self.config.publish_endpoint(rank).connect)
                poller.register(sub, zmq.POLLIN)
                stream.dealer = self._open_dealer(stream, poller)
            poller.register(self._wake_r, zmq.POLLIN)
        except BaseException as exc:
            self._setup_error = exc
            try:
                for stream in streams:
                    self._close_stream(stream, poller)
                if self._inline_output and self._publisher is not None:
                    self._publisher.shutdown(0.0)
            finally:
                self._ready.set()  # start() waits for this
            return
        self._ready.set()
        for stream in streams:
            if stream.dealer is not None:
                # Catch up on what the rank published before we joined (or before our
                # subscription took effect): everything its replay buffer still holds.
                self._request_replay(stream, 0, startup=True)
        by_socket = {s.sub: s for s in streams}
        by_dealer = {s.dealer: s for s in streams if s.dealer is not None}
        self._poller, self._by_dealer = poller, by_dealer
        try:
            while True:
                try:
                    self._loop(streams, poller, by_socket, by_dealer, inline)
                    break
                except zmq.ContextTerminated:
                    break  # the shared context is gone (process exit): nothing left to read
                except Exception:  # a bug, not bad input: count it and keep ingesting
                    self._n_ingest_errors += 1
                    self._loop_failures += 1
                    # A failure that repeats must not turn into a busy loop: back off up to 1 s.
                    # The back-off restarts from 2 ms once a message is applied cleanly again.
                    self._stop.wait(min(1.0, 0.001 * 2 ** min(self._loop_failures, 10)))
                    if self._n_ingest_errors == 1:
                        logger.exception("%s: ingest loop failed; continuing",
                                         type(self).__name__)
                    else:
                        self._log.log(logging.ERROR, "ingest", "%s: ingest loop failed again "
                                      "(%d times); continuing", type(self).__name__,
                                      self._n_ingest_errors)
        finally:
            self._drain_registrations()
            self._flush()
            for stream in streams:
                self._close_stream(stream, poller)
            if self._inline_output and self._publisher is not None:
                self._publisher.shutdown(max(0.1, self._shutdown_deadline - time.monotonic()))

    def _open_dealer(self, stream: _Stream, poller: zmq.Poller) -> zmq.Socket | None:
        endpoint = self.config.replay_endpoint(stream.rank)
        if endpoint is None:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint.connect)
        poller.register(dealer, zmq.POLLIN)
        return dealer

    @staticmethod
    def _close_stream(stream: _Stream, poller: zmq.Poller) -> None:
        if stream.watch is not None:
            with contextlib.suppress(KeyError):
                poller.unregister(stream.watch.socket)
            stream.watch.close()
            stream.watch = None
        for sock in (stream.sub, stream.dealer):
            if sock is not None:
                with contextlib.suppress(KeyError):
                    poller.unregister(sock)
                sock.close(linger=0)
        stream.sub = stream.dealer = None

    def _loop(self, streams: list[_Stream], poller: zmq.Poller,
              by_socket: dict[Any, _Stream], by_dealer: dict[Any, _Stream],
              inline: ZmqEventPublisher | None = None) -> None:
        wake_r = self._wake_r
        budget = 256  # messages per socket per round: bounds latency of the other inputs
        flush_every = self._flush_every
        while not self._stop.is_set():
            timeout: int | None = None
            now = time.monotonic()
            for stream in streams:
                if stream.replay is not None:
                    left = max(0, int((stream.replay.deadline - now) * 1000) + 1)
                    timeout = left if timeout is None else min(timeout, left)
            if self._queue:
                timeout = 0  # queued registrations (e.g. after a failed round): no sleeping
            self._idle = timeout is None
            if inline is not None and inline.replay_busy:
                # Replay answers of our output go out bit by bit as their requesters read (not
                # input work: the consolidator still counts as idle).
                timeout = 5 if timeout is None else min(timeout, 5)
            ready = dict(poller.poll(timeout))
            unflushed = 0  # input batches applied since the last flush (the loop's end flushed)
            self._idle = False
            if wake_r in ready:
                try:
                    while os.read(wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                # Only after the pipe is empty: a submitter that saw the flag still set has
                # already queued its item, which _drain_registrations below applies; clearing
                # the flag first would let a later submitter's wake byte be swallowed above and
                # leave its item queued while this thread sleeps.
                self._wake_pending = False
            if inline is not None and (inline.replay_socket in ready or inline.replay_busy):
                inline.service_replay()  # our output's replay requests and answers
            for stream in streams:
                # Before the stream's messages: a message from a restarted publisher must not be
                # taken for the old stream's before its reconnection is seen.
                if stream.watch is not None and stream.watch.socket in ready:
                    for event in stream.watch.events():
                        self._on_connection_event(stream, event)
            # A snapshot: draining a replay may replace the stream's DEALER (_renew_dealer).
            for sock, stream in list(by_dealer.items()):
                if sock in ready:
                    self._drain_replay(stream, sock)
            for sock, stream in by_socket.items():
                if sock in ready:
                    for _ in range(budget):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._n_messages_received += 1
                        self._on_live(stream, frames)
                        unflushed += 1
                        if unflushed >= flush_every:
                            # Output of up to ``flush_every`` input batches goes out as one
                            # batch per dp rank: a backlog then costs the output publisher
                            # (an encode call and a send) and every consumer one message per
                            # ``flush_every`` inputs instead of one each. Only a
                            # backlog is held: the round's end flushes below, so a lone
                            # batch is published right after it was applied.
                            unflushed = 0
                            self._flush()
            if any(s.replay is not None for s in streams):
                now = time.monotonic()
                for stream in streams:
                    if stream.replay is not None and now >= stream.replay.deadline:
                        if not stream.replay.startup:
                            self._log.log(logging.WARNING, "replay-timeout", "rank %d: replay "
                                          "gave no END_SEQ within %.1fs", stream.rank,
                                          self._replay_timeout)
                        if stream.replay.verify is not None:
                            # The stream could not be checked: assume the worst.
                            self._n_replay_failures += 1
                            self._publisher_restarted(stream, "replay to check the stream "
                                                      "after a reconnection timed out")
                            continue
                        self._replay_failed(stream)
            self._drain_registrations()
            self._flush()

    # --- GPU-tier messages

    def _on_live(self, stream: _Stream, frames: list[bytes]) -> None:
        if stream.replay is not None:
            if len(stream.replay.pending) < self._max_pending:
                stream.replay.pending.append(frames)
                return
            # The replay takes too long for the live rate: give it up.
            self._n_replay_failures += 1
            self._finish_replay(stream, incomplete=True)
        self._on_message(stream, frames, live=True)

    def _on_message(self, stream: _Stream, frames: list[bytes], live: bool) -> None:
        """Sequence check, then apply. ``live`` False: the frames came from a replay."""
        if len(frames) == 3:
            try:
                seq = decode_seq(frames[1])
            except WireFormatError as exc:
                self._bad_message(stream, exc)
                return
            payload = frames[2]
        elif len(frames) == 2:
            seq, payload = None, frames[1]  # no seq: nothing to check
        else:
            self._bad_message(stream, WireFormatError(
                f"message has {len(frames)} frames, expected 2 or 3"))
            return
        if seq is not None:
            expected = stream.expected
            if seq != expected:
                if not live:
                    if seq < expected:
                        return  # already applied
                    if stream.seen:
                        # A hole inside the replayed range: what is missing is gone.
                        self._n_unfillable_gaps += 1
                        if stream.replay is not None:
                            stream.replay.failed = True
                        self._resync(stream, f"replay from seq {expected} skipped to {seq}")
                elif seq < expected:
                    # The publisher restarted (its seq starts at 0 again): its GPU pool is new.
                    self._n_restarts += 1
                    self._resync(stream, f"seq went back from {expected - 1} to {seq}")
                    stream.expected = 0
                    stream.last_payload = None
                    if seq != 0:
                        self._gap(stream, frames, seq)
                        return
                else:
                    self._gap(stream, frames, seq)
                    return
            stream.expected = seq + 1
            stream.last_payload = payload
        if not stream.seen:
            stream.seen = True
            if seq:  # batches before this one are gone for good
                self._n_late_joins += 1
        self._apply_payload(stream, payload)

    def _gap(self, stream: _Stream, frames: list[bytes], seq: int) -> None:
        """Live ``seq`` arrived past ``stream.expected``: replay the hole or resync."""
        first = not stream.seen  # joined late: nothing of ours to repair, just catch up
        if not first:
            self._n_gaps += 1
        start = stream.expected
        if stream.dealer is not None:
            # From the last batch applied, not the first missing one: if that batch comes back
            # different, the publisher restarted and the higher seq is not a gap in our stream.
            self._request_replay(stream, start, verify=stream.last_applied())
            stream.replay.pending.append(frames)  # type: ignore[union-attr]
            return
        if not first:
            self._n_unfillable_gaps += 1
            self._resync(stream, f"seq {start}..{seq - 1} lost and no replay endpoint")
        stream.expected = seq
        self._on_message(stream, frames, live=True)

    def _request_replay(self, stream: _Stream, start: int, startup: bool = False,
                        verify: tuple[int, bytes] | None = None) -> None:
        """Ask the rank's publisher for its batches from ``start`` on (from ``verify``'s seq
        when given: that batch must come back unchanged first, see :class:`_Replay`)."""
        assert stream.dealer is not None
        self._n_replay_requests += 1
        first = start if verify is None else verify[0]
        # zmq.Again: not connected yet; the deadline turns this into a failed replay.
        with contextlib.suppress(zmq.Again):
            stream.dealer.send_multipart([b"", encode_seq(first)], zmq.NOBLOCK)
        stream.replay = _Replay(time.monotonic() + self._replay_timeout, startup, verify)

    def _renew_dealer(self, stream: _Stream) -> None:
        """A fresh DEALER, so a late answer to an abandoned request cannot be taken for the
        answer to a later one."""
        if stream.dealer is None:
            return
        self._by_dealer.pop(stream.dealer, None)
        self._poller.unregister(stream.dealer)
        stream.dealer.close(linger=0)
        stream.dealer = self._open_dealer(stream, self._poller)
        if stream.dealer is not None:
            self._by_dealer[stream.dealer] = stream

    def _on_connection_event(self, stream: _Stream, event: str) -> None:
        """The rank's SUB lost its publisher, or reached one again (ingest thread)."""
        if event == LOST:
            stream.anchor = stream.last_applied()
            return
        assert event == BACK
        self._n_reconnects += 1
        anchor, stream.anchor = stream.anchor, None
        if not stream.seen:
            return  # nothing applied yet: the seq alone tells where the new stream starts
        if stream.dealer is None:
            # Batches sent while disconnected are gone and a restart cannot be told from a
            # blip: what the rank held may have changed, so treat it as cleared.
            self._resync(stream, "reconnected to the publisher without a replay endpoint")
            stream.seen, stream.expected, stream.last_payload = False, 0, None
            return
        if anchor is None:
            return
        # Replay from the last batch applied before the connection was lost: unchanged means
        # the same publisher (and the replay fills whatever was missed meanwhile).
        pending: list[list[bytes]] = []
        if stream.replay is not None:
            pending = stream.replay.pending
            self._renew_dealer(stream)
        if stream.dealer is not None:
            self._request_replay(stream, anchor[0] + 1, verify=anchor)
            stream.replay.pending.extend(pending)  # type: ignore[union-attr]
        else:
            for frames in pending:
                self._on_message(stream, frames, live=True)

    def _publisher_restarted(self, stream: _Stream, why: str) -> None:
        """A replay showed that the rank's publisher is not the one whose batches were
        applied: forget the old stream, then take the new one from its first buffered batch."""
        self._n_restarts += 1
        self._resync(stream, f"publisher restarted ({why})")
        pending = stream.replay.pending if stream.replay is not None else []
        stream.replay = None
        stream.seen, stream.expected, stream.last_payload = False, 0, None
        self._renew_dealer(stream)
        if stream.dealer is None:
            for frames in pending:
                self._on_message(stream, frames, live=True)
            return
        self._request_replay(stream, 0, startup=True)
        stream.replay.pending.extend(pending)  # type: ignore[union-attr]

    def _drain_replay(self, stream: _Stream, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if stream.replay is None:
                continue  # a late reply to a replay we gave up on
            # Replies are [b"", topic, seq, payload] (DEALER keeps the empty delimiter);
            # older publishers omit the topic. The end marker's seq frame is END_SEQ.
            body = frames[1:] if len(frames) == 4 and frames[0] == b"" else frames
            verify = stream.replay.verify
            if len(body) >= 2 and (body[1] == END_SEQ or body[0] == END_SEQ):
                if verify is not None:
                    self._publisher_restarted(stream, f"its replay no longer holds seq "
                                              f"{verify[0]}")
                    return
                self._finish_replay(stream, incomplete=False)
                return
            if len(body) == 2:
                body = [b"", body[0], body[1]]
            if verify is not None:
                try:
                    first = decode_seq(body[1]) if len(body) == 3 else None
                except WireFormatError:
                    first = None
                if first is not None and first > verify[0]:
                    # The buffer no longer holds it: nothing to compare. What follows is checked
                    # as any replay is (a hole is resynced).
                    stream.replay.verify = None
                elif first == verify[0] and body[2] == verify[1]:
                    stream.replay.verify = None  # the same publisher: go on with the replay
                    continue
                else:
                    self._publisher_restarted(stream, f"its replay of seq {verify[0]} differs "
                                              "from the batch applied")
                    return
            self._n_replayed_batches += 1
            self._on_message(stream, body, live=False)

    def _replay_failed(self, stream: _Stream) -> None:
        assert stream.replay is not None
        if not stream.replay.startup:  # at start the rank's publisher may simply not be up
            self._n_replay_failures += 1
        self._renew_dealer(stream)
        self._finish_replay(stream, incomplete=True)

    def _finish_replay(self, stream: _Stream, incomplete: bool) -> None:
        """Apply the live messages held back during the replay, resyncing over any hole."""
        replay = stream.replay
        assert replay is not None
        stream.replay = None
        for frames in replay.pending:
            try:
                seq = decode_seq(frames[1]) if len(frames) == 3 else None
            except WireFormatError:
                seq = None
            if seq is not None and seq > stream.expected:
                # The replay did not reach this message: the rest of the hole is lost.
                if stream.seen and not replay.failed:
                    self._n_unfillable_gaps += 1
                    self._resync(stream, f"replay ended at seq {stream.expected}, live stream "
                                 f"resumed at {seq}" + (" (timed out)" if incomplete else ""))
                replay.failed = True
                stream.expected = seq
            if seq is not None and seq < stream.expected:
                continue  # the replay already applied it
            self._on_message(stream, frames, live=True)

    def _resync(self, stream: _Stream, why: str) -> None:
        self._log.log(logging.WARNING, f"resync-{stream.rank}", "rank %d: GPU-tier events lost "
                      "(%s); its GPU residency is treated as cleared until new stores arrive",
                      stream.rank, why)
        for dp_rank in sorted(stream.dp_ranks):
            self._core.resync(dp_rank)

    def _apply_payload(self, stream: _Stream, payload: bytes) -> None:
        """Decode and apply one message's payload; whatever it raises stays with this message.

        Bad input is expected to raise WireFormatError (counted as malformed) inside; anything
        else escaping (a bug met by odd input) is counted in ``message_errors`` and logged
        rate-limited, so one message can neither stop nor slow down the ingest loop.
        """
        try:
            self._apply_payload_unguarded(stream, payload)
        except Exception as exc:
            self._n_message_errors += 1
            self._log.log(logging.ERROR, "message-error", "rank %d: message dropped, applying "
                          "it raised %s: %s", stream.rank, type(exc).__name__,
                          saferepr(str(exc)))
            return
        self._loop_failures = 0

    def _apply_payload_unguarded(self, stream: _Stream, payload: bytes) -> None:
        try:
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types
            self._bad_message(stream, WireFormatError(f"payload is not msgpack ({exc}): "
                                                      f"{bytes(payload[:32])!r}"))
            return
        if type(batch) is not list or not 2 <= len(batch) <= 3 or type(batch[1]) is not list:
            self._bad_message(stream, WireFormatError(f"payload is not [ts, events, dp_rank]: "
                                                      f"{saferepr(batch)}"))
            return
        dp_rank = batch[2] if len(batch) == 3 else None
        if dp_rank is None:
            dp_rank = stream.rank
        elif type(dp_rank) is not int or dp_rank < 0:
            self._bad_message(stream, WireFormatError(
                f"batch data_parallel_rank is not an int >= 0: {saferepr(dp_rank, 100)}"))
            return
        if dp_rank not in stream.dp_ranks:
            if not self._core.admit_dp_rank(dp_rank):  # counted by the core
                self._log.log(logging.WARNING, "dp-rank", "rank %d: batch for "
                              "data_parallel_rank %d dropped: only ranks below %d are accepted "
                              "(unknown_dp_ranks_refused)", stream.rank, dp_rank,
                              self._core.max_dp_ranks)
                return
            stream.dp_ranks.add(dp_rank)
        applied = self._core.apply_events(dp_rank, batch[1],
                                          lambda exc: self._bad_event(stream, exc))
        self._n_batches_applied += 1
        self._n_events_applied += applied

    def _bad_message(self, stream: _Stream, exc: WireFormatError) -> None:
        self._n_malformed += 1
        self._log.log(logging.WARNING, "malformed", "rank %d: malformed message dropped: %s",
                      stream.rank, exc)

    def _bad_event(self, stream: _Stream, exc: WireFormatError) -> None:
        if isinstance(exc, UnknownMediumError):
            self._n_unknown_medium += 1
            self._log.log(logging.WARNING, "medium", "rank %d: event with an unknown medium "
                          "dropped: %s", stream.rank, exc)
        else:
            self._n_malformed += 1
            self._log.log(logging.WARNING, "malformed-event", "rank %d: malformed event "
                          "dropped: %s", stream.rank, exc)

    # --- registrations and output

    def _drain_registrations(self) -> None:
        queue = self._queue
        core = self._core
        while queue:
            item = queue.popleft()
            try:
                kind, medium, dp_rank = item[0], item[1], item[2]
                if kind == "store":
                    core.store(SOURCE_TIERS, medium, dp_rank, [item[3]], item[4], item[5],
                               item[6], item[7], None, item[8])
                elif kind == "remove":
                    core.remove(SOURCE_TIERS, medium, dp_rank, item[3])
                else:
                    core.clear(SOURCE_TIERS, medium, dp_rank)
                self._n_registrations += 1
            except Exception as exc:  # e.g. token count != block_size: the tier's bug
                self._n_registration_errors += 1
                self._log.log(logging.WARNING, "registration", "registration %s dropped: %s",
                              saferepr(item), exc)

    def _flush(self) -> None:
        """Publish what the core produced: one batch per dp rank, dp rank preserved."""
        output = self._core.take_output()
        if not output:
            return
        publisher = self._publisher
        assert publisher is not None
        for dp_rank, events in output.items():
            self._published_batches += 1
            self._n_batches_out += 1
            self._n_events_out += len(events)
            try:
                ok = publisher.publish(events, data_parallel_rank=dp_rank)
            except Exception as exc:  # a publisher plugin breaking its never-raise contract
                ok = False
                self._log.log(logging.ERROR, "output-error", "%s.publish raised %s: %s",
                              type(publisher).__name__, type(exc).__name__, exc)
            if not ok:
                self._n_output_lost += 1
                self._log.log(logging.WARNING, "output-lost", "output batch for dp rank %d lost "
                              "by the publisher (consumers see a seq gap)", dp_rank)


def _check_hash(value: int) -> None:
    if type(value) is not int or not -(1 << 63) <= value < _U64:
        raise ValueError(f"block hash {value!r} is not a signed or unsigned 64-bit integer")


# ====================================================================== standalone command


def main_consolidate(argv: list[str] | None = None) -> int:
    """``kvbm-plugin consolidate``: run the consolidator until SIGINT/SIGTERM.

    Reads the DYN_KVBM_* variables like the leader does, each validated before anything starts
    (the consolidator switch too, though asking for the command runs it whatever its value);
    the options override them. Runs in the foreground on the main thread (which only waits for
    a signal).
    """
    from kvbm_plugin.cli import ArgumentParser
    from kvbm_plugin.consolidator_config import (
        CONSOLIDATOR_MODE,
        consolidator_enabled,
        native_enabled,
    )

    parser = ArgumentParser(
        prog="kvbm-plugin consolidate",
        description="De-duplicate the per-rank GPU-tier KV-event streams into one stream.")
    parser.add_argument("--num-ranks", type=int, default=1,
                        help="number of GPU-tier publishers (attention-DP ranks); default 1")
    parser.add_argument("--mode", choices=("dedup", "passthrough"),
                        help="override DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE")
    parser.add_argument("--events-endpoint", help=f"override {EVENTS_ENDPOINT} (rank 0's)")
    parser.add_argument("--replay-endpoint", help=f"override {REPLAY_ENDPOINT} (rank 0's)")
    parser.add_argument("--output-endpoint", help=f"override {OUTPUT_ENDPOINT}")
    parser.add_argument("--output-replay-endpoint", help=f"override {OUTPUT_REPLAY_ENDPOINT}")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                        help="log level (default INFO)")
    args = parser.parse_args(argv)
    if args.num_ranks < 1:
        parser.error(f"argument --num-ranks: {args.num_ranks} must be >= 1")
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env = dict(os.environ)
    for value, name in ((args.mode, CONSOLIDATOR_MODE), (args.events_endpoint, EVENTS_ENDPOINT),
                        (args.replay_endpoint, REPLAY_ENDPOINT),
                        (args.output_endpoint, OUTPUT_ENDPOINT),
                        (args.output_replay_endpoint, OUTPUT_REPLAY_ENDPOINT)):
        if value is not None:
            env[name] = value
    try:
        consolidator_enabled(env)  # validated, then overridden: the command always runs it
        native_enabled(env)  # read by the core's loops
        env[ENABLE_CONSOLIDATOR] = "true"
        config = load_consolidator_config(env, num_ranks=args.num_ranks,
                                          require_gpu_events=True)
    except ConfigError as exc:
        print(f"kvbm-plugin consolidate: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    consolidator = KvEventConsolidator(config)
    try:
        consolidator.start()
    except (zmq.ZMQError, ConfigError, OSError) as exc:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print(f"kvbm-plugin consolidate: cannot start: {exc}", file=sys.stderr)
        return 1
    inputs = ", ".join(config.publish_endpoint(r).connect for r in range(config.num_ranks))
    logger.info("KV event consolidator started (%s): %s -> %s", config.mode, inputs,
                config.output.bind)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        consolidator.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        logger.info("KV event consolidator stopped: %s", consolidator.stats())
    return 0

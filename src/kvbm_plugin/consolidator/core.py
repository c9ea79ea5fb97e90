"""The consolidator's pure core: the dedup state machine behind
:mod:`kvbm_plugin.consolidator.service`.

:class:`ConsolidatorCore` has no sockets, no threads and no clock, and imports neither zmq nor
torch. It takes GPU-tier wire events (per dp rank) and offload-tier registrations, and emits
output wire events per dp rank. Everything the router sees is decided here, so every invariant
is unit-testable in milliseconds.

Who calls what: one owner drives a core, on one thread — the socket shell
:class:`~kvbm_plugin.consolidator.service.KvEventConsolidator` on its ingest thread
(decoded GPU-tier batches through :meth:`ConsolidatorCore.apply_events`, queued tier
registrations through
:meth:`ConsolidatorCore.store` / :meth:`ConsolidatorCore.remove` /
:meth:`ConsolidatorCore.clear`, then :meth:`ConsolidatorCore.take_output` to publish), or a
test. Callers import these names from :mod:`kvbm_plugin.consolidator.service`, which
re-exports them.

The dedup block loops also exist compiled (``consolidator/_core_c.c``, used when built): the Python
loops here are their reference, the tests compare the two, and everything the compiled loops do
not take (clears, passthrough mode, unusual or malformed input) runs here. The compiled loops
read and write this module's block and :class:`_Rank` layouts directly, so the two stay in step.

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

from collections.abc import Callable, Sequence
from typing import Any, Final

from kvbm_plugin._util import native as _native
from kvbm_plugin.consolidator_config import ConsolidatorMode
from kvbm_plugin.wire.events import (
    MAX_DP_RANKS,
    MEDIA,
    MEDIUM_GPU,
    U32_MAX,
    WireFormatError,
    normalize_medium,
)
from kvbm_plugin.wire.identity import lora_name as wire_lora_name
from kvbm_plugin.wire.publisher_base import WireEvent

__all__ = [
    "SOURCE_ENGINE",
    "SOURCE_TIERS",
    "UnknownMediumError",
    "UnknownDpRankError",
    "ConsolidatorCore",
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
    """An ``extra_keys`` item the consolidator keeps: str, bytes, an int in 64 bits, or an
    ``(identifier, offset)`` pair (a multimodal key in vLLM's offset-tagged form)."""
    t = type(value)
    if t is list or t is tuple:
        return (len(value) == 2 and type(value[0]) is str and type(value[1]) is int
                and -(1 << 63) <= value[1] < (1 << 64))
    return t is str or t is bytes or (t is int and -(1 << 63) <= value < (1 << 64))


def _hashable_entry(entry: Any) -> tuple[Any, ...]:
    return tuple(tuple(k) if type(k) is list else k for k in entry)


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
        if extra_keys is not None or lora_id is not None or lora_name is not None:
            scope = self._scopes(lora_id, lora_name, extra_keys, n)
        if not tokens:
            self._store_hash_only(rank, slot, hashes)
        else:
            self._store_chain(rank, slot, hashes, parent_raw, tokens, block_size, lora_id,
                              lora_name, scope, extra_keys)
        # Counted once applied (an unhashable token raises before anything changed).
        self._n_stores_in += 1
        self._n_store_blocks_in += n

    @staticmethod
    def _scopes(lora_id: Any, lora_name: Any, extra_keys: Any, n: int) -> list[Any]:
        """Per block, what besides tokens names its content: (adapter, extra keys); two
        adapters' or two salts' blocks with the same tokens are different blocks. The adapter
        is what a router reads, its ``lora_name`` (else the name its ``lora_id`` goes out
        under); task id 0 is an adapter, apart from the base model."""
        lora = lora_name if lora_name is not None else wire_lora_name(lora_id)
        if extra_keys is None:
            return [(lora, None)] * n
        if not isinstance(extra_keys, (list, tuple)) or len(extra_keys) != n:
            raise WireFormatError(f"BlockStored extra_keys must be a list of one entry per "
                                  f"block ({n}): {extra_keys!r:.100}")
        out = []
        for entry in extra_keys:
            if entry is None:
                out.append((lora, None))
                continue
            if type(entry) not in (list, tuple) or not all(map(_plain_key, entry)):
                # Refused here like any odd value: the output encoder must take what we keep.
                raise WireFormatError(f"BlockStored extra_keys entry is not a list of strings, "
                                      f"bytes or 64-bit integers: {entry!r:.100}")
            out.append((lora, _hashable_entry(entry)))
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

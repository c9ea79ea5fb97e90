"""GPU-tier KV event sink: TensorRT-LLM KV-cache events in, one wire batch per iteration out.

Two inputs, one output:

- ``ingest(events)``: TRT-LLM's buffered event dicts (``KVCacheEventSerializer`` form, as
  ``KVCacheManager.get_latest_events`` + serializer, ``LLM.get_kv_cache_events()`` and
  ``trtllm-serve``'s ``POST /kv_cache_events`` return them). Hashes arrive unsigned (u64).
- The KVCacheManagerV2 event-sink hooks (``add_stored_block_event_from_block`` ...), by duck
  typing: the sink can stand where V2's ``KVCacheEventManager`` stands, or receive a copy of its
  calls (see :func:`attach_event_source`). A 32-byte radix key maps to the wire hash as the
  signed big-endian reading of its first 8 bytes.
- ``flush()``: one batch per data-parallel rank with events, handed to the publisher.

Rules applied on the way (see the event-sink issue): only full blocks are published (a stored
run stops at its first partial block, and that block's later removal is suppressed); only the
routing attention window is published (the largest, unless configured); consecutive stored
blocks of one chain are coalesced into one ``BlockStored``; order is preserved; ``created`` and
``updated`` are counted, never turned into stores or removes; a store whose event names no
LoRA adapter (TensorRT-LLM's serializer writes no ``lora_id``) takes the adapter the leader
named for its chain (:meth:`KvEventSink.name_lora_root`, :mod:`kvbm_plugin.naming.names`:
once an adapter was seen, a chain nobody named is withheld and counted). Removals are never
dropped except by the partial-block rule (and, for sliding-window models, when they belong to a
window that is not published at all). Every drop is counted in :meth:`KvEventSink.stats` and logged
rate-limited.

``ingest`` has two loops with one behaviour: the Python loop (the reference) and, when the
extension was built, a compiled loop (``events/_sink_c.c``) that takes the common events (the
decode's one-block stores and a prompt's chain of full blocks, a partial last block's hash
handed back to be suppressed; removals) and hands every other event to the Python loop. With the
extension, each rank's batch is compiled too (``_rank_batch.c``, the compiled form of
:class:`Rank`): the events the compiled code takes are written straight into their wire bytes
(an ``events.EncodedEvents`` run in an ``events.EncodedBatch``), so no Python object is made,
encoded or freed per event or token; the V2 hooks' common calls (a full block, the removal of
a published one) are taken by the batch's own C methods, installed on the sink in place of the
Python hooks. A publisher that does not take encoded batches, and an ``on_flush`` observer,
get every event as its map.

Threads: ``ingest`` and ``flush`` take one short lock (never held across I/O), so buffered
events may arrive on TRT-LLM's KV-event dispatch thread while the leader's event pump flushes on
its own thread (``leader/event_pump.py``). The V2 hooks take no lock (per-block budget ~1 us):
TRT-LLM calls them on the executor thread, and where they feed the sink the leader flushes on
that thread too (the pump's thread is stopped at attach). Nothing here waits on I/O: the
publisher's ``publish`` hands the batch over without waiting (see
:mod:`kvbm_plugin.wire.publisher`). No torch or TensorRT-LLM import.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from operator import itemgetter
from typing import Any

from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.events.fields import (
    REMOVED,
    STORED,
    block_extra_keys,
    is_scoped,
    parse_lora_id,
    parse_token_ids,
)
from kvbm_plugin.events.rank import Rank, add_child, native_rank_type
from kvbm_plugin.events.rank_writer import RankWriter
from kvbm_plugin.events.v2_hooks import BLOCK_HOOKS, V2Hooks
from kvbm_plugin.naming.names import LoraNames, signed_hash
from kvbm_plugin.wire.events import (
    MAX_DP_RANKS,
    MEDIUM_GPU,
    EncodedBatch,
    WireFormatError,
    event_count,
    events_as_maps,
)
from kvbm_plugin.wire.identity import lora_name, salt_of_extra_keys
from kvbm_plugin.wire.publisher import EventPublisher, WireEvent

logger = logging.getLogger(__name__)

_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1
_I64_MIN = -(1 << 63)
_token_id = itemgetter("token_id")
_INT_ONLY = {int}
# Unpublished hashes remembered so that their removal can be suppressed. Partial blocks are
# normally removed soon; the cap only guards against a producer that never removes them.
_MAX_SUPPRESSED = 1 << 20



class KvEventSink:
    """Filters and batches one executor's GPU-tier KV events for a publisher.

    Built by the leader (one per rank whose KV cache manager it watches) or by the sidecar.
    ``publisher`` receives one batch per rank per :meth:`flush`; events carrying
    ``attention_dp_rank`` go to that rank's batch, published with that dp_rank (on
    ``rank_publishers[rank]`` when given, else on ``publisher``). ``block_size`` is the router's
    block size (tokens per block); ``window_size`` pins the published attention window
    (default: the largest seen). ``strict=True`` raises :class:`WireFormatError` on malformed
    input instead of counting and logging it (tests). The sink owns its publishers: ``shutdown``
    shuts them down unless ``owns_publisher=False``. An ``attention_dp_rank`` other than
    ``data_parallel_rank``, a key of ``rank_publishers`` or one below ``max_dp_ranks`` is
    refused (counted in ``unknown_dp_rank_events``, logged): each rank costs state kept for the
    sink's lifetime. ``max_suppressed`` caps the unpublished (partial or filtered) hashes
    remembered per rank so that their removals are dropped; past it the oldest is forgotten
    in O(1) (counted in ``suppressed_evicted``).
    """

    def __init__(self, publisher: EventPublisher, *, block_size: int,
                 window_size: int | None = None, data_parallel_rank: int = 0,
                 rank_publishers: Mapping[int, EventPublisher] | None = None,
                 strict: bool = False, owns_publisher: bool = True,
                 native: bool | None = None, max_dp_ranks: int = MAX_DP_RANKS,
                 prefix_closed: bool = False, max_suppressed: int = _MAX_SUPPRESSED) -> None:
        if type(block_size) is not int or block_size <= 0:
            raise ValueError(f"KvEventSink: block_size={block_size!r} must be a positive integer")
        if window_size is not None and (type(window_size) is not int or window_size <= 0):
            raise ValueError(f"KvEventSink: window_size={window_size!r} must be a positive "
                             "integer or None")
        if type(data_parallel_rank) is not int or data_parallel_rank < 0:
            raise ValueError(f"KvEventSink: data_parallel_rank={data_parallel_rank!r} must be "
                             "a non-negative integer")
        if type(max_dp_ranks) is not int or max_dp_ranks < 1:
            raise ValueError(f"KvEventSink: max_dp_ranks={max_dp_ranks!r} must be an integer "
                             ">= 1")
        if type(max_suppressed) is not int or max_suppressed < 1:
            raise ValueError(f"KvEventSink: max_suppressed={max_suppressed!r} must be an "
                             "integer >= 1")
        # attention_dp_rank values below this are accepted (and our own, and those with a
        # publisher); any other would get state kept for the sink's lifetime.
        self._max_dp_ranks = max_dp_ranks
        self._publisher = publisher
        self._rank_publishers = dict(rank_publishers or {})
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self._configured_window = window_size
        # Routing window for the dict path: configured, else the largest window seen.
        self._window: int | None = window_size
        self._strict = strict
        # Keep the buffered path's output prefix-closed (the leader and the sidecar, whose
        # streams a router may read directly): see Rank.published.
        self._prefix_closed = prefix_closed
        self._owns_publisher = owns_publisher
        # The compiled batch and ingest loop, when built (None: the Python ones alone).
        module = _compiled.choose("event_sink", native, "KvEventSink")
        self._native: Callable[..., tuple[Any, ...]] | None = (
            None if module is None else module.ingest_dicts)
        self._rank_type: Callable[[], Rank] = (
            Rank if module is None else partial(native_rank_type(module), block_size))
        self._lock = threading.Lock()
        rs = self._rank_type()
        self._ranks: dict[int, Rank] = {data_parallel_rank: rs}
        # Called by flush (the flushing thread) with each rank's wire events before they are
        # published; the leader learns TRT-LLM's block hashes from it.
        self.on_flush: Callable[[int, list[WireEvent]], None] | None = None
        # dp rank -> the in-process consumer its batches are handed to as they are (the
        # leader's consolidator: KvEventConsolidator.take_gpu_batch), besides its publisher.
        self._direct: dict[int, Callable[[int, Any], None]] = {}
        self._closed = False
        self._log = RateLimitedLog(logger)
        self._c: dict[str, int] = dict.fromkeys((
            "events_in", "batches_published", "batches_lost", "blocks_stored",
            "blocks_removed", "stores", "removes", "cleared", "partial_blocks_suppressed",
            "partial_removes_suppressed", "window_filtered", "window_removes_filtered",
            "created_events", "updated_events", "unknown_events", "malformed_events",
            "unknown_removes_suppressed", "suppressed_evicted", "discarded_events",
            "unknown_dp_rank_events", "orphan_stores_dropped", "duplicate_stores_dropped",
            "cascade_removes", "hand_over_errors",
        ), 0)
        # The adapter of stores whose events name none (TensorRT-LLM's serializer writes no
        # lora_id): named by the leader, written into the events before the loops read them.
        self._lora = LoraNames(self._c, accepts_rank=lambda rank: type(rank) is int and (
            0 <= rank < self._max_dp_ranks or rank in self._rank_publishers))
        # KVCacheManagerV2's block hooks (events/v2_hooks.py) for this sink's rank, set on the
        # sink under V2's names; with the compiled batch, its own hooks take the common calls
        # (no Python frame per block) and hand any other to these.
        # How stores and removals enter a rank's batch (both inputs' Python paths).
        self._writer = RankWriter(self._c, self._log, block_size, prefix_closed=prefix_closed,
                                  max_suppressed=max_suppressed)
        self._v2 = v2 = V2Hooks(rs, self._c, self._writer, malformed=self._malformed)
        for name in BLOCK_HOOKS:
            setattr(self, name, getattr(v2, name))
        if module is not None:
            rs.fallback_store = v2.add_stored_block_event_from_block
            rs.fallback_remove = v2.add_removed_event
            self.add_stored_block_event_from_block = rs.v2_store
            self.add_removed_event = rs.v2_remove

    # ---- dict input (buffered path) -------------------------------------------------------

    def ingest(self, events: Iterable[Mapping[str, Any]]) -> None:
        """Add TRT-LLM buffered event dicts to the current iteration's batch.

        Called by the leader on the executor thread (or by the event-source tee on TRT-LLM's
        KV-event dispatch thread, or by the sidecar), any number of times per iteration.
        O(events), no I/O. A malformed event is counted and logged (raised when strict) and the
        rest are still taken.
        """
        native = self._native
        with self._lock:
            if self._lora.active:
                events = self._lora.annotate(list(events), self.data_parallel_rank)
            if native is None or type(events) is not list:
                self._ingest_locked(events)
                return
            # The compiled loop takes the common events and stops at the first one that needs
            # a decision (window, created, partial block, other rank, malformed ...); the
            # Python loop takes that one, and the compiled loop goes on after it. It also
            # stops after a store whose last block is partial, which is suppressed here first.
            c = self._c
            rs = self._ranks[self.data_parallel_rank]
            start = 0
            while True:
                (stop, n_in, n_stores, n_stored, n_removes, n_removed, n_partial,
                 n_unknown, tail) = native(events, start, rs, self._window, self._prefix_closed)
                c["events_in"] += n_in
                c["stores"] += n_stores
                c["blocks_stored"] += n_stored
                c["removes"] += n_removes
                c["blocks_removed"] += n_removed
                c["partial_removes_suppressed"] += n_partial
                c["unknown_removes_suppressed"] += n_unknown
                if tail is not None:
                    self._writer.suppress(rs, tail)
                    c["partial_blocks_suppressed"] += 1
                    start = stop
                    continue
                if stop >= len(events):  # re-read: a caller's key object may change the list
                    return
                self._ingest_locked((events[stop],))
                start = stop + 1

    def _ingest_locked(self, events: Iterable[Mapping[str, Any]]) -> None:
        """The Python ingest loop (lock held): the reference for the compiled fast path."""
        # Hot path: locals only (the routing window too; refreshed when it changes), hashes
        # converted inline (same rule as signed: u64 -> two's complement, anything else
        # outside the int64 range goes to signed, which raises), the one-block store and the
        # one-hash removal (TRT-LLM's decode steady state) built directly; every other case
        # goes through the helper methods.
        c = self._c
        bs = self.block_size
        i64_max = _I64_MAX
        i64_min = _I64_MIN
        u64 = _U64
        token_ids = parse_token_ids
        n_in = n_stores = n_stored = n_removes = n_removed = 0
        ranks = self._ranks
        default_rs = ranks[self.data_parallel_rank]
        cur_window = self._window
        closed = self._prefix_closed
        # The counters are added even when strict mode raises part-way (as the compiled loop
        # adds those of the events it took before stopping).
        try:
            for ev in events:
                n_in += 1
                try:
                    data = ev["data"]
                    kind = data["type"]
                    window = ev.get("window_size")
                    if window is not None and window != cur_window:
                        if kind == "created":
                            c["created_events"] += 1
                            self._window_accepts(window, kind)  # learn the largest window
                            cur_window = self._window
                            continue
                        if not self._window_accepts(window, kind):
                            if kind == "stored":
                                c["window_filtered"] += len(data["blocks"])
                            elif kind == "removed":
                                c["window_removes_filtered"] += len(data["block_hashes"])
                            continue
                        cur_window = self._window
                    elif kind == "created":
                        c["created_events"] += 1
                        continue
                    rank = ev.get("attention_dp_rank")
                    if rank is None:
                        rs = default_rs
                    else:
                        rs = ranks.get(rank)
                        if rs is None:
                            rs = self._new_rank(rank)
                            if rs is None:
                                continue  # refused: counted and logged
                    if kind == "stored":
                        blocks = data["blocks"]
                        block = blocks[0] if len(blocks) == 1 else None
                        if block is not None and len(tokens := block["tokens"]) == bs \
                                and not is_scoped(block):
                            # The common decode case: one full block.
                            h = block["block_hash"]
                            if type(h) is not int or not i64_min <= h <= i64_max:
                                if type(h) is int and i64_max < h < u64:
                                    h -= u64
                                else:
                                    h = signed_hash(h, "stored.blocks[].block_hash")
                            parent = data.get("parent_hash")
                            if parent is not None and (type(parent) is not int
                                                       or not i64_min <= parent <= i64_max):
                                if type(parent) is int and i64_max < parent < u64:
                                    parent -= u64
                                else:
                                    parent = signed_hash(parent, "stored.parent_hash")
                            # A block's own lora_id (None included) overrides the
                            # event's, as in _dict_stored.
                            lora_id = block["lora_id"] if "lora_id" in block \
                                else data.get("lora_id")
                            if lora_id is not None:
                                lora_id = parse_lora_id(lora_id)
                            # Every field read and checked: only now may the batch change.
                            ids = token_ids(tokens)
                            published = rs.published
                            if closed and ((parent is not None and parent not in published)
                                           or h in published):
                                self._writer.store(rs, [h], parent, [])  # drops it, counted
                                continue
                            last = rs.last
                            if (last is not None and parent is not None
                                    and last["type"] == STORED
                                    and last["block_hashes"][-1] == parent
                                    and last["lora_id"] == lora_id):
                                last["block_hashes"].append(h)
                                last["token_ids"].extend(ids)
                            else:
                                n_stores += 1
                                last = rs.last = {
                                    "type": STORED, "block_hashes": [h],
                                    "parent_block_hash": parent,
                                    "token_ids": ids,
                                    "block_size": bs, "lora_id": lora_id,
                                    "medium": MEDIUM_GPU, "lora_name": lora_name(lora_id)}
                                rs.events.append(last)
                            if closed:
                                published[h] = parent
                                if parent is not None:
                                    add_child(rs.kids, parent, h)
                            n_stored += 1
                        else:
                            self._dict_stored(rs, data, bs)
                    elif kind == "removed":
                        raw = data["block_hashes"]
                        if type(raw) is list and len(raw) == 1:
                            h = raw[0]
                            if type(h) is not int or not i64_min <= h <= i64_max:
                                if type(h) is int and i64_max < h < u64:
                                    h -= u64
                                else:
                                    h = signed_hash(h, "removed.block_hashes[]")
                            hashes = [h]
                        else:
                            hashes = []
                            for h in raw:
                                if type(h) is not int or not i64_min <= h <= i64_max:
                                    h = signed_hash(h, "removed.block_hashes[]")
                                hashes.append(h)
                        last = rs.last
                        if rs.suppressed or not hashes or closed and (
                                len(hashes) != 1 or h not in rs.published or h in rs.kids):
                            self._writer.remove(rs, hashes, track_live=False)
                            continue
                        if closed:
                            rs.unpublish(h)
                        if last is not None and last["type"] == REMOVED:
                            last["block_hashes"].extend(hashes)
                            n_removed += len(hashes)
                        else:
                            n_removes += 1
                            n_removed += len(hashes)
                            last = rs.last = {"type": REMOVED, "block_hashes": hashes,
                                              "medium": MEDIUM_GPU}
                            rs.events.append(last)
                    elif kind == "updated":
                        # cache_level/priority changes: counted, never guessed into events.
                        c["updated_events"] += 1
                    else:
                        c["unknown_events"] += 1
                        self._log.log(logging.WARNING, "unknown", "KvEventSink: unknown event "
                                      "type data.type=%r (event_id %s) not published", kind,
                                      ev.get("event_id"))
                except (KeyError, TypeError, ValueError, AttributeError) as exc:
                    self._malformed(exc, ev)
        finally:
            c["events_in"] += n_in
            c["stores"] += n_stores
            c["blocks_stored"] += n_stored
            c["removes"] += n_removes
            c["blocks_removed"] += n_removed

    def _window_accepts(self, window: Any, kind: str) -> bool:
        """Whether an event of attention window ``window`` is published (lock held)."""
        if type(window) is not int:
            raise WireFormatError(f"window_size is not an integer: {window!r}")
        if self._configured_window is not None:
            return False  # != the configured window
        current = self._window
        if current is None or window > current:
            if current is not None and kind != "created":
                self._log.log(logging.WARNING, "window-grew", "KvEventSink: a larger attention "
                              "window %d appeared after %d was being published; publishing %d "
                              "from now on (set the window explicitly to avoid this)", window,
                              current, window)
            self._window = window
            return True
        return False

    def _dict_stored(self, rs: Rank, data: Mapping[str, Any], bs: int) -> None:
        # The whole event is read and checked first: a malformed one changes nothing (neither
        # the batch nor the suppressed set).
        parent = data.get("parent_hash")
        if parent is not None:
            parent = signed_hash(parent, "stored.parent_hash")
        blocks = data["blocks"]
        # LoRA id: per block in newer serializers, else per event (TRT-LLM uses 0 for none).
        event_lora = parse_lora_id(data.get("lora_id"))
        hashes: list[int] = []
        tokens: list[int] = []
        loras: list[int | None] = []
        extras: list[Any] = []  # per block: multimodal keys and cache salt, or None
        unpublished: list[int] = []  # the first partial block and every block after it
        oversized = 0
        for i, block in enumerate(blocks):
            btok = block["tokens"]
            h = signed_hash(block["block_hash"], "stored.blocks[].block_hash")
            if len(btok) != bs:
                if len(btok) > bs:
                    oversized = len(btok)
                # The run stops here; this block and any after it are never published.
                unpublished.append(h)
                unpublished.extend(signed_hash(later["block_hash"], "stored.blocks[].block_hash")
                                   for later in blocks[i + 1:])
                break
            hashes.append(h)
            tokens.extend(parse_token_ids(btok))
            loras.append(parse_lora_id(block["lora_id"]) if "lora_id" in block else event_lora)
            extras.append(block_extra_keys(block))
        if unpublished:
            if oversized:
                self._log.log(logging.ERROR, "oversized", "KvEventSink: stored block %d has %d "
                              "tokens > block_size %d; the sink's block_size does not match "
                              "the engine's tokens_per_block", unpublished[0], oversized, bs)
            for h in unpublished:
                self._writer.suppress(rs, h)
            self._c["partial_blocks_suppressed"] += len(unpublished)
        # One store per run of one adapter and cache salt (a router reads both per event);
        # the chain goes on across runs.
        salts = [salt_of_extra_keys(e) for e in extras]
        start = 0
        for end in range(1, len(hashes) + 1):
            if end == len(hashes) or loras[end] != loras[start] or salts[end] != salts[start]:
                self._writer.store(rs, hashes[start:end], parent, tokens[start * bs:end * bs],
                            loras[start], extras[start:end])
                parent = hashes[end - 1]
                start = end

    def name_lora_root(self, block_hash: int, lora_task_id: int | None) -> None:
        """TensorRT-LLM's (wire) hash of a request's first block and the request's LoRA task
        id (None: the base model); see :mod:`kvbm_plugin.naming.names`.

        Called by the leader (executor thread) for each request once its first block is full,
        before TensorRT-LLM can store it. O(1), one short lock."""
        with self._lock:
            self._lora.name_root(block_hash, lora_task_id)

    # ---- shared batch building (lock held) -------------------------------------------------

    def _new_rank(self, rank: Any) -> Rank | None:
        """State for a dp rank seen for the first time, or None when the rank is refused
        (counted and logged; raised when strict): ranks are kept for the sink's lifetime, so
        only those the configuration allows get one."""
        if type(rank) is not int or rank < 0:
            raise WireFormatError(f"attention_dp_rank is not a non-negative integer: {rank!r}")
        if rank >= self._max_dp_ranks and rank not in self._rank_publishers:
            self._c["unknown_dp_rank_events"] += 1
            if self._strict:
                raise WireFormatError(f"attention_dp_rank={rank} is outside the ranks this sink "
                                      f"accepts (0..{self._max_dp_ranks - 1} and "
                                      f"{sorted(self._ranks)})")
            self._log.log(logging.WARNING, "dp-rank", "KvEventSink: event for "
                          "attention_dp_rank=%d not published: ranks above %d are refused "
                          "(unknown_dp_rank_events)", rank, self._max_dp_ranks - 1)
            return None
        rs = self._ranks[rank] = self._rank_type()
        return rs

    def _count_lost_input(self, n: int) -> None:
        """``n`` events that never reached :meth:`ingest` (the buffered tee could not turn them
        into dicts): counted as malformed; any thread."""
        with self._lock:
            self._c["malformed_events"] += n

    def _malformed(self, exc: BaseException, what: Any) -> None:
        self._c["malformed_events"] += 1
        if self._strict:
            if isinstance(exc, WireFormatError):
                raise exc
            raise WireFormatError(f"malformed KV event ({type(exc).__name__}: {exc}): "
                                  f"{what!r:.300}") from exc
        self._log.log(logging.ERROR, "malformed", "KvEventSink: malformed KV event not "
                      "published (%s: %s): %.300r", type(exc).__name__, exc, what)

    # ---- KVCacheManagerV2's event-manager interface, besides the block hooks -------------
    # (events/v2_hooks.py has those; the sink's own state is here: window, counters, flush)

    @property
    def dropped_event_count(self) -> int:
        """Batches the publisher lost (V2 manager property name)."""
        return self._c["batches_lost"] + self._lost_by_publishers()

    @property
    def queue_high_watermark(self) -> int:
        """Publisher queue high-water mark (V2 manager property name)."""
        return int(self._publisher.stats().get("queue_high_water", 0))

    def set_layer_group_window_sizes(self, window_sizes: Mapping[int, int]) -> None:
        """V2 hook: window per layer group; picks the routing group(s) (largest or configured)."""
        sizes = {int(k): int(v) for k, v in window_sizes.items()}
        with self._lock:
            if not sizes:
                self._v2.route(None)
                return
            target = self._configured_window
            if target is None or target not in sizes.values():
                if target is not None:
                    self._log.log(logging.ERROR, "window-missing", "KvEventSink: configured "
                                  "window_size %d is none of the layer-group windows %s; "
                                  "publishing the largest", target, sorted(set(sizes.values())))
                target = max(sizes.values())
            self._window = target
            self._v2.route(frozenset(g for g, w in sizes.items() if w == target))

    def set_routing_layer_group(self, layer_group_id: int) -> None:
        """V2 hook: publish exactly this layer group."""
        with self._lock:
            self._v2.route(frozenset((int(layer_group_id),)))

    def add_created_event(self, num_blocks_per_cache_level: Sequence[int],
                          layer_group_ids: Sequence[int] | None = None) -> None:
        """V2 hook: pool created; counted (the wire format has no such event)."""
        self._c["created_events"] += 1

    def add_updated_event(self, block_hash: Any, *, cache_level: Any = None,
                          priority: Any = None, layer_group_id: int | None = None) -> None:
        """V2 hook: cache level / priority changed; counted, not published."""
        self._c["updated_events"] += 1

    def flush_iteration_events(self) -> None:
        """V2 hook: TRT-LLM's per-iteration flush; publishes like :meth:`flush`."""
        self.flush()

    def get_latest_events(self, timeout_ms: float | None = None,
                          max_events: int | None = None) -> list[Any]:
        """V2 pull API: always ``[]``; events are pushed to the publisher instead."""
        return []

    def discard_events(self) -> None:
        """V2 hook: drop pending events (counted and logged; removals included).

        Each rank's batch is taken as :meth:`flush` takes it and thrown away: the compiled
        batch then starts a new batch of its own kind (a plain list put in its place would
        carry its later encoded runs to the publisher as items of a list, which is no event),
        and an encoded run counts as the events it holds."""
        with self._lock:
            n = 0
            for rs in self._ranks.values():
                n += event_count(rs.take())
            self._c["discarded_events"] += n
        if n:
            self._log.log(logging.WARNING, "discard", "KvEventSink: discard_events dropped %d "
                          "pending events", n)

    # ---- output -----------------------------------------------------------------------------

    def clear_all(self, data_parallel_rank: int | None = None) -> None:
        """Queue ``AllBlocksCleared`` for a rank (the leader, when the GPU pool is reset)."""
        rank = self.data_parallel_rank if data_parallel_rank is None else data_parallel_rank
        with self._lock:
            rs = self._ranks.get(rank) or self._new_rank(rank)
            if rs is None:
                raise ValueError(f"KvEventSink.clear_all: data_parallel_rank={rank!r} is "
                                 "outside the ranks this sink accepts")
            rs.events.append({"type": "AllBlocksCleared"})
            rs.last = None
            rs.forget_suppressed()
            rs.live.clear()
            rs.live_keys.clear()
            rs.published.clear()
            rs.kids.clear()
            self._lora.clear(rank)
            self._c["cleared"] += 1

    def hand_over(self, rank: int, consumer: Callable[[int, Any], None]) -> None:
        """Also hand dp rank ``rank``'s batches to ``consumer(rank, events)`` in this process
        (the in-process consolidator), after its publisher had them: the events as the
        publisher got them (an encoded batch, or maps where ``on_flush`` decoded them), never
        encoded, sent or decoded for it. Called once by the leader's assembly at bring-up,
        before the first flush. ``consumer`` must not block; what it raises is logged."""
        self._direct[rank] = consumer

    def flush(self) -> bool:
        """Publish this iteration's batch (one per rank with events); nothing when empty.

        Called by the leader's event pump (its thread, every 5 ms while the engine iterates;
        the executor thread where the V2 hooks feed the sink), one flush at a time. Never
        blocks: the publisher hands the batch over without waiting
        (:class:`~kvbm_plugin.wire.publisher.ZmqEventPublisher`). Returns False if any batch was
        lost (counted in ``batches_lost``; consumers see a seq gap). Never raises, even when a
        publisher does.
        """
        with self._lock:
            pending = [(rank, rs.take()) for rank, rs in self._ranks.items() if rs.pending]
        ok = True
        observer = self.on_flush
        for rank, events in pending:
            publisher = self._rank_publishers.get(rank, self._publisher)
            # The compiled batch's encoded runs are decoded at most once, only for a reader of
            # maps; a publisher that takes them gets them as they are.
            maps = events
            if type(events) is EncodedBatch and (observer is not None
                                                 or not publisher.accepts_encoded_events):
                maps = events_as_maps(events)
            if observer is not None:
                try:
                    observer(rank, maps)
                except Exception as exc:  # an observer must not cost the batch
                    self._log.log(logging.ERROR, "observer", "KvEventSink: on_flush observer "
                                  "raised %s: %s", type(exc).__name__, exc)
            if not publisher.accepts_encoded_events:
                events = maps
            try:
                published = publisher.publish(events, data_parallel_rank=rank)
            except Exception as exc:  # a transport plugin breaking the never-raise contract
                published = False
                self._log.log(logging.ERROR, "publish-error", "KvEventSink: %s.publish raised "
                              "%s: %s; batch of %d events for dp rank %d lost",
                              type(publisher).__name__, type(exc).__name__, exc,
                              event_count(events), rank)
            if published:
                self._c["batches_published"] += 1
            else:
                self._c["batches_lost"] += 1
                ok = False
            consumer = self._direct.get(rank)
            if consumer is not None:
                try:
                    # The maps when on_flush decoded them (no second decode), else as sent.
                    consumer(rank, maps if observer is not None else events)
                except Exception as exc:  # the consumer's bug must not cost the executor
                    self._c["hand_over_errors"] += 1
                    self._log.log(logging.ERROR, "hand-over", "KvEventSink: handing the batch "
                                  "of dp rank %d over raised %s: %s", rank,
                                  type(exc).__name__, exc)
        return ok

    def _lost_by_publishers(self) -> int:
        """Batches the publishers accepted and lost afterwards (a threaded publisher's encode,
        send or shutdown loss): ``flush`` counted them as published."""
        total = 0
        seen: set[int] = set()
        for publisher in (self._publisher, *self._rank_publishers.values()):
            if id(publisher) not in seen:
                seen.add(id(publisher))
                total += int(publisher.stats().get("lost_after_accept", 0))
        return total

    def rank_batches_published(self, rank: int) -> int:
        """Batches dp rank ``rank``'s publisher (``rank_publishers``, else the sink's own)
        published; any thread (a consumer checking it has all of one rank's stream)."""
        publisher = self._rank_publishers.get(rank, self._publisher)
        return int(publisher.stats().get("batches_published", 0))

    def stats(self) -> dict[str, int]:
        """Sink counters plus the publisher's (prefixed ``publisher_``); any thread.

        ``batches_published`` and ``batches_lost`` include what the publishers lost after
        accepting a batch, so that the two add up to the batches flushed.
        """
        out = dict(self._c)
        later = self._lost_by_publishers()
        out["batches_published"] -= later
        out["batches_lost"] += later
        # A snapshot (atomic under the GIL): ingest may add a rank on another thread meanwhile.
        out["pending_events"] = sum(rs.pending for rs in list(self._ranks.values()))
        if self._native is not None:
            # What the compiled V2 hooks took (the default rank's batch counts it).
            blocks_stored, stores, blocks_removed, removes = \
                self._ranks[self.data_parallel_rank].v2_counts()
            out["blocks_stored"] += blocks_stored
            out["stores"] += stores
            out["blocks_removed"] += blocks_removed
            out["removes"] += removes
        for key, value in self._publisher.stats().items():
            out[f"publisher_{key}"] = value
        return out

    def shutdown(self, timeout: float = 5.0) -> None:
        """Flush what is pending, then shut the publishers down; idempotent.

        Called once by the owner at teardown (leader, sidecar); also reachable as ``close``.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush()
        if self._owns_publisher:
            seen: set[int] = set()
            for publisher in (self._publisher, *self._rank_publishers.values()):
                if id(publisher) not in seen:
                    seen.add(id(publisher))
                    publisher.shutdown(timeout)

    close = shutdown

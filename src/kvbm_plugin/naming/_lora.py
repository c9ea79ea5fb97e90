"""The LoRA adapter of GPU-tier stores whose events do not name it.

A private part of :mod:`kvbm_plugin.naming.names` (import :class:`LoraNames` from there).

TensorRT-LLM's C++ ``KVCacheStoredBlockData`` carries the block's ``loraId``
(``cpp/include/tensorrt_llm/executor/executor.h`` @ 879039f6), but its Python serializer leaves
it out of the dicts (``tensorrt_llm/_utils.py`` @ ed53795b, ``KVCacheEventSerializer.
_stored_block_to_json``: the ``lora_id`` line is commented out, a TODO). On the buffered path
the sink therefore reads no adapter from the event, and a router (Dynamo keys a block by its
tokens and ``lora_name``) would take two adapters' blocks with the same tokens for one block
under two hashes.

The leader knows each request's LoRA task id and TensorRT-LLM's hash of its first block
(``RequestData.block_hashes`` or the V1 hash it computes, ``BlockNaming.root_hash``), and
names that root before the request's blocks are stored (:meth:`LoraNames.name_root`). A
stored event is one sequence's chain (block ``i``'s parent is block ``i - 1``), and TensorRT-LLM
mixes the task id into every block's key, so a chain's blocks share its parent's adapter: a
store under a parent takes the parent's adapter, a store at the root the one the leader named.
:meth:`LoraNames.annotate` writes that task id into the event as ``lora_id`` (a copy; the
caller's dicts stay as they are) before the sink's loops read it, so both loops publish it as
``lora_name``.

Once an adapter was seen, a root the leader did not name (a request whose hash it cannot
compute, e.g. with multimodal inputs) may be any adapter's or the base model's: such a chain
and everything stored under it is not published (``lora_unnamed_blocks``, logged), nor its
removals (``lora_unnamed_removes``); publishing it under a guessed adapter could give one
content two names. Until the first adapter, nothing is annotated and nothing costs.

Owned by :class:`kvbm_plugin.event_sink.KvEventSink`, called under its lock: ``name_root``
from the leader (executor thread), ``annotate`` from ``ingest`` (the executor thread or
TensorRT-LLM's KV-event dispatch thread). O(1) per event and per removed hash; bounded maps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvbm_plugin._util.bounded import EvictionOrder
from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.naming._hashes import signed_hash
from kvbm_plugin.wire.events import WireFormatError

logger = logging.getLogger(__name__)

UNNAMED = -1  # a published-state marker: a block whose adapter is not known (not published)
_MISSING = object()
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


def _wire(value: Any, what: str) -> int:
    """The wire (signed int64) form of a hash; the common in-range int without a call."""
    if type(value) is int and _I64_MIN <= value <= _I64_MAX:
        return value
    return signed_hash(value, what)


COUNTERS = ("lora_named_blocks", "lora_unnamed_blocks", "lora_unnamed_removes",
            "lora_names_evicted")


class LoraNames:
    """Root names from the leader; the adapter of each stored adapter block, per dp rank.

    ``counters`` is the sink's counter dict (the :data:`COUNTERS` keys are added);
    ``accepts_rank`` says whether the sink keeps state for an event's ``attention_dp_rank``
    (an event of a refused rank passes as it is: the sink counts it, and no map is made);
    ``max_entries`` bounds each map (the oldest entry is forgotten in O(1), counted in
    ``lora_names_evicted``: a forgotten block's later children would be taken for the base
    model's, so the bound is far above any GPU pool's block count).
    """

    def __init__(self, counters: dict[str, int], max_entries: int = 1 << 20,
                 accepts_rank: Callable[[Any], bool] = lambda rank: rank == 0) -> None:
        if type(max_entries) is not int or max_entries < 1:
            raise ValueError(f"LoraNames: max_entries={max_entries!r} must be an integer >= 1")
        self._c = counters
        for name in COUNTERS:
            counters.setdefault(name, 0)
        self._max = max_entries
        self._accepts_rank = accepts_rank
        self._roots: dict[int, int | None] = {}  # wire hash of a first block -> task id
        self._roots_order = EvictionOrder()
        # Per dp rank: wire hash of a published (or withheld) adapter block -> task id, or
        # UNNAMED. Base-model blocks have no entry.
        self._blocks: dict[int, dict[int, int]] = {}
        self._orders: dict[int, EvictionOrder] = {}
        self.active = False  # an adapter was seen: events are annotated from now on
        self._log = RateLimitedLog(logger)

    def name_root(self, h: int, task_id: int | None) -> None:
        """The first block of a request has wire hash ``h`` and LoRA task ``task_id`` (None:
        the base model). The leader calls it for every request once its first block is full,
        before that block can be stored."""
        if self._roots_order.put(self._roots, h, task_id, self._max):
            self._c["lora_names_evicted"] += 1
        if task_id is not None:
            self.active = True

    def clear(self, rank: int) -> None:
        """The rank's pool was cleared: its blocks are gone."""
        self._blocks.pop(rank, None)
        self._orders.pop(rank, None)

    def annotate(self, events: Sequence[Mapping[str, Any]], default_rank: int) -> list[Any]:
        """``events`` with each adapter store's ``lora_id`` written in (a copy of the event),
        unnamed stores and their removals left out. Malformed events pass as they are (the
        sink's loops count them)."""
        out: list[Any] = []
        for ev in events:
            try:
                data = ev["data"]
                kind = data["type"]
                rank = ev.get("attention_dp_rank")
                if rank is None:
                    rank = default_rank
                elif rank != default_rank and not self._accepts_rank(rank):
                    out.append(ev)
                    continue
                if kind == "stored":
                    ev = self._stored(ev, data, rank)
                elif kind == "removed":
                    ev = self._removed(ev, data, rank)
            except (KeyError, TypeError, ValueError, AttributeError, WireFormatError):
                pass  # the loops report it
            if ev is not None:
                out.append(ev)
        return out

    def _rank_map(self, rank: Any) -> tuple[dict[int, int], EvictionOrder]:
        blocks = self._blocks.get(rank)
        if blocks is None:
            blocks = self._blocks[rank] = {}
            self._orders[rank] = EvictionOrder()
        return blocks, self._orders[rank]

    def _record(self, rank: Any, hashes: list[int], task_id: int) -> None:
        blocks, order = self._rank_map(rank)
        for h in hashes:
            if order.put(blocks, h, task_id, self._max):
                self._c["lora_names_evicted"] += 1

    def _stored(self, ev: Mapping[str, Any], data: Mapping[str, Any], rank: Any) -> Any:
        blocks = data["blocks"]
        if not blocks:
            return ev
        event_lora = data.get("lora_id")
        named = event_lora is not None
        if not named:
            for b in blocks:
                if b.get("lora_id") is not None:
                    named = True
                    break
        if named:
            # The event names its adapter itself (a serializer that writes it): remembered for
            # the stores under these blocks that may not.
            for b in blocks:
                task = b.get("lora_id", event_lora)
                if type(task) is int:
                    self._record(rank, [_wire(b["block_hash"], "stored.blocks[].block_hash")],
                                 task)
            return ev
        parent = data.get("parent_hash")
        if parent is not None:
            known = self._blocks.get(rank)
            if not known:
                return ev  # no adapter block on this rank: a base-model parent
            task: Any = known.get(_wire(parent, "stored.parent_hash"))
        else:
            task = self._roots.get(_wire(blocks[0]["block_hash"], "stored.blocks[].block_hash"),
                                   _MISSING)
        if task is None:
            return ev  # the base model's (absent parent: a base-model block)
        hashes = [_wire(b["block_hash"], "stored.blocks[].block_hash") for b in blocks]
        if task is _MISSING or task == UNNAMED:
            self._record(rank, hashes, UNNAMED)
            c = self._c
            c["lora_unnamed_blocks"] += len(hashes)
            self._log.log(logging.WARNING, "lora-unnamed", "KvEventSink: stored block(s) %s "
                          "of an unknown LoRA adapter or the base model (TensorRT-LLM's events "
                          "name none, and the leader named no request's first block %d) not "
                          "published (lora_unnamed_blocks=%d)", hashes[:4],
                          hashes[0] if parent is None else _wire(parent, "parent"),
                          c["lora_unnamed_blocks"])
            return None
        self._record(rank, hashes, task)
        self._c["lora_named_blocks"] += len(hashes)
        return {**ev, "data": {**data, "lora_id": task}}

    def _removed(self, ev: Mapping[str, Any], data: Mapping[str, Any], rank: Any) -> Any:
        blocks = self._blocks.get(rank)
        if not blocks:
            return ev
        raw = data["block_hashes"]
        kept: list[Any] = []
        for value in raw:
            if blocks.pop(_wire(value, "removed.block_hashes[]"), None) != UNNAMED:
                kept.append(value)
        if len(kept) == len(raw):
            return ev
        self._c["lora_unnamed_removes"] += len(raw) - len(kept)
        return {**ev, "data": {**data, "block_hashes": kept}} if kept else None

"""The event sink's KVCacheManagerV2 block hooks: what V2's radix tree and storage manager
call on their event manager when a block is stored or removed, turned into the sink's own
stores and removals.

:class:`V2Hooks` is built by :class:`kvbm_plugin.event_sink.KvEventSink` for its own dp rank,
which sets these methods (or, with the compiled batch, that batch's ``v2_store`` /
``v2_remove``, which hand any call they do not take to these) on itself under V2's names: the
sink stands where V2's ``KVCacheEventManager`` stands, or receives a copy of its calls
(``events/source.py``). The rest of V2's interface (windows, flush, discard, counters) is the
sink's own. Called on TensorRT-LLM's executor thread; no torch or TensorRT-LLM import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvbm_plugin.events.fields import (
    REMOVED,
    STORED,
    block_extra_keys,
    parse_lora_id,
)
from kvbm_plugin.events.rank import Rank
from kvbm_plugin.events.rank_writer import RankWriter
from kvbm_plugin.naming.names import parse_hash, radix_key_hash
from kvbm_plugin.wire.events import MEDIUM_GPU

# V2's block hooks, the names the sink takes these methods under.
BLOCK_HOOKS = ("add_stored_block_event_from_block", "add_stored_life_cycle_event_from_block",
               "add_stored_event", "add_removed_event", "add_removed_life_cycle_event")


class V2Hooks:
    """One dp rank's V2 block hooks: the rank's batch (``rank``), the sink's counters
    (``counters``), the sink's :class:`~kvbm_plugin.events.rank_writer.RankWriter` (how stores
    and removals enter the batch, shared with the dict input) and ``malformed`` (count, log, or
    raise when strict). Owns the routing layer groups (:meth:`route`, set by the sink's window
    hooks).

    The hooks take no lock (the per-block cost budget is ~1 us): TRT-LLM calls them and the
    leader calls the sink's ``flush`` on the same (executor) thread. Only the sink's ``ingest``
    may run on another thread (the buffered-path tee), and it does not reach here."""

    def __init__(self, rank: Rank, counters: dict[str, int], writer: RankWriter, *,
                 malformed: Callable[[BaseException, Any], None]) -> None:
        self._rank = rank
        self._c = counters
        self.block_size = writer.block_size
        self._store = writer.store
        self._remove = writer.remove
        self._suppress = writer.suppress
        self._malformed = malformed
        # The layer groups published (None = not known: publish every group).
        self.routing_groups: frozenset[int] | None = None

    def route(self, groups: frozenset[int] | None) -> None:
        """Publish only ``groups`` (None: every group); the sink's window hooks, under its
        lock. The compiled batch's hooks take calls only while every group is published (these
        filter by group)."""
        self.routing_groups = groups
        if hasattr(self._rank, "fast_hooks"):
            self._rank.fast_hooks = groups is None

    def add_stored_block_event_from_block(self, block: Any) -> None:
        """V2 hook: one radix block became reusable (``.key``, ``.tokens``, ``.prev``).

        Executor thread, once per block. Published when full and held by a routing layer group
        (per ``block.storage`` when the window map is known); coalesced with its parent when
        that was the previous event. Like every V2 hook it takes no lock: TRT-LLM calls the
        hooks and the leader calls ``flush`` on the same (executor) thread.
        """
        try:
            groups = self.routing_groups
            if groups is not None and not self._held_by(block, groups):
                rs = self._rank
                self._suppress(rs, radix_key_hash(block.key))
                self._c["window_filtered"] += 1
                return
            self._v2_store(block)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            self._malformed(exc, block)

    def add_stored_life_cycle_event_from_block(self, block: Any, life_cycle_id: int) -> None:
        """V2 hook: a block gained a page in layer group ``life_cycle_id``."""
        try:
            groups = self.routing_groups
            if groups is not None and int(life_cycle_id) not in groups:
                self._c["window_filtered"] += 1
                return
            self._v2_store(block)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            self._malformed(exc, block)

    @staticmethod
    def _held_by(block: Any, groups: frozenset[int]) -> bool:
        storage = getattr(block, "storage", None)
        if storage is None:
            return True  # no per-group information: do not guess a filter
        n = len(storage)
        for g in groups:
            if g < n:
                ref = storage[g]
                if ref is not None and ref() is not None:
                    return True
        return False

    def _v2_store(self, block: Any) -> None:
        rs = self._rank
        k = block.key
        live_keys = rs.live_keys
        if k in live_keys:
            return  # already published (another layer group of the same block)
        h = int.from_bytes(k[:8], "big", signed=True) if len(k) >= 8 else radix_key_hash(k)
        tokens = block.tokens
        if len(tokens) != self.block_size:
            self._suppress(rs, h)
            self._c["partial_blocks_suppressed"] += 1
            return
        prev = block.prev
        if getattr(prev, "ordinal", -1) == -1:
            parent = None
        else:
            pk = prev.key
            parent = live_keys.get(pk)
            if parent is None:
                parent = radix_key_hash(pk)
        if rs.suppressed:
            rs.suppressed.pop(h, None)
        live_keys[k] = h
        rs.live[h] = k
        c = self._c
        c["blocks_stored"] += 1
        last = rs.last
        if (last is not None and parent is not None and last["type"] == STORED
                and last["block_hashes"][-1] == parent and last["lora_id"] is None):
            last["block_hashes"].append(h)
            last["token_ids"].extend(tokens)
            return
        c["stores"] += 1
        last = rs.last = {"type": STORED, "block_hashes": [h], "parent_block_hash": parent,
                          "token_ids": list(tokens), "block_size": self.block_size,
                          "lora_id": None, "medium": MEDIUM_GPU, "lora_name": None}
        rs.events.append(last)

    def add_stored_event(self, parent_hash: Any, blocks: Sequence[Any],
                         layer_group_id: int | None = None) -> None:
        """V2 hook: stored blocks as ``KVCacheStoredBlockData`` (``.block_hash``, ``.tokens``,
        and ``.lora_id``, the C++ ``loraId``: a LoRA task id goes out as the block's
        ``lora_name``, task 0 included)."""
        try:
            groups = self.routing_groups
            if groups is not None and layer_group_id is not None and \
                    int(layer_group_id) not in groups:
                self._c["window_filtered"] += len(blocks)
                return
            rs = self._rank
            parent = None if parent_hash is None else parse_hash(parent_hash, "parent_hash")
            hashes: list[int] = []
            tokens: list[Any] = []
            extras: list[Any] = []  # per-block mm_keys / cache_salt (KVCacheStoredBlockData)
            loras: list[int | None] = []
            for i, b in enumerate(blocks):
                h = parse_hash(b.block_hash, "block_hash")
                btok = b.tokens
                if len(btok) != self.block_size:
                    for later in blocks[i:]:
                        self._suppress(rs, parse_hash(later.block_hash, "block_hash"))
                    self._c["partial_blocks_suppressed"] += len(blocks) - i
                    break
                hashes.append(h)
                tokens.extend(t.token_id if hasattr(t, "token_id") else t for t in btok)
                extras.append(block_extra_keys(b))
                loras.append(parse_lora_id(getattr(b, "lora_id", None)))
            if hashes:
                for h in hashes:
                    rs.suppressed.pop(h, None)
                    rs.live.setdefault(h, None)
                bs = self.block_size
                start = 0  # one store per run of one adapter; the chain goes on across runs
                for end in range(1, len(hashes) + 1):
                    if end == len(hashes) or loras[end] != loras[start]:
                        self._store(rs, hashes[start:end], parent, tokens[start * bs:end * bs],
                                    loras[start], extras[start:end], closed=False)
                        parent = hashes[end - 1]
                        start = end
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            self._malformed(exc, blocks)

    def add_removed_event(self, block_hashes: Any) -> None:
        """V2 hook: blocks left the pool (bytes key, hex key, int, or an iterable of them)."""
        try:
            rs = self._rank
            if type(block_hashes) is bytes:
                # Fast path: one radix key that we published.
                h = rs.live_keys.pop(block_hashes, None)
                if h is not None:
                    rs.live.pop(h, None)
                    c = self._c
                    c["blocks_removed"] += 1
                    last = rs.last
                    if last is not None and last["type"] == REMOVED:
                        last["block_hashes"].append(h)
                    else:
                        c["removes"] += 1
                        last = rs.last = {"type": REMOVED, "block_hashes": [h],
                                          "medium": MEDIUM_GPU}
                        rs.events.append(last)
                    return
                block_hashes = (block_hashes,)
            elif isinstance(block_hashes, (bytes, bytearray, memoryview, str, int)):
                block_hashes = (block_hashes,)
            hashes = [parse_hash(item, "removed block hash") for item in block_hashes]
            self._remove(rs, hashes, track_live=True)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            self._malformed(exc, block_hashes)

    def add_removed_life_cycle_event(self, block_hash: Any, life_cycle_id: int) -> None:
        """V2 hook: a block lost its page in one layer group."""
        try:
            groups = self.routing_groups
            if groups is not None and int(life_cycle_id) not in groups:
                self._c["window_removes_filtered"] += 1
                return
            h = parse_hash(block_hash, "removed block hash")
            self._remove(self._rank, (h,), track_live=True)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            self._malformed(exc, block_hash)


__all__ = ["BLOCK_HOOKS", "V2Hooks"]

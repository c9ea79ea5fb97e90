"""The event sink's KVCacheManagerV2 hooks: V2's ``KVCacheEventManager`` interface.

:class:`V2Hooks` is a base of :class:`kvbm_plugin.event_sink.KvEventSink`: the methods V2's
radix tree and storage manager call on their event manager, turned into the sink's own stores
and removals. Called on TensorRT-LLM's executor thread; no torch or TensorRT-LLM import.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvbm_plugin.events.fields import (
    REMOVED,
    STORED,
    block_extra_keys,
    parse_lora_id,
)
from kvbm_plugin.naming.names import parse_hash, radix_key_hash
from kvbm_plugin.wire.events import MEDIUM_GPU, event_count


class V2Hooks:
    """Mixin of :class:`~kvbm_plugin.event_sink.KvEventSink`; it relies on the sink's state
    (``_lock``, ``_ranks``, ``_c``, ``_log``, ``_store``/``_remove``, ...)."""

    # ---- KVCacheManagerV2 event-sink hooks (duck typed) -------------------------------------
    # Called by V2's radix tree / storage manager on the executor thread (directly, when the
    # sink stands in for V2's KVCacheEventManager, or through attach_event_source's tee). They
    # take no lock (the per-block cost budget is ~1 us): hooks and flush share the executor
    # thread. Only ``ingest`` may run on another thread (the buffered-path tee).

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
                self._routing_groups = None
                self._routing_changed()
                return
            target = self._configured_window
            if target is None or target not in sizes.values():
                if target is not None:
                    self._log.log(logging.ERROR, "window-missing", "KvEventSink: configured "
                                  "window_size %d is none of the layer-group windows %s; "
                                  "publishing the largest", target, sorted(set(sizes.values())))
                target = max(sizes.values())
            self._window = target
            self._routing_groups = frozenset(g for g, w in sizes.items() if w == target)
            self._routing_changed()

    def set_routing_layer_group(self, layer_group_id: int) -> None:
        """V2 hook: publish exactly this layer group."""
        with self._lock:
            self._routing_groups = frozenset((int(layer_group_id),))
            self._routing_changed()

    def _routing_changed(self) -> None:
        """The compiled V2 hooks take calls only while every layer group is published (the
        Python hooks filter by group)."""
        if self._native is not None:
            self._ranks[self.data_parallel_rank].fast_hooks = self._routing_groups is None

    def add_created_event(self, num_blocks_per_cache_level: Sequence[int],
                          layer_group_ids: Sequence[int] | None = None) -> None:
        """V2 hook: pool created; counted (the wire format has no such event)."""
        self._c["created_events"] += 1

    def add_stored_block_event_from_block(self, block: Any) -> None:
        """V2 hook: one radix block became reusable (``.key``, ``.tokens``, ``.prev``).

        Executor thread, once per block. Published when full and held by a routing layer group
        (per ``block.storage`` when the window map is known); coalesced with its parent when
        that was the previous event. Like every V2 hook it takes no lock: TRT-LLM calls the
        hooks and the leader calls ``flush`` on the same (executor) thread.
        """
        try:
            groups = self._routing_groups
            if groups is not None and not self._held_by(block, groups):
                rs = self._ranks[self.data_parallel_rank]
                self._suppress(rs, radix_key_hash(block.key))
                self._c["window_filtered"] += 1
                return
            self._v2_store(block)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            self._malformed(exc, block)

    def add_stored_life_cycle_event_from_block(self, block: Any, life_cycle_id: int) -> None:
        """V2 hook: a block gained a page in layer group ``life_cycle_id``."""
        try:
            groups = self._routing_groups
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
        rs = self._ranks[self.data_parallel_rank]
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
            groups = self._routing_groups
            if groups is not None and layer_group_id is not None and \
                    int(layer_group_id) not in groups:
                self._c["window_filtered"] += len(blocks)
                return
            rs = self._ranks[self.data_parallel_rank]
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
            rs = self._ranks[self.data_parallel_rank]
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
            groups = self._routing_groups
            if groups is not None and int(life_cycle_id) not in groups:
                self._c["window_removes_filtered"] += 1
                return
            h = parse_hash(block_hash, "removed block hash")
            self._remove(self._ranks[self.data_parallel_rank], (h,), track_live=True)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            self._malformed(exc, block_hash)

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

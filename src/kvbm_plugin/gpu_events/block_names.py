"""TensorRT-LLM's own name (hash) of each block, learned from the GPU-tier events.

Where ``RequestData.block_hashes`` is absent (released versions up to 1.2.x, and every
KVCacheManagerV2), the connector is never told which hash TensorRT-LLM gives a block. Its GPU-tier
events name each stored block with its parent's hash and its tokens, though, and a request's
blocks form the same chain. :class:`BlockNames` remembers ``(parent hash, tokens, LoRA task id)
-> hash`` from
the events the leader publishes (the task id as the event sink names it,
:mod:`kvbm_plugin.gpu_events.lora_names`: two adapters' first blocks with the same tokens are
two entries), walks a request's chain through it, and lets the leader name its
host/disk copies by TensorRT-LLM's hash, so a router sees one name per block across media. Both
tables are bounded; at the bound the oldest entry is forgotten in O(1) (see
:mod:`kvbm_plugin.gpu_events.bounded`).

Called by the leader on the executor thread only (the event sink's ``on_flush`` runs where the
leader flushes). Pure Python, bounded memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvbm_plugin.gpu_events.bounded import EvictionOrder
from kvbm_plugin.wire.events import to_unsigned_u64

AMBIGUOUS = -1  # one (parent, tokens) seen under two hashes (e.g. salts the events hide)


class BlockNames:
    """``(parent hash, tokens, LoRA task id) -> hash`` from stored GPU events, and content key
    -> hash."""

    def __init__(self, block_size: int, max_entries: int = 1 << 20) -> None:
        self._block_size = block_size
        self._max = max_entries
        self._by_content: dict[tuple[int | None, tuple[int, ...], int | None], int] = {}
        self._by_key: dict[int, int] = {}  # the plugin's content key -> TRT-LLM's hash
        # Insertion order of each table (entries leave only by eviction, so it is exact).
        self._content_order = EvictionOrder()
        self._key_order = EvictionOrder()

    def __bool__(self) -> bool:
        return bool(self._by_content)

    def observe(self, rank: int, events: Sequence[dict[str, Any]]) -> None:
        """``KvEventSink.on_flush``: remember each stored block's hash (u64). O(blocks)."""
        known = self._by_content
        order = self._content_order
        cap = self._max
        for ev in events:
            if ev.get("type") != "BlockStored" or not ev.get("token_ids"):
                continue
            bs = ev["block_size"]
            tokens = ev["token_ids"]
            parent = ev["parent_block_hash"]
            parent = None if parent is None else to_unsigned_u64(parent)
            lora = ev.get("lora_id")
            for j, h in enumerate(ev["block_hashes"]):
                h = to_unsigned_u64(h)
                k = (parent, tuple(tokens[j * bs:(j + 1) * bs]), lora)
                old = known.get(k)
                if old is None:
                    known[k] = h
                    order.added(known, k)
                    if len(known) > cap:
                        order.evict_oldest(known)  # the oldest first
                elif old != h:
                    known[k] = AMBIGUOUS
                parent = h

    def extend(self, tokens: Sequence[int], keys: Sequence[int], learned: list[int],
               lora: int | None = None) -> None:
        """Extend ``learned`` (TRT-LLM's hashes of a request's first blocks) along the
        request's full blocks as far as the events named them; each block's content key
        (``keys[i]``) is mapped to its hash for :meth:`rename`. ``lora``: the request's LoRA
        task id (None: the base model)."""
        bs = self._block_size
        known = self._by_content
        i = len(learned)
        while i < len(keys):
            h = known.get((learned[i - 1] if i else None, tuple(tokens[i * bs:(i + 1) * bs]),
                           lora))
            if h is None or h == AMBIGUOUS:
                return
            learned.append(h)
            by_key = self._by_key
            key = keys[i]
            if key not in by_key:
                by_key[key] = h
                self._key_order.added(by_key, key)
                if len(by_key) > self._max:
                    self._key_order.evict_oldest(by_key)
            else:
                by_key[key] = h  # keeps its place, as a dict does
            i += 1

    def hash_of_key(self, key: int) -> int | None:
        """TRT-LLM's hash of the block with content key ``key``, when learned."""
        return self._by_key.get(key)

    def hash_of_content(self, parent: int | None, tokens: Sequence[int],
                        lora: int | None = None) -> int | None:
        """TRT-LLM's hash of the block of ``tokens`` of LoRA task ``lora`` (None: the base
        model) under TRT-LLM's ``parent`` hash (None: a root block), when an event named it
        and nothing else was named so."""
        h = self._by_content.get((parent, tuple(tokens), lora))
        return None if h is None or h == AMBIGUOUS else h

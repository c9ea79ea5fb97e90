"""The simulated engine's GPU block pool: TensorRT-LLM's V1 block manager where it matters to
the connector (prefix reuse, leaf-first LRU eviction, the KV events it records).

Used by :class:`~kvbm_plugin.testing.engine.SimulatedEngine` on its executor thread only.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any


class GpuPool:
    """Block allocation with prefix reuse and leaf-first LRU eviction; records TRT-LLM KV events.

    Follows TensorRT-LLM's ``WindowBlockManager`` (cpp/tensorrt_llm/batch_manager/
    kvCacheManager.cpp and evictionPolicy.cpp, read at revision 002ba6a7cc5e):

    * Stored blocks form a radix tree (``parent_of``/``children``). ``storeBlocks`` walks the
      tree from the root along the sequence's block keys; a block whose key is already cached is
      traversed (not stored twice) and the first missing one and everything after it are
      inserted under the last match, in one ``stored`` event: a block is stored only under a
      cached parent.
    * A request that reuses a cached block only claims it (takes it out of the free queue); its
      cached children stay cached and nothing is emitted.
    * A sequence's blocks are released last block first, so within one release the leaf enters
      the LRU free queue before its parent, and the queue's front is a leaf.
    * ``getFreeBlock`` takes the queue's front and frees all its cached descendants first
      (``freeChildren``, post-order: children before parents), emitting a removal for each and
      then for the block itself; consecutive removals coalesce into one ``removed`` event.
    The GPU-tier stream is therefore prefix-closed: a parent is never removed while a
    descendant stays stored.
    """

    def __init__(self, num_blocks: int, block_size: int, window: int) -> None:
        self.block_size = block_size
        self.window = window
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.cached: OrderedDict[int, None] = OrderedDict()  # refcount 0, reusable, LRU first
        self.refs: dict[int, int] = {}
        self.by_hash: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}
        self.parent_of: dict[int, int | None] = {}
        self.children: dict[int, set[int]] = {}  # stored block -> its stored children
        self.full: set[int] = set()  # blocks stored with a full block of tokens
        # Hashes of full blocks as the events taken so far describe the pool: what a reader of
        # TensorRT-LLM's readable queue can know (see take_events).
        self.readable_full: set[int] = set()
        self.events: list[dict[str, Any]] = []
        self._event_id = itertools.count()
        self._emit({"type": "created", "num_blocks_per_cache_level": [num_blocks, 0]})

    def _emit(self, data: dict[str, Any]) -> None:
        self.events.append({"event_id": next(self._event_id), "window_size": self.window,
                            "data": data})

    def take_events(self) -> list[dict[str, Any]]:
        """The events recorded since the last take (already serialized to dicts), for the
        manager's ``flush_iteration_events`` (executor thread): from then on they are readable,
        and :attr:`readable_full` follows them.

        Blocks stored after a pass's flush (upstream: the release STORE of a request that
        ``get_finished`` terminates, after ``_add_kv_cache_events``) stay out of
        :attr:`readable_full` until the next pass's flush: while TensorRT-LLM's loop waits for
        a request, no reader can know them (docs/event_sources.md)."""
        out, self.events = self.events, []
        bs, readable = self.block_size, self.readable_full
        for event in out:
            data = event["data"]
            if data["type"] == "stored":
                readable.update(b["block_hash"] for b in data["blocks"]
                                if len(b["tokens"]) == bs)
            elif data["type"] == "removed":
                readable.difference_update(data["block_hashes"])
        return out

    def match(self, hashes: list[int]) -> list[int]:
        out = []
        for h in hashes:
            b = self.by_hash.get(h)
            if b is None or b not in self.full:
                break
            out.append(b)
        return out

    def available(self) -> int:
        return len(self.free) + len(self.cached)

    def acquire(self, block: int) -> None:
        """Claim a cached block for reuse (upstream ``claimBlock``): children stay cached."""
        self.refs[block] = self.refs.get(block, 0) + 1
        self.cached.pop(block, None)

    def alloc(self) -> int:
        if not self.free:
            victim = next(iter(self.cached))  # LRU front; a leaf unless children are in use
            self._free_subtree(victim)
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def _free_subtree(self, root: int) -> None:
        """Upstream ``freeChildren``: unstore ``root`` and its descendants, children first,
        in one coalesced ``removed`` event. Unused blocks return to the free list; a block
        still in use (a request holds it) stays allocated as a private, unstored block."""
        order: list[int] = []
        stack = [(root, False)]
        while stack:
            block, expanded = stack.pop()
            if expanded:
                order.append(block)
                continue
            stack.append((block, True))
            stack.extend((child, False) for child in self.children.get(block, ()))
        removed: list[int] = []
        for block in order:
            removed.append(self.hash_of.pop(block))
            del self.by_hash[removed[-1]]
            parent = self.parent_of.pop(block, None)
            if parent is not None:
                siblings = self.children[parent]
                siblings.discard(block)
                if not siblings:
                    del self.children[parent]
            self.children.pop(block, None)
            self.full.discard(block)
            if block in self.cached:
                del self.cached[block]
                self.free.append(block)
        if self.events and self.events[-1]["data"]["type"] == "removed":
            self.events[-1]["data"]["block_hashes"].extend(removed)  # upstream coalescing
        else:
            self._emit({"type": "removed", "block_hashes": removed})

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            del self.refs[block]
            if block in self.hash_of:
                self.cached[block] = None
            else:
                self.free.append(block)

    def store_blocks(self, blocks: list[int], keys: list[tuple[int, list[int]]],
                     first: int = 0, cache_salt: str | None = None,
                     lora_task_id: int | None = None,
                     mm_keys: list[list[tuple[bytes, int]]] | None = None) -> None:
        """Upstream ``storeBlocks`` for a sequence's blocks ``blocks[i]`` with block keys
        ``keys[i] = (hash, tokens)`` (the last may be partial), of which ``first..`` are new.

        The walk starts at the deepest ``first`` whose parent is still cached (usually
        ``first`` itself: the parent was stored in an earlier iteration); cached keys are
        traversed and the rest inserted under the last match, as one ``stored`` event. A
        salted block's event carries ``cache_salt`` per block, as newer TRT-LLM's do. A LoRA
        block's record carries its task id as ``lora_id``, as the C++ ``KVCacheStoredBlockData``
        does (``loraId``); TensorRT-LLM's serializer leaves it out of the dicts (see
        ``fake_trtllm.KVCacheEventSerializer``). ``mm_keys[i]``: block ``i``'s multimodal keys
        (digest, offset), written as the serializer writes ``MmKey`` (``mm_keys``: ``type``
        ``mm_key``, ``hash`` as hex, ``start_offset``).
        """
        n = min(len(blocks), len(keys))
        while first > 0 and keys[first - 1][0] not in self.by_hash:
            first -= 1  # the parent left the tree: it is stored again, from this sequence
        parent: int | None = self.by_hash[keys[first - 1][0]] if first else None
        first_parent = parent
        stored: list[dict[str, Any]] = []
        for i in range(first, n):
            h, tokens = keys[i]
            cached = self.by_hash.get(h)
            if cached is not None and not stored:
                parent = first_parent = cached  # traverse the cached prefix
                continue
            block = blocks[i]
            if cached is not None or block in self.hash_of:
                break  # cannot happen for one sequence's own chain; never store twice
            self.by_hash[h] = block
            self.hash_of[block] = h
            self.parent_of[block] = parent
            if parent is not None:
                self.children.setdefault(parent, set()).add(block)
            if len(tokens) == self.block_size:
                self.full.add(block)
            stored.append({
                "type": "stored_block", "block_hash": h,
                "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                           for t in tokens],
                "cache_level": 0, "priority": 35})
            if cache_salt is not None:
                stored[-1]["cache_salt"] = cache_salt
            if lora_task_id is not None:
                stored[-1]["lora_id"] = lora_task_id
            if mm_keys and i < len(mm_keys) and mm_keys[i]:
                stored[-1]["mm_keys"] = [{"type": "mm_key", "hash": digest.hex(),
                                          "start_offset": offset}
                                         for digest, offset in mm_keys[i]]
            parent = block
        if stored:
            self._emit({"type": "stored", "blocks": stored, "parent_hash":
                        None if first_parent is None else self.hash_of[first_parent]})

    def resident_full_hashes(self) -> set[int]:
        return {self.hash_of[b] for b in self.full}

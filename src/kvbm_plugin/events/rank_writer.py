"""How stores and removals enter a dp rank's batch: coalescing, prefix closure, cascades and
the suppressed (never published) hashes.

:class:`RankWriter` is built by :class:`kvbm_plugin.event_sink.KvEventSink` and shared by its
two inputs: the dict input's Python loop (under the sink's lock) and the V2 block hooks
(``events/v2_hooks.py``, executor thread). The compiled loops write the same events into the
compiled batch themselves (``_sink_c.c``, ``_rank_batch.c``) and call here only for what they
hand back. No torch or TensorRT-LLM import.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.events.fields import REMOVED, STORED
from kvbm_plugin.events.rank import Rank, add_child, children
from kvbm_plugin.wire.events import MEDIUM_GPU
from kvbm_plugin.wire.identity import lora_name


class RankWriter:
    """Appends stores and removals to a :class:`Rank`'s batch, counted in the sink's counters
    (``counters``, the dict :meth:`KvEventSink.stats` reports) and logged rate-limited (``log``).
    ``prefix_closed``: keep the buffered path's output prefix-closed (see ``Rank.published``);
    ``max_suppressed``: the unpublished hashes remembered per rank (oldest forgotten first)."""

    def __init__(self, counters: dict[str, int], log: RateLimitedLog, block_size: int, *,
                 prefix_closed: bool, max_suppressed: int) -> None:
        self._c = counters
        self._log = log
        self.block_size = block_size
        self._prefix_closed = prefix_closed
        self._max_suppressed = max_suppressed

    def store(self, rs: Rank, hashes: list[int], parent: int | None, tokens: list[Any],
               lora_id: Any = None, extras: list[Any] | None = None, *,
               closed: bool = True) -> None:
        """Append a stored chain to the batch. ``closed`` (the buffered path): keep the stream
        prefix-closed. A chain whose parent is not published is dropped (TensorRT-LLM stores
        a block only under a cached parent, so its parent's store was lost and will not come
        again: holding it back would wait for ever); a block already published is dropped and
        the chain goes on under it."""
        if closed and self._prefix_closed:
            published = rs.published
            c = self._c
            if parent is not None and parent not in published:
                c["orphan_stores_dropped"] += len(hashes)
                self._log.log(logging.WARNING, "orphan", "KvEventSink: stored block(s) %s "
                              "under parent %d, which is not published (events lost?); not "
                              "published (%d so far)", hashes[:4], parent,
                              c["orphan_stores_dropped"])
                return
            bs = self.block_size
            start = 0
            seen: set[int] = set()
            for i, h in enumerate(hashes):
                if h in published or h in seen:
                    c["duplicate_stores_dropped"] += 1
                    if i > start:
                        self.store(rs, hashes[start:i], parent, tokens[start * bs:i * bs],
                                    lora_id, None if extras is None else extras[start:i])
                    parent, start = h, i + 1
                seen.add(h)
            if start:
                if start < len(hashes):
                    self.store(rs, hashes[start:], parent, tokens[start * bs:], lora_id,
                                None if extras is None else extras[start:])
                return
            kids = rs.kids
            p = parent
            for h in hashes:
                published[h] = p
                if p is not None:
                    add_child(kids, p, h)
                p = h
        c = self._c
        c["blocks_stored"] += len(hashes)
        if extras is not None and any(e is not None for e in extras):
            # Blocks with extra keys (multimodal, cache salt) keep them on the wire, one entry
            # per block; such an event is never extended (neither loop appends a key list).
            c["stores"] += 1
            rs.events.append({"type": STORED, "block_hashes": hashes,
                              "parent_block_hash": parent, "token_ids": tokens,
                              "block_size": self.block_size, "lora_id": lora_id,
                              "medium": MEDIUM_GPU, "lora_name": lora_name(lora_id),
                              "extra_keys": extras})
            rs.last = None
            return
        last = rs.last
        if (last is not None and last["type"] == STORED and parent is not None
                and last["block_hashes"][-1] == parent and last["lora_id"] == lora_id):
            last["block_hashes"].extend(hashes)
            last["token_ids"].extend(tokens)
            return
        c["stores"] += 1
        ev = {"type": STORED, "block_hashes": hashes, "parent_block_hash": parent,
              "token_ids": tokens, "block_size": self.block_size, "lora_id": lora_id,
              "medium": MEDIUM_GPU, "lora_name": lora_name(lora_id)}
        rs.events.append(ev)
        rs.last = ev

    def remove(self, rs: Rank, hashes: Iterable[int], *, track_live: bool) -> None:
        suppressed = rs.suppressed
        live = rs.live
        out: list[int] = []
        c = self._c
        for h in hashes:
            if suppressed and h in suppressed:
                del suppressed[h]
                c["partial_removes_suppressed"] += 1
                continue
            if track_live:
                if h not in live:
                    c["unknown_removes_suppressed"] += 1
                    continue
                k = live.pop(h)
                if k is not None:
                    rs.live_keys.pop(k, None)
            elif self._prefix_closed:
                published = rs.published
                if h not in published:
                    c["unknown_removes_suppressed"] += 1  # never published (or cascaded)
                    continue
                if h in rs.kids:
                    out.extend(self._cascade(rs, h))
                rs.unpublish(h)
            out.append(h)
        if not out:
            return
        c["blocks_removed"] += len(out)
        last = rs.last
        if last is not None and last["type"] == REMOVED:
            last["block_hashes"].extend(out)  # consecutive removals: one event, same order
            return
        c["removes"] += 1
        ev = {"type": REMOVED, "block_hashes": out, "medium": MEDIUM_GPU}
        rs.events.append(ev)
        rs.last = ev

    def _cascade(self, rs: Rank, h: int) -> list[int]:
        """Unpublish the published descendants of ``h`` (about to be removed), each after all
        of its own descendants (the reverse of a walk down from ``h``); their own later
        removals are then dropped as unknown. O(descendants): the walk follows ``kids`` down
        from ``h`` and touches no other block (only an engine that removes a parent before its
        children gets here; TensorRT-LLM frees descendants first). Iterative: a chain of any
        length."""
        published, kids = rs.published, rs.kids
        order: list[int] = []
        stack = list(children(kids, h))
        kids.pop(h, None)
        while stack:
            node = stack.pop()
            order.append(node)
            del published[node]
            below = kids.pop(node, None)
            if below is not None:
                if type(below) is set:
                    stack.extend(below)
                else:
                    stack.append(below)
        order.reverse()
        self._c["cascade_removes"] += len(order)
        return order

    def suppress(self, rs: Rank, h: int) -> None:
        if rs.suppress(h, self._max_suppressed):
            self._c["suppressed_evicted"] += 1


__all__ = ["RankWriter"]

"""TensorRT-LLM's own names of blocks, learned from its GPU-tier events.

A private part of :mod:`kvbm_plugin.naming.names` (import these from there).

Where ``RequestData.block_hashes`` is absent (released versions up to 1.2.x, and every
KVCacheManagerV2), the connector is never told which hash TensorRT-LLM gives a block. Its GPU-tier
events name each stored block with its parent's hash and its tokens, though, and a request's
blocks form the same chain. :class:`BlockNames` remembers ``(parent hash, tokens, LoRA task id)
-> hash`` from the events (the task id as the event sink names it, :class:`LoraNames
<kvbm_plugin.naming._lora.LoraNames>`: two adapters' first blocks with the same tokens are two
entries), walks a request's chain through it, and lets the leader name its host/disk copies by
TensorRT-LLM's hash, so a router sees one name per block across media. Both tables are
bounded; at the bound the oldest entry is forgotten in O(1) (``_util/bounded.py``).

The events come from three places, each calling :meth:`BlockNames.observe`:

* rank 0's event sink, as it publishes (``KvEventSink.on_flush``, set by the leader);
* TensorRT-LLM's own streaming publisher, as the consolidator's ingest thread received it
  (``events.trtllm_publisher.TrtllmNameFeed``, drained by the leader under its lock);
* under attention DP, a rank r > 0's own GPU-tier stream (:class:`StreamNames`): TensorRT-LLM
  gathers every rank's events onto rank 0 (``leader/event_path.py``), so rank r's leader never
  sees its rank's events in process, and rank 0's leader publishes them on rank r's endpoint.
  A batch sent before the subscription reached the publisher is not seen; only its blocks'
  names wait for a later confirmation.

Called by the leader under its lock (executor thread, or its idle keeper's thread; the sink's
``on_flush`` runs where the leader flushes). Pure Python, bounded memory; :class:`StreamNames`
reads without blocking and does O(events) work per poll.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

from kvbm_plugin._util.bounded import EvictionOrder
from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.wire.events import to_unsigned_u64

logger = logging.getLogger(__name__)

AMBIGUOUS = -1  # one (parent, tokens) seen under two hashes (e.g. salts the events hide)
# A key of the content table: (TRT-LLM's parent hash or None, the block's tokens, LoRA task id)
ContentKey = tuple[int | None, tuple[int, ...], int | None]
MAX_MESSAGES_PER_POLL = 256  # bounds one StreamNames.poll's work; the rest waits for the next


class BlockNames:
    """``(parent hash, tokens, LoRA task id) -> hash`` from stored GPU events, and content key
    -> hash."""

    def __init__(self, block_size: int, max_entries: int = 1 << 20) -> None:
        self._block_size = block_size
        self._max = max_entries
        self._by_content: dict[ContentKey, int] = {}
        self._by_key: dict[int, int] = {}  # the plugin's content key -> TRT-LLM's hash
        # Insertion order of each table (entries leave only by eviction, so it is exact).
        self._content_order = EvictionOrder()
        self._key_order = EvictionOrder()
        # Hashes the leader waits to see stored: computed V2 names -> (input rule, the
        # truncation the name was cut by). One seen confirms both: the rule (a salt or
        # adapter scope TensorRT-LLM derives as computed) and the truncation ("head"/"tail").
        # Bounded by the caller (BlockNaming.v2_extend).
        self.watch: dict[int, tuple[Any, str]] = {}
        self.seen_rules: set[Any] = set()
        self.seen_wires: set[str] = set()
        # What was named since the unnamed tier stores last looked, kept only while ``track``
        # (blocks wait; :meth:`tracking`): ``UnnamedStores.named_now`` takes both lists
        # (:meth:`take_fresh`) and looks only at the blocks these can name. The plugin's
        # content keys mapped, and the content-table keys added.
        self.track = False
        self.fresh_keys: list[int] = []
        self.fresh_contents: list[ContentKey] = []

    def __bool__(self) -> bool:
        return bool(self._by_content)

    def observe(self, rank: int, events: Sequence[dict[str, Any]]) -> None:
        """``KvEventSink.on_flush``: remember each stored block's hash (u64). O(blocks)."""
        known = self._by_content
        order = self._content_order
        cap = self._max
        fresh = self.fresh_contents if self.track else None
        for ev in events:
            if ev.get("type") != "BlockStored" or not ev.get("token_ids"):
                continue
            bs = ev["block_size"]
            tokens = ev["token_ids"]
            parent = ev["parent_block_hash"]
            parent = None if parent is None else to_unsigned_u64(parent)
            lora = ev.get("lora_id")
            watch = self.watch
            for j, h in enumerate(ev["block_hashes"]):
                h = to_unsigned_u64(h)
                if watch and h in watch:
                    rule, wire = watch.pop(h)
                    self.seen_rules.add(rule)
                    self.seen_wires.add(wire)
                k = (parent, tuple(tokens[j * bs:(j + 1) * bs]), lora)
                old = known.get(k)
                if old is None:
                    # EvictionOrder.put without its membership test: a tuple key's hash is
                    # not cached, and this runs once per stored block.
                    known[k] = h
                    order.added(known, k)
                    if len(known) > cap:
                        order.evict_oldest(known)  # the oldest first
                    if fresh is not None:
                        fresh.append(k)
                elif old != h:
                    known[k] = AMBIGUOUS
                parent = h

    def extend(self, tokens: Sequence[int], keys: Sequence[int], learned: list[int],
               lora: int | None = None, map_until: int = 1 << 62) -> None:
        """Extend ``learned`` (TRT-LLM's hashes of a request's first blocks) along the
        request's full blocks as far as the events named them; the content key of each block
        below ``map_until`` (``keys[i]``) is mapped to its hash for :meth:`hash_of_key` (the
        later ones' learned hashes only confirm or refute a computed rule: see
        ``names.NameInputs.learn_tokens``). ``lora``: the request's LoRA task id (None: the base
        model)."""
        bs = self._block_size
        known = self._by_content
        i = len(learned)
        while i < len(keys):
            h = known.get((learned[i - 1] if i else None, tuple(tokens[i * bs:(i + 1) * bs]),
                           lora))
            if h is None or h == AMBIGUOUS:
                return
            learned.append(h)
            if i < map_until:
                self._key_order.put(self._by_key, keys[i], h, self._max)
                if self.track:
                    self.fresh_keys.append(keys[i])
            i += 1

    def name_key(self, key: int, h: int) -> None:
        """Map the plugin's content key ``key`` to TRT-LLM's hash ``h`` (u64), computed
        rather than learned (``BlockNaming.v2_extend``)."""
        self._key_order.put(self._by_key, key, h, self._max)
        if self.track:
            self.fresh_keys.append(key)

    def tracking(self, on: bool) -> None:
        """Record what is named from now on (``on``: blocks wait for a name), or stop and
        forget what was recorded (none wait)."""
        self.track = on
        if not on:
            self.fresh_keys.clear()
            self.fresh_contents.clear()

    def take_fresh(self) -> tuple[list[int], list[ContentKey]]:
        """The content keys mapped and the content-table keys added since the last call (while
        tracking), each list handed over and started anew."""
        keys, contents = self.fresh_keys, self.fresh_contents
        self.fresh_keys, self.fresh_contents = [], []
        return keys, contents

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


class StreamNames:
    """A SUB on one attention-DP rank's GPU-tier stream, feeding ``names.observe`` (see the
    module docstring). Owned by the leader of rank r > 0; :meth:`poll` runs under its lock."""

    def __init__(self, endpoint: str, names: Any, hwm: int = 100000) -> None:
        self._names = names
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, hwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self.endpoint = endpoint
        self.batches = 0
        self.malformed = 0
        self._log = RateLimitedLog(logger)

    @classmethod
    def for_rank(cls, par: Any, config: Any, names: Any, events_source: str
                 ) -> StreamNames | None:
        """The reader for attention-DP rank ``par.dp_rank`` > 0 (None elsewhere, or where no
        GPU-tier stream is published: ``events_source`` off, no endpoint)."""
        if not par.attention_dp or par.dp_rank == 0 or events_source == "off" \
                or config.gpu_events is None:
            return None
        return cls(config.publish_endpoint(par.dp_rank).connect, names,
                   config.publisher.hwm)

    def poll(self) -> int:
        """Observe the batches that arrived (at most :data:`MAX_MESSAGES_PER_POLL`)."""
        n = 0
        while n < MAX_MESSAGES_PER_POLL:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            try:
                _ts, events, rank = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
                self._names.observe(int(rank), events)
                self.batches += 1
            except Exception as exc:  # a bad batch names nothing; the next ones still do
                self.malformed += 1
                self._log.log(logging.WARNING, "malformed", "kvbm_plugin: GPU-tier batch on "
                              "%s not usable for block names (%s: %s)", self.endpoint,
                              type(exc).__name__, exc)
        return n

    def close(self) -> None:
        self._sub.close()
        self._ctx.term()

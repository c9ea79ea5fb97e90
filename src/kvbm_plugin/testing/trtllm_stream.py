"""TensorRT-LLM's own streaming KV-event publisher, as a simulated engine's KV cache manager.

With ``kv_cache_config.kv_events_config`` enabled, TensorRT-LLM's KVCacheManagerV2 hands its
block events to ``StreamingKVCacheEventManager`` instead of the buffered queue: the pull API
(``get_latest_events``) returns ``[]`` and every rank that has an event manager publishes one
batch per iteration on its own ZMQ PUB socket. :class:`SimStreamingKVCacheManager` does that
for the simulated engine, sending the bytes upstream sends. Read in the stored upstream index
(NVIDIA/TensorRT-LLM):

* ``tensorrt_llm/_torch/pyexecutor/kv_cache_events.py`` (@ 44004b3864a7, PR #17023; stored ids
  68762347738 and 71400586074 @ 13599e98c71c): ``ZmqEventPublisher`` binds ``endpoint`` offset
  by rank (rank 0 as given, tcp port + r, ipc/inproc ``_dp{r}``), reserves a seq per batch from
  0, sends three frames ``[topic, seq as 8 bytes big-endian, payload]``, keeps the last
  ``buffer_steps`` payloads and answers a ROUTER replay request ``[client, b"", start_seq]``
  with every kept batch from ``start_seq`` and then ``[client, b"", b"", END_SEQ, b""]``;
  ``flush_iteration_events`` publishes nothing for an iteration without events; the batch's
  ``data_parallel_rank`` is the rank's.
* ``cpp/tensorrt_llm/batch_manager/kv_cache_manager_v2/streamingEventSink.cpp`` (@
  1454f28a18fa; stored ids 68391744805, 69004824793): only full blocks of the largest-window
  life cycle are stored (partial and multimodal blocks suppressed), a block is stored once, a
  removal is sent only for a block that was stored; a stored block whose parent is the last
  block of the previous pending BlockStored extends that event, consecutive removals share
  one event. The wire hash is the block's 32-byte radix key's first 8 bytes, big-endian, as
  a signed int64; a block under the root has ``parent_block_hash`` nil. The payload is
  msgpack ``[ts (float64), [events], dp_rank]`` with every integer written as int64 (0xd3);
  a BlockStored is the 8-key map ``type, block_hashes, parent_block_hash, token_ids,
  block_size, lora_id (nil), medium ("GPU"), lora_name (nil)``, a BlockRemoved the 3-key
  map ``type, block_hashes, medium``.

The simulated pool hashes blocks with TensorRT-LLM's V1 hash; this stand-in gives each block
the radix key KVCacheManagerV2 gives it (``naming.names.v2_block_key`` chained from the root
of the request's ``ReuseScope``: LoRA task id and ``v2_reuse_salt`` of its ``cache_salt``, as
the pool's stored-block records carry them), and truncates it as upstream does. With
:attr:`SimStreamingKVCacheManager.form` set, a batch goes out through that form's msgspec schema
(:func:`encode_form_batch`) instead of the C++ sink's bytes. Used by
:class:`~kvbm_plugin.testing.engine.SimulatedEngine` (executor thread:
:meth:`flush_iteration_events`; the publisher thread sends and answers replays).
"""

from __future__ import annotations

import hashlib
import queue
import struct
import threading
import time
from typing import Any

import zmq

from kvbm_plugin._util.bounded import EvictionOrder
from kvbm_plugin.events.trtllm_publisher import TrtllmPublisher, read_trtllm_publisher
from kvbm_plugin.naming.names import v2_block_key, v2_reuse_salt, v2_root_key
from kvbm_plugin.testing.kv_events import SimKVCacheManager

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def radix_key(v1_hash: int) -> bytes:
    """An arbitrary 32-byte key, opaque to the plugin (wire-format tests); the simulated
    publisher names blocks by their real V2 keys (see the module docstring)."""
    return hashlib.sha256(b"kvbm-sim-v2-radix-key" + (v1_hash & (2**64 - 1)).to_bytes(8, "big")
                          ).digest()


def wire_hash(key: bytes) -> int:
    """``StreamingEventSink::wireHash``: the key's first 8 bytes big-endian, as int64."""
    value = int.from_bytes(key[:8], "big")
    return value - 2**64 if value >= 2**63 else value


class _Writer:
    """``MessagePackWriter`` of streamingEventSink.cpp: the bytes upstream writes."""

    def __init__(self) -> None:
        self.out = bytearray()

    def array(self, n: int) -> None:
        if n <= 15:
            self.out.append(0x90 | n)
        elif n <= 0xFFFF:
            self.out += b"\xdc" + n.to_bytes(2, "big")
        else:
            self.out += b"\xdd" + n.to_bytes(4, "big")

    def map(self, n: int) -> None:
        self.out.append(0x80 | n)

    def string(self, text: str) -> None:
        data = text.encode()
        self.out += (bytes((0xA0 | len(data),)) if len(data) <= 31
                     else b"\xd9" + bytes((len(data),))) + data

    def int64(self, value: int) -> None:
        self.out += b"\xd3" + struct.pack(">q", value)

    def double(self, value: float) -> None:
        self.out += b"\xcb" + struct.pack(">d", value)

    def nil(self) -> None:
        self.out.append(0xC0)


def encode_batch(ts: float, events: list[dict[str, Any]], block_size: int,
                 dp_rank: int) -> bytes:
    """``serializeBatch``: msgpack ``[ts, events, dp_rank]`` as upstream's C++ writes it."""
    w = _Writer()
    w.array(3)
    w.double(ts)
    w.array(len(events))
    for event in events:
        if event["type"] == "BlockStored":
            w.map(8)
            w.string("type")
            w.string("BlockStored")
            w.string("block_hashes")
            w.array(len(event["block_hashes"]))
            for h in event["block_hashes"]:
                w.int64(h)
            w.string("parent_block_hash")
            if event["parent_block_hash"] is None:
                w.nil()
            else:
                w.int64(event["parent_block_hash"])
            w.string("token_ids")
            w.array(len(event["token_ids"]))
            for t in event["token_ids"]:
                w.int64(t)
            w.string("block_size")
            w.int64(block_size)
            for name, value in (("lora_id", None), ("medium", "GPU"), ("lora_name", None)):
                w.string(name)
                if value is None:
                    w.nil()
                else:
                    w.string(value)
        else:
            w.map(3)
            w.string("type")
            w.string("BlockRemoved")
            w.string("block_hashes")
            w.array(len(event["block_hashes"]))
            for h in event["block_hashes"]:
                w.int64(h)
            w.string("medium")
            w.string("GPU")
    w.int64(dp_rank)
    return bytes(w.out)


FORMS = ("44004b3864a7", "13599e98c71c", "kv-event-adapter")


def _form_structs(form: str) -> tuple[Any, Any, Any]:
    """msgspec structs with the wire schema of ``kv_cache_events.py``'s form ``form``, as read
    (see :func:`encode_form_batch`): (batch, BlockStored, MultimodalKey or None)."""
    import msgspec

    mm = form == "13599e98c71c"
    token = int | str if mm else int
    hash_type = bytes | int if form == "kv-event-adapter" else int
    opts = {"omit_defaults": True, "gc": False}

    class MultimodalKey(msgspec.Struct, tag="mm_key", **opts):  # type: ignore[call-arg]
        hash: str
        start_offset: int
        uuid: str | None = None

    class Event(msgspec.Struct, tag=True, **opts):  # type: ignore[call-arg]
        pass

    class BlockStored(Event):
        block_hashes: list[hash_type]  # type: ignore[valid-type]
        parent_block_hash: hash_type | None  # type: ignore[valid-type]
        token_ids: list[token]  # type: ignore[valid-type]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        if mm:
            mm_keys: list[list[MultimodalKey]] | None = None

    class BlockRemoved(Event):
        block_hashes: list[hash_type]  # type: ignore[valid-type]
        medium: str | None

    class Batch(msgspec.Struct, array_like=True, **opts):  # type: ignore[call-arg]
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    Batch.removed = BlockRemoved  # type: ignore[attr-defined]
    return Batch, BlockStored, MultimodalKey if mm else None


def encode_form_batch(form: str, ts: float, stored: list[dict[str, Any]],
                      dp_rank: int) -> bytes:
    """The payload ``kv_cache_events.py`` of form ``form`` writes for BlockStored events
    ``stored`` (dicts of its fields; ``mm_keys`` items as dicts), through msgspec's encoder as
    upstream's publisher thread does. Schemas as read in the stored index (NVIDIA/TensorRT-LLM
    ``tensorrt_llm/_torch/pyexecutor/kv_cache_events.py``): ``"44004b3864a7"`` (stored id
    57357230020: ``token_ids: list[int]``), ``"13599e98c71c"`` (stored id 71400586074:
    ``token_ids: list[int | str]``, ``mm_keys``), ``"kv-event-adapter"`` (stored id 58569138750:
    ``ExternalBlockHash = bytes | int``). Every form: map-tagged events (``tag=True``),
    ``omit_defaults``, the batch ``[ts, events, data_parallel_rank]`` as an array."""
    import msgspec

    batch_type, stored_type, mm_type = _form_structs(form)
    events = []
    for fields in stored:
        fields = dict(fields)
        if fields.pop("type", "BlockStored") == "BlockRemoved":
            events.append(batch_type.removed(**fields))
            continue
        if "mm_keys" in fields and fields["mm_keys"] is not None:
            fields["mm_keys"] = [[mm_type(**k) for k in block] for block in fields["mm_keys"]]
        events.append(stored_type(**fields))
    return msgspec.msgpack.encode(batch_type(ts=ts, events=events, data_parallel_rank=dp_rank))


class SimZmqEventPublisher:
    """Upstream's ``ZmqEventPublisher`` for one rank: a PUB (and optional replay ROUTER) bound
    at the rank's endpoint, fed by :meth:`publish` (never blocks), sent by its own thread."""

    def __init__(self, config: Any, trtllm_pub: TrtllmPublisher, rank: int,
                 context: zmq.Context | None = None) -> None:
        self.rank = rank
        self.endpoint = trtllm_pub.bind_endpoint(rank)
        self.replay_endpoint = trtllm_pub.bind_replay(rank)
        self._topic = trtllm_pub.topic.encode()
        self._buffer_steps = int(getattr(config, "buffer_steps", 10_000))
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(
            maxsize=int(getattr(config, "max_queue_size", 100_000)))
        self._buffer: list[tuple[int, bytes]] = []
        self._seq = 0
        self.published = 0
        self.dropped = 0
        ctx = context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(int(getattr(config, "hwm", 100_000)))
        self._replay: zmq.Socket | None = None
        try:
            self._pub.bind(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"sim-trtllm-kv-events-rank-{rank}")
        self._thread.start()

    def publish(self, payload: bytes) -> bool:
        seq, self._seq = self._seq, self._seq + 1  # reserved here: a loss leaves a gap
        try:
            self._queue.put_nowait((seq, payload))
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._service_replay()
                try:
                    item = self._queue.get(timeout=0.01)
                except queue.Empty:
                    continue
                if item is None:
                    return
                seq, payload = item
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                del self._buffer[:-self._buffer_steps]
                self.published += 1
        finally:
            self._close_sockets()

    def _service_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)


class SimStreamingKVCacheManager:
    """The simulated engine's KV cache manager with TensorRT-LLM's streaming events on.

    :meth:`flush_iteration_events` (executor thread, end of each pass, where upstream flushes)
    turns the pool's events of the pass into upstream's stream batch and publishes it (only
    with ``publisher="zmq"``; ``"null"`` sends nothing); :meth:`get_latest_events` is
    upstream's empty pull API.
    """

    def __init__(self, pool: Any, config: Any, trtllm_pub: TrtllmPublisher, *, rank: int = 0,
                 block_size: int) -> None:
        self.pool = pool
        self.rank = rank
        self.block_size = block_size
        self.trtllm_pub = trtllm_pub
        self.publisher = (SimZmqEventPublisher(config, trtllm_pub, rank) if trtllm_pub.streams
                          else None)
        self._stored: dict[int, int] = {}  # V1 hash -> wire hash of the blocks published
        self._keys: dict[int, bytes] = {}  # V1 hash -> V2 radix key of full blocks seen
        self._key_order = EvictionOrder()
        self.published_hashes: set[int] = set()  # every wire hash ever stored (tests)
        self.form: str | None = None  # one of FORMS: that form's msgspec bytes (tests)
        # Bytes per token id in a radix key: 8, or 4 on the revisions whose hasher matches
        # the C++ backend's 4-byte layout (naming._hashes.V2_TOKEN_WIDTHS; tests set it).
        self.key_width = 8
        self.batches = 0

    def get_latest_events(self, timeout_ms: float | None = 0) -> list[Any]:
        return []  # StreamingKVCacheEventManager.get_latest_events: pushed out of band

    def readable(self) -> int:
        return 0

    def flush_iteration_events(self) -> None:
        events = self.pool.take_events()
        pending: list[dict[str, Any]] = []
        for event in events:
            data = event["data"]
            if data["type"] == "stored":
                parent_v1 = data["parent_hash"]
                for block in data["blocks"]:
                    self._stored_block(block, parent_v1, pending)
                    parent_v1 = block["block_hash"]
            elif data["type"] == "removed":
                for v1 in data["block_hashes"]:
                    self._removed_block(v1, pending)
        if pending and self.publisher is not None:
            payload = encode_batch(time.time(), pending, self.block_size, self.rank) \
                if self.form is None else self._form_payload(pending)
            if self.publisher.publish(payload):
                self.batches += 1

    def _form_payload(self, pending: list[dict[str, Any]]) -> bytes:
        """``pending`` as form :attr:`form` writes it: 13599e9 names the adapter
        (``lora_id=event.lora_id``), 44004b3 never does."""
        events = []
        for event in pending:
            event = dict(event)
            lora = event.pop("lora", None)
            if event["type"] == "BlockStored":
                event.update(block_size=self.block_size, medium="GPU", lora_name=None,
                             lora_id=lora if self.form == "13599e98c71c" else None)
            else:
                event["medium"] = "GPU"
            events.append(event)
        return encode_form_batch(str(self.form), time.time(), events, self.rank)

    def _stored_block(self, block: dict[str, Any], parent_v1: int | None,
                      pending: list[dict[str, Any]]) -> None:
        tokens = [t["token_id"] for t in block["tokens"]]
        v1 = block["block_hash"]
        if len(tokens) < self.block_size or v1 in self._stored:
            return  # a partial block is suppressed; a block is stored once
        salt = block.get("cache_salt")
        parent_key = None if parent_v1 is None else self._keys.get(parent_v1)
        if parent_key is None:
            parent_key = v2_root_key(block.get("lora_id"),
                                     None if salt is None else v2_reuse_salt(salt))
        key = v2_block_key(parent_key, tokens, self.key_width)
        self._key_order.put(self._keys, v1, key, 1 << 20)
        h = wire_hash(key)
        parent = None if parent_v1 is None else wire_hash(parent_key)
        self._stored[v1] = h
        self.published_hashes.add(h)
        last = pending[-1] if pending else None
        if (last is not None and last["type"] == "BlockStored" and parent is not None
                and last["block_hashes"][-1] == parent):
            last["block_hashes"].append(h)
            last["token_ids"].extend(tokens)
            return
        pending.append({"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
                        "token_ids": tokens, "lora": block.get("lora_id")})

    def _removed_block(self, v1: int, pending: list[dict[str, Any]]) -> None:
        h = self._stored.pop(v1, None)
        if h is None:
            return  # never published (partial): no removal either
        if pending and pending[-1]["type"] == "BlockRemoved":
            pending[-1]["block_hashes"].append(h)
        else:
            pending.append({"type": "BlockRemoved", "block_hashes": [h]})

    def resident_wire_hashes(self) -> set[int]:
        """The wire hashes of the blocks this publisher stored and has not removed."""
        return set(self._stored.values())

    def shutdown(self, timeout: float = 5.0) -> None:
        if self.publisher is not None:
            self.publisher.shutdown(timeout)


def kv_cache_manager_for(pool: Any, kv_cache_config: Any, *, event_buffer_max_size: int,
                         dp_rank: int, dp_size: int, block_size: int
                         ) -> SimKVCacheManager | SimStreamingKVCacheManager:
    """The simulated engine's KV cache manager, built as ``create_py_executor`` builds it: after
    the connector, from the ``kv_cache_config`` the connector was handed (which the leader may
    have changed: ``leader.dynamo_streaming``). The buffered one, or TensorRT-LLM's
    streaming one where ``kv_events_config`` is on. Called by the engine's constructor."""
    config = kv_cache_config.kv_events_config
    trtllm_pub = read_trtllm_publisher({"kv_cache_config": {"kv_events_config": config}})
    adp = dp_size > 1
    if trtllm_pub is None:
        return SimKVCacheManager(pool, event_buffer_max_size,
                                 attention_dp_rank=dp_rank if adp else None,
                                 attention_dp_size=dp_size)
    return SimStreamingKVCacheManager(pool, config, trtllm_pub, block_size=block_size,
                                      rank=dp_rank if adp else 0)

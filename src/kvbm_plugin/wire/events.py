"""KV-cache events in the vLLM wire format, and the codec both streams share.

A message is three ZMQ frames ``[topic, seq, payload]``: ``seq`` is an unsigned 64-bit
big-endian batch counter, ``payload`` a msgpack array ``[ts, events, data_parallel_rank]``; each
event a msgpack map tagged ``"type"``. Block hashes are signed int64 on the wire.

Encoding is strict (what we publish must satisfy Dynamo's and vLLM's decoders); decoding is
tolerant (maps or legacy positional arrays, signed or unsigned hashes, 2 or 3 frames, medium
aliases) and raises :class:`WireFormatError` with the offending value for anything else.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack

from kvbm_plugin._util.saferepr import saferepr
from kvbm_plugin.wire.identity import lora_name

try:  # msgspec is the faster encoder (~4x on a 128-event batch) and writes identical bytes
    import msgspec as _msgspec
except ImportError:  # pragma: no cover - msgspec is a declared dependency
    _msgspec = None

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
# The shared tier (a store every engine reads): NVIDIA Dynamo's KV indexer (ai-dynamo-runtime
# 1.6.1, the interop extra) holds an EXTERNAL block in its external storage tier (``/dump``'s
# ``storage_tier`` "external") as a continuation of the advertising worker's prefix, and removes
# it on a BlockRemoved of that medium (tests/interop/test_dynamo_external.py); NETWORK, REMOTE
# and SHARED are the other names routers give that tier.
MEDIUM_EXTERNAL = "EXTERNAL"
MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_EXTERNAL)

_MEDIUM_ALIASES = {
    "GPU": MEDIUM_GPU, "DEVICE": MEDIUM_GPU,
    "CPU": MEDIUM_CPU, "CPU_PINNED": MEDIUM_CPU, "CPU_TIER1": MEDIUM_CPU,
    "DISK": MEDIUM_DISK, "CPU_TIER2": MEDIUM_DISK, "STORAGE": MEDIUM_DISK, "NVME": MEDIUM_DISK,
    "EXTERNAL": MEDIUM_EXTERNAL, "NETWORK": MEDIUM_EXTERNAL, "REMOTE": MEDIUM_EXTERNAL,
    "SHARED": MEDIUM_EXTERNAL,
}

# Data-parallel ranks a stream may name: 0 .. MAX_DP_RANKS - 1 (or the configured count, when
# larger). Every rank seen gets its own state in the event sink and the consolidator; a bound
# keeps a stream of bogus ranks from growing that state without limit. Attention-DP sizes are
# far below it.
MAX_DP_RANKS = 1024
# Token ids are u32 on the wire (the router hashes them as u32 little-endian).
U32_MAX = (1 << 32) - 1

# Replay reply terminator (vLLM): seq frame of -1 as signed 64-bit big-endian.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1
_SEQ = struct.Struct(">Q")


class WireFormatError(ValueError):
    """A message or event that is not in the wire format; the message names the value."""


def to_signed_int64(value: int, what: str = "block hash") -> int:
    """Two's-complement reinterpretation of a u64 hash as int64 (signed input passes through).

    ``what`` names the field in the error for a value outside both ranges.
    """
    if value > _I64_MAX:
        if value >= _U64:
            raise WireFormatError(f"{what}={value} exceeds 64 bits")
        return value - _U64
    if value < -(1 << 63):
        raise WireFormatError(f"{what}={value} is below the int64 range")
    return value


def to_unsigned_u64(value: int) -> int:
    """The u64 form of a hash given signed or unsigned (the consolidator keys on this)."""
    if value < 0:
        if value < -(1 << 63):
            raise WireFormatError(f"block hash {value} is below the int64 range")
        return value + _U64
    if value >= _U64:
        raise WireFormatError(f"block hash {value} exceeds 64 bits")
    return value


def normalize_medium(value: Any) -> str:
    """Canonical medium (GPU/CPU/DISK/EXTERNAL) for a case-insensitive name or alias."""
    if type(value) is str:  # the common case, a canonical name (every tier registration)
        medium = _MEDIUM_ALIASES.get(value)
        if medium is not None:
            return medium
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str):
        medium = _MEDIUM_ALIASES.get(value.strip().upper())
        if medium is not None:
            return medium
    raise WireFormatError(f"unknown medium {saferepr(value)}")


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    # vLLM's per-block extra hash keys (multimodal keys, cache salt), one entry (a list, or
    # None) per block; the field comes last and is left out of the map when None, as vLLM's
    # msgspec encoder omits defaults. A salted block's entry holds the salt as the item
    # identity.salt_extra_key makes (a router reads the first entry's).
    extra_keys: list[Any] | None = None
    # The event's cache salt as the client sent it (map form only; Dynamo reads it as the
    # cache namespace of every block of the event, before any tagged extra_keys item; vLLM and
    # llm-d ignore it): written by wire.router_forms on the consolidated output.
    cache_salt: str | None = None

    def to_wire(self) -> dict[str, Any]:
        wire = {
            "type": "BlockStored",
            "block_hashes": [to_signed_int64(h) for h in self.block_hashes],
            "parent_block_hash": (None if self.parent_block_hash is None
                                  else to_signed_int64(self.parent_block_hash)),
            "token_ids": self.token_ids,
            "block_size": self.block_size,
            "lora_id": self.lora_id,
            "medium": self.medium,
            # A router keys an adapter's blocks by lora_name and ignores lora_id: an adapter's
            # block always carries its name (see identity.lora_name).
            "lora_name": (self.lora_name if self.lora_name is not None
                          else lora_name(self.lora_id)),
        }
        if self.extra_keys is not None:
            wire["extra_keys"] = [None if k is None else list(k) for k in self.extra_keys]
        if self.cache_salt is not None:
            wire["cache_salt"] = self.cache_salt
        return wire


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": "BlockRemoved",
            "block_hashes": [to_signed_int64(h) for h in self.block_hashes],
            "medium": self.medium,
        }


@dataclass(slots=True)
class AllBlocksCleared:
    medium: str | None = None  # not on the wire; lets passthrough consumers keep the tier

    def to_wire(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    """One decoded message: its seq (None for 2-frame messages), time, events and dp rank."""

    seq: int | None
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None
    topic: bytes = b""


def encode_seq(seq: int) -> bytes:
    return _SEQ.pack(seq)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireFormatError(f"seq frame has {len(frame)} bytes, expected 8: "
                              f"{saferepr(frame)}")
    return _SEQ.unpack(frame)[0]


def payload_encoder() -> Callable[[Any], bytes]:
    """A fresh msgpack encoder function (one per thread: encoders keep a reusable buffer).

    msgspec's encoder is used when importable: measured on a 128-event batch (64 one-block
    stores with 32 tokens + 64 removes) it takes ~19 us against ~77 us for ``msgpack.Packer``,
    and it writes the same bytes (str as str, bytes as bin, float64, smallest int forms).
    """
    if _msgspec is not None:
        return _msgspec.msgpack.Encoder().encode
    return msgpack.Packer(use_bin_type=True).pack


class EncodedEvents(NamedTuple):
    """``count`` consecutive wire events already encoded: ``data`` holds their msgpack maps one
    after another, the bytes msgspec makes of each map. The event sink's compiled batch writes
    the events it takes this way (no Python object per event or token); it appears only in an
    :class:`EncodedBatch`."""

    data: bytes
    count: int


class EncodedBatch(list):  # type: ignore[type-arg]
    """A batch of wire events that may hold :class:`EncodedEvents` runs among its maps (the
    event sink's compiled batch). Only a publisher with ``accepts_encoded_events`` is handed
    one; :func:`batch_payload`, :func:`event_count` and :func:`events_as_maps` read it."""

    __slots__ = ()


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def event_count(events: Sequence[Any]) -> int:
    """Events in a batch (an :class:`EncodedEvents` run counts its events)."""
    if type(events) is not EncodedBatch:
        return len(events)
    return sum(item.count if type(item) is EncodedEvents else 1 for item in events)


def events_as_maps(events: Sequence[Any]) -> list[dict[str, Any]]:
    """The batch with every event as its map (the encoded runs decoded)."""
    if type(events) is not EncodedBatch:
        return list(events)
    out: list[dict[str, Any]] = []
    for item in events:
        if type(item) is EncodedEvents:
            out.extend(_decode_maps(_array_header(item.count) + item.data))
        else:
            out.append(item)
    return out


def batch_payload(encode: Callable[[Any], bytes], ts: float, events: Sequence[Any],
                  dp_rank: int) -> bytes:
    """msgpack ``[ts, events, dp_rank]``, with ``encode`` (see :func:`payload_encoder`) for
    the parts not yet encoded: an :class:`EncodedBatch`'s runs are copied as they are, the
    same bytes as encoding their maps."""
    if type(events) is not EncodedBatch:
        return encode([ts, events, dp_rank])
    parts = [b"\x93", encode(ts), b""]
    n = 0
    for item in events:
        if type(item) is EncodedEvents:
            parts.append(item.data)
            n += item.count
        else:
            parts.append(encode(item))
            n += 1
    parts[2] = _array_header(n)
    parts.append(encode(dp_rank))
    return b"".join(parts)


_encode = payload_encoder()
_decode_maps: Callable[[bytes], list[dict[str, Any]]] = (
    _msgspec.msgpack.decode if _msgspec is not None
    else lambda data: msgpack.unpackb(data, raw=False))


def encode_payload(ts: float, events: Sequence[Any], dp_rank: int) -> bytes:
    """msgpack ``[ts, events, dp_rank]`` for events already in wire form (maps, or an
    :class:`EncodedBatch`)."""
    return batch_payload(_encode, ts, events if type(events) is EncodedBatch else list(events),
                         dp_rank)


def encode_batch(topic: bytes, seq: int, ts: float, events: Sequence[KvEvent],
                 dp_rank: int) -> list[bytes]:
    """The three frames of one batch."""
    return [topic, encode_seq(seq), encode_payload(ts, [e.to_wire() for e in events], dp_rank)]


def _field(raw: Any, index: int, name: str) -> Any:
    if isinstance(raw, dict):
        return raw.get(name)
    return raw[index] if index < len(raw) else None


def _hashes(value: Any, what: str) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise WireFormatError(f"{what} is not a list: {saferepr(value)}")
    out = []
    for item in value:
        if not isinstance(item, int) or isinstance(item, bool):
            raise WireFormatError(f"{what} holds a non-integer hash: {saferepr(item)}")
        out.append(to_unsigned_u64(item))
    return out


def _cache_salt(raw: Any) -> str | None:
    """A map-form store's top-level ``cache_salt`` (the positional form has no slot for it)."""
    salt = raw.get("cache_salt") if isinstance(raw, dict) else None
    if salt is None or isinstance(salt, str):
        return salt
    raise WireFormatError(f"BlockStored cache_salt is not a string: {saferepr(salt)}")


def decode_event(raw: Any) -> KvEvent:
    """One event from its map or positional-array form; hashes come back as u64."""
    if isinstance(raw, dict):
        kind = raw.get("type")
    elif isinstance(raw, (list, tuple)) and raw:
        kind, raw = raw[0], list(raw[1:])
    else:
        raise WireFormatError(f"event is neither a map nor an array: {saferepr(raw)}")
    if isinstance(kind, bytes):
        kind = kind.decode("utf-8", "replace")
    if kind == "BlockStored":
        parent = _field(raw, 1, "parent_block_hash")
        if parent is not None:
            parent = _hashes([parent], "parent_block_hash")[0]
        token_ids = _field(raw, 2, "token_ids")
        block_size = _field(raw, 3, "block_size")
        if not isinstance(token_ids, (list, tuple)):
            raise WireFormatError(f"BlockStored token_ids is not a list: "
                                  f"{saferepr(token_ids)}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise WireFormatError(f"BlockStored block_size is invalid: {saferepr(block_size)}")
        medium = _field(raw, 5, "medium")
        return BlockStored(
            block_hashes=_hashes(_field(raw, 0, "block_hashes"), "BlockStored block_hashes"),
            parent_block_hash=parent,
            token_ids=list(token_ids),
            block_size=block_size,
            lora_id=_field(raw, 4, "lora_id"),
            medium=None if medium is None else normalize_medium(medium),
            lora_name=_field(raw, 6, "lora_name"),
            extra_keys=_field(raw, 7, "extra_keys"),
            cache_salt=_cache_salt(raw),
        )
    if kind == "BlockRemoved":
        medium = _field(raw, 1, "medium")
        return BlockRemoved(
            block_hashes=_hashes(_field(raw, 0, "block_hashes"), "BlockRemoved block_hashes"),
            medium=None if medium is None else normalize_medium(medium),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise WireFormatError(f"unknown event type {saferepr(kind)}")


def decode_payload(payload: bytes) -> tuple[float, list[Any], int | None]:
    """``(ts, raw events, dp_rank)`` from a payload; raw events still need decode_event."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireFormatError(f"payload is not msgpack ({exc}): "
                              f"{saferepr(payload[:32])}") from None
    if isinstance(batch, dict):
        batch = [batch.get("ts"), batch.get("events"), batch.get("data_parallel_rank")]
    if not isinstance(batch, (list, tuple)) or len(batch) not in (2, 3):
        raise WireFormatError(f"payload is not [ts, events, dp_rank]: {saferepr(batch, 200)}")
    ts, events = batch[0], batch[1]
    dp_rank = batch[2] if len(batch) == 3 else None
    if not isinstance(events, (list, tuple)):
        raise WireFormatError(f"batch events is not a list: {saferepr(events, 200)}")
    if dp_rank is not None and not isinstance(dp_rank, int):
        raise WireFormatError(f"batch data_parallel_rank is not an integer: "
                              f"{saferepr(dp_rank)}")
    if ts is None:
        ts = 0.0
    elif type(ts) not in (int, float):
        raise WireFormatError(f"batch ts is not a number: {saferepr(ts, 100)}")
    return float(ts), list(events), dp_rank


def decode_message(frames: Sequence[bytes]) -> EventBatch:
    """A 3-frame ``[topic, seq, payload]`` or 2-frame ``[topic, payload]`` message."""
    if len(frames) == 3:
        topic, seq, payload = frames[0], decode_seq(frames[1]), frames[2]
    elif len(frames) == 2:
        topic, seq, payload = frames[0], None, frames[1]
    else:
        raise WireFormatError(f"message has {len(frames)} frames, expected 2 or 3")
    ts, raw_events, dp_rank = decode_payload(payload)
    return EventBatch(seq, ts, [decode_event(e) for e in raw_events], dp_rank, bytes(topic))


def salvage_batch(encode: Callable[[Any], bytes], ts: float, events: Sequence[Any], rank: int
                  ) -> tuple[bytes | None, list[Any], int, str]:
    """``(payload, events kept, events dropped, first error)`` of a batch whose whole encoding
    failed: each event is encoded alone and those that fail are dropped, so one bad value
    does not lose the others (runs of :class:`EncodedEvents` are valid as written). Payload
    None when no event is left or the batch still cannot be encoded (e.g. a bad ``ts`` or
    rank). Called by the publisher on the thread that encodes (see
    ``wire.batch_encoding.BatchEncoding``)."""
    kept: list[Any] = EncodedBatch() if type(events) is EncodedBatch else []
    dropped = 0
    first_error = ""
    for event in events:
        if type(event) is EncodedEvents:  # written by the sink's compiled batch: valid
            kept.append(event)
            continue
        try:
            encode(event)
        except Exception as exc:
            dropped += 1
            if not first_error:
                first_error = f"{type(exc).__name__}: {exc}"
            continue
        kept.append(event)
    payload = None
    if kept:
        try:
            payload = batch_payload(encode, ts, kept, rank)
        except Exception as exc:
            first_error = first_error or f"{type(exc).__name__}: {exc}"
    return payload, kept, dropped, first_error

"""A test model of llm-d's KV-event indexer and precise-prefix scorer, read line by line from
llm-d's Go source (``llm-d/llm-d-router`` @ ebab6879; llm-d cannot be built here: its Go
toolchain is newer than the machine's and its modules cannot be fetched).

What it follows (file: function, at ebab6879):

* ``pkg/kvevents/zmq_subscriber.go``: ``parseEventFrame`` (exactly 3 frames, seq frame at least
  8 bytes, big-endian u64) after the SUB's prefix filter (``OptionSubscribe``, default
  ``TopicFilter: "kv@"``, ``pkg/kvevents/pool.go``); with no replay endpoint every message is
  applied (``if z.replayEndpoint == ""``). The replay path is not modelled.
* ``pkg/kvevents/engineadapter/common.go``: ``parseTopic`` (``kv@<pod>@<model>``: exactly three
  ``@`` parts, else the whole topic is the pod and the model is ""), ``getHashAsUint64``
  (``uint64``, ``int64`` cast, ``[]byte`` last 8 bytes big-endian; any other Go type fails).
* ``pkg/kvevents/engineadapter/vllm_adapter.go``: the batch ``{TS float64, Events, DataParallel
  Rank *int}`` (the rank is decoded and then dropped), events as positional arrays or maps
  tagged ``"type"`` normalised to ``block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...``; one event that
  fails to convert fails the whole batch. msgpack is decoded as ``vmihailenco/msgpack/v5``'s
  ``DecodeInterface`` types it (a fixint is ``int8``, ``0xcc`` ``uint8``, ...): :func:`go_decode`
  keeps that Go type on every integer, because ``getHashAsUint64`` accepts only ``uint64`` and
  ``int64`` (a hash the encoder wrote in fewer bytes fails the batch).
* ``pkg/kvevents/pool.go``: ``processEventBatch`` (medium lower-cased, "" = ``gpu``;
  ``lora_name`` when set replaces the topic's model in the hashes; a store whose parent engine
  key has no request key is skipped whole; tokens re-hashed into request keys at llm-d's own
  block size; a store with tokens but no full llm-d block, or without tokens and no known engine
  key, indexes nothing; ``AllBlocksCleared`` clears every tier of the pod), ``realignExtra
  Features`` and ``handleDeviceTierUpdate``; ``pkg/kvevents/event_dedup_filter.go``: stores
  reference-counted per (pod, tier, group, dp rank = -1 always, hash), a remove forwarded only
  on the last reference (or for a hash never tracked).
* ``pkg/kvcache/kvblock/token_processor.go``: request keys are FNV-64a over the canonical CBOR
  of ``[parent, tokens, extras]`` (``cbor.CanonicalEncOptions``; ``extras`` is null or an array
  of ``{"Hash": <string>}``); the chain's root is ``hash(fnv64a(seed), nil, model)``; partial
  blocks are not keyed. ``pkg/kvcache/kvblock/extra_keys.go``: ``ParseRawExtraKeys`` (every bare
  string, or the first item of a list, in a block's ``extra_keys`` is a multimodal hash).
* ``pkg/kvcache/kvblock/in_memory.go`` / ``index.go``: the engine key -> request keys mapping
  (``engineToRequestMapping``, 1:many and many:1), ``GetRequestKey`` (the last request key),
  evict by engine key per pod entry (pod, tier, group), ``Lookup``, ``Clear``.
* ``pkg/epp/.../preciseprefixcache/blockkeys.go``: a request's keys are computed from its
  tokens under the request's target model, its raw ``cache_salt`` string folded into block 0's
  extras only (``foldCacheSalt``). ``pkg/kvcache/kvblock_scorer.go``: the longest-prefix score
  per pod, each block weighted by the best tier the pod holds it in (``backend.go``: ``gpu`` 1.0,
  ``cpu`` 0.8, any other tier 1.0).

Not modelled: the xxh64 hash option, LRU capacities (llm-d's are far larger than any test),
speculative entries, pseudo-pods, the Redis index, replay and its cooldown. Who calls it: tests
only (tests/cli/test_llmd_model.py); pure Python, not thread-safe.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbm_plugin.routers.llmd_msgpack import GoDecodeError, GoInt, go_decode

LLMD_COMMIT = "ebab6879"
DEFAULT_TOPIC_FILTER = "kv@"  # pkg/kvevents/pool.go, DefaultConfig's TopicFilter
DEFAULT_BLOCK_SIZE = 16  # pkg/kvcache/kvblock/token_processor.go, defaultBlockSize
DEFAULT_MEDIUM_WEIGHTS = {"gpu": 1.0, "cpu": 0.8}  # pkg/kvcache/backend.go
_U64 = (1 << 64) - 1
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
NO_GROUP = -1  # noGroupIdx
NO_DP_RANK = -1  # noDataParallelRank: the dedup scope never names the dp rank
_INDEXABLE_KINDS = {"full_attention", "mla_attention", "sink_full_attention"}


# --- hashing: FNV-64a over canonical CBOR ------------------------------------------------


def fnv64a(data: bytes) -> int:
    """FNV-1a, 64 bit (Go's ``hash/fnv.New64a``)."""
    h = _FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & _U64
    return h


@dataclass(frozen=True)
class MMHash:
    """``kvblock.MMHash{Hash string}``: a Go struct, so CBOR encodes it as ``{"Hash": s}``."""

    hash: str


def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes((major << 5 | n,))
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes((major << 5 | info,)) + n.to_bytes(size, "big")
    raise ValueError(f"CBOR argument {n} exceeds 64 bits")


def cbor(value: Any) -> bytes:
    """Canonical CBOR (RFC 8949 §4.2.1 length-first key order, as ``fxamacker/cbor``'s
    ``CanonicalEncOptions``) of the types the token processor hashes: None (a nil slice),
    bool, int, bytes, str, list/tuple, dict and :class:`MMHash`. Floats are not needed."""
    if value is None:
        return b"\xf6"
    if value is True or value is False:
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):
        return _head(0, value) if value >= 0 else _head(1, -1 - value)
    if isinstance(value, (bytes, bytearray)):
        return _head(2, len(value)) + bytes(value)
    if isinstance(value, str):
        raw = value.encode("utf-8", "surrogateescape")
        return _head(3, len(raw)) + raw
    if isinstance(value, MMHash):
        return cbor({"Hash": value.hash})
    if isinstance(value, (list, tuple)):
        return _head(4, len(value)) + b"".join(cbor(v) for v in value)
    if isinstance(value, dict):
        items = sorted((cbor(k), cbor(v)) for k, v in value.items())
        items.sort(key=lambda kv: len(kv[0]))  # stable: length first, then bytes
        return _head(5, len(items)) + b"".join(k + v for k, v in items)
    raise TypeError(f"cbor: unsupported type {type(value).__name__}")


class TokenProcessor:
    """``chunkedTokenDatabase`` with the default ``cbor-fnv`` algorithm."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, hash_seed: str = "") -> None:
        if block_size <= 0:
            raise ValueError(f"blockSizeTokens must be greater than 0, got {block_size}")
        self.block_size = block_size
        self.init_hash = fnv64a(hash_seed.encode("utf-8"))

    def hash(self, parent: int, tokens: Sequence[int] | None, extra: Any) -> int:
        return fnv64a(cbor([parent, None if tokens is None else list(tokens), extra]))

    def root(self, model: str) -> int:
        """``getInitHash``: the chain's parent for a first block of ``model``."""
        return self.hash(self.init_hash, None, model)

    def keys(self, parent_key: int, tokens: Sequence[int], model: str,
             extra_features: list[list[MMHash] | None] | None = None) -> list[int]:
        """``TokensToKVBlockKeys``: one key per full block of ``tokens``."""
        bs = self.block_size
        chunks = [list(tokens[i:i + bs]) for i in range(0, len(tokens) - bs + 1, bs)]
        if not chunks:
            return []
        if extra_features is None:
            extra_features = [None] * len(chunks)
        elif len(extra_features) != len(chunks):
            raise ValueError(f"extraFeatures length {len(extra_features)} does not match "
                             f"token chunk count {len(chunks)}")
        prefix = parent_key if parent_key != 0 else self.root(model)
        out = []
        for chunk, extras in zip(chunks, extra_features, strict=True):
            prefix = self.hash(prefix, chunk, None if extras is None else list(extras))
            out.append(prefix)
        return out


def parse_raw_extra_keys(raw: list[Any] | None) -> list[list[MMHash] | None] | None:
    """``ParseRawExtraKeys``: a bare string, or a list's first item when it is a string, is an
    MM hash; anything else in an entry is skipped."""
    if raw is None:
        return None
    out: list[list[MMHash] | None] = []
    for entry in raw:
        hashes = []
        for item in entry or ():
            if isinstance(item, str):
                hashes.append(MMHash(item))
            elif isinstance(item, list) and item and isinstance(item[0], str):
                hashes.append(MMHash(item[0]))
        out.append(hashes or None)
    return out


def realign_extra_features(features: list[list[MMHash] | None],
                           canonical: int) -> list[list[MMHash] | None] | None:
    """``realignExtraFeatures``: engine blocks' features onto llm-d's blocks."""
    engine = len(features)
    if canonical == 0:
        return None
    if engine in (0, canonical):
        return features
    out: list[list[MMHash] | None] = [None] * canonical
    if engine < canonical:
        for i in range(canonical):
            out[i] = features[i * engine // canonical]
        return out
    for i, feature in enumerate(features):
        if feature is None:
            continue
        j = i * canonical // engine
        out[j] = (out[j] or []) + feature
    return out


def fold_cache_salt(features: list[list[MMHash] | None] | None, salt: str | None,
                    num_blocks: int) -> list[list[MMHash] | None] | None:
    """``foldCacheSalt``: the request's raw salt string after block 0's MM hashes."""
    if not salt or num_blocks == 0:
        return features
    features = [None] * num_blocks if features is None else list(features)
    features[0] = [*(features[0] or []), MMHash(salt)]
    return features


# --- the vLLM adapter ----------------------------------------------------------------------


@dataclass
class Stored:
    block_hashes: list[int]
    parent_hash: int
    tokens: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str = ""
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    spec_kind: str = ""


@dataclass
class Removed:
    block_hashes: list[int]
    medium: str = ""
    group_idx: int | None = None


@dataclass
class Cleared:
    pass


Event = Stored | Removed | Cleared
_STORED_ORDER = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                 "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                 "kv_cache_spec_sliding_window")
_REMOVED_ORDER = ("block_hashes", "medium", "group_idx")


def parse_topic(topic: str) -> tuple[str, str]:
    """``parseTopic``: (pod, model)."""
    parts = topic.split("@")
    return (parts[1], parts[2]) if len(parts) == 3 else (topic, "")


def hash_as_uint64(raw: Any) -> int:
    """``getHashAsUint64``."""
    if isinstance(raw, GoInt) and raw.go in ("uint64", "int64"):
        return int(raw) & _U64
    if isinstance(raw, bytes):
        if not raw:
            raise GoDecodeError("hash byte slice is empty")
        return int.from_bytes(raw[-8:], "big")
    go = raw.go if isinstance(raw, GoInt) else type(raw).__name__
    raise GoDecodeError(f"unsupported hash type: {go}")


def _to_int(raw: Any, what: str) -> int:
    if not isinstance(raw, GoInt):
        raise GoDecodeError(f"{what}: unsupported numeric type: {type(raw).__name__}")
    return int(raw)


def _str(raw: Any, what: str) -> str | None:
    if raw is not None and not isinstance(raw, str):
        raise GoDecodeError(f"{what} is not a string: {raw!r}")
    return raw


def _group(raw: Any, what: str) -> int | None:
    if raw is None:
        return None
    group = _to_int(raw, what)
    if group < 0:
        raise GoDecodeError(f"{what}: group_idx: negative value: {group}")
    return group


def decode_event(raw: Any) -> Event:
    """``decodeVLLMEvent`` and its converters."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise GoDecodeError(f"map-encoded event tag is missing or not a string: {tag!r}")
        order = {"BlockStored": _STORED_ORDER, "BlockRemoved": _REMOVED_ORDER}.get(tag, ())
        fields = [tag, *(raw.get(name) for name in order)]
    elif isinstance(raw, list):
        fields = raw
    else:
        raise GoDecodeError(f"event is neither an array nor a map: {raw!r}")
    if not fields or not isinstance(fields[0], str):
        raise GoDecodeError("malformed tagged union: no string tag")

    def at(i: int) -> Any:
        return fields[i] if i < len(fields) else None

    tag = fields[0]
    if tag == "AllBlocksCleared":
        return Cleared()
    if tag not in ("BlockStored", "BlockRemoved"):
        raise GoDecodeError(f"unknown vLLM event tag: {tag}")
    if not isinstance(at(1), list):
        raise GoDecodeError(f"{tag}: block_hashes is not an array: {at(1)!r}")
    hashes = [hash_as_uint64(h) for h in at(1)]
    if tag == "BlockRemoved":
        return Removed(hashes, _str(at(2), "BlockRemoved: medium") or "",
                       _group(at(3), "BlockRemoved"))
    if len(fields) < 5:
        raise GoDecodeError(f"BlockStored: need at least 5 fields, got {len(fields)}")
    if not isinstance(at(3), list):
        raise GoDecodeError(f"BlockStored: token_ids is not an array: {at(3)!r}")
    tokens = [_to_int(t, "token_ids") & 0xFFFFFFFF for t in at(3)]
    extra = at(8)
    if extra is not None and (not isinstance(extra, list) or any(
            e is not None and not isinstance(e, list) for e in extra)):
        raise GoDecodeError(f"BlockStored: extra_keys has an invalid type: {extra!r}")
    return Stored(
        block_hashes=hashes,
        parent_hash=0 if at(2) is None else hash_as_uint64(at(2)),
        tokens=tokens, block_size=_to_int(at(4), "block_size"),
        lora_id=None if at(5) is None else _to_int(at(5), "lora_id"),
        medium=_str(at(6), "BlockStored: medium") or "",
        lora_name=_str(at(7), "BlockStored: lora_name"), extra_keys=extra,
        group_idx=_group(at(9), "BlockStored"),
        spec_kind=_str(at(10), "BlockStored: kv_cache_spec_kind") or "")


def decode_batch(payload: bytes) -> tuple[float, list[Event], int | None]:
    """``ParseMessage``'s batch: (ts, events, dp rank). The dp rank goes no further."""
    raw = go_decode(payload)
    if not isinstance(raw, list):
        raise GoDecodeError(f"failed to decode vLLM event batch: not an array: {raw!r}")
    ts = raw[0] if raw else 0.0
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise GoDecodeError(f"batch ts is not a number: {ts!r}")
    events = raw[1] if len(raw) > 1 else None
    if events is not None and not isinstance(events, list):
        raise GoDecodeError(f"batch events is not an array: {events!r}")
    rank = raw[2] if len(raw) > 2 else None
    if rank is not None and not isinstance(rank, GoInt):
        raise GoDecodeError(f"batch data_parallel_rank is not an int: {rank!r}")
    return float(ts), [decode_event(e) for e in events or ()], rank


# --- the index and the pool ----------------------------------------------------------------


@dataclass(frozen=True)
class PodEntry:
    pod: str
    tier: str
    group: int | None = None


@dataclass
class Match:
    """One pod's answer to a prompt: the consecutive blocks it holds from the first and the
    scorer's weighted sum over them."""

    blocks: int
    score: float


@dataclass
class LlmdIndexer:
    """llm-d's event pool, in-memory index and longest-prefix scorer, for any number of pods.

    ``receive`` takes a message's frames as the SUB delivers them; ``counts`` names what was
    applied (``batches``, ``stores``, ``clears``, ``suppressed_removes``) and every rule that
    dropped something: ``topic_filtered``, ``malformed_frames``, ``parse_errors`` (a whole
    batch; ``last_error`` says why), ``unknown_parent_stores``, ``unkeyed_stores`` (no full
    llm-d block and no known engine key), ``skipped_stores`` / ``skipped_removes`` (a group
    of a kind llm-d does not index), ``key_errors``."""

    block_size: int = DEFAULT_BLOCK_SIZE
    hash_seed: str = ""
    topic_filter: str = DEFAULT_TOPIC_FILTER
    medium_weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MEDIUM_WEIGHTS))
    counts: Counter = field(default_factory=Counter)
    last_error: str | None = None

    def __post_init__(self) -> None:
        self.tokens = TokenProcessor(self.block_size, self.hash_seed)
        self.data: dict[int, dict[PodEntry, None]] = {}  # request key -> pod entries (ordered)
        self.engine_to_request: dict[int, list[int]] = {}
        self.refs: dict[str, Counter] = {}  # pod -> (tier, group, dp, hash) -> stores
        self.groups: dict[tuple[str, int], str] = {}  # (pod, group) -> spec kind learnt

    # ingestion
    def receive(self, frames: Sequence[bytes]) -> None:
        """One SUB message: prefix filter, ``parseEventFrame``, then the pool."""
        if not frames or not bytes(frames[0]).startswith(self.topic_filter.encode()):
            self.counts["topic_filtered"] += 1
            return
        if len(frames) != 3 or len(frames[1]) < 8:
            self.counts["malformed_frames"] += 1
            return
        self.process_message(bytes(frames[0]).decode("utf-8", "surrogateescape"),
                             bytes(frames[2]))

    def process_message(self, topic: str, payload: bytes) -> None:
        """``processRawMessage``: a batch that fails to parse is dropped whole."""
        pod, model = parse_topic(topic)
        try:
            _, events, _ = decode_batch(payload)
        except GoDecodeError as exc:
            self.counts["parse_errors"] += 1
            self.last_error = str(exc)
            return
        self.counts["batches"] += 1
        self.process_batch(events, pod, model)

    def process_batch(self, events: Iterable[Event], pod: str, model: str) -> None:
        """``processEventBatch``."""
        for ev in events:
            if isinstance(ev, Stored):
                self._store(ev, pod, model)
            elif isinstance(ev, Removed):
                self._remove(ev, pod)
            else:
                self.counts["clears"] += 1
                self.clear_pod(pod)

    def _store(self, ev: Stored, pod: str, model: str) -> None:
        tier = (ev.medium or "gpu").lower()
        scope = (tier, NO_GROUP if ev.group_idx is None else ev.group_idx, NO_DP_RANK)
        effective = ev.lora_name if ev.lora_name else model
        entry = PodEntry(pod, tier, ev.group_idx)
        if ev.group_idx is not None:
            if ev.spec_kind:
                self.groups[(pod, ev.group_idx)] = ev.spec_kind
            else:
                ev.spec_kind = self.groups.get((pod, ev.group_idx), "")
            dense = (not ev.tokens or (ev.block_size > 0 and len(ev.tokens) % ev.block_size == 0
                     and len(ev.tokens) // ev.block_size == len(ev.block_hashes)))
            if ev.spec_kind not in _INDEXABLE_KINDS or not dense:
                self.counts["skipped_stores"] += 1
                return
        parent_key = 0
        if ev.parent_hash != 0:
            rks = self.engine_to_request.get(ev.parent_hash)
            if not rks:
                self.counts["unknown_parent_stores"] += 1
                return
            parent_key = rks[-1]
        features = parse_raw_extra_keys(ev.extra_keys)
        if features is not None:
            canonical = len(ev.tokens) // self.block_size
            features = None if canonical == 0 else (
                features if len(features) == canonical
                else realign_extra_features(features, canonical))
        try:
            request_keys = self.tokens.keys(parent_key, ev.tokens, effective, features)
        except ValueError as exc:
            self.counts["key_errors"] += 1
            self.last_error = str(exc)
            return
        if not request_keys:
            if self._device_tier_update(ev, entry):
                self._track(pod, scope, ev.block_hashes)
            else:
                self.counts["unkeyed_stores"] += 1
            return
        self._add(ev.block_hashes, request_keys, entry)
        self._track(pod, scope, ev.block_hashes)
        self.counts["stores"] += 1

    def _device_tier_update(self, ev: Stored, entry: PodEntry) -> bool:
        if ev.tokens or not ev.block_hashes:
            return False
        resolved = list(dict.fromkeys(self.engine_to_request[h][-1] for h in ev.block_hashes
                                      if self.engine_to_request.get(h)))
        if not resolved:
            return False
        self._add([], resolved, entry)
        return True

    def _add(self, engine_keys: list[int], request_keys: list[int], entry: PodEntry) -> None:
        if engine_keys:
            n = max(len(engine_keys), len(request_keys))
            mapping: dict[int, list[int]] = {}
            for i in range(n):
                ek = engine_keys[i * len(engine_keys) // n]
                mapping.setdefault(ek, []).append(request_keys[i * len(request_keys) // n])
            self.engine_to_request.update(mapping)
        for rk in request_keys:
            self.data.setdefault(rk, {})[entry] = None

    def _track(self, pod: str, scope: tuple[str, int, int], hashes: list[int]) -> None:
        bucket = self.refs.setdefault(pod, Counter())
        for h in hashes:
            bucket[(*scope, h)] += 1

    def _remove(self, ev: Removed, pod: str) -> None:
        tier = (ev.medium or "gpu").lower()
        if ev.group_idx is not None and \
                self.groups.get((pod, ev.group_idx)) not in _INDEXABLE_KINDS:
            self.counts["skipped_removes"] += 1
            return
        scope = (tier, NO_GROUP if ev.group_idx is None else ev.group_idx, NO_DP_RANK)
        entry = PodEntry(pod, tier, ev.group_idx)
        bucket = self.refs.get(pod)
        for h in ev.block_hashes:
            key = (*scope, h)
            if bucket is not None and bucket.get(key, 0) > 1:
                bucket[key] -= 1  # still referenced: suppressed
                self.counts["suppressed_removes"] += 1
                continue
            if bucket is not None:
                bucket.pop(key, None)
            self._evict(h, entry)
        if bucket is not None and not bucket:
            del self.refs[pod]

    def _evict(self, engine_key: int, entry: PodEntry) -> None:
        rks = self.engine_to_request.get(engine_key)
        if rks is None:
            return
        for rk in rks:
            self._evict_request_key(rk, [entry])
        if all(not self.data.get(rk) for rk in rks):
            del self.engine_to_request[engine_key]

    def _evict_request_key(self, rk: int, entries: Iterable[PodEntry]) -> None:
        pods = self.data.get(rk)
        if pods is None:
            return
        for entry in entries:
            pods.pop(entry, None)
        if not pods:
            del self.data[rk]

    def clear_pod(self, pod: str) -> None:
        """``clearPod``: every tier and group of the pod, and its dedup state."""
        for rk in list(self.data):
            self._evict_request_key(rk, [e for e in self.data[rk] if e.pod == pod])
        self.refs.pop(pod, None)

    # queries
    def request_keys(self, tokens: Sequence[int], model: str,
                     cache_salt: str | None = None) -> list[int]:
        """``computeBlockKeysForTokens`` for a text prompt of ``model`` (the request's target
        model: the adapter's name for a LoRA request) with its raw ``cache_salt``."""
        features = fold_cache_salt(None, cache_salt, len(tokens) // self.block_size)
        return self.tokens.keys(0, tokens, model, features)

    def match(self, tokens: Sequence[int], model: str,
              cache_salt: str | None = None) -> dict[str, Match]:
        """``LongestPrefixScorer.Score`` over ``Lookup``: per pod, its run of blocks from the
        first and their weights (the best tier the pod holds each block in)."""
        out: dict[str, Match] = {}
        active: set[str] | None = None
        for rk in self.request_keys(tokens, model, cache_salt):
            weights: dict[str, float] = {}
            for entry in self.data.get(rk, {}):
                w = self.medium_weights.get(entry.tier, 1.0)
                weights[entry.pod] = max(w, weights.get(entry.pod, w))
            if active is None:
                active = set(weights)
                out = {pod: Match(0, 0.0) for pod in active}
            active &= set(weights)
            if not active:
                break
            for pod in active:
                out[pod].blocks += 1
                out[pod].score += weights[pod]
        return out

    def cached_tokens(self, tokens: Sequence[int], model: str, cache_salt: str | None = None,
                      pod: str | None = None) -> int:
        """Tokens of the prompt's prefix llm-d credits ``pod`` (None: the best pod) with."""
        matches = self.match(tokens, model, cache_salt)
        if pod is not None:
            found = matches.get(pod)
            return 0 if found is None else found.blocks * self.block_size
        return max((m.blocks for m in matches.values()), default=0) * self.block_size

    def tiers_held(self, pod: str) -> Counter:
        """Request keys the pod holds, per tier."""
        return Counter(e.tier for pods in self.data.values() for e in pods if e.pod == pod)


def llmd_tap(indexers: Sequence[LlmdIndexer], *args: Any, **kwargs: Any) -> Any:
    """A :class:`~kvbm_plugin.routers.router_view.TreeSubscriber` (``args``/``kwargs`` as its
    own) that also hands every batch it applies, in order and as the raw frames it received
    (live or replayed), to each of ``indexers``: llm-d's view of the same stream, with gaps
    and the join repaired by the plugin's replay (llm-d's own replay rules are not modelled)."""
    from kvbm_plugin.routers.router_view import TreeSubscriber

    class LlmdTap(TreeSubscriber):
        def __init__(self) -> None:
            self._raw: dict[int, list[bytes]] = {}  # id(batch) -> its frames, decode to apply
            super().__init__(*args, **kwargs)

        def _decode(self, frames: list[bytes]) -> Any:
            batch = super()._decode(frames)
            if batch is not None:
                self._raw[id(batch)] = list(frames)
            return batch

        def apply(self, batch: Any) -> None:
            frames = self._raw.pop(id(batch), None)
            if frames is not None:
                for indexer in indexers:
                    indexer.receive(frames)
            super().apply(batch)

    return LlmdTap()


__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_MEDIUM_WEIGHTS", "DEFAULT_TOPIC_FILTER", "LLMD_COMMIT",
           "Cleared", "GoDecodeError", "GoInt", "LlmdIndexer", "MMHash", "Match", "Removed",
           "Stored", "TokenProcessor", "cbor", "decode_batch", "decode_event", "fnv64a",
           "fold_cache_salt", "go_decode", "hash_as_uint64", "llmd_tap", "parse_raw_extra_keys",
           "parse_topic", "realign_extra_features"]

"""TensorRT-LLM's own stream in each of its forms, turned into the fields the core accepts.

TensorRT-LLM's ``tensorrt_llm/_torch/pyexecutor/kv_cache_events.py`` exists in several forms
that differ on the wire (read in the stored upstream index, NVIDIA/TensorRT-LLM):

* 44004b3864a7 (stored id 57357230020), Python hooks: ``BlockStored.token_ids: list[int]``,
  ``lora_id`` always None; msgspec writes map-tagged events with ``omit_defaults``.
* 13599e98c71c (stored id 71400586074, the default version), the C++ ``StreamingEventSink``:
  ``token_ids: list[int | str]`` (``EventTokenId``), ``lora_id=event.lora_id`` (may be set),
  and a new ``mm_keys``: one list per block of ``MultimodalKey`` maps (tag ``"mm_key"``,
  ``hash`` the item's digest in hex, ``start_offset``, ``uuid`` omitted when None), present
  only where ``mm_token_id_offset`` is set.
* an older ``NativeKVCacheEventManager`` + ``KVEventAdapter`` (stored id 58569138750): the same
  fields as 44004b3, hashes from the radix key's *last* 8 bytes, ``ExternalBlockHash = bytes |
  int`` (a hex-string hash goes out as msgpack bin); its PUB connects unless the endpoint is a
  wildcard or ipc/inproc.

A string token id is the digest of the multimodal item at that position: Dynamo's tests of its
TensorRT-LLM publisher set a token id and the block's ``mm_keys[*].hash`` to the same digest
(``components/src/dynamo/trtllm/tests/...`` stored id 68879048151), and Dynamo routes such a
position under ``pad_value_for_mm_hash(int(uuid, 16))`` = 1,000,000 + the uuid's low 30 bits
(``dynamo/common/multimodal/routing_utils.py``, stored id 55096954484; pinned in Dynamo's Rust
router as well), refusing an item without a uuid. :class:`EngineForms` does the same, so a
multimodal block carries the token ids a Dynamo frontend computes for the prompt, and carries
each item's digest as the block's ``extra_keys`` entry, as the plugin's own V2 path writes it
(``wire.identity.mm_extra_key``; two items whose pad values collide stay apart in the
consolidator's identity). A non-null ``lora_id`` without
a ``lora_name`` goes out under the adapter name the plugin gives every LoRA task
(``wire.identity.lora_name``: ``lora-<id>``), the one the core's identity already uses.

TensorRT-LLM's stream carries no cache salt and (44004b3) no adapter, so the scope of a salted
or adapter block, which is part of its identity in the core (its tier copies carry it), cannot
be read there. :class:`WireScopes` (``EngineForms.scopes``) is filled by the leader, which
computes each request's V2 radix keys (``naming.names.BlockNaming.v2_extend``) before the
iteration's events can be published: ``wire hash -> (LoRA task id, salt id)``. A stored block
found there gets the salt item in its ``extra_keys`` entry (``wire.identity.salt_extra_key``,
as tier events carry it) and, where the event names no adapter, the ``lora_id``.

Anything else is refused, one event at a time, counted per reason and logged rate-limited: a
string token that names no ``mm_keys`` item of its block, an item without a uuid, malformed
``mm_keys``. Fields the core does not read (``group_idx``, ``kv_cache_spec_*``, ``locality``,
or unknown ones) are counted in ``fields_ignored`` when set; the event is kept. A bytes hash
(the older form's adapter path) is refused by the core itself (``malformed``).

Called on the consolidator's ingest thread (``GpuStreams.engine_forms``) and on the
name reader's thread (``TrtllmNameReader``), never on TensorRT-LLM's executor thread; the
counters have one writer each (one consolidator or one reader per leader). Events are changed in
place: a batch's events are decoded fresh for each reader.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from kvbm_plugin._util.bounded import EvictionOrder
from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.wire.identity import lora_name as wire_lora_name
from kvbm_plugin.wire.identity import mm_extra_key, salt_extra_key

logger = logging.getLogger(__name__)

MM_PAD_SHIFT: Final = 1_000_000  # Dynamo's pad_value_for_mm_hash (see the module docstring)
MM_PAD_MASK: Final = (1 << 30) - 1
_READ: Final = frozenset({"type", "block_hashes", "parent_block_hash", "token_ids",
                          "block_size", "lora_id", "medium", "lora_name", "extra_keys",
                          "mm_keys"})
_MAX64: Final = (1 << 63) - 1
_TWO64: Final = 1 << 64
_STORED_BASE: Final = 8  # a BlockStored of 44004b3 and 13599e9 without the omitted fields


class FormRefused(ValueError):
    """A BlockStored this module cannot turn into the core's fields; ``reason`` counts it."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def mm_pad_token(uuid: str) -> int:
    """The routing token id of a multimodal position whose item has ``uuid`` (hex)."""
    return MM_PAD_SHIFT + (int(uuid, 16) & MM_PAD_MASK)


class WireScopes:
    """``wire hash (signed int64) -> (LoRA task id, salt id)`` of scoped blocks on TensorRT-LLM's
    stream, bounded: past :attr:`capacity` the oldest is forgotten (``evicted``, logged
    rate-limited; such a block then keeps the unscoped identity). One writer (the leader,
    executor thread, under its lock: :meth:`register`), one reader (the consolidator's ingest
    thread: :meth:`get`, one dict lookup, safe beside the writer under the GIL)."""

    def __init__(self, capacity: int = 1 << 18) -> None:
        self.capacity = capacity
        self.registered = 0
        self.evicted = 0
        self._map: dict[int, tuple[int | None, int | None]] = {}
        self._order = EvictionOrder()
        self._log = RateLimitedLog(logger)

    def __len__(self) -> int:
        return len(self._map)

    def register(self, wire_hash: int, scope: tuple[int | None, int | None]) -> None:
        self.registered += 1
        if self._order.put(self._map, wire_hash, scope, self.capacity):
            self.evicted += 1
            self._log.log(logging.WARNING, "scopes-full", "kvbm_plugin: %d scoped blocks of "
                          "TensorRT-LLM's stream remembered; the oldest is forgotten "
                          "(engine_scopes_evicted): its GPU event, if still to come, names no "
                          "salt or adapter", self.capacity)

    def get(self, wire_hash: Any) -> tuple[int | None, int | None] | None:
        return self._map.get(wire_hash)


class EngineForms:
    """Normalises TensorRT-LLM's stored-block events in place (see the module docstring)."""

    def __init__(self) -> None:
        self.scopes = WireScopes()  # filled by the leader (see the module docstring)
        self.scopes_applied = 0  # stored blocks given their scope from self.scopes
        self.tokens_converted = 0  # string token ids turned into routing token ids
        self.mm_blocks = 0  # blocks whose mm_keys went into extra_keys
        self.lora_names_filled = 0
        self.refused: dict[str, int] = {}  # reason -> events refused
        self.fields_ignored: dict[str, int] = {}  # field -> events that set it
        self._log = RateLimitedLog(logger)

    def stats(self) -> dict[str, int]:
        out = {"engine_tokens_converted": self.tokens_converted,
               "engine_mm_blocks": self.mm_blocks,
               "engine_lora_names_filled": self.lora_names_filled,
               "engine_events_refused": sum(self.refused.values()),
               "engine_fields_ignored": sum(self.fields_ignored.values()),
               "engine_scopes_applied": self.scopes_applied,
               "engine_scopes_registered": self.scopes.registered,
               "engine_scopes_evicted": self.scopes.evicted}
        return out

    def __call__(self, dp_rank: int, events: list[Any]) -> list[Any]:
        """``events`` with each BlockStored normalised, refused ones left out (counted)."""
        out = events  # copied only once an event is refused
        for i, event in enumerate(events):
            if type(event) is dict and event.get("type") == "BlockStored":
                try:
                    self._stored(event)
                except FormRefused as exc:
                    if out is events:
                        out = events[:i]
                    self.refused[exc.reason] = self.refused.get(exc.reason, 0) + 1
                    self._log.log(logging.WARNING, "refused-" + exc.reason, "kvbm_plugin: "
                                  "rank %d: TensorRT-LLM BlockStored refused (%s, "
                                  "engine_events_refused): %s", dp_rank, exc.reason, exc)
                    continue
            if out is not events:
                out.append(event)
        return out

    def _stored(self, event: dict[str, Any]) -> None:
        if len(event) > _STORED_BASE:
            for name, value in event.items():
                if name not in _READ and value is not None:
                    self.fields_ignored[name] = self.fields_ignored.get(name, 0) + 1
                    self._log.log(logging.INFO, "ignored-" + str(name)[:40], "kvbm_plugin: "
                                  "TensorRT-LLM BlockStored field %.40r=%.60r not read "
                                  "(engine_fields_ignored)", name, value)
        if self.scopes:
            self._scope(event)
        if event.get("lora_id") is not None and event.get("lora_name") is None \
                and type(event["lora_id"]) is int:
            event["lora_name"] = wire_lora_name(event["lora_id"])
            self.lora_names_filled += 1
        mm_keys = event.pop("mm_keys", None)
        tokens = event.get("token_ids")
        has_text = type(tokens) is list and str in set(map(type, tokens))
        if mm_keys is None and not has_text:
            return
        hashes, size = event.get("block_hashes"), event.get("block_size")
        if type(hashes) is not list or type(size) is not int or size <= 0 \
                or type(tokens) is not list or len(tokens) != size * len(hashes):
            raise FormRefused("shape", f"token_ids ({_n(tokens)}) is not block_size "
                              f"({size!r:.20}) x len(block_hashes) ({_n(hashes)})")
        per_block = self._mm_entries(mm_keys, len(hashes))
        if has_text:
            self._convert_tokens(tokens, size, per_block)
        if mm_keys is not None and any(per_block):
            extra = event.get("extra_keys")
            if extra is not None and (type(extra) is not list or len(extra) != len(hashes)):
                raise FormRefused("extra_keys", f"extra_keys {extra!r:.80} is not one entry "
                                  f"per block ({len(hashes)})")
            merged = []
            for j, items in enumerate(per_block):
                own = list(extra[j]) if extra is not None and extra[j] is not None else []
                keys = own + [mm_extra_key(digest, offset) for digest, offset, _ in items]
                merged.append(keys or None)
            event["extra_keys"] = merged
            self.mm_blocks += sum(1 for items in per_block if items)

    def _scope(self, event: dict[str, Any]) -> None:
        """Give each block the leader registered its scope (see :class:`WireScopes`)."""
        hashes = event.get("block_hashes")
        if type(hashes) is not list:
            return
        get = self.scopes.get
        # the older adapter form writes its u64 unsigned; the leader registers int64s
        found = [get(h - _TWO64 if h > _MAX64 else h) if type(h) is int else None
                 for h in hashes]
        if not any(found):
            return
        extra = event.get("extra_keys")
        if extra is not None and (type(extra) is not list or len(extra) != len(hashes)):
            raise FormRefused("extra_keys", f"extra_keys {extra!r:.80} is not one entry "
                              f"per block ({len(hashes)})")
        merged = []
        for j, scope in enumerate(found):
            own = list(extra[j]) if extra is not None and extra[j] is not None else []
            if scope is not None and scope[1] is not None:
                own.append(salt_extra_key(scope[1]))
            merged.append(own or None)
        event["extra_keys"] = merged
        lora = next((s[0] for s in found if s is not None), None)
        if lora is not None and event.get("lora_id") is None:
            event["lora_id"] = lora
        self.scopes_applied += sum(1 for s in found if s is not None)

    @staticmethod
    def _mm_entries(mm_keys: Any, n: int) -> list[list[tuple[str, int, str | None]]]:
        """Per block, its items as (digest, start_offset, uuid)."""
        if mm_keys is None:
            return [[] for _ in range(n)]
        if type(mm_keys) is not list or len(mm_keys) != n:
            raise FormRefused("mm_keys", f"mm_keys is not one list per block ({n}): "
                              f"{mm_keys!r:.80}")
        out = []
        for block in mm_keys:
            if type(block) is not list:
                raise FormRefused("mm_keys", f"mm_keys entry is not a list: {block!r:.80}")
            items = []
            for key in block:
                digest = key.get("hash") if type(key) is dict else None
                offset = key.get("start_offset") if type(key) is dict else None
                uuid = key.get("uuid") if type(key) is dict else None
                if type(digest) is not str or not digest or type(offset) is not int \
                        or offset < 0 or not (uuid is None or type(uuid) is str):
                    raise FormRefused("mm_keys", f"mm_keys item is not {{hash: str, "
                                      f"start_offset: int >= 0, uuid: str?}}: {key!r:.80}")
                items.append((digest, offset, uuid))
            out.append(items)
        return out

    def _convert_tokens(self, tokens: list[Any], size: int,
                        per_block: list[list[tuple[str, int, str | None]]]) -> None:
        converted = 0
        for i, token in enumerate(tokens):
            if type(token) is not str:
                continue
            uuids = {d: u for d, _, u in per_block[i // size]}
            if token not in uuids:
                raise FormRefused("token_ids", f"token_ids[{i}] is a string that names no "
                                  "mm_keys item of its block (the digest is not logged)")
            uuid = uuids[token]
            try:
                tokens[i] = mm_pad_token(uuid)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                raise FormRefused("mm_uuid", f"token_ids[{i}]: its mm_keys item has no hex "
                                  f"uuid ({uuid!r:.40}); Dynamo routes such an item by "
                                  "nothing either") from None
            converted += 1
        self.tokens_converted += converted


def _n(value: Any) -> str:
    return str(len(value)) if isinstance(value, list) else f"{value!r:.20}"

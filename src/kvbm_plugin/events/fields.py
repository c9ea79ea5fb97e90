"""Reading TensorRT-LLM's KV-event fields: token ids, LoRA ids, extra keys (a block's hash, its
name, is read by :mod:`kvbm_plugin.naming.names`: ``signed_hash``, ``parse_hash``).

Called by the event sink (:mod:`kvbm_plugin.event_sink`) on whichever thread feeds it, per
event or block; pure functions, no state, no torch or TensorRT-LLM import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import Any

from kvbm_plugin.wire.events import U32_MAX, WireFormatError
from kvbm_plugin.wire.identity import mm_extra_key, salt_extra_key, salt_of

_U64 = 1 << 64
_token_id = itemgetter("token_id")
_INT_ONLY = {int}
STORED = "BlockStored"
REMOVED = "BlockRemoved"


def parse_token_ids(tokens: Sequence[Any]) -> list[int]:
    """The ``token_id`` of each TRT-LLM token dict, each checked to be a u32 integer.

    Called before a store touches the batch, so a bad token leaves the batch as it was.
    """
    ids = list(map(_token_id, tokens))
    if ids and (set(map(type, ids)) != _INT_ONLY or min(ids) < 0 or max(ids) > U32_MAX):
        bad = next(t for t in ids if type(t) is not int or not 0 <= t <= U32_MAX)
        raise WireFormatError(f"stored.blocks[].tokens[].token_id is not a u32 integer: "
                              f"{bad!r:.100}")
    return ids


def parse_lora_id(value: Any) -> int | None:
    """The published ``lora_id`` of a TRT-LLM store: None for the base model, else the u64
    task id, 0 included (TensorRT-LLM's ``KVCacheStoredBlockData.loraId`` is a
    ``std::optional``: absent means no adapter, 0 is adapter 0; see
    :func:`kvbm_plugin.wire.identity.lora_of`); anything else raises (it would fail the encoder
    later and take the whole batch with it)."""
    if value is None:
        return None
    if type(value) is not int or not 0 <= value < _U64:
        raise WireFormatError(f"stored.lora_id is not None or a u64 integer: {value!r:.100}")
    return value


def is_scoped(block: Mapping[str, Any]) -> bool:
    """Whether a stored block carries a per-block LoRA id, multimodal keys or a cache salt."""
    return (block.get("lora_id") is not None or bool(block.get("mm_keys"))
            or block.get("cache_salt") is not None or block.get("cache_salt_id") is not None)


def block_extra_keys(block: Any) -> list[Any] | None:
    """The wire ``extra_keys`` entry of one stored block: its multimodal keys (the hash of each
    ``mm_keys`` item) and its cache salt, or None when it has neither. Dict blocks (buffered
    events) or ``KVCacheStoredBlockData`` objects (V2 ``add_stored_event``)."""
    mm = block.get("mm_keys") if isinstance(block, Mapping) else getattr(block, "mm_keys", None)
    keys: list[Any] = []
    for item in mm or ():
        offset: Any = 0
        if isinstance(item, Mapping):
            item, offset = item.get("hash"), item.get("start_offset", 0)
        elif isinstance(item, (tuple, list)) and item:
            item, offset = item[0], (item[1] if len(item) > 1 else 0)
        if isinstance(item, (bytes, bytearray)):
            item = bytes(item).hex()
        if item is not None:
            keys.append(mm_extra_key(str(item), offset))
    salt = salt_of(block)
    if salt is not None:
        keys.append(salt_extra_key(salt))
    return keys or None

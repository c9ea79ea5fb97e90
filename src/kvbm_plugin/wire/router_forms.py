"""The consolidated stream spelled the way the routers operators run read it.

Inside the plugin a salted block carries its salt as the item ``"dynamo-cache-salt:<16 hex of
the salt id>"`` in every block's ``extra_keys`` entry (:mod:`kvbm_plugin.wire.identity`): the
consolidator keys each block's identity on it, on every stream and medium. A router, though,
compares a block with what a *client* sends:

* Dynamo's frontend takes a request's ``nvext.cache_salt`` as the cache namespace as it is, and
  its indexer reads a stored event's namespace from a top-level ``cache_salt`` (map form) before
  any ``dynamo-cache-salt:`` item in the event's first ``extra_keys`` entry, and mixes it into
  every block of the event (ai-dynamo/dynamo ``lib/kv-router/src/zmq_wire/deserialize.rs`` @
  0917ca25, ``visit_map``; ``extra_keys.rs`` @ 035d7262, ``extra_keys_to_cache_namespace``;
  ``convert.rs`` @ 2bd0a36d, ``create_stored_blocks``). A bare string in ``extra_keys`` is a
  multimodal hash to Dynamo only in its marker form: 16 hex digits, the hash's u64, then 48
  zeros (``mark_mm_hash_for_extra_key`` / ``parse_mm_hash_from_extra_key``, ``extra_keys.rs``
  stored id 57897292560; earlier revisions took any 64 hex digits, by their first 16). A
  plain digest (TensorRT-LLM's ``mm_keys`` hash, 64 hex digits) is no multimodal hash to
  Dynamo 1.6.1's indexer: two images' blocks behind the same placeholder tokens become one
  block there, a request with one image is credited with the other's blocks, and the second
  image's children are refused ("Failed to find parent"; ``tests/interop/
  test_dynamo_multimodal.py``). Every such digest is therefore spelled in the marker form of
  its first 16 hex digits (``wire.identity.mm_marker``), the u64 either revision reads from
  it: by the event sink and the leader on every stream, and here again for any other input.
* llm-d folds the request's raw ``cache_salt`` string into block 0's extra features only, after
  its multimodal hashes, and reads every bare string of a stored block's ``extra_keys`` entry as
  one such feature (llm-d/llm-d-router @ ebab6879: ``preciseprefixcache/blockkeys.go``
  ``foldCacheSalt``; ``pkg/kvcache/kvblock/extra_keys.go`` ``ParseRawExtraKeys``): vLLM's own
  publisher writes the raw salt into the first block's entry only
  (``generate_block_hash_extra_keys``), and later blocks inherit it through their parent.

One spelling serves both (:data:`FORM_CLIENT`, the default): a salted store gets the salt
string as a top-level ``cache_salt`` (Dynamo), and the block that starts a sequence (no parent)
gets the same string as a bare item of its entry (llm-d, vLLM-compatible readers); the
``dynamo-cache-salt:`` items are dropped. The string is the one TensorRT-LLM handed the
connector (``RequestData.cache_salt`` / the request's ``cache_salt``, remembered in
:data:`~kvbm_plugin.wire.identity.SALT_TEXTS`); where a revision gives only ``cache_salt_id``,
the 16-hex name of the id stands in (no client sends it: such tenants get no credit from
either router, never another tenant's). :data:`FORM_ID` keeps the internal spelling.

Adapters: TensorRT-LLM names an adapter to the connector by its task id only (the request's
``lora_task_id``; ``RequestData`` has no adapter field at 035ab91cad04, and the Python request
keeps the adapter's path, ``py_lora_path``, not its name), so the plugin names it
``lora-<task id>`` inside. A router keys an adapter's blocks by ``lora_name``: Dynamo by the
model name a request asks for, llm-d by the request's target model (``lora_name`` replaces the
topic's model in its block keys, ``pkg/kvevents/pool.go`` @ ebab6879). ``DYN_KVBM_LORA_NAMES``
(``<task id>=<name>,...``) gives the names requests use; an adapter not named there keeps
``lora-<task id>``, which no request names: its blocks are credited to nobody.

Hashes: msgpack writes an int in the fewest bytes, and llm-d's decoder (vmihailenco's
``DecodeInterface``) then types a hash below 2^32 as a small Go int that ``getHashAsUint64``
refuses, dropping the whole batch (``engineadapter/common.go`` @ ebab6879). Every hash of the
consolidated output is therefore written as msgpack int64 (``0xd3``) when it would otherwise be
shorter (:func:`wide_hash`), which every reader decodes as the same integer.

Called by :meth:`kvbm_plugin.consolidator.service.KvEventConsolidator._flush` on the ingest
thread (never TensorRT-LLM's executor thread), on the core's output events just before they are
published; pure Python, no I/O; about 0.16 us per block on this project's 2-core machine.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any, Final

from kvbm_plugin.wire.identity import (
    LORA_NAME_PREFIX,
    SALT_TAG,
    SALT_TEXTS,
    mm_marker,
    salt_of_extra_keys,
)

try:
    from msgspec import Raw as _Raw
except ImportError:  # msgspec is a dependency; without it hashes keep msgpack's short forms
    _Raw = None

FORM_CLIENT: Final = "client"
FORM_ID: Final = "id"
SALT_FORMS: Final = (FORM_CLIENT, FORM_ID)
_I64 = struct.Struct(">q")
_NARROW_LO, _NARROW_HI = -(1 << 31), 1 << 32  # what msgpack writes in fewer than 8 bytes
_HEX = frozenset("0123456789abcdef")


def wide_hash(value: int) -> Any:
    """``value`` as msgpack int64 when msgpack would write it in fewer than 8 bytes (it fits
    32 bits); otherwise ``value`` itself (written as int64 or uint64, both read by llm-d)."""
    if _Raw is None or not _NARROW_LO <= value < _NARROW_HI:
        return value
    return _Raw(b"\xd3" + _I64.pack(value))


def salt_text(namespace: str) -> str:
    """The string a client sends for the salt the plugin names ``namespace`` (16 hex of its
    id): the remembered ``cache_salt`` string, or the namespace itself when only the id was
    ever seen in this process or the string is empty."""
    if len(namespace) == 16 and set(namespace) <= _HEX:
        text = SALT_TEXTS.get(int(namespace, 16))
        # Not "": TensorRT-LLM keys a request salted with "" apart from an unsalted one, but
        # Dynamo reads an empty cache_salt as none and llm-d folds none, so "" would credit
        # the engine's ""-salted blocks to every unsalted request. The id's hex keeps them apart.
        if text:
            return text
    return namespace


def _mark_mm(event: dict[str, Any]) -> None:
    """Every plain multimodal digest of a store's ``extra_keys`` in the marker form (the
    plugin's own streams write no other; a stream it relays may). An entry is replaced, never
    changed in place: the core may still hold it (held back)."""
    extra = event.get("extra_keys")
    if not extra:
        return
    for i, entry in enumerate(extra):
        if entry:
            marked = [mm_marker(item) for item in entry]
            if marked != entry:
                extra[i] = marked


def _strip(entry: Any) -> list[Any] | None:
    if entry is None:
        return None
    kept = [item for item in entry
            if not (isinstance(item, str) and item.startswith(SALT_TAG))]
    return kept or None


def _runs(namespaces: list[str | None]) -> list[tuple[int, int]]:
    """``[start, end)`` runs of equal namespace."""
    runs, start = [], 0
    for i in range(1, len(namespaces) + 1):
        if i == len(namespaces) or namespaces[i] != namespaces[start]:
            runs.append((start, i))
            start = i
    return runs


def _spell_store(event: dict[str, Any], out: list[dict[str, Any]]) -> None:
    extra = event.get("extra_keys")
    if not extra:
        out.append(event)
        return
    namespaces = [salt_of_extra_keys(entry) for entry in extra]
    if not any(namespaces):
        out.append(event)
        return
    hashes, bs = event["block_hashes"], event["block_size"]
    tokens, parent = event["token_ids"], event.get("parent_block_hash")
    for start, end in _runs(namespaces):
        part = dict(event) if (start, end) != (0, len(hashes)) else event
        part["block_hashes"] = hashes[start:end]
        part["parent_block_hash"] = parent if start == 0 else hashes[start - 1]
        part["token_ids"] = tokens[start * bs:end * bs]
        entries = [_strip(e) for e in extra[start:end]]
        namespace = namespaces[start]
        if namespace is not None:
            text = salt_text(namespace)
            part["cache_salt"] = text
            if part["parent_block_hash"] is None:  # a sequence's first block: vLLM's place
                entries[0] = [*(entries[0] or ()), text]
        if any(e is not None for e in entries):
            part["extra_keys"] = entries
        else:
            part.pop("extra_keys", None)
        out.append(part)


def spell_for_routers(events: Sequence[dict[str, Any]], salt_form: str = FORM_CLIENT,
                      wide_hashes: bool = True,
                      lora_names: Mapping[int, str] | None = None) -> list[dict[str, Any]]:
    """The core's output ``events`` (wire-form maps, handed over: changed in place) as routers
    read them: salts in ``salt_form``, hashes widened (``wide_hashes``), adapters named by
    ``lora_names`` (task id -> the name requests use, ``DYN_KVBM_LORA_NAMES``; an adapter
    not in it keeps ``lora-<task id>``). A store whose blocks name two salts is split into one
    store per salt, chained (the core never emits one)."""
    if lora_names:
        for event in events:
            lora = event.get("lora_id")
            if lora is not None and lora in lora_names \
                    and event.get("lora_name") == f"{LORA_NAME_PREFIX}{lora}":
                event["lora_name"] = lora_names[lora]
    out: list[dict[str, Any]] = []
    for event in events:
        if event.get("type") != "BlockStored":
            out.append(event)
            continue
        _mark_mm(event)
        if salt_form == FORM_CLIENT:
            _spell_store(event, out)
        else:
            out.append(event)
    if wide_hashes and _Raw is not None:
        for event in out:
            hashes = event.get("block_hashes")
            # A random 64-bit hash fits 32 bits about once in 2^31: look before rebuilding.
            if hashes and not all(h < _NARROW_LO or h >= _NARROW_HI for h in hashes):
                event["block_hashes"] = [wide_hash(h) for h in hashes]
            parent = event.get("parent_block_hash")
            if parent is not None and _NARROW_LO <= parent < _NARROW_HI:
                event["parent_block_hash"] = wide_hash(parent)
    return out


__all__ = ["FORM_CLIENT", "FORM_ID", "SALT_FORMS", "salt_text", "spell_for_routers",
           "wide_hash"]

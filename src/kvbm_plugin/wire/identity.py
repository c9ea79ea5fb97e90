"""Cache salt and LoRA scope of a request or a KV event, in one canonical form.

TensorRT-LLM spells a tenant's cache salt several ways: the C++ request that
``get_num_new_matched_tokens`` receives exposes ``cache_salt_id`` (an unsigned 64-bit int,
``tensorrt_llm.inputs.utils.get_cache_salt_id(cache_salt)``: the first 8 bytes of
``blake3(cache_salt)``, little-endian); the Python request, ``RequestData`` and the per-block
fields of newer KV events carry the string ``cache_salt``. The KV cache manager mixes the salt
(and the LoRA task id) into its own block keys, so blocks of different salts never match on
the GPU. Everything the plugin keys on content (tier keys, the consolidator's identity) must
do the same, under every spelling: :func:`request_scope` turns whichever fields an object has
into one string, the same for the int and the string spelling of the same salt.

Called by the leader (executor thread) and the event sink; pure Python, no TRT-LLM import.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any

_U64 = (1 << 64) - 1

try:  # TensorRT-LLM depends on blake3; its salt ids are blake3 digests
    from blake3 import blake3 as _blake3
except ImportError:  # without it (tests, CPU-only installs) a stand-in digest of the same size
    _blake3 = None


def cache_salt_id(cache_salt: str) -> int:
    """The u64 id TensorRT-LLM derives from a ``cache_salt`` string (blake3, 8 bytes, LE).

    Without the ``blake3`` package a blake2b digest stands in: the plugin then still isolates
    every salt from every other (and from none), it only cannot recognise a string salt as the
    same tenant as an id computed by TensorRT-LLM (a missed reuse, never a wrong one).
    """
    data = cache_salt.encode("utf-8")
    if _blake3 is not None:
        digest = _blake3(data).digest(length=8)
    else:
        digest = hashlib.blake2b(data, digest_size=8, person=b"kvbm-slt").digest()
    return int.from_bytes(digest, "little")


# The longest salt string remembered, in UTF-8 bytes. A client chooses its salt's length
# (TensorRT-LLM's OpenAI server takes any string), and a remembered string goes out on every
# salted STORE of the consolidated output: unbounded, 65,536 distinct 1 MB salts would hold
# 64 GB here and make every such STORE a megabyte. Salts are short in practice (vLLM suggests
# 43 base64 characters; a UUID is 36).
MAX_SALT_TEXT_BYTES = 256


class SaltTexts:
    """The salt strings behind salt ids, as far as this process has seen them: a bounded map
    id -> string (FIFO past ``capacity``; ``evicted`` counts what left; a string over
    :data:`MAX_SALT_TEXT_BYTES` is not kept, ``too_long`` counts those: such a salt goes out
    by its id, as if its string had never been seen).

    Filled by :func:`salt_of` whenever it reads a ``cache_salt`` string (the leader's request
    objects on the executor thread; the event sink's GPU-event blocks), read by
    :mod:`kvbm_plugin.wire.router_forms` on the consolidator's ingest thread to spell a salted
    block by the string the client sent. Writers take a lock (no I/O under it); ``get`` is one
    dict lookup."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self.evicted = 0
        self.too_long = 0
        # An OrderedDict, not a dict: dropping a dict's first key leaves a hole that every
        # later ``next(iter(...))`` walks past, so past the bound each new salt cost a walk
        # of up to ~capacity/3 holes (34 us on average at 65,536, on the executor thread).
        self._texts: OrderedDict[int, str] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, salt: int, text: str) -> None:
        if self._texts.get(salt) == text:
            return
        if too_long(text):
            self.too_long += 1  # a statistic: a lost increment between threads is harmless
            return
        with self._lock:
            self._texts[salt] = text
            while len(self._texts) > self.capacity:
                self._texts.popitem(last=False)
                self.evicted += 1

    def get(self, salt: int) -> str | None:
        return self._texts.get(salt)

    def clear(self) -> None:
        with self._lock:
            self._texts.clear()


SALT_TEXTS = SaltTexts()


def too_long(text: str) -> bool:
    """Whether ``text`` is over :data:`MAX_SALT_TEXT_BYTES` in UTF-8 (never remembered)."""
    return len(text) > MAX_SALT_TEXT_BYTES or \
        len(text.encode("utf-8", "replace")) > MAX_SALT_TEXT_BYTES


def salt_of(obj: Any) -> int | None:
    """The cache salt id of a request-like object (C++ ``LlmRequest``, the Python request,
    ``RequestData``, a KV event block dict), or None when it carries no salt.

    ``cache_salt_id`` (int) wins over ``cache_salt`` (str): it is what the KV cache manager
    hashes. An empty string is a salt like any other (only None means "no salt").
    """
    if isinstance(obj, dict):
        sid, text = obj.get("cache_salt_id"), obj.get("cache_salt")
    else:
        sid = getattr(obj, "cache_salt_id", None)
        text = getattr(obj, "cache_salt", None)
        if text is None:
            text = getattr(obj, "py_cache_salt", None)
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if sid is not None and not isinstance(sid, bool):
        try:
            salt = int(sid) & _U64
        except (TypeError, ValueError):
            # Called inside TRT-LLM's allocation: never raise there. A salt we cannot read
            # still isolates: it is keyed by its text, apart from every int id.
            return cache_salt_id(f"cache_salt_id={sid!r}")
        if text is not None and SALT_TEXTS.get(salt) != text \
                and not too_long(str(text)) and cache_salt_id(str(text)) == salt:
            SALT_TEXTS.remember(salt, str(text))  # the string is the id's (blake3 agrees)
        return salt
    if text is not None:
        salt = cache_salt_id(str(text))
        SALT_TEXTS.remember(salt, str(text))
        return salt
    return None


def remember_salt_text(obj: Any) -> None:
    """Remember the ``cache_salt`` string of a request-like object, if it has one (the
    leader calls this for each new request of ``build_connector_meta``: ``RequestData``
    carries the string on revisions whose C++ request gives ``get_num_new_matched_tokens`` the
    id only), before any block of the request is stored, so that every event of the salt is
    spelled the same way on the consolidated output (:mod:`kvbm_plugin.wire.router_forms`)."""
    text = getattr(obj, "cache_salt", None)
    if text is None:
        return
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = str(text)
    if too_long(text):  # before hashing it on the executor thread: it will not be kept
        SALT_TEXTS.too_long += 1
        return
    SALT_TEXTS.remember(cache_salt_id(text), text)


def lora_of(obj: Any) -> int | None:
    """The LoRA task id of a request-like object, or None for the base model.

    Task id 0 is an adapter like any other: TensorRT-LLM's ``BlockKey`` holds the task id as
    ``std::optional<LoraTaskIdType>`` and mixes it into every block hash whenever it is set
    (``cpp/tensorrt_llm/batch_manager/blockKey.cpp``, ``BlockKeyHasher::hash``), 0 included;
    only an absent id means the base model.
    """
    lora = getattr(obj, "lora_task_id", None)
    if lora is None:
        lora = getattr(obj, "py_lora_task_id", None)
    if lora is None or isinstance(lora, bool):
        return None
    return int(lora) & _U64


def multimodal_of(obj: Any) -> str | None:
    """A digest of a request's multimodal hashes (the C++ request binds
    ``multimodal_hashes``: one list of ints per image/video), or None for a text-only request.

    The prompt's placeholder token ids do not tell two images apart, so a request with any
    multimodal input gets all of them in its scope: it shares tier blocks only with requests
    carrying the same inputs (conservative: the text before the first image is not shared).
    """
    hashes = getattr(obj, "multimodal_hashes", None)
    if not hashes:
        return None
    digest = hashlib.blake2b(repr([list(h) for h in hashes]).encode(), digest_size=8)
    return digest.hexdigest()


def request_scope(obj: Any) -> str | None:
    """One string naming the reuse scope (salt, LoRA, multimodal inputs) of ``obj``, None for
    the default scope: mixed into every tier key, so blocks of two scopes never share a key."""
    return request_scopes(obj)[0]


def request_scopes(obj: Any) -> tuple[str | None, tuple[int | None, int | None]]:
    """(:func:`request_scope`, (LoRA task id, salt id)) of ``obj``, its fields read once: what
    the leader keys a request's tier blocks by and names their tier events with (executor
    thread, once per request)."""
    salt, lora = salt_of(obj), lora_of(obj)
    return scope_string(salt, lora, multimodal_of(obj)), (lora, salt)


def scope_string(salt: int | None, lora: int | None, mm: str | None) -> str | None:
    """:func:`request_scope` of a request with this salt id, LoRA task id and multimodal
    digest (also how a leader receiving another engine's announcement recomputes the scope
    from the announced salt and adapter, ``tiers/shared/announce.py``)."""
    if salt is None and lora is None and mm is None:
        return None
    parts = []
    if salt is not None:
        parts.append(f"salt:{salt:016x}")
    if lora is not None:
        parts.append(f"lora:{lora}")
    if mm is not None:
        parts.append(f"mm:{mm}")
    return ",".join(parts)


# How a router reads a block's identity from a ``BlockStored`` event (NVIDIA Dynamo,
# ``lib/kv-router/src/zmq_wire/extra_keys.rs`` and ``deserialize.rs``, ai-dynamo-runtime 1.6.1):
# its content key mixes the token ids with ``lora_name``, a cache namespace and multimodal
# hashes. The namespace is a top-level ``cache_salt`` (map-form events only) or, in either form,
# an item ``"dynamo-cache-salt:<namespace>"`` in the event's FIRST ``extra_keys`` entry; any
# other bare string there is ignored (it would make two tenants' blocks one block). ``lora_id``
# is ignored. vLLM's own decoder (``vllm/distributed/kv_events.py``: ``extra_keys`` is a list of
# tuples of any items, unknown map keys ignored) accepts the tagged item as it is, so the salt
# travels as that item in every salted block's entry, the first included: it needs no field
# outside vLLM's list and reads the same in map and array form.
SALT_TAG = "dynamo-cache-salt:"
LORA_NAME_PREFIX = "lora-"


def salt_namespace(salt: int) -> str:
    """The cache namespace a router keys a salted block by: the salt id (see
    :func:`cache_salt_id`) as 16 lowercase hex digits. A router's query names a tenant by the
    same string (Dynamo's ``/query`` body: ``"cache_salt": salt_namespace(id)``)."""
    return f"{salt & _U64:016x}"


def salt_extra_key(salt: int) -> str:
    """The ``extra_keys`` item naming a cache salt on the wire (in every salted block's
    entry): ``"dynamo-cache-salt:<salt_namespace>"``."""
    return SALT_TAG + salt_namespace(salt)


MM_PAD = "0" * 48
_LOWER_HEX = frozenset("0123456789abcdef")


def is_mm_digest(item: Any) -> bool:
    """Whether ``item`` is a multimodal digest as the plugin writes one: 64 lowercase hex
    digits (plain, as TensorRT-LLM's ``mm_keys``, or in :func:`mm_marker`'s form)."""
    return type(item) is str and len(item) == 64 and set(item) <= _LOWER_HEX


def mm_marker(item: Any) -> Any:
    """A multimodal item's digest (64 hex digits) as every stream of the plugin spells it in
    ``extra_keys``: its first 16 digits, the u64 NVIDIA Dynamo keys the item by, then 48
    zeros, the only 64-hex form Dynamo 1.6.1 reads as a multimodal hash
    (:mod:`kvbm_plugin.wire.router_forms`); anything else as it is."""
    if type(item) is str and len(item) == 64 and not item.endswith(MM_PAD):
        low = item.lower()
        if is_mm_digest(low):
            return low[:16] + MM_PAD
    return item


def mm_extra_key(digest: str, offset: Any = 0) -> Any:
    """One multimodal item in a block's ``extra_keys`` entry, in a form a router mixes into
    the block's content key (Dynamo, ``lib/kv-router/src/zmq_wire/extra_keys.rs``): a 32-byte
    digest (64 hex digits, either case) in :func:`mm_marker`'s form; any other identifier as
    an ``[identifier, start_offset]`` pair (vLLM 0.19's offset-tagged form), since a bare
    string of another shape is ignored there and the block would read as text-only. Called
    by the event sink (TensorRT-LLM's ``mm_keys``) and the consolidator's engine forms."""
    low = digest.lower()
    if is_mm_digest(low):
        return mm_marker(low)
    return [digest, offset if type(offset) is int and 0 <= offset <= _U64 else 0]


def scope_extra_keys(scope: tuple[Any, ...]) -> tuple[str, ...] | None:
    """The ``extra_keys`` entry of a tier block of ``scope`` (LoRA id, salt id[, multimodal
    digests as :func:`mm_marker` spells them]): the digests, then the salt's item, in the
    order the event sink writes a GPU block's (``events.fields.block_extra_keys``), so both
    copies have one identity; None when there are neither. Called by the leader as it
    announces a tier STORE."""
    salt = scope[1]
    keys = tuple(scope[2]) if len(scope) > 2 else ()
    if salt is not None:
        keys += (salt_extra_key(salt),)
    return keys or None


def salt_of_extra_keys(entry: Any) -> str | None:
    """The cache namespace an ``extra_keys`` entry names (the text after :data:`SALT_TAG` in
    its first tagged string item), or None."""
    if not isinstance(entry, (list, tuple)):
        return None
    for item in entry:
        if isinstance(item, str) and item.startswith(SALT_TAG) and len(item) > len(SALT_TAG):
            return item[len(SALT_TAG):]
    return None


def lora_name(task_id: int | None) -> str | None:
    """The ``lora_name`` a block of LoRA task ``task_id`` goes out under: ``"lora-<task id>"``
    (None for the base model).

    TensorRT-LLM names an adapter to its KV cache only by its task id (``LoRARequest``'s
    ``lora_int_id``, ``tensorrt_llm/executor/request.py``; the C++ request and its KV events
    carry ``lora_task_id`` / ``lora_id`` alone), so the name is derived from the id, the same on
    every stream and medium; TensorRT-LLM's own tests spell adapter 0 ``LoRARequest("lora-0",
    0, ...)``. A router's query names the adapter the same way."""
    return None if task_id is None else f"{LORA_NAME_PREFIX}{int(task_id) & _U64}"

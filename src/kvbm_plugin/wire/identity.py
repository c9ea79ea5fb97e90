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
    if sid is not None and not isinstance(sid, bool):
        try:
            return int(sid) & _U64
        except (TypeError, ValueError):
            # Called inside TRT-LLM's allocation: never raise there. A salt we cannot read
            # still isolates: it is keyed by its text, apart from every int id.
            return cache_salt_id(f"cache_salt_id={sid!r}")
    if text is not None:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return cache_salt_id(str(text))
    return None


def lora_of(obj: Any) -> int | None:
    """The LoRA task id of a request-like object, or None (0 and None mean no adapter)."""
    lora = getattr(obj, "lora_task_id", None)
    if lora is None:
        lora = getattr(obj, "py_lora_task_id", None)
    if lora is None or isinstance(lora, bool):
        return None
    lora = int(lora)
    return lora or None


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
    salt = salt_of(obj)
    lora = lora_of(obj)
    mm = multimodal_of(obj)
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


def salt_extra_key(salt: int) -> str:
    """The ``extra_keys`` entry naming a cache salt on the wire (one per salted block)."""
    return f"salt:{salt & _U64:016x}"

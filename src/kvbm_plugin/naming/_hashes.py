"""TensorRT-LLM's names of blocks, computed: the V1 block hash, and the wire form of a V2 key.

A private part of :mod:`kvbm_plugin.naming.names` (import these from there).

**V1 rules.** Where ``RequestData.block_hashes`` is absent (TensorRT-LLM releases up to 1.2.x
and every KVCacheManagerV2), the leader still has to name a tier copy of a block by the hash
TensorRT-LLM's KV cache manager gives it, or a router sees one block under two names. That hash
is a pure function of the block's tokens, its parent's hash, the request's cache salt and LoRA
task id (and multimodal keys, prompt-tuning extra ids), so the leader computes it here.

Bit-exact port of ``BlockKeyHasher::hash`` (NVIDIA/TensorRT-LLM
``cpp/tensorrt_llm/batch_manager/blockKey.cpp``, read at 0bd2980d75e7 where the salt is the
``cacheSaltID`` u64, and at stored file 71072996115 where it is ``std::hash<std::string>`` of
the ``cacheSalt`` string) and of its ``hash32Mix`` / ``hash64Mix`` helpers, as upstream's own
Python form has them (``tensorrt_llm/runtime/kv_cache_hash.py::hash_v1_block_key`` @
991de58c52ac). All arithmetic is modulo 2**64; ``hash32Mix`` wraps its ``value + 0x9E3779B9``
to 32 bits before widening (both operands are ``uint32_t`` in C++).

* the seed is ``len(tokens) ^ (parent * C1)``; the root's parent hash is 0;
* the salt is mixed into the first block of a sequence only (``parent == 0``);
* every token id is mixed as its low 32 bits (two's complement for negative ids), followed by
  its extra id when the request has prompt-tuning extra ids;
* a LoRA task id is mixed into EVERY block when set (task id 0 included: ``std::optional``);
* each multimodal key: its 32-byte hash as eight little-endian 32-bit words, then its start
  offset as u64; a block's keys are the items overlapping it (:func:`mm_block_keys`).

:func:`std_string_hash` is libstdc++'s ``std::hash<std::string>`` (``_Hash_bytes`` with seed
0xc70f6907, the Linux build TensorRT-LLM ships), the salt of the newest revision.

**V2 keys.** KVCacheManagerV2 names a block by its radix key (bytes); its events hand the key
as bytes (the hooks) or as hex (``_normalize_block_hash``). Every path publishes the key's
first 8 bytes, big-endian, read as a signed int64 (:func:`radix_key_hash`), so the buffered
and the hook path name a block alike; a u64 hash is published in its signed form
(:func:`signed_hash`).

**V2 keys, computed** (:func:`v2_root_key`, :func:`v2_block_key`, :func:`v2_chain`): where
TensorRT-LLM's own streaming publisher is the GPU-tier source, its stream carries no salt and
(form 44004b3) no adapter, so the leader computes a request's keys itself, by the radix tree's
rule (``tensorrt_llm/runtime/kv_cache_manager_v2/_block_radix_tree.py``, stored id
55130171628: ``ReuseScope.to_bytes``, ``RootBlock.make_key``, ``Block.make_key``, ``Hasher``;
the same rule TensorRT-LLM's router uses, ``tensorrt_llm/block_hash.py``
``v2_sha256_block_hasher``, stored id 67652511907):

* the root key is ``sha256(scope)``, ``scope`` = one presence-mask byte (bit 0: a LoRA task id,
  bit 1: a salt) followed by each present field as 8 bytes little-endian (LoRA id, then salt);
* a block's key is ``sha256(parent key + each token id as 8 bytes little-endian)``, or 4
  bytes on the newest hasher (:data:`V2_TOKEN_WIDTHS`);
* the salt is the manager's ``_derive_reuse_salt(cache_salt)``: the first 8 bytes of
  ``sha256(cache_salt.encode())``, little-endian (``kv_cache_manager_v2.py``, stored id
  56023105518), not the blake3 ``cache_salt_id`` the V1 hash and the router's helper use;
* multimodal items enter the key as synthetic tokens (``gen_multimodal_cache_key_tokens``:
  the item's digest bytes at its first position) -- not computed here (such a request's
  blocks wait for a name, see :class:`~kvbm_plugin.naming.names.BlockNaming`).

A wire hash is the key's first 8 bytes (forms 44004b3 and 13599e9, :func:`radix_key_hash`) or
its last 8 (the older adapter form, :func:`radix_key_tail_hash`), read as a signed int64.

Pure Python, no TRT-LLM import; called by the leader on the executor thread, by the event
sink (any thread feeding it, under its lock) and by the simulated executor.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

from kvbm_plugin.wire.events import WireFormatError, to_signed_int64

_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1
_K32 = 0x045D9F3B
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_GOLDEN = 0x9E3779B9


def hash32_mix(value: int, seed: int) -> int:
    """``hash32Mix``: a 32-bit avalanche of ``value`` combined into the u64 ``seed``."""
    a = value & _U32
    a = (((a >> 16) ^ a) * _K32) & _U32
    a = (((a >> 16) ^ a) * _K32) & _U32
    a = (a >> 16) ^ a
    t = (a + _GOLDEN) & _U32
    return (seed ^ ((t + ((seed << 6) & _U64) + (seed >> 2)) & _U64)) & _U64


def hash64_mix(value: int, seed: int) -> int:
    """``hash64Mix``: splitmix64's finaliser of ``value`` combined into the u64 ``seed``."""
    b = value & _U64
    b = ((b ^ (b >> 30)) * _C1) & _U64
    b = ((b ^ (b >> 27)) * _C2) & _U64
    b = b ^ (b >> 31)
    return (seed ^ ((b + _GOLDEN + ((seed << 6) & _U64) + (seed >> 2)) & _U64)) & _U64


def v1_block_hash(tokens: Sequence[int], parent: int | None = None, *,
                  salt: int | None = None, lora_task_id: int | None = None,
                  extra_ids: Sequence[int] | None = None,
                  mm_keys: Iterable[tuple[bytes, int]] = ()) -> int:
    """The u64 hash TensorRT-LLM's V1 KV cache manager gives a block of ``tokens`` under
    ``parent`` (None or 0: the first block). ``salt``: the u64 the C++ mixes (``cacheSaltID``,
    or :func:`std_string_hash` of the salt string). ``extra_ids``: one per token when the
    request has prompt-tuning extra ids. ``mm_keys``: (32-byte hash, start offset) per
    multimodal item overlapping the block."""
    p = 0 if parent is None else parent & _U64
    seed = (len(tokens) ^ ((p * _C1) & _U64)) & _U64
    if p == 0 and salt is not None:
        seed = hash64_mix(salt, seed)
    if extra_ids is None:
        for t in tokens:
            seed = hash32_mix(t, seed)
    else:
        if len(extra_ids) != len(tokens):
            raise ValueError(f"v1_block_hash: extra_ids has {len(extra_ids)} entries for "
                             f"{len(tokens)} tokens")
        for t, e in zip(tokens, extra_ids, strict=True):
            seed = hash64_mix(e, hash32_mix(t, seed))
    if lora_task_id is not None:
        seed = hash64_mix(lora_task_id, seed)
    for digest, offset in mm_keys:
        if len(digest) != 32:
            raise ValueError(f"v1_block_hash: a multimodal key hash has {len(digest)} bytes, "
                             "not 32")
        for i in range(0, 32, 4):
            seed = hash32_mix(int.from_bytes(digest[i:i + 4], "little"), seed)
        seed = hash64_mix(offset, seed)
    return seed


# A request's multimodal item as the V1 hasher reads it: (32-byte digest, its runs of prompt
# positions as (first position, number of tokens)); one run where the item is contiguous.
MmItem = tuple[bytes, tuple[tuple[int, int], ...]]


def mm_block_keys(items: Sequence[MmItem], start: int, end: int) -> list[tuple[bytes, int]]:
    """The multimodal keys of the block holding prompt positions ``start..end - 1``, by
    ``generateBlockHashExtraKeys`` (``blockKey.cpp``, stored id 56377047221): for every run of
    every item that overlaps the block, in item then run order, (the item's digest, the offset
    inside the item of the first overlapping token: the tokens of the item's earlier runs,
    plus the overlap's start minus the run's). An item of one run (``multimodal_positions``
    / ``multimodal_lengths``, and every item of the revisions before run metadata,
    ``kvCacheManager.cpp`` stored id 126178160) has offset 0 when it starts inside the block,
    else the block's start minus its position."""
    out: list[tuple[bytes, int]] = []
    for digest, runs in items:
        item_offset = 0
        for position, length in runs:
            if end > position and start < position + length:
                out.append((digest, item_offset + max(start, position) - position))
            item_offset += length
    return out


def v1_chain(tokens: Sequence[int], block_size: int, *, start: int = 0,
             parent: int | None = None, salt: int | None = None,
             lora_task_id: int | None = None, mm_items: Sequence[MmItem] = ()) -> list[int]:
    """Hashes of the full blocks ``start..`` of ``tokens``, chained from ``parent`` (the hash
    of block ``start - 1``; None at the root). ``mm_items``: the request's multimodal items
    (:func:`mm_block_keys` picks each block's)."""
    out: list[int] = []
    for i in range(start, len(tokens) // block_size):
        lo = i * block_size
        parent = v1_block_hash(tokens[lo:lo + block_size], parent, salt=salt,
                               lora_task_id=lora_task_id,
                               mm_keys=mm_block_keys(mm_items, lo, lo + block_size)
                               if mm_items else ())
        out.append(parent)
    return out


def mm_hash_bytes(parts: Sequence[int]) -> bytes:
    """The 32-byte multimodal hash the C++ builds from 8 int32 hash parts (``makeHashArray``:
    each part big-endian)."""
    if len(parts) != 8:
        raise ValueError(f"mm_hash_bytes: {len(parts)} hash parts, not 8")
    return b"".join((p & _U32).to_bytes(4, "big") for p in parts)


_MUL = 0xC6A4A7935BD1E995
_STD_SEED = 0xC70F6907


def _shift_mix(v: int) -> int:
    return v ^ (v >> 47)


def std_string_hash(text: str | bytes) -> int:
    """libstdc++'s ``std::hash<std::string>`` (``std::_Hash_bytes(data, len, 0xc70f6907)``,
    the 64-bit MurmurHash2 variant in libstdc++-v3/libsupc++/hash_bytes.cc)."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    n = len(data)
    h = (_STD_SEED ^ ((n * _MUL) & _U64)) & _U64
    end = n - n % 8
    for i in range(0, end, 8):
        w = int.from_bytes(data[i:i + 8], "little")
        w = (_shift_mix((w * _MUL) & _U64) * _MUL) & _U64
        h = ((h ^ w) * _MUL) & _U64
    if n % 8:
        h = ((h ^ int.from_bytes(data[end:], "little")) * _MUL) & _U64
    h = (_shift_mix(h) * _MUL) & _U64
    return _shift_mix(h)


def radix_key_hash(key: bytes | bytearray | memoryview) -> int:
    """Wire hash of a V2 radix key: its first 8 bytes, big-endian, read as signed int64."""
    if len(key) < 8:
        raise WireFormatError(f"radix block key has {len(key)} bytes, need >= 8: {bytes(key)!r}")
    return int.from_bytes(key[:8], "big", signed=True)


def radix_key_tail_hash(key: bytes | bytearray | memoryview) -> int:
    """Wire hash of a V2 radix key in the older adapter form (``_vllm_wire_hash_from_radix_key``,
    ``kv_cache_events.py`` stored id 58569138750): its last 8 bytes, big-endian, as int64."""
    if len(key) < 8:
        raise WireFormatError(f"radix block key has {len(key)} bytes, need >= 8: {bytes(key)!r}")
    return int.from_bytes(key[-8:], "big", signed=True)


def v2_reuse_salt(cache_salt: str | bytes) -> int:
    """``ReuseScope.salt`` of a ``cache_salt`` string (KVCacheManagerV2's
    ``_derive_reuse_salt``: the first 8 bytes of its SHA-256, little-endian)."""
    data = cache_salt.encode("utf-8") if isinstance(cache_salt, str) else bytes(cache_salt)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def v2_scope_bytes(lora_id: int | None = None, salt: int | None = None) -> bytes:
    """``ReuseScope(lora_id, salt).to_bytes()``: a presence mask, then each field present."""
    out = bytearray((int(lora_id is not None) | int(salt is not None) << 1,))
    for value, what in ((lora_id, "lora_id"), (salt, "salt")):
        if value is not None:
            if type(value) is not int or not 0 <= value <= _U64:
                raise ValueError(f"v2_scope_bytes: {what}={value!r} is not a u64")
            out += value.to_bytes(8, "little")
    return bytes(out)


def v2_root_key(lora_id: int | None = None, salt: int | None = None) -> bytes:
    """``RootBlock.make_key(ReuseScope(lora_id, salt))``: the key every chain starts from."""
    return hashlib.sha256(v2_scope_bytes(lora_id, salt)).digest()


# How many bytes a V2 radix key gives each integer token id, by revision: 8 little-endian
# (``Hasher.update``'s ``array("Q", ...)``, ``_cache_key.py`` @ fa202e2a0fc2, stored id
# 55367474285, and ``_block_radix_tree.py`` stored id 55130171628) or 4 (``array("I", ...)``,
# "matching the C++ backend's 4-byte TokenIdExt layout", ``_block_radix_tree.py`` @
# 27efb004dedb, stored id 57352786808). The stream shows which one an engine runs
# (``BlockNaming``): names are computed under both until one was seen there.
_PACK = {8: "Q", 4: "I"}  # token width -> the array typecode that packs it
V2_TOKEN_WIDTHS = tuple(_PACK)


def v2_block_key(parent_key: bytes, tokens: Sequence[int], width: int = 8) -> bytes:
    """``Block.make_key(parent_key, tokens)`` for text tokens: each token id as ``width``
    bytes little-endian (see :data:`V2_TOKEN_WIDTHS`)."""
    code = _PACK.get(width)
    if code is None:
        raise ValueError(f"v2_block_key: width={width!r} is not one of {V2_TOKEN_WIDTHS}")
    h = hashlib.sha256(parent_key)
    try:
        h.update(array(code, tokens).tobytes() if _LITTLE else
                 b"".join(t.to_bytes(width, "little") for t in tokens))
    except OverflowError:
        raise ValueError(f"v2_block_key: a token id is not in [0, 2**{8 * width}): "
                         f"{list(tokens)!r:.80}") from None
    return h.digest()


def v2_chain(tokens: Sequence[int], block_size: int, *, start: int = 0,
             parent_key: bytes | None = None, lora_id: int | None = None,
             salt: int | None = None, width: int = 8) -> list[bytes]:
    """Radix keys of the full blocks ``start..`` of ``tokens``, chained from ``parent_key``
    (block ``start - 1``'s key; None: the root of scope ``(lora_id, salt)``), each token id
    ``width`` bytes wide."""
    key = v2_root_key(lora_id, salt) if parent_key is None else parent_key
    out: list[bytes] = []
    for i in range(start, len(tokens) // block_size):
        key = v2_block_key(key, tokens[i * block_size:(i + 1) * block_size], width)
        out.append(key)
    return out


_LITTLE = array("Q", [1]).tobytes()[0] == 1  # array packs in machine byte order (x86_64, aarch64)


def parse_hex_hash(value: str, what: str) -> int:
    """Wire hash of a V2 radix key written as hex (:func:`radix_key_hash` of its bytes)."""
    try:
        return radix_key_hash(bytes.fromhex(value[:16]))
    except ValueError:
        raise WireFormatError(f"{what} is not an integer or a hex key of >= 8 bytes: "
                              f"{value!r}") from None


def signed_hash(value: Any, what: str) -> int:
    """Wire form (signed int64) of a TRT-LLM hash given as u64 (or already signed), or as a
    hex string (V2 events with ``v2_sha256`` hashing: the radix key's hex, same rule as
    :func:`radix_key_hash`, so the buffered and the hook path name a block alike)."""
    if type(value) is not int:
        if isinstance(value, str):
            return parse_hex_hash(value, what)
        raise WireFormatError(f"{what} is not an integer: {value!r}")
    return to_signed_int64(value, what)


def parse_hash(value: Any, what: str) -> int:
    """Wire hash of a V2 hook hash argument: bytes key, hex-string key, or int."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return radix_key_hash(value)
    return signed_hash(value, what)

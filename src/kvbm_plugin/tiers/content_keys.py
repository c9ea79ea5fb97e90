"""What a block is called in the host and disk tiers, and where its disk copy lives.

A block's identity in the tiers is a content key: a chained hash over full blocks of token ids
(``cache_salt`` mixed in), :func:`chain_key` / :func:`block_keys`. A disk block is one file per
rank and slot (:func:`block_path`), checked by its :data:`Signature` (:func:`stat_signature`).
Used by both halves of a tier: the leader's :class:`~kvbm_plugin.tiers.index.TierIndex`
(rank 0, the executor thread) and the workers' :class:`~kvbm_plugin.tiers.base.OffloadTier`
(every rank, the transfer and disk threads). Pure Python, standard library only.
"""

from __future__ import annotations

import hashlib
import operator
import os
import struct
from collections.abc import Sequence
from typing import Any, Literal

from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin.consolidator_config import ConfigError

TierName = Literal["host", "disk"]
TIER_HOST: TierName = "host"
TIER_DISK: TierName = "disk"

# Signature of one rank's copy of a disk block: (file size, mtime in ns). Cheap to re-check with
# one stat() call; any rewrite or truncation of the file changes it.
Signature = tuple[int, int]

_U64_MASK = (1 << 64) - 1


_PERSON = b"kvbm-blk"  # the personalisation of a content key with a token past u32
_PERSON_U32 = b"kvbm-blk-u32"  # ... and of every other (chain_key)
_U32_MAX = (1 << 32) - 1


def chain_key(parent: int | None, tokens: Sequence[int], salt: str | None = None) -> int:
    """Content key (u64) of one full block given its parent block's key, tokens and salt: the
    8-byte BLAKE2b digest, read little-endian, of the block's tokens and, where there is a salt,
    ``\\0salt\\0`` + the salt (UTF-8). Where every token is a u32 (every token id in practice):
    person ``kvbm-blk-u32``, the parent key (u64, little-endian; 0 for a root) in BLAKE2b's
    salt field, the tokens as little-endian u32 (32 tokens: one 128-byte compression). Any
    other block: person ``kvbm-blk``, over the parent key as u64 then the tokens as int64. The
    two personalisations keep the forms apart. Keys name blocks inside one engine only (its
    leader's index and its workers' copies); the shared tier's digests are their own
    (``tiers/shared/keys.py``)."""
    p = 0 if parent is None else parent & _U64_MASK
    suffix = b"\x00salt\x00" + salt.encode("utf-8") if salt else b""
    return _key_py(p, tokens, suffix)


def _key_py(parent: int, tokens: Sequence[int], suffix: bytes) -> int:
    """:func:`chain_key` of one block, ``parent`` a u64 (the reference of ``_digests_c.keys``)."""
    tokens = [operator.index(t) for t in tokens]  # (as the compiled form reads them)
    n = len(tokens)
    if all(0 <= t <= _U32_MAX for t in tokens):
        h = hashlib.blake2b(digest_size=8, person=_PERSON_U32,
                            salt=parent.to_bytes(8, "little"))
        h.update(struct.pack(f"<{n}I", *tokens) + suffix)
    else:
        h = _keyed(8, _PERSON).copy()
        h.update(struct.pack(f"<Q{n}q", parent, *tokens) + suffix)
    return int.from_bytes(h.digest(), "little")


def block_keys(tokens: Sequence[int], block_size: int, salt: str | None = None, *,
               start: int = 0, parent: int | None = None) -> list[int]:
    """Content keys of the full blocks ``start..`` of ``tokens`` (``parent`` = key of block
    ``start - 1``): :func:`chain_key` along the chain, in one compiled call (``_digests_c``'s
    ``keys``) where it is built (the leader's match hashes every prompt block on the executor
    thread), else block by block."""
    first = 0 if parent is None else parent & _U64_MASK
    suffix = b"\x00salt\x00" + salt.encode("utf-8") if salt else b""
    if _COMPILED is not None:
        return _COMPILED.keys(first, tokens, block_size, start, suffix)
    return _keys_py(first, tokens, block_size, start, suffix)


def _keys_py(parent: int, tokens: Sequence[int], block_size: int, start: int,
             suffix: bytes) -> list[int]:
    """:func:`block_keys` in Python (the reference of ``_digests_c.keys``): the run's tokens
    packed as u32 once, each block one hashlib call; where a token is not a u32, block by
    block (:func:`_key_py`)."""
    if block_size < 1 or start < 0:
        raise ValueError(f"block_keys: block_size {block_size} must be >= 1 and start "
                         f"{start} >= 0")
    n = len(tokens) // block_size
    if n <= start:
        return []
    run = tokens[start * block_size:n * block_size]
    try:
        packed: bytes | None = _packer(len(run), "I").pack(*run)
    except struct.error:
        packed = None  # a token past u32, or not an int: block by block (which says so)
    blake2b, width = hashlib.blake2b, 4 * block_size
    out: list[int] = []
    for k in range(n - start):
        if packed is None:
            parent = _key_py(parent, run[k * block_size:(k + 1) * block_size], suffix)
        else:
            parent = int.from_bytes(blake2b(
                packed[k * width:(k + 1) * width] + suffix, digest_size=8,
                person=_PERSON_U32, salt=parent.to_bytes(8, "little")).digest(), "little")
        out.append(parent)
    return out


def chained_digests(digest_size: int, person: bytes, first: bytes, tokens: Sequence[int],
                    block_size: int, start: int = 0, *, before: bytes = b"",
                    after: bytes = b"") -> list[bytes]:
    """Digests of the full blocks ``start..`` of ``tokens`` along a chain: each is BLAKE2b
    (``digest_size`` bytes, personalisation ``person``) over the previous digest (``first``
    for block ``start``), ``before``, the block's tokens as little-endian int64 and ``after``
    (the tier content keys and the shared tier's digests, both on the executor thread). The
    compiled form (``_digests_c.c``) where it is built and not switched off
    (``DYN_KVBM_NATIVE``, read once at import), else :func:`_chained_py`."""
    if _COMPILED is not None:
        return _COMPILED.chained(digest_size, person, first, tokens, block_size, start, before,
                                 after, False)
    return _chained_py(digest_size, person, first, tokens, block_size, start, before, after)


def _compiled_digests() -> Any:
    """``_digests_c`` where it is built and ``DYN_KVBM_NATIVE`` does not switch it off, else
    None (also for a value of the switch that is not a boolean: start-up refuses that value
    with its own error, ``_util.compiled.loops``, and both forms give the same digests)."""
    try:
        return _compiled.loops("tier_digests")
    except ConfigError:
        return None


_COMPILED = _compiled_digests()

# Each (digest size, personalisation)'s hash, keyed and sized once; each digest hashes a copy.
_KEYED: dict[tuple[int, bytes], Any] = {}


def _keyed(digest_size: int, person: bytes) -> Any:
    keyed = _KEYED.get((digest_size, person))
    if keyed is None:
        keyed = _KEYED[digest_size, person] = hashlib.blake2b(digest_size=digest_size,
                                                              person=person)
    return keyed


# Compiled packers by token count: ``struct``'s own format cache is shared with every other
# caller in the process and emptied whole when full (a prompt's keys are packed on the
# executor thread; in the engine a one-block prompt's pack took 5 us, against 0.4 us warm).
_PACKERS: dict[tuple[int, str], struct.Struct] = {}
_MAX_PACKERS = 512


def _packer(count: int, code: str) -> struct.Struct:
    """A compiled packer of ``count`` little-endian values of struct type ``code``."""
    packer = _PACKERS.get((count, code))
    if packer is None:
        if len(_PACKERS) >= _MAX_PACKERS:
            _PACKERS.clear()
        packer = _PACKERS[count, code] = struct.Struct(f"<{count}{code}")
    return packer


def _chained_py(digest_size: int, person: bytes, first: bytes, tokens: Sequence[int],
                block_size: int, start: int, before: bytes, after: bytes) -> list[bytes]:
    """:func:`chained_digests` in Python, with hashlib (the reference of ``_digests_c.c``):
    the tokens are packed once, each block hashes a copy of the keyed hash."""
    keyed = _keyed(digest_size, person)
    n = len(tokens) // block_size
    if n <= start:
        return []
    lo, count = start * block_size, (n - start) * block_size
    packed = _packer(count, "q").pack(*tokens[lo:lo + count])
    digest = first
    width = 8 * block_size
    out: list[bytes] = []
    copy = keyed.copy
    for off in range(0, 8 * count, width):
        h = copy()
        h.update(digest + before + packed[off:off + width] + after)
        digest = h.digest()
        out.append(digest)
    return out


def block_path(directory: str, rank: int, slot: int) -> str:
    """Where rank ``rank`` keeps disk slot ``slot`` (shared by the disk tier and the leader)."""
    return os.path.join(directory, f"rank{rank}", f"slot{slot:08d}.kvblk")


def stat_signature(path: str) -> Signature | None:
    """The (size, mtime_ns) of ``path``, or None when it is missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns)

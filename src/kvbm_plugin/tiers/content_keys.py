"""What a block is called in the host and disk tiers, and where its disk copy lives.

A block's identity in the tiers is a 16-byte digest chained over full blocks of token ids
(the reuse scope mixed in), :func:`chain_digest` / :func:`block_keys`: its first 8 bytes are
its content key in the host and disk tiers, all 16 its name in the shared tier. A disk block
is one file per rank and slot (:func:`block_path`), checked by its :data:`Signature`
(:func:`stat_signature`).
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

DIGEST_BYTES = 16  # a block's digest; its first 8 bytes are its content key
_ROOT = bytes(DIGEST_BYTES)  # the parent digest of a chain's first block
_PERSON = b"kvbm-blk"  # the personalisation of a digest with a token past u32
_PERSON_U32 = b"kvbm-blk-u32"  # ... and of every other (chain_digest)
_U32_MAX = (1 << 32) - 1


def chain_digest(parent: bytes | None, tokens: Sequence[int], salt: str | None = None) -> bytes:
    """The 16-byte digest of one full block given its parent block's digest (None for a
    root), its tokens and its reuse scope ``salt`` (``wire.identity.request_scope``: cache
    salt, LoRA adapter, multimodal keys; None for none): BLAKE2b of the block's tokens
    and, where there is a salt, ``\\0salt\\0`` + the salt (UTF-8). Where every token is a
    u32 (every token id in practice): person ``kvbm-blk-u32``, the parent's digest (16 zero
    bytes for a root) in BLAKE2b's salt field, the tokens as little-endian u32 (32 tokens: one
    128-byte compression). Any other block: person ``kvbm-blk``, over the parent's digest then
    the tokens as int64. The two personalisations keep the forms apart.

    One digest names a block everywhere: its first 8 bytes read little-endian
    (:func:`key_of`) are its content key in this engine's host and disk tiers, and all 16 its
    name in the shared tier, across engines (``tiers/shared/keys.py``): the leader hashes a
    prompt once for both."""
    suffix = b"\x00salt\x00" + salt.encode("utf-8") if salt else b""
    return _digest_py(_ROOT if parent is None else parent, tokens, suffix)


def key_of(digest: bytes) -> int:
    """The content key (u64) of the block with ``digest``: its first 8 bytes, little-endian."""
    return int.from_bytes(digest[:8], "little")


def _digest_py(parent: bytes, tokens: Sequence[int], suffix: bytes) -> bytes:
    """:func:`chain_digest` of one block, ``parent`` its 16 bytes (the reference of
    ``_digests_c.keys``, block by block)."""
    tokens = [operator.index(t) for t in tokens]  # (as the compiled form reads them)
    n = len(tokens)
    if all(0 <= t <= _U32_MAX for t in tokens):
        h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=_PERSON_U32, salt=parent)
        h.update(struct.pack(f"<{n}I", *tokens) + suffix)
    else:
        h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=_PERSON)
        h.update(parent + struct.pack(f"<{n}q", *tokens) + suffix)
    return h.digest()


def block_keys(tokens: Sequence[int], block_size: int, salt: str | None = None, *,
               start: int = 0, parent: bytes | None = None,
               digests: list[bytes] | None = None) -> list[int]:
    """Content keys of the full blocks ``start..`` of ``tokens`` (``parent``: the digest of
    block ``start - 1``): :func:`chain_digest` along the chain, each read as :func:`key_of`,
    in one compiled call (``_digests_c``'s ``keys``) where it is built (the leader's match
    hashes every prompt block on the executor thread), else block by block. ``digests``: a
    list the blocks' digests are appended to (the next call's ``parent``, the shared tier's
    names)."""
    if parent is not None and (type(parent) is not bytes or len(parent) != DIGEST_BYTES):
        raise ValueError(f"block_keys: parent {parent!r} is not a {DIGEST_BYTES}-byte digest")
    first = _ROOT if parent is None else parent
    suffix = b"\x00salt\x00" + salt.encode("utf-8") if salt else b""
    if _COMPILED is not None:
        return _COMPILED.keys(first, tokens, block_size, start, suffix, digests)
    return _keys_py(first, tokens, block_size, start, suffix, digests)


def block_digests(tokens: Sequence[int], block_size: int, salt: str | None = None, *,
                  start: int = 0, parent: bytes | None = None) -> list[bytes]:
    """The digests (:func:`chain_digest`) of the full blocks ``start..`` of ``tokens``."""
    out: list[bytes] = []
    block_keys(tokens, block_size, salt, start=start, parent=parent, digests=out)
    return out


def _keys_py(parent: bytes, tokens: Sequence[int], block_size: int, start: int,
             suffix: bytes, digests: list[bytes] | None) -> list[int]:
    """:func:`block_keys` in Python (the reference of ``_digests_c.keys``): the run's tokens
    packed as u32 once, each block one hashlib call; where a token is not a u32, block by
    block (:func:`_digest_py`)."""
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
            parent = _digest_py(parent, run[k * block_size:(k + 1) * block_size], suffix)
        else:
            parent = blake2b(packed[k * width:(k + 1) * width] + suffix,
                             digest_size=DIGEST_BYTES, person=_PERSON_U32, salt=parent).digest()
        out.append(int.from_bytes(parent[:8], "little"))
        if digests is not None:
            digests.append(parent)
    return out


def _compiled_digests() -> Any:
    """``_digests_c`` where it is built and ``DYN_KVBM_NATIVE`` does not switch it off, else
    None (also for a value of the switch that is not a boolean: start-up refuses that value
    with its own error, ``_util.compiled.loops``, and both forms give the same digests)."""
    try:
        return _compiled.loops("tier_digests")
    except ConfigError:
        return None


_COMPILED = _compiled_digests()

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

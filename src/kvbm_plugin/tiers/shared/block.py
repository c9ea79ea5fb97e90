"""One block of the shared tier (:class:`SharedBlock`) and the check of its fields.

What the consolidator needs to advertise a shared block (a STORE of medium EXTERNAL) and what
an announcement carries between engines. :func:`check_block` is called on whatever thread
receives a block from outside the process (the announcement listener, the agent thread) before
the :class:`~kvbm_plugin.tiers.shared.directory.SharedDirectory` takes it; ``make_block``
builds one of fields already checked, for the directory's lookups on TensorRT-LLM's executor
thread (rank 0's leader).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from kvbm_plugin._util.saferepr import saferepr
from kvbm_plugin.tiers.shared.keys import DIGEST_BYTES

_U64: Final = (1 << 64) - 1
_I64_MIN: Final = -(1 << 63)
_I64_MAX: Final = (1 << 63) - 1
_INT_ONLY: Final = frozenset((int,))


@dataclass(frozen=True, slots=True)
class SharedBlock:
    """One block of the shared tier: what the consolidator needs to advertise it (a STORE of
    medium EXTERNAL) and what an announcement carries to the other engines."""

    digest: bytes  # 16 bytes, keys.content_digest: the object key's content part
    parent_digest: bytes | None  # None: the first block of a prompt
    event_hash: int  # TensorRT-LLM's block hash (signed or unsigned 64-bit)
    parent_event_hash: int | None
    token_ids: tuple[int, ...]
    lora_id: int | None
    extra_keys: tuple | None  # as the consolidator takes them (salt item, multimodal keys)


def check_block(block: Any) -> SharedBlock:
    """``block`` if it is a well-formed :class:`SharedBlock`, else ValueError naming the field
    and its value (an announcement from the network, a caller's bug)."""
    if not isinstance(block, SharedBlock):
        raise ValueError(f"not a SharedBlock: {type(block).__name__}")
    if not isinstance(block.digest, bytes) or len(block.digest) != DIGEST_BYTES:
        raise ValueError(f"digest {saferepr(block.digest)} is not {DIGEST_BYTES} bytes")
    parent = block.parent_digest
    if parent is not None and (not isinstance(parent, bytes) or len(parent) != DIGEST_BYTES):
        raise ValueError(f"parent_digest {saferepr(parent)} is not None or {DIGEST_BYTES} "
                         "bytes")
    if parent == block.digest:
        raise ValueError(f"parent_digest equals digest {block.digest.hex()}")
    _check_hash("event_hash", block.event_hash)
    if block.parent_event_hash is not None:
        _check_hash("parent_event_hash", block.parent_event_hash)
    tokens = block.token_ids
    if not isinstance(tokens, tuple) or not tokens:
        raise ValueError(f"token_ids {saferepr(tokens)} is not a non-empty tuple")
    # In C loops (type, min, max): this runs once per block written through, on the
    # executor thread; the first bad token is looked for only when there is one.
    if set(map(type, tokens)) != _INT_ONLY or min(tokens) < _I64_MIN or max(tokens) > _I64_MAX:
        bad = next(t for t in tokens if type(t) is not int or not _I64_MIN <= t <= _I64_MAX)
        raise ValueError(f"token_ids: {saferepr(bad)} is not an int64")
    lora = block.lora_id
    if lora is not None and (type(lora) is not int or not _I64_MIN <= lora <= _I64_MAX):
        raise ValueError(f"lora_id {saferepr(lora)} is not None or an int64")
    extra = block.extra_keys
    if extra is not None and not (isinstance(extra, tuple) and _plain(extra, 0)):
        raise ValueError(f"extra_keys {saferepr(extra)} is not None or a tuple of None, "
                         f"bool, int, float, str, bytes or such tuples ({_EXTRA_DEPTH} deep "
                         "at most)")
    return block


_EXTRA_DEPTH: Final = 4
_SCALARS: Final = (type(None), bool, int, float, str, bytes)


def _plain(value: tuple, depth: int) -> bool:
    """A hashable tuple of scalars and such tuples, nested at most ``_EXTRA_DEPTH``."""
    if depth >= _EXTRA_DEPTH:
        return False
    return all(type(v) in _SCALARS or (type(v) is tuple and _plain(v, depth + 1))
               for v in value)


def _check_hash(field: str, value: Any) -> None:
    if type(value) is not int or not _I64_MIN <= value <= _U64:
        raise ValueError(f"{field} {saferepr(value)} is not a signed or unsigned 64-bit hash")


# SharedBlock's slot setters: a block made for a lookup on the executor thread is built
# through them, half the cost of the frozen dataclass's __init__ (which sets each field with
# object.__setattr__, i.e. through these same descriptors, one Python call each).
_SETTERS: Final = tuple(getattr(SharedBlock, name).__set__ for name in (
    "digest", "parent_digest", "event_hash", "parent_event_hash", "token_ids", "lora_id",
    "extra_keys"))


def make_block(digest: bytes, parent_digest: bytes | None, event_hash: int,
                parent_event_hash: int | None, token_ids: tuple[int, ...], lora_id: int | None,
                extra_keys: tuple | None) -> SharedBlock:
    """``SharedBlock(...)`` of fields already checked."""
    block = object.__new__(SharedBlock)
    s0, s1, s2, s3, s4, s5, s6 = _SETTERS
    s0(block, digest)
    s1(block, parent_digest)
    s2(block, event_hash)
    s3(block, parent_event_hash)
    s4(block, token_ids)
    s5(block, lora_id)
    s6(block, extra_keys)
    return block

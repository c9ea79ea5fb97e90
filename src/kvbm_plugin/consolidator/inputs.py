"""What the consolidator's core accepts: the checks of an event's fields before it changes
anything.

Called by :class:`~kvbm_plugin.consolidator.core.ConsolidatorCore` on its owner's thread, for
each event the compiled loops leave (and every event without them). A refused field raises
:class:`~kvbm_plugin.wire.events.WireFormatError` naming it and its value; anything the output
encoder or the router cannot take is refused here, with its own event only (accepted, it would
fail the encoder and lose the whole output batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from kvbm_plugin.consolidator.blocks import MASK, U64
from kvbm_plugin.wire.events import U32_MAX, WireFormatError
from kvbm_plugin.wire.identity import lora_name as wire_lora_name

_INT_ONLY: Final = {int}


def _plain_key(value: Any) -> bool:
    """An ``extra_keys`` item the consolidator keeps: str, bytes, an int in 64 bits, or an
    ``(identifier, offset)`` pair (a multimodal key in vLLM's offset-tagged form)."""
    t = type(value)
    if t is list or t is tuple:
        return (len(value) == 2 and type(value[0]) is str and type(value[1]) is int
                and -(1 << 63) <= value[1] < (1 << 64))
    return t is str or t is bytes or (t is int and -(1 << 63) <= value < (1 << 64))


def _hashable_entry(entry: Any) -> tuple[Any, ...]:
    return tuple(tuple(k) if type(k) is list else k for k in entry)


def u64_hashes(value: Any, what: str, native: Any) -> list[int]:
    """``value``'s hashes in u64 form (``native``: the compiled loops' module, or None)."""
    if native is not None and type(value) is list:
        out = native.u64_hashes(value)
        if out is not None:
            return out  # else a non-integer: the Python loop below names it
    if not isinstance(value, (list, tuple)):
        raise WireFormatError(f"{what} is not a list: {value!r:.200}")
    # msgpack yields only ints in [-2**63, 2**64): masking is the exact u64 form. The type
    # test drops bools and anything else that is not a hash; a shorter result means one.
    out = [h & MASK for h in value if type(h) is int]
    if len(out) != len(value):
        bad = next(h for h in value if type(h) is not int)
        raise WireFormatError(f"{what} holds a non-integer hash: {bad!r:.100}")
    return out


def stored_fields(parent_raw: Any, tokens: Any, block_size: Any, lora_id: Any,
                  lora_name: Any) -> tuple[int | None, list[int]]:
    """A BlockStored's parent hash (u64 or None) and token ids (a list), its block size,
    LoRA id and name checked."""
    if parent_raw is not None:
        if type(parent_raw) is not int:
            raise WireFormatError(f"BlockStored parent_block_hash is not an integer: "
                                  f"{parent_raw!r:.100}")
        parent_raw &= MASK
    if type(block_size) is not int or block_size <= 0:
        raise WireFormatError(f"BlockStored block_size is invalid: {block_size!r:.100}")
    if type(tokens) is not list:
        if not isinstance(tokens, (list, tuple)):
            raise WireFormatError(f"BlockStored token_ids is not a list: {tokens!r:.100}")
        tokens = list(tokens)
    if tokens and (set(map(type, tokens)) != _INT_ONLY or min(tokens) < 0
                   or max(tokens) > U32_MAX):
        bad = next(t for t in tokens if type(t) is not int or not 0 <= t <= U32_MAX)
        raise WireFormatError(f"BlockStored token_ids holds a value that is not a u32 "
                              f"integer: {bad!r:.100}")
    if lora_id is not None and (type(lora_id) is not int or not 0 <= lora_id < U64):
        raise WireFormatError(f"BlockStored lora_id is not None or a u64 integer: "
                              f"{lora_id!r:.100}")
    if lora_name is not None and type(lora_name) is not str:
        raise WireFormatError(f"BlockStored lora_name is not None or a string: "
                              f"{lora_name!r:.100}")
    return parent_raw, tokens


# The scope :func:`scopes` gives a block of no adapter and no extra keys. The core gives such
# a block the identity it has in an event without scopes, whatever its chain-mates carry:
# TensorRT-LLM stores a multimodal chain's text blocks in the event of its image blocks, and
# a tier copy of a text block comes alone.
UNSCOPED = (None, None)


def scopes(lora_id: Any, lora_name: Any, extra_keys: Any, n: int) -> list[Any]:
    """Per block, what besides tokens names its content: (adapter, extra keys); two
    adapters' or two salts' blocks with the same tokens are different blocks. The adapter
    is what a router reads, its ``lora_name`` (else the name its ``lora_id`` goes out
    under); task id 0 is an adapter, apart from the base model."""
    lora = lora_name if lora_name is not None else wire_lora_name(lora_id)
    if extra_keys is None:
        return [(lora, None)] * n
    if not isinstance(extra_keys, (list, tuple)) or len(extra_keys) != n:
        raise WireFormatError(f"BlockStored extra_keys must be a list of one entry per "
                              f"block ({n}): {extra_keys!r:.100}")
    out = []
    for entry in extra_keys:
        if entry is None:
            out.append((lora, None))
            continue
        if type(entry) not in (list, tuple) or not all(map(_plain_key, entry)):
            # Refused here like any odd value: the output encoder must take what we keep.
            raise WireFormatError(f"BlockStored extra_keys entry is not a list of strings, "
                                  f"bytes or 64-bit integers: {entry!r:.100}")
        out.append((lora, _hashable_entry(entry)))
    return out


def chain_identities(parent_ident: int, tokens: Sequence[Any], block_size: int,
                     scope: list[Any] | None) -> list[int]:
    """The content identity of each block of a stored chain under the parent identity
    ``parent_ident``: ``hash((parent identity, its tokens))``, with its :func:`scopes` entry
    as a third item where it has one (not :data:`UNSCOPED`). Called by the core's Python
    store loop before it changes anything (an unhashable token raises TypeError here); the
    compiled loop takes only unscoped chains and computes the same hashes."""
    tt = tuple(tokens)
    idents = []
    pident = parent_ident
    if scope is None:  # the common case: one test per chain, not per block
        for off in range(0, len(tt), block_size):
            pident = hash((pident, tt[off:off + block_size]))
            idents.append(pident)
        return idents
    for j, off in enumerate(range(0, len(tt), block_size)):
        s = scope[j]
        pident = hash((pident, tt[off:off + block_size])) if s == UNSCOPED \
            else hash((pident, tt[off:off + block_size], s))
        idents.append(pident)
    return idents

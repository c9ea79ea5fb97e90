"""The name (hash) a tier event gives each block: TensorRT-LLM's, never a second one.

A router must see one name per block across media, so the leader's host/disk STOREs carry the
hash TensorRT-LLM's KV cache manager gives the same block on the GPU. In order of preference:

1. ``RequestData.block_hashes``, where TensorRT-LLM hands them over (PR #14806 and later);
2. the V1 block hash the leader computes itself (:mod:`kvbm_plugin.connector.block_hash`)
   from the request's tokens, cache salt and LoRA task id: every text-only request of the
   V1 manager;
3. the hash learned from TensorRT-LLM's own GPU-tier STORE events
   (:class:`~kvbm_plugin.gpu_events.block_names.BlockNames`), which is also the cross-check
   of 2: a computed hash that disagrees with a learned one turns computation off for good
   (counted in ``block_name_mismatches``, logged), so a revision whose hasher differs falls
   back to 3 instead of publishing second names.

A block whose name is none of these yet (a multimodal or prompt-tuning request, a
KVCacheManagerV2, a distrusted hasher) is held back by the leader until it is learned (bounded;
see ``KvbmConnectorLeader``). Called under the leader's lock (executor thread or the leader's
idle keeper thread). Pure Python.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.connector.block_hash import std_string_hash, v1_chain
from kvbm_plugin.connector.requests import RequestState
from kvbm_plugin.gpu_events.block_names import BlockNames

logger = logging.getLogger(__name__)

_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class NameInputs:
    """What TensorRT-LLM's V1 hasher mixes beyond the tokens, read from a request object."""

    salt: int | None  # the u64 the C++ mixes into the first block
    lora: int | None  # the LoRA task id (0 is an adapter too), mixed into every block
    why_not: str | None = None  # why the hash cannot be computed (None: it can)


def name_inputs(obj: Any) -> NameInputs:
    """The V1 hasher's inputs on a request-like object (C++ ``LlmRequest`` or
    ``RequestData``). The salt is ``cache_salt_id`` where the object carries it (the revisions
    whose ``BlockKey`` holds ``cacheSaltID``), else ``std::hash`` of the ``cache_salt`` string
    (the revisions whose ``BlockKey`` holds the string)."""
    if getattr(obj, "multimodal_hashes", None):
        return NameInputs(None, None, "multimodal inputs")
    if getattr(obj, "input_token_extra_ids", None) is not None:
        return NameInputs(None, None, "prompt-tuning extra ids")
    sid = getattr(obj, "cache_salt_id", None)
    salt: int | None = None
    if isinstance(sid, int) and not isinstance(sid, bool):
        salt = sid & _U64
    elif sid is not None:
        return NameInputs(None, None, f"unreadable cache_salt_id {sid!r}")
    else:
        text = getattr(obj, "cache_salt", None)
        if text is None:
            text = getattr(obj, "py_cache_salt", None)
        if text is not None:
            salt = std_string_hash(text if isinstance(text, (str, bytes)) else str(text))
    lora = getattr(obj, "lora_task_id", None)
    if lora is None:
        lora = getattr(obj, "py_lora_task_id", None)
    if lora is not None and (isinstance(lora, bool) or not isinstance(lora, int)):
        return NameInputs(None, None, f"unreadable lora_task_id {lora!r}")
    return NameInputs(salt, lora)


class BlockNaming:
    """TensorRT-LLM's hash of a request's block ``i``: handed over, computed or learned."""

    def __init__(self, block_size: int, stats: dict[str, int]) -> None:
        self._bs = block_size
        self._stats = stats
        stats.setdefault("block_name_mismatches", 0)
        stats.setdefault("block_names_computed", 0)
        self.names = BlockNames(block_size)  # learned from GPU-tier events
        self.learning = False  # the sink feeds self.names (no block_hashes seen)
        self.trusted = True  # computed hashes agree with every learned one so far
        self._log = RateLimitedLog(logger)

    def hash_of(self, state: RequestState, index: int) -> int | None:
        """TRT-LLM's hash of block ``index`` of ``state``, or None while unknown."""
        if index < len(state.event_hashes):
            return int(state.event_hashes[index])
        inputs: NameInputs | None = state.name_inputs
        if self.trusted and inputs is not None and inputs.why_not is None:
            self._compute(state, index + 1)
            if index < len(state.computed):
                return state.computed[index]
        if self.learning and index >= len(state.learned) and not state.event_hashes:
            self.names.extend(state.tokens, state.keys, state.learned)
        if index < len(state.learned):
            return state.learned[index]
        return None

    def _compute(self, state: RequestState, n_blocks: int) -> None:
        done = len(state.computed)
        n = min(n_blocks, len(state.tokens) // self._bs)
        if n <= done:
            return
        inputs: NameInputs = state.name_inputs
        state.computed.extend(v1_chain(
            state.tokens[:n * self._bs], self._bs, start=done,
            parent=state.computed[-1] if done else None, salt=inputs.salt,
            lora_task_id=inputs.lora))
        self._stats["block_names_computed"] += n - done

    def refresh(self, states: Iterable[RequestState]) -> None:
        """Learn from the events published so far (requests without block_hashes) and
        cross-check the computed hashes against what was learned."""
        if not self.names:
            return
        for state in states:
            if state.event_hashes or len(state.learned) >= len(state.keys):
                continue
            before = len(state.learned)
            self.names.extend(state.tokens, state.keys, state.learned)
            if self.trusted and state.computed:
                for i in range(before, min(len(state.learned), len(state.computed))):
                    if state.learned[i] != state.computed[i]:
                        self._distrust(state, i)
                        break

    def _distrust(self, state: RequestState, index: int) -> None:
        self.trusted = False
        self._stats["block_name_mismatches"] += 1
        self._log.log(logging.ERROR, "mismatch", "kvbm_plugin: TensorRT-LLM named block %d of "
                      "request %d %d, the leader computed %d: this TensorRT-LLM hashes blocks "
                      "differently; offload-tier events now wait for the names its GPU events "
                      "carry", index, state.req_id, state.learned[index],
                      state.computed[index])

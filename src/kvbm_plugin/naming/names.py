"""What a block is called: the one place that answers it, for every source.

A router must see one name per block across media and dp ranks, so every event the plugin
publishes names a block by the hash TensorRT-LLM's KV cache manager gives it, never a second
one. Callers import from this module only; its pieces (``naming/_*.py``) are private.

What it answers, and for whom:

* **TensorRT-LLM's hashes, computed** (``_hashes``): the V1 rules (:func:`v1_block_hash`,
  :func:`v1_chain`, :func:`std_string_hash`, :func:`mm_hash_bytes`; the leader and the
  simulated executor) and the wire form of V2 radix keys and u64 hashes
  (:func:`radix_key_hash`, :func:`signed_hash`, :func:`parse_hash`; the event sink).
* **Names learned from events** (``_learned``): :class:`BlockNames` from rank 0's sink, from
  TensorRT-LLM's own streaming publisher (``connector.trtllm_publisher.TrtllmNameFeed``) and, on
  an attention-DP rank r > 0, from its own GPU-tier stream (:class:`StreamNames`).
* **The leader's question** (:class:`BlockNaming`, below): the name of a request's block ``i``.
* **Tier blocks not named yet** (``_unnamed``): :class:`UnnamedStores`, the leader's committed
  host/disk blocks whose STORE waits for the name (``BlockNaming.unnamed``).
* **LoRA adapters** (``_lora``): :class:`LoraNames`, the adapter of each stored chain whose
  events do not name it (the event sink's, named at the root by :meth:`BlockNaming.name_root`).

The leader's order of preference for a request's block:

1. ``RequestData.block_hashes``, where TensorRT-LLM hands them over (PR #14806 and later);
2. the V1 block hash the leader computes itself from the request's tokens, cache salt and LoRA
   task id: every text-only request of the V1 manager. Which salt the C++ mixes differs by
   revision (``cacheSaltID`` or ``std::hash`` of the string), so each input rule (no scope;
   salt id; salt string; with LoRA) is used only once TensorRT-LLM's own GPU STORE events
   carried a hash computed under it (a 64-bit equality: the rule is confirmed); a rule whose
   hash differs from the event's for a block whose parent agreed is refuted for good
   (``block_name_mismatches``, logged);
3. the hash learned from TensorRT-LLM's own GPU-tier STORE events (:class:`BlockNames`).

A block whose name is none of these yet (a multimodal or prompt-tuning request, a
KVCacheManagerV2, a distrusted hasher) waits in :class:`UnnamedStores` until it is learned
(bounded). :class:`BlockNaming` is called under the leader's lock (executor thread or the
leader's idle keeper thread). Pure Python.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.naming._hashes import (
    _U64,
    mm_hash_bytes,
    parse_hash,
    radix_key_hash,
    signed_hash,
    std_string_hash,
    v1_block_hash,
    v1_chain,
)
from kvbm_plugin.naming._learned import BlockNames, StreamNames
from kvbm_plugin.naming._lora import LoraNames
from kvbm_plugin.naming._unnamed import UnnamedStores
from kvbm_plugin.wire.events import to_signed_int64

if TYPE_CHECKING:
    from kvbm_plugin.connector.requests import RequestState

__all__ = ["BlockNames", "BlockNaming", "LoraNames", "NameInputs", "StreamNames",
           "UnnamedStores", "mm_hash_bytes", "name_inputs", "parse_hash", "radix_key_hash",
           "rule_of", "signed_hash", "std_string_hash", "v1_block_hash", "v1_chain"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NameInputs:
    """What TensorRT-LLM's V1 hasher mixes beyond the tokens, read from a request object."""

    salt: int | None  # the u64 the C++ mixes into the first block
    lora: int | None  # the LoRA task id (0 is an adapter too), mixed into every block
    why_not: str | None = None  # why the hash cannot be computed (None: it can)
    salt_kind: str = "id"  # "id": cache_salt_id as is; "string": std::hash of cache_salt


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
    kind = "id"
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
            kind = "string"
    lora = getattr(obj, "lora_task_id", None)
    if lora is None:
        lora = getattr(obj, "py_lora_task_id", None)
    if lora is not None and (isinstance(lora, bool) or not isinstance(lora, int)):
        return NameInputs(None, None, f"unreadable lora_task_id {lora!r}")
    return NameInputs(salt, lora, salt_kind=kind)


def rule_of(inputs: NameInputs) -> tuple[str, bool]:
    """The input rule a computed hash depends on: (salt spelling, LoRA set)."""
    salt = "none" if inputs.salt is None else inputs.salt_kind
    return salt, inputs.lora is not None


class BlockNaming:
    """TRT-LLM's hash of a request's block ``i``: handed over, computed or learned."""

    def __init__(self, block_size: int, stats: dict[str, int]) -> None:
        self._bs = block_size
        self._stats = stats
        for name in ("block_name_mismatches", "block_names_computed",
                     "block_name_rules_confirmed"):
            stats.setdefault(name, 0)
        self.names = BlockNames(block_size)  # learned from GPU-tier events
        self.unnamed = UnnamedStores(self.names, stats)  # tier blocks waiting for a name
        self.learning = False  # the sink feeds self.names (no block_hashes seen)
        # TensorRT-LLM's own stream is the source of names: it carries no salt, and
        # self.names keys blocks by (parent, tokens, LoRA), so a salted request's root would
        # take the name of an unsalted block with the same tokens (the consolidator then
        # mints a name of its own for it). Its blocks wait for a name instead (bounded).
        self.salt_blind = False
        self.confirmed: set[tuple[str, bool]] = set()
        self.refuted: set[tuple[str, bool]] = set()
        self._log = RateLimitedLog(logger)

    @property
    def trusted(self) -> bool:
        """No computed hash was ever refuted by TRT-LLM's events."""
        return not self.refuted

    def _rule(self, state: RequestState) -> tuple[str, bool] | None:
        inputs: NameInputs | None = state.name_inputs
        if inputs is None or inputs.why_not is not None:
            return None
        rule = rule_of(inputs)
        return None if rule in self.refuted else rule

    def hash_of(self, state: RequestState, index: int) -> int | None:
        """TRT-LLM's hash of block ``index`` of ``state``, or None while unknown."""
        if index < len(state.event_hashes):
            return int(state.event_hashes[index])
        rule = self._rule(state)
        if rule is not None:
            self._compute(state, index + 1)
            if rule in self.confirmed and index < len(state.computed):
                return state.computed[index]
        if self.learning and index >= len(state.learned) and not state.event_hashes \
                and self._may_learn(state):
            self.names.extend(state.tokens, state.keys, state.learned, state.scope[0])
        if index < len(state.learned):
            return state.learned[index]
        return None

    def _may_learn(self, state: RequestState) -> bool:
        """Whether the learned names can name ``state``'s blocks (see ``salt_blind``)."""
        return not (self.salt_blind and state.scope[1] is not None)

    def root_hash(self, state: RequestState) -> int | None:
        """TRT-LLM's hash of the request's first block, as best known (for the event sink's
        LoRA names, :class:`LoraNames`): handed over, else the V1 hash
        under the request's inputs, confirmed or not (a wrong one names no block the events
        store: that chain is then counted as unnamed, never misnamed); None when neither."""
        if state.event_hashes:
            return int(state.event_hashes[0])
        if state.computed:
            return state.computed[0]
        inputs: NameInputs | None = state.name_inputs
        if inputs is None or inputs.why_not is not None or len(state.tokens) < self._bs:
            return None
        return v1_block_hash(state.tokens[:self._bs], None, salt=inputs.salt,
                             lora_task_id=inputs.lora)

    def name_root(self, state: RequestState, sink: Any) -> None:
        """Tell the event sink (``KvEventSink.name_lora_root``) the request's first-block hash
        and LoRA task id, once, as soon as the hash is known; a request whose adapter the
        leader did not read from its object (``lora_root_pending`` unset) is never named.
        Called by the leader for each reported request (``build_connector_meta``)."""
        if not state.lora_root_pending or sink is None:
            return
        root = self.root_hash(state)
        if root is not None:
            state.lora_root_pending = False
            sink.name_lora_root(to_signed_int64(root), state.scope[0])

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
        """Learn from the events published so far (requests without block_hashes); confirm or
        refute the rules the computed hashes were made under."""
        if not self.names:
            return
        for state in states:
            if state.event_hashes or len(state.learned) >= len(state.keys) \
                    or not self._may_learn(state):
                continue
            self.names.extend(state.tokens, state.keys, state.learned, state.scope[0])
            rule = self._rule(state)
            if rule is None:
                continue
            self._compute(state, len(state.learned))
            self._check(state, rule)

    def _check(self, state: RequestState, rule: tuple[str, bool]) -> None:
        learned, computed = state.learned, state.computed
        for i in range(min(len(learned), len(computed))):
            if learned[i] == computed[i]:
                if rule not in self.confirmed:
                    self.confirmed.add(rule)
                    self._stats["block_name_rules_confirmed"] += 1
            elif i and learned[i - 1] == computed[i - 1]:
                # Same parent, other hash: the hasher differs (a root-block difference may
                # be another scope's block with the same tokens, so it proves nothing).
                self._refute(state, rule, i)
                return

    def _refute(self, state: RequestState, rule: tuple[str, bool], index: int) -> None:
        self.refuted.add(rule)
        self.confirmed.discard(rule)
        self._stats["block_name_mismatches"] += 1
        self._log.log(logging.ERROR, "mismatch", "kvbm_plugin: TensorRT-LLM named block %d of "
                      "request %d %d, the leader computed %d: this TensorRT-LLM hashes blocks "
                      "differently (rule %s); offload-tier events of such requests now wait "
                      "for the names its GPU events carry", index, state.req_id,
                      state.learned[index], state.computed[index], rule)

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
  TensorRT-LLM's own streaming publisher (``events.trtllm_publisher.TrtllmNameFeed``) and, on
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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin._util.saferepr import saferepr
from kvbm_plugin.naming._hashes import (
    _U64,
    V2_TOKEN_WIDTHS,
    MmItem,
    mm_block_keys,
    mm_hash_bytes,
    parse_hash,
    radix_key_hash,
    radix_key_tail_hash,
    signed_hash,
    std_string_hash,
    v1_block_hash,
    v1_chain,
    v2_block_key,
    v2_chain,
    v2_reuse_salt,
    v2_root_key,
    v2_scope_bytes,
)
from kvbm_plugin.naming._learned import BlockNames, StreamNames
from kvbm_plugin.naming._lora import LoraNames
from kvbm_plugin.naming._unnamed import UnnamedStores
from kvbm_plugin.wire.events import to_signed_int64
from kvbm_plugin.wire.identity import SALT_TEXTS, mm_marker

if TYPE_CHECKING:
    from kvbm_plugin.leader.requests import RequestState

__all__ = ["BlockNames", "BlockNaming", "LoraNames", "MmItem", "NameInputs", "StreamNames",
           "UnnamedStores", "block_scope", "mm_block_keys", "mm_hash_bytes", "name_inputs",
           "parse_hash", "radix_key_hash",
           "radix_key_tail_hash", "rule_of", "signed_hash", "std_string_hash", "v1_block_hash",
           "v1_chain", "v2_block_key", "v2_chain", "v2_reuse_salt", "v2_root_key",
           "v2_scope_bytes"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NameInputs:
    """What TensorRT-LLM's V1 hasher mixes beyond the tokens, read from a request object."""

    salt: int | None  # the u64 the C++ mixes into the first block
    lora: int | None  # the LoRA task id (0 is an adapter too), mixed into every block
    why_not: str | None = None  # why the hash cannot be computed (None: it can)
    salt_kind: str = "id"  # "id": cache_salt_id as is; "string": std::hash of cache_salt
    # KVCacheManagerV2's ReuseScope salt (v2_reuse_salt of the cache_salt string), and why its
    # radix keys cannot be computed (None: they can).
    v2_salt: int | None = None
    v2_why_not: str | None = None
    # The request's multimodal items (digest, runs of positions), mixed into the blocks they
    # overlap (mm_block_keys); () for a text-only request.
    mm: tuple[MmItem, ...] = ()
    # How many of the prompt's first tokens a name learned by (parent, tokens, LoRA) may
    # name: a multimodal item's tokens are placeholders every image shares (prompt-tuning
    # tokens: ids whose extra ids differ), so a learned name from the first item on may be
    # another image's block. All of them for a text request; up to the first item's first
    # position; none where the items or extra ids cannot be read (never advertised then).
    learn_tokens: int = 1 << 62
    # why_not names a field whose value cannot be read (bad input, logged with the value by
    # the leader), not a form the plugin does not follow (prompt tuning, a revision's fields)
    bad_input: bool = False


_NO_INPUTS: Final = NameInputs(None, None)  # a request without salt, adapter or multimodal items

# Revisions between the contiguous and the run-based rule placed items by other fields
# (per-item hash positions; run offsets named ``_cu_seqlen``): not followed, so such a
# request's names are not computed.
_MM_UNFOLLOWED = ("multimodal_hash_positions", "multimodal_item_run_cu_seqlen")
_I32_MAX = (1 << 31) - 1


def _run(position: Any, length: Any) -> tuple[int, int] | None:
    """One run as ``getValidRunEnd`` takes it: a non-negative start, a positive length, an
    end that fits int32; else None."""
    position, length = int(position), int(length)
    if position < 0 or length <= 0 or position + length > _I32_MAX:
        return None
    return position, length


def _item_runs(obj: Any, n_items: int) -> list[tuple[tuple[int, int], ...]] | None:
    """Each item's runs from the request's run metadata (``multimodal_item_run_cu_offsets``,
    ``multimodal_run_positions``, ``multimodal_run_lengths``), as ``resolveRunMetadata`` and
    ``generateRunBasedExtraKeys`` read them (``blockKey.cpp``, stored id 56377047221); None
    where TensorRT-LLM falls back to the contiguous spans (absent, incomplete or invalid)."""
    offsets = getattr(obj, "multimodal_item_run_cu_offsets", None)
    positions = getattr(obj, "multimodal_run_positions", None)
    lengths = getattr(obj, "multimodal_run_lengths", None)
    if not offsets or not positions or not lengths:
        return None
    offsets = [int(o) for o in offsets]
    if len(offsets) != n_items + 1 or offsets[0] != 0 or offsets[-1] != len(positions) \
            or len(positions) != len(lengths):
        return None
    out = []
    for begin, end in zip(offsets, offsets[1:], strict=False):
        if begin < 0 or end < begin or end > len(positions):
            return None
        runs = [_run(positions[k], lengths[k]) for k in range(begin, end)]
        if None in runs:
            return None
        out.append(tuple(runs))  # type: ignore[arg-type]
    return out


_MM_PLACED_BY_HASH_POSITIONS = "multimodal inputs placed by hash positions"


def _mm_items(obj: Any) -> tuple[tuple[MmItem, ...], str | None]:
    """The multimodal items of a request-like object as the V1 hasher reads them
    (``multimodal_hashes``: 8 int32 parts per item; their runs, else ``multimodal_positions``
    and ``multimodal_lengths``: one run each), or why they cannot be read (naming the fields
    and their values where a value is bad)."""
    hashes = getattr(obj, "multimodal_hashes", None)
    if not hashes:
        return (), None
    if any(getattr(obj, f, None) for f in _MM_UNFOLLOWED):
        return (), _MM_PLACED_BY_HASH_POSITIONS
    positions = getattr(obj, "multimodal_positions", None)
    lengths = getattr(obj, "multimodal_lengths", None)
    spans = f"multimodal_positions={saferepr(positions)}, multimodal_lengths={saferepr(lengths)}"
    try:
        digests = [mm_hash_bytes([int(p) for p in h]) for h in hashes]
        by_runs = _item_runs(obj, len(digests))
        if by_runs is not None:
            return tuple(zip(digests, by_runs, strict=True)), None
        if not positions or not lengths or not len(digests) == len(positions) == len(lengths):
            return (), (f"multimodal inputs without one position and length per item "
                        f"({len(digests)} multimodal_hashes; {spans})")
        runs = [_run(p, n) for p, n in zip(positions, lengths, strict=True)]
        if None in runs:  # the newest revision then mixes in no item at all, older ones do
            return (), f"multimodal inputs with an invalid position or length ({spans})"
        return tuple((d, (run,)) for d, run in zip(digests, runs, strict=True)), None
    except (TypeError, ValueError) as exc:
        return (), (f"unreadable multimodal inputs (multimodal_hashes={saferepr(hashes)}; "
                    f"{spans}: {exc})")


def name_inputs(obj: Any) -> NameInputs:
    """The V1 hasher's inputs on a request-like object (C++ ``LlmRequest`` or
    ``RequestData``). The salt is ``cache_salt_id`` where the object carries it (the revisions
    whose ``BlockKey`` holds ``cacheSaltID``), else ``std::hash`` of the ``cache_salt`` string
    (the revisions whose ``BlockKey`` holds the string)."""
    mm, mm_why = _mm_items(obj)
    if mm_why is not None:
        return NameInputs(None, None, mm_why, v2_why_not=mm_why, learn_tokens=0,
                          bad_input=mm_why != _MM_PLACED_BY_HASH_POSITIONS)
    if getattr(obj, "input_token_extra_ids", None) is not None:
        return NameInputs(None, None, "prompt-tuning extra ids",
                          v2_why_not="prompt-tuning extra ids", learn_tokens=0)
    sid = getattr(obj, "cache_salt_id", None)
    salt: int | None = None
    kind = "id"
    text = getattr(obj, "cache_salt", None)
    if text is None:
        text = getattr(obj, "py_cache_salt", None)
    if isinstance(sid, int) and not isinstance(sid, bool):
        salt = sid & _U64
        if text is None:
            text = SALT_TEXTS.get(salt)  # V2 keys need the string the id was made from
    elif sid is not None:
        why = f"unreadable cache_salt_id={saferepr(sid)}"
        return NameInputs(None, None, why, v2_why_not=why, bad_input=True)
    elif text is not None:
        salt = std_string_hash(text if isinstance(text, (str, bytes)) else str(text))
        kind = "string"
    lora = getattr(obj, "lora_task_id", None)
    if lora is None:
        lora = getattr(obj, "py_lora_task_id", None)
    if lora is not None and (isinstance(lora, bool) or not isinstance(lora, int)):
        why = f"unreadable lora_task_id={saferepr(lora)}"
        return NameInputs(None, None, why, v2_why_not=why, bad_input=True)
    v2_salt = None
    v2_why = None
    if text is not None:
        v2_salt = v2_reuse_salt(text if isinstance(text, (str, bytes)) else str(text))
    elif salt is not None:
        v2_why = _NO_SALT_TEXT
    if not mm:
        if salt is None and lora is None and v2_why is None:
            return _NO_INPUTS  # (most requests: no salt, no adapter; one frozen object for all)
        return NameInputs(salt, lora, salt_kind=kind, v2_salt=v2_salt, v2_why_not=v2_why)
    # V2 keys put the digests in the tokens: not computed (docs/event_sources.md).
    return NameInputs(salt, lora, salt_kind=kind, v2_salt=v2_salt,
                      v2_why_not="multimodal inputs", mm=mm,
                      learn_tokens=min(run[0] for _, runs in mm for run in runs))


def rule_of(inputs: NameInputs) -> tuple[str, bool, bool]:
    """The input rule a computed hash depends on: (salt spelling, LoRA set, multimodal)."""
    salt = "none" if inputs.salt is None else inputs.salt_kind
    return salt, inputs.lora is not None, bool(inputs.mm)


def block_scope(state: RequestState, index: int, block_size: int) -> tuple[Any, ...]:
    """The scope a tier copy of the request's block ``index`` carries in its events:
    ``state.scope`` (LoRA id, salt id), and for a block that multimodal items overlap, their
    digests (``wire.identity.mm_marker``, the form the event sink gives TensorRT-LLM's
    ``mm_keys``: ``events.fields.block_extra_keys``), so its identity equals its GPU copy's;
    ``()`` in their place where the request's items cannot be read (the block is never named
    by its tokens alone: :class:`UnnamedStores`). The leader's offload planning, executor thread."""
    inputs: NameInputs | None = state.name_inputs
    if inputs is None or not inputs.mm:
        if inputs is not None and inputs.learn_tokens == 0:
            return (*state.scope, ())
        return state.scope
    lo = index * block_size
    keys = mm_block_keys(inputs.mm, lo, lo + block_size)
    if not keys:
        return state.scope
    return (*state.scope, tuple(mm_marker(digest.hex()) for digest, _ in keys))


class BlockNaming:
    """TRT-LLM's hash of a request's block ``i``: handed over, computed or learned."""

    def __init__(self, block_size: int, stats: dict[str, int]) -> None:
        self._bs = block_size
        self._stats = stats
        for name in ("block_name_mismatches", "block_names_computed",
                     "block_name_rules_confirmed", "requests_names_not_computed"):
            stats.setdefault(name, 0)
        self.names = BlockNames(block_size)  # learned from GPU-tier events
        self.unnamed = UnnamedStores(self.names, stats)  # tier blocks waiting for a name
        self.learning = False  # the sink feeds self.names (no block_hashes seen)
        # TensorRT-LLM's own stream is the source of names: it carries no salt, and
        # self.names keys blocks by (parent, tokens, LoRA), so a salted request's root would
        # take the name of an unsalted block with the same tokens (the consolidator then
        # mints a name of its own for it). Its blocks wait for a name instead (bounded).
        self.salt_blind = False
        # Where that stream is the source: each request's V2 radix keys, computed
        # (v2_extend); its blocks go out under them once one computed key met upstream's own
        # name (the form, the truncation "head" or "tail" and the token width 8 or 4, is then
        # confirmed); scoped blocks' wire hashes are registered in scope_sink
        # (EngineForms.scopes) for the consolidator.
        self.v2_stream = False
        self.scope_sink: Any = None
        self.v2_wire: tuple[str, int] | None = None  # confirmed (truncation, token width)
        self.v2_refuted = False
        self._v2_rules_named = 0  # len(names.seen_rules) when the content keys were last named
        self._v2_pending: dict[tuple[bool, bool], dict[int, bytes]] = {}
        self._v2_pending_n = 0
        for name in ("v2_names_computed", "v2_rule_mismatches", "v2_pending_dropped"):
            stats.setdefault(name, 0)
        self.confirmed: set[tuple[str, bool, bool]] = set()
        # The rules of the requests read so far (inputs_of): while one is neither confirmed
        # nor refuted, the leader reads TensorRT-LLM's events before it may forget a request
        # of that rule (awaiting_events), so that its names can confirm the rule.
        self.rules_in_use: set[tuple[str, bool, bool]] = set()
        self.refuted: set[tuple[str, bool, bool]] = set()
        self._log = RateLimitedLog(logger)

    def inputs_of(self, obj: Any, req_id: int) -> NameInputs:
        """:func:`name_inputs` of a request the leader starts tracking (its match, or its
        first RequestData), counted (``requests_names_not_computed``) and logged, rate-limited,
        where the names of its blocks cannot be computed: a WARNING naming the field and its
        value for bad input, INFO for a form not followed. Executor thread."""
        inputs = name_inputs(obj)
        why = inputs.why_not
        if why is None:
            self.rules_in_use.add(rule_of(inputs))
        else:
            self._stats["requests_names_not_computed"] += 1
            bad = inputs.bad_input
            self._log.log(logging.WARNING if bad else logging.INFO,
                          "names-bad-input" if bad else f"names-not-followed-{why}",
                          "kvbm_plugin: request %d: %s; TensorRT-LLM's names of its blocks are "
                          "not computed (learned from its events where the tokens alone name "
                          "a block; its other tier copies are never advertised; "
                          "requests_names_not_computed=%d)", req_id, why,
                          self._stats["requests_names_not_computed"])
        return inputs

    @property
    def awaiting_events(self) -> bool:
        """Names are learned from TensorRT-LLM's events and a rule in use is neither confirmed
        nor refuted yet: the leader reads this iteration's events before it goes on (the
        first requests of each rule). O(rules), at most 12."""
        return self.learning and not self.rules_in_use <= self.confirmed | self.refuted

    @property
    def trusted(self) -> bool:
        """No computed hash was ever refuted by TRT-LLM's events."""
        return not self.refuted

    def _rule(self, state: RequestState) -> tuple[str, bool, bool] | None:
        inputs: NameInputs | None = state.name_inputs
        if inputs is None or inputs.why_not is not None:
            return None
        rule = rule_of(inputs)
        return None if rule in self.refuted else rule

    def hash_of(self, state: RequestState, index: int) -> int | None:
        """TRT-LLM's hash of block ``index`` of ``state``, or None while unknown."""
        if index < len(state.event_hashes):
            return int(state.event_hashes[index])
        form = self.v2_wire
        if form is not None and self._v2_seen(state):
            keys = state.v2_keys.get(form[1], ())
            if index < len(keys):
                return _wire(keys[index], form[0])
        rule = self._rule(state)
        if rule is not None:
            self._compute(state, index + 1)
            if rule in self.confirmed and index < len(state.computed):
                return state.computed[index]
        learnable = _learnable(state, self._bs)
        if self.learning and index >= len(state.learned) and not state.event_hashes \
                and self._may_learn(state):
            self.names.extend(state.tokens, state.keys, state.learned, state.scope[0],
                              learnable)
        if index < len(state.learned) and index < learnable:
            return state.learned[index]
        return None

    def v2_extend(self, state: RequestState) -> None:
        """Where TensorRT-LLM's own stream is the source (``v2_stream``): compute the V2 radix
        keys of the request's new full blocks (under each token width until the stream showed
        which one the engine uses) and register each scoped block's wire hashes (every form
        until one is confirmed) with its scope in ``scope_sink``, before this iteration's
        events can be published; name the content keys once the form is confirmed. Called
        by the leader for each scheduled request (``build_connector_meta``, executor thread,
        under its lock): one SHA-256 per new block and width."""
        inputs: NameInputs | None = state.name_inputs
        if not self.v2_stream or self.v2_refuted or inputs is None:
            return
        if inputs.v2_why_not is not None:
            # The C++ request carries the salt id only; its string came with RequestData
            # (remembered by the leader before this call: wire.identity.remember_salt_text).
            text = SALT_TEXTS.get(inputs.salt) if inputs.v2_why_not == _NO_SALT_TEXT \
                and inputs.salt is not None else None
            if text is None:
                return
            inputs = state.name_inputs = replace(inputs, v2_salt=v2_reuse_salt(text),
                                                 v2_why_not=None)
        widths = self._widths()
        for width in [w for w in state.v2_keys if w not in widths]:
            del state.v2_keys[width]  # a width the stream did not confirm
        done = len(state.v2_keys.get(widths[0], ()))
        n = min(len(state.tokens) // self._bs, len(state.keys))
        if n <= done:
            return
        chunk = state.tokens[done * self._bs:n * self._bs]
        new_keys: dict[int, list[bytes]] = {}
        for width in widths:
            keys = state.v2_keys.setdefault(width, [])
            new_keys[width] = new = v2_chain(chunk, self._bs, parent_key=keys[-1] if keys
                                             else None, lora_id=inputs.lora,
                                             salt=inputs.v2_salt, width=width)
            keys.extend(new)
        self._stats["v2_names_computed"] += n - done
        scope = state.scope
        sink = self.scope_sink
        truncations = _TRUNCATIONS if self.v2_wire is None else (self.v2_wire[0],)
        if sink is not None and (scope[0] is not None or scope[1] is not None):
            for new in new_keys.values():  # every form until the stream showed which it uses
                for key in new:
                    for truncation in truncations:  # the stream's signed int64 form
                        sink.register(_SIGNED_WIRE[truncation](key), scope)
        rule = _v2_rule(inputs)
        if (self.v2_wire is None or rule not in self.names.seen_rules) \
                and len(self.names.watch) < self.MAX_WATCHED:
            # A salt or adapter rule is used once TensorRT-LLM stored a block under it (a
            # revision that derives the scope otherwise then never names a tier copy), and the
            # form once any computed name was stored. Watched on the stream itself
            # (BlockNames.observe), not through a live request's learned names: a request may
            # finish before its names are read. The first new block and the newest are
            # watched: a prefix already stored is not stored again, the newest block is the
            # one this request is likeliest to store itself.
            for width, new in new_keys.items():
                for key in {new[0], new[-1]}:
                    for truncation in _TRUNCATIONS:
                        self.names.watch[_wire(key, truncation)] = (rule, (truncation, width))
        self._v2_name_keys(state, done)

    MAX_WATCHED = 4096  # computed root names waiting to be seen on the stream, at most
    MAX_PENDING = 1 << 15  # computed names of blocks whose rule is not confirmed yet

    def _widths(self) -> tuple[int, ...]:
        """The token widths a V2 key is computed under: the confirmed one, else every one."""
        return V2_TOKEN_WIDTHS if self.v2_wire is None else (self.v2_wire[1],)

    def _v2_seen(self, state: RequestState) -> bool:
        """Whether the input rule ``state``'s V2 names depend on (salt, adapter) was seen on
        the stream; an unscoped one needs only the form (``v2_wire``)."""
        rule = _v2_rule(state.name_inputs)
        return rule == _PLAIN or rule in self.names.seen_rules

    def _v2_name_keys(self, state: RequestState, start: int) -> None:
        """Map the content keys of blocks ``start..`` to their computed names (for the tier
        blocks that wait for one: ``UnnamedStores``); while their rule is not confirmed, keep
        them (bounded) until it is (:meth:`_v2_flush`): the request may be gone by then."""
        form = self.v2_wire
        by_width = state.v2_keys
        end = min(len(by_width.get(self._widths()[0], ())), len(state.keys))
        if form is not None and self._v2_seen(state):
            keys = by_width[form[1]]
            for i in range(start, end):
                self.names.name_key(state.keys[i], _wire(keys[i], form[0]))
            return
        pending = self._v2_pending.setdefault(_v2_rule(state.name_inputs), {})
        lists = [by_width.get(w) for w in V2_TOKEN_WIDTHS]
        for i in range(start, end):
            if self._v2_pending_n >= self.MAX_PENDING:
                self._stats["v2_pending_dropped"] += end - i  # such blocks wait for a name
                return
            pending[state.keys[i]] = tuple(k[i] if k is not None and i < len(k) else None
                                           for k in lists)
            self._v2_pending_n += 1

    def _v2_flush(self) -> None:
        """Name the kept content keys whose rule (and form) is confirmed now."""
        form = self.v2_wire
        if form is None:
            return
        at = V2_TOKEN_WIDTHS.index(form[1])
        seen = self.names.seen_rules
        for rule in [r for r in self._v2_pending if r == _PLAIN or r in seen]:
            kept = self._v2_pending.pop(rule)
            self._v2_pending_n -= len(kept)
            for key, radix in kept.items():
                if radix[at] is not None:
                    self.names.name_key(key, _wire(radix[at], form[0]))

    def _v2_check(self, state: RequestState) -> None:
        """Confirm the V2 form (truncation and width) where a learned name equals a computed
        one; refute it for good where one differs under a parent that agreed."""
        learned = state.learned
        for width, keys in list(state.v2_keys.items()):
            for i in range(min(len(learned), len(keys))):
                head, tail = _wire(keys[i], "head"), _wire(keys[i], "tail")
                if learned[i] in (head, tail):
                    if self.v2_wire is None:
                        self.v2_wire = ("head" if learned[i] == head else "tail", width)
                        self._v2_flush()
                elif i and learned[i - 1] in (_wire(keys[i - 1], "head"),
                                              _wire(keys[i - 1], "tail")):
                    self.v2_refuted = True
                    self.v2_wire = None
                    self._v2_pending.clear()
                    self._v2_pending_n = 0
                    self._stats["v2_rule_mismatches"] += 1
                    self._log.log(logging.ERROR, "v2-mismatch", "kvbm_plugin: TensorRT-LLM's "
                                  "stream named block %d of request %d %d, not the V2 radix "
                                  "key the leader computed: salted and adapter blocks' tier "
                                  "copies now wait for names", i, state.req_id, learned[i])
                    return

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
                             lora_task_id=inputs.lora,
                             mm_keys=mm_block_keys(inputs.mm, 0, self._bs))

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
            lora_task_id=inputs.lora, mm_items=inputs.mm))
        self._stats["block_names_computed"] += n - done

    def refresh(self, states: Iterable[RequestState]) -> None:
        """Learn from the events published so far (requests without block_hashes); confirm or
        refute the rules the computed hashes were made under."""
        if self.v2_wire is None and not self.v2_refuted and len(self.names.seen_wires) == 1:
            self.v2_wire = next(iter(self.names.seen_wires))  # a watched name was stored
            self._v2_flush()
        if not self.names:
            return
        if self._v2_pending and len(self.names.seen_rules) != self._v2_rules_named:
            self._v2_rules_named = len(self.names.seen_rules)  # a salt/adapter rule seen
            self._v2_flush()
        for state in states:
            if state.event_hashes or len(state.learned) >= len(state.keys) \
                    or not self._may_learn(state):
                continue
            self.names.extend(state.tokens, state.keys, state.learned, state.scope[0],
                              _learnable(state, self._bs))
            if state.v2_keys and not self.v2_refuted:
                self._v2_check(state)
            rule = self._rule(state)
            if rule is None:
                continue
            self._compute(state, len(state.learned))
            self._check(state, rule)

    def _check(self, state: RequestState, rule: tuple[str, bool, bool]) -> None:
        learned, computed = state.learned, state.computed
        mm = state.name_inputs.mm if rule[2] else ()
        bs = self._bs
        for i in range(min(len(learned), len(computed))):
            overlapped = bool(mm) and bool(mm_block_keys(mm, i * bs, (i + 1) * bs))
            if mm and not overlapped:
                continue  # the multimodal rule is shown only by a block an item overlaps
            if learned[i] == computed[i]:
                if rule not in self.confirmed:
                    self.confirmed.add(rule)
                    self._stats["block_name_rules_confirmed"] += 1
            elif overlapped:
                # A learned name keys a block by its tokens, not its items: another image
                # behind the same placeholder tokens has the one found, so a difference
                # proves nothing (only an equality does: 64 bits).
                continue
            elif i and learned[i - 1] == computed[i - 1]:
                # Same parent, other hash: the hasher differs (a root-block difference may
                # be another scope's block with the same tokens, so it proves nothing).
                self._refute(state, rule, i)
                return

    def _refute(self, state: RequestState, rule: tuple[str, bool, bool], index: int) -> None:
        self.refuted.add(rule)
        self.confirmed.discard(rule)
        self._stats["block_name_mismatches"] += 1
        self._log.log(logging.ERROR, "mismatch", "kvbm_plugin: TensorRT-LLM named block %d of "
                      "request %d %d, the leader computed %d: this TensorRT-LLM hashes blocks "
                      "differently (rule %s); offload-tier events of such requests now wait "
                      "for the names its GPU events carry", index, state.req_id,
                      state.learned[index], state.computed[index], rule)


def _learnable(state: RequestState, block_size: int) -> int:
    """How many of a request's first blocks a learned name may name
    (:attr:`NameInputs.learn_tokens`)."""
    inputs: NameInputs | None = state.name_inputs
    return (NameInputs.learn_tokens if inputs is None else inputs.learn_tokens) // block_size


def _v2_rule(inputs: Any) -> tuple[bool, bool]:
    """What a request's V2 names depend on beyond the tokens: (a salt, an adapter)."""
    return inputs.v2_salt is not None, inputs.lora is not None


_PLAIN = (False, False)  # the rule of a request keyed by its tokens alone
_TRUNCATIONS = ("head", "tail")
_SIGNED_WIRE = {"head": radix_key_hash, "tail": radix_key_tail_hash}  # as the stream spells it
_NO_SALT_TEXT = "salt id without its string"


def _wire(key: bytes, truncation: str) -> int:
    """The u64 a stream carries for radix key ``key`` (see :func:`radix_key_hash`)."""
    return int.from_bytes(key[:8] if truncation == "head" else key[-8:], "big")

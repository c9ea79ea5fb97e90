"""The leader's bookkeeping records: one :class:`RequestState` per request TensorRT-LLM
scheduled; in the :class:`OpTable`, one :class:`Op` per demotion or shared-tier load in
flight, and one record per run of blocks that one call scheduled together: a request's saves
(:class:`SaveRun`), its host and disk loads (:class:`LoadRun`), the writes-through to the
shared tier (:class:`SharedRun`).

Owned by ``KvbmConnectorLeader`` on rank 0 (each attention-DP rank's leader has its own); read
and written under the leader's lock only (the executor thread's hooks and the leader's idle
keeper thread). Data only (the table numbers its ops).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvbm_plugin.connector.meta import ERR_FAILED, LoadOp, OpReport
from kvbm_plugin.tiers.base import TierEntry

# The leader's own counters (stats()), each 0 at construction; its collaborators add theirs.
LEADER_STATS = (
    "matched_host_tokens", "matched_disk_tokens", "match_calls", "saves_scheduled",
    "saves_committed", "saves_failed", "demotes_scheduled", "demotes_committed",
    "demotes_failed", "loads_failed", "corrupt_blocks", "stale_disk_blocks",
    "tier_full_skips", "host_evictions", "disk_evictions", "evicted_ahead",
    "demoted_ahead", "demotes_withdrawn", "demotes_ahead_paused", "reports_rejected",
    "cancelled_tokens", "cancels_too_late", "parent_resaves", "orphan_saves_skipped",
    "chain_demotes", "demotes_skipped", "cascade_drops", "orphan_commits_dropped",
    "requests_terminated_silently",
    "saves_discarded_terminated", "gpu_source_silent_iterations", "window_skips",
    "hook_lock_waits", "ops_expired")


@dataclass(slots=True)
class RequestState:
    """What the leader knows about one request."""

    req_id: int
    salt: str | None = None  # reuse scope (cache salt, LoRA) mixed into every tier key
    scope: tuple[int | None, int | None] = (None, None)  # (LoRA id, salt id) for tier events
    tokens: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # Several KV layer groups (leader/layer_groups.py): each group's pages by block index
    # as reported, and the pages bound at allocation for loads; empty for one group.
    group_pages: list[list[int]] = field(default_factory=list)
    alloc_pages: list[list[int]] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # content keys of full blocks
    # The full blocks' digests (tiers.content_keys.chain_digest: keys[i] is digests[i]'s
    # first 8 bytes; the shared tier's names), computed with the keys, always as many
    digests: list[bytes] = field(default_factory=list)
    event_hashes: list[int] = field(default_factory=list)  # RequestData.block_hashes
    # TRT-LLM's V1 block hashes computed by the leader (naming.names), and the inputs
    # they are computed from (None: cannot be computed for this request).
    computed: list[int] = field(default_factory=list)
    name_inputs: Any = None
    learned: list[int] = field(default_factory=list)  # TRT-LLM's hashes seen in GPU events
    # V2 radix keys, computed (naming), by token width (one width once the stream showed it)
    v2_keys: dict[int, list[bytes]] = field(default_factory=dict)
    # The event sink is still to be told its first block's hash and LoRA adapter: only for a
    # request whose object the leader read the adapter from (RequestData names none).
    lora_root_pending: bool = False
    offload_next: int = 0  # first block index not yet considered for offload
    # Blocks [lo, hi) bound to loads from the first tier (the host), touched and pinned by
    # the match: the offload planner passes them in one step, not block by block.
    host_matched: tuple[int, int] | None = None
    valid_tokens: int = 0  # tokens whose KV exists after the last scheduled forward
    prompt_tokens: int = 0  # the first report's tokens (TensorRT-LLM commits only these)
    match_base: int | None = None  # device-computed + connector-loaded tokens at match time
    # A load failed: its first block index, then (the engine computed on it unrecomputed) the
    # block index from which this request's blocks are never offloaded.
    load_failed_at: int | None = None
    offload_stop: int | None = None
    plan: list[tuple[int, str, TierEntry]] = field(default_factory=list)  # (block idx, tier, e)
    load: LoadOp | None = None
    reported: bool = False  # seen in a SchedulerOutput
    saves_inflight: set[int] = field(default_factory=set)  # its SaveRuns' first op ids
    loads_inflight: set[int] = field(default_factory=set)
    finished: bool = False
    # The request object's life: a weak reference where the object allows one (see
    # leader.lifetime); the leader forgets a request TensorRT-LLM dropped without telling.
    handle: Any = None
    last_seen: int = 0  # the leader's iteration that last saw this request scheduled


@dataclass(slots=True)
class Op:
    """One transfer: "save" | "demote" write ``tier``; "load" reads it."""

    kind: str
    tier: str
    key: int
    req_id: int | None
    entry: TierEntry | None = None  # the entry written (save/demote) or read (load)
    reports: dict[int, OpReport] = field(default_factory=dict)
    # A save of a request TRT-LLM terminated without telling (its blocks may be reused before
    # the copy read them): never committed.
    tainted: bool = False
    failed: bool = False  # some rank reported it failed (OpCompletions.apply)

    def signatures(self) -> dict[int, tuple[int, int]] | None:
        """Once every rank reported: each rank's disk signature where its report carries one,
        else None (whether every rank succeeded is ``not failed``)."""
        return {r.rank: r.signature for r in self.reports.values()
                if r.signature is not None} or None


_ERR_BITS = 16  # error codes kept as bits per block (connector.meta's ERR_* are below 4)


class _Run:
    """What every run record holds: op ids ``first .. first + len(entries) - 1``, one per
    block as the metadata carries them, every id mapped to the one record in the
    :class:`OpTable` (the leader pays per block a table slot and the fold of its reports, not
    an :class:`Op`); per rank, the blocks it reported (one bit each, so a rank's copy batch
    is folded in one step: :meth:`mark`); per block, the errors ranks reported. Folded by
    ``OpCompletions.apply``: the run is done once every rank reported every block
    (``done_ranks`` is the TP size); block ``k`` succeeded where no rank failed it (the
    intersection rule of connector/meta.py, per block)."""

    __slots__ = ("first", "entries", "seen", "full", "done_ranks", "errors")

    def __init__(self, first: int, entries: list[Any]) -> None:
        self.first = first
        self.entries = entries
        # Per rank (made at the first report): the blocks it reported, bit k for block k.
        self.seen: list[int] | None = None
        self.full = (1 << len(entries)) - 1  # every block's bit
        self.done_ranks = 0  # ranks that reported every block
        # Per block, bit ``e`` set once a rank failed it with error ``e`` (connector.meta's
        # ERR_*); None while no rank failed any block.
        self.errors: list[int] | None = None

    def mark(self, rank: int, bits: int, tp_size: int) -> int:
        """Rank ``rank`` (``0 <= rank < tp_size``) reported the blocks of ``bits``: 1 where
        that completes the run, 0 where not, -1 (and nothing marked) where it reported one
        of them before (a duplicate report counts once)."""
        seen = self.seen
        if seen is None:
            seen = self.seen = [0] * tp_size
        mine = seen[rank]
        if mine & bits:
            return -1
        seen[rank] = mine = mine | bits
        if mine == self.full:
            self.done_ranks += 1
            return 1 if self.done_ranks == tp_size else 0
        return 0

    def take_back(self, k: int, tp_size: int) -> bool:
        """Block ``k`` will never be reported (``cancel_load`` took it back before the
        metadata left): every rank counts as having reported it. True where that completes
        the run."""
        done = False
        for rank in range(tp_size):
            if self.mark(rank, 1 << k, tp_size) == 1:
                done = True
        return done

    def fail(self, k: int, error: int) -> None:
        """A rank failed block ``k`` (``error``: the report's)."""
        errors = self.errors
        if errors is None:
            errors = self.errors = [0] * len(self.entries)
        # (a code past the known ones, from a malformed report, reads as a plain failure:
        # never a shift by whatever int a peer sent)
        errors[k] |= 1 << (error if 0 <= error < _ERR_BITS else ERR_FAILED)

    def sign(self, k: int, rank: int, signature: tuple[int, int]) -> None:
        """Rank ``rank``'s disk signature of block ``k`` (only a save keeps it)."""


class SaveRun(_Run):
    """The saves of one request's run of blocks into one tier, made by one planner call; block
    ``k`` writes ``entries[k]``, committed where every rank succeeded at it. ``tokens``: the
    token ids the run was reserved with (a block size's per block; None: read from the tier's
    rows), what the run's STOREs carry."""

    __slots__ = ("tier", "req_id", "signatures", "tainted", "tokens")
    kind = "save"

    def __init__(self, tier: str, req_id: int, first: int, entries: list[TierEntry],
                 tokens: list[int] | None = None) -> None:
        super().__init__(first, entries)
        self.tier = tier
        self.req_id = req_id
        self.tokens = tokens
        # Per block, the disk signatures reports carry ({rank: signature}); None: none yet.
        self.signatures: list[dict[int, tuple[int, int]] | None] | None = None
        # Its request was terminated without telling (see Op.tainted): none committed.
        self.tainted = False

    def sign(self, k: int, rank: int, signature: tuple[int, int]) -> None:
        """Rank ``rank``'s disk signature of block ``k`` (a report's)."""
        signatures = self.signatures
        if signatures is None:
            signatures = self.signatures = [None] * len(self.entries)
        by_rank = signatures[k]
        if by_rank is None:
            by_rank = signatures[k] = {}
        by_rank[rank] = signature


class LoadRun(_Run):
    """The loads of one request from the host and disk tiers, bound by one
    ``update_state_after_alloc``. Block ``k`` reads ``entries[k]`` (pinned until its load is
    final) in tier ``tiers[k]``; a block whose errors include ERR_CORRUPT failed its source
    block's check. Finished when every rank reported every block not taken back by
    ``cancel_load`` before the metadata left (``cancelled``). The request's
    ``loads_inflight`` holds ``first`` for the whole run."""

    __slots__ = ("req_id", "tiers", "cancelled")
    kind = "load"

    def __init__(self, req_id: int, first: int, tiers: list[str],
                 entries: list[TierEntry]) -> None:
        super().__init__(first, entries)
        self.req_id = req_id
        self.tiers = tiers
        self.cancelled: set[int] = set()  # blocks taken back before the metadata left


class SharedRun(_Run):
    """The writes-through to the shared tier one planner call (or the host copies a match
    found resident) scheduled, one record for the run (``LeaderSharedTier``'s; ERR_DROPPED
    among its errors: a rank's write queue was full): write ``k`` (op ``first + k``) puts
    the block with digest ``entries[k]`` (its parent's ``parents[k]``, None for a root) from
    host copy ``keys[k]``, scope ``scopes[k]`` (``naming.names.block_scope``), its digest
    keyed under ``key_scope`` (``request_scope``); ``names[k]`` is the host copy's final name
    (event hash, parent event hash, token ids) once known, ``done[k]`` 1 once every rank put
    it. Handed back to the shared tier whole (``LeaderSharedTier.run_done``). Not a
    request's: a write-through outlives its request."""

    __slots__ = ("parents", "keys", "scopes", "key_scope", "names", "done", "_at")
    kind = "shared_save"
    req_id = None

    def __init__(self, first: int, digests: list[bytes], parents: list[bytes | None],
                 keys: list[int], scopes: list[Any], key_scope: str | None,
                 names: list[tuple[int, int | None, tuple[int, ...]] | None]) -> None:
        super().__init__(first, digests)
        self.parents = parents
        self.keys = keys
        self.scopes = scopes
        self.key_scope = key_scope
        self.names = names
        self.done = bytearray(len(digests))
        self._at: dict[int, int] | None = None  # host key -> write index, made when asked

    def position(self, key: int) -> int:
        """The index of the write whose host copy is ``key`` (one of ``keys``): a dict of the
        run's keys made at the first call (a name announced for one of its writes: usually on
        the keeper's thread), not per block when the run is made."""
        at = self._at
        if at is None:
            at = self._at = dict(zip(self.keys, range(len(self.keys)), strict=True))
        return at[key]


_R = TypeVar("_R", bound=_Run)


class OpTable(dict[int, "Op | SaveRun | LoadRun | SharedRun"]):
    """The leader's transfers in flight, by op id. Ids grow by one per op, so along a chain a
    parent's op id is below its children's (reports are finalized in id order). Owned by the
    leader and lent to its tier collaborators, which add their own ops (demotions,
    shared-tier writes) with :meth:`new`; under the leader's lock only."""

    def __init__(self) -> None:
        super().__init__()
        self._next = 1

    def new(self, kind: str, tier: str, key: int, req_id: int | None,
            entry: TierEntry | None = None) -> int:
        """Record a new op and return its id."""
        op_id = self._next
        self._next += 1
        self[op_id] = Op(kind, tier, key, req_id, entry)
        return op_id

    @property
    def next_id(self) -> int:
        """The id the next op or run's first block gets (a run's metadata is made first)."""
        return self._next

    def new_load_run(self, req_id: int, tiers: list[str],
                     entries: list[TierEntry]) -> LoadRun:
        """Record the loads of ``entries`` (from ``tiers``) as one :class:`LoadRun`, with
        consecutive op ids from its ``first`` (:attr:`next_id` before the call)."""
        return self._numbered(LoadRun(req_id, self._next, tiers, entries))

    def new_shared_run(self, digests: list[bytes], parents: list[bytes | None],
                       keys: list[int], scopes: list[Any], key_scope: str | None,
                       names: list[Any]) -> SharedRun:
        """Record the writes-through of ``digests`` (the rest: :class:`SharedRun`'s fields)
        as one :class:`SharedRun`, with consecutive op ids from its ``first``."""
        return self._numbered(SharedRun(self._next, digests, parents, keys, scopes, key_scope,
                                        names))

    def new_run(self, tier: str, req_id: int, entries: list[TierEntry],
                tokens: list[int] | None = None) -> SaveRun:
        """Record the saves of ``entries`` (a chain, in order; reserved with ``tokens``, where
        given) as one :class:`SaveRun`, with consecutive op ids from its ``first``."""
        return self._numbered(SaveRun(tier, req_id, self._next, entries, tokens))

    def _numbered(self, run: _R) -> _R:
        """Map each op id of ``run`` (made with ``first`` = the next id) to it."""
        self._next = last = run.first + len(run.entries)
        for op_id in range(run.first, last):
            self[op_id] = run
        return run

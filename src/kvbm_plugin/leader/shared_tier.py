"""The leader's side of the shared tier: match into it, write-through, and what the router is
told.

:class:`LeaderSharedTier` is owned by :class:`~kvbm_plugin.connector_leader.KvbmConnectorLeader`
and is given what it reads (the leader's
:class:`~kvbm_plugin.leader.offload_tiers.OffloadTiers` for the host copies, the op table,
the stats, the tier events). With
``DYN_KVBM_SHARED_TIER`` set, its constructor (the leader's, a thread-pool thread) opens the
leader's own store client (no segment of its own) and the
:class:`~kvbm_plugin.tiers.shared.directory.SharedDirectory`; :meth:`LeaderSharedTier.start`
(first sizing of the tiers, or an idle tick, once rank 0's worker published its key layout)
starts the :class:`~kvbm_plugin.tiers.shared.agent.SharedAgent`. Everything else runs under the
leader's lock on the executor thread or the leader's idle keeper thread, and reads only the
directory (a table probe per block): never the store.

* **Match** (:meth:`LeaderSharedTier.match`, from ``get_num_new_matched_tokens``): the host/disk
  prefix continues into the shared tier while the directory offers each next block (resident, with
  at least ``DYN_KVBM_SHARED_LOAD_MARGIN_S`` of its lease left, the store available); each offered
  block is pinned in the directory until its load is reported, so the agent keeps renewing its
  lease. Blocks are named by 128-bit digests chained over the prompt and seeded by the request's
  reuse scope (``wire.identity.request_scope``: salt, LoRA task id with task 0 an adapter,
  multimodal keys), so two tenants or adapters never share a shared-tier block.
* **Write-through** (:meth:`LeaderSharedTier.follow`, from the host-save scheduling): each block
  saved to the host tier, and not yet in the shared tier, also gets a
  :class:`~kvbm_plugin.connector.meta.SharedSaveOp` in the same metadata; every rank stages the
  device block in the same copy batch and puts it asynchronously. When every rank reported its put
  ok *and* the host copy is announced (so the block's TensorRT-LLM name is known), the agent is
  told (``committed``): it confirms the objects with ``exists()`` and only then makes the block
  resident, advertised and announced to the other engines. A failed or dropped write on any rank is
  never advertised.
* **What routers see**: the agent's ``on_store``/``on_remove`` are registered with medium
  ``EXTERNAL`` through the leader's tier events: by the agent's own thread into the in-process
  consolidator (thread-safe, off the executor thread), else queued and registered by
  :meth:`LeaderSharedTier.sync` (the TierEventPublisher without a consolidator): exactly the
  blocks the directory holds resident, i.e. the blocks this engine can load.

Never imports torch.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final

from kvbm_plugin.connector import llm_args as _llm_args
from kvbm_plugin.connector.meta import (
    ERR_DROPPED,
    SharedSaveOp,
    SharedSaveOpRun,
    record,
    shared_layout,
)
from kvbm_plugin.consolidator_config import CPU_CACHE_GB, SHARED_TIER, ConfigError
from kvbm_plugin.leader.offload_tiers import OffloadTiers
from kvbm_plugin.leader.requests import OpTable, SharedRun
from kvbm_plugin.settings.shared import load_shared_settings
from kvbm_plugin.tiers.base import TIER_DISK, TIER_HOST, key_of
from kvbm_plugin.tiers.shared.directory import SharedBlock, SharedDirectory
from kvbm_plugin.wire.events import MEDIUM_EXTERNAL
from kvbm_plugin.wire.identity import scope_extra_keys

logger = logging.getLogger("kvbm_plugin.connector_leader")

TIER_SHARED: Final = "shared"
MATCHED_STAT: Final = {TIER_HOST: "matched_host_tokens", TIER_DISK: "matched_disk_tokens",
                       TIER_SHARED: "matched_shared_tokens"}
SHARED_STATS: Final = (
    "matched_shared_tokens", "shared_saves_scheduled", "shared_saves_committed",
    "shared_saves_failed", "shared_saves_unnamed", "shared_saves_skipped_unavailable",
    "shared_loads_failed", "shared_stores_registered", "shared_removes_registered",
    "shared_agent_start_failed", "shared_writes_dropped")
# Finished shared writes that wait for their host copy's name, at most (older ones are given up,
# counted as shared_saves_unnamed: their host copy left the tier unannounced).
MAX_WAITING = 4096


def _nothing() -> None:
    """``on_agent_events`` until the leader sets its keeper's nudge."""


def agent_class() -> type:
    """The leader's shared-tier agent class (imported on first use: it binds ZMQ sockets)."""
    from kvbm_plugin.tiers.shared.agent import SharedAgent

    return SharedAgent


class SharedHold:
    """A shared block in a request's match plan, where host/disk blocks have their TierEntry:
    the digest it was pinned under, the pins this plan holds, ``key`` for the load op."""

    __slots__ = ("digest", "key", "pins")
    slot: Final = -1

    def __init__(self, digest: bytes) -> None:
        self.digest = digest
        self.key = key_of(digest)  # (its host/disk content key: the same block, the same key)
        self.pins = 0


class SharedPins:
    """The shared tier as the plan's code sees a tier index: pin/unpin on the directory."""

    name: Final = TIER_SHARED

    def __init__(self, directory: SharedDirectory) -> None:
        self._directory = directory

    def pin(self, hold: SharedHold) -> bool:
        if not self._directory.pin(hold.digest):
            return False
        hold.pins += 1
        return True

    def unpin(self, hold: SharedHold) -> None:
        hold.pins -= 1
        self._directory.unpin(hold.digest)

    def get(self, key: int) -> None:
        return None  # a load's source is never "forgotten" by the leader: nothing to drop

    def holds(self, hold: SharedHold) -> bool:
        return False  # likewise: no tier entry of the leader's to drop


class LeaderSharedTier:
    """The leader's shared-tier state (see the module docstring); ``settings`` is None when no
    shared tier is configured (then every method is a cheap no-op)."""

    def __init__(self, env: Any, *, host_enabled: bool, group: str, tp_size: int,
                 dp_rank: int, block_size: int, stats: dict[str, int], tier_events: Any,
                 tiers: OffloadTiers, ops: OpTable, lock: Any,
                 thread_safe_events: bool = False) -> None:
        """Leader constructor (thread-pool thread): settings, the leader's store client and
        the directory; nothing when no shared tier is configured. ``lock`` is the leader's
        (the agent's starter thread takes it to hand the agent over). ``thread_safe_events``:
        ``tier_events`` may be called from the agent's thread (the in-process consolidator),
        which then registers the EXTERNAL residency changes itself."""
        self._env = env
        self._group = group
        self._tp_size = tp_size
        self._dp_rank = dp_rank
        self._block_size = block_size
        self._stats = stats
        self._tier_events = tier_events
        self._tiers = tiers
        self._ops = ops
        self._lock = lock
        self._direct = thread_safe_events
        self._closed = False
        self.settings = settings = load_shared_settings(self._env)
        self._store: Any = None
        self.directory: SharedDirectory | None = None
        self.pins: SharedPins | None = None
        self.agent: Any = None
        # Blocks committed since the agent was last woken, handed to it then (wake_agent):
        # each block's fields in make_block's order (the agent's thread makes the SharedBlock)
        # and the scope it is keyed under; the digests handed over that its thread has not
        # queued yet, by hand-over ticket.
        self._commits: list[tuple[tuple[Any, ...], str | None]] = []
        self._handed: deque[tuple[int, list[bytes]]] = deque()
        self._in_hand: dict[bytes, None] = {}
        self._starter: threading.Thread | None = None
        self._agent_events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        # Told (agent thread) when a residency change waits in _agent_events: the leader's
        # keeper, which registers it under the leader's lock (take_agent_events) before a hook
        # would, so the executor thread does not pay for it.
        self.on_agent_events: Callable[[], None] = _nothing
        self._inflight = 0  # writes-through scheduled and not yet reported by every rank
        # Writes-through in flight or waiting for a name: host key -> its run
        # (SharedRun.position: its index there), and (every rank put it, its host copy's name
        # not known yet) op id -> run
        self._by_key: dict[int, SharedRun] = {}
        self._waiting: dict[int, SharedRun] = {}
        self.pending_saves: list[SharedSaveOp | SharedSaveOpRun] = []
        self._stats.update(dict.fromkeys(SHARED_STATS, 0))
        if settings is None:
            return
        if not host_enabled:
            raise ConfigError(f"{SHARED_TIER}={settings.store!r} writes through the host tier; "
                              f"enable it ({CPU_CACHE_GB} or DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_"
                              "BLOCKS)")
        from kvbm_plugin.worker.shared_io import open_store

        self.directory = SharedDirectory(settings.tracked_blocks, settings.lease_s,
                                         settings.load_margin_s)
        self.pins = SharedPins(self.directory)
        self._store = open_store(settings, segment_bytes=0)

    def start(self) -> None:
        """Once rank 0's worker published its key layout (first tier sizing, or an idle tick):
        start the agent on a thread of its own (it binds its sockets and asks the store's
        health, up to about a second: never on the executor thread), with every rank's key
        layout derived from rank 0's (the same page size on every TP rank)."""
        settings = self.settings
        if settings is None or self._starter is not None:
            return
        layout = shared_layout(self._group)
        if layout is None:
            raise ConfigError(f"{SHARED_TIER}={settings.store!r}: no worker registered a KV pool "
                              "in the leader's process (the keys need its page size)")
        layouts = [layout.for_rank(r) for r in range(self._tp_size)]
        endpoint = settings.announce_endpoint or (
            f"tcp://{_llm_args.leader_host(self._env)}:"
            f"{_llm_args.leader_port(self._env) + 2000 + self._dp_rank}")
        self._starter = threading.Thread(
            target=self._run_agent, args=(settings, layouts, endpoint),
            name=f"kvbm-shared-start-r{self._dp_rank}", daemon=True)
        self._starter.start()

    def _run_agent(self, settings: Any, layouts: list[Any], endpoint: str) -> None:
        """The starter thread: build and start the agent; the leader offers and writes shared
        blocks from the moment it is set."""
        try:
            agent = agent_class()(
                settings, self._store, layouts, self.directory,
                on_store=self._on_store, on_remove=self._on_remove,
                announce_endpoint=endpoint, peers=settings.peers)
            agent.start()
        except Exception as exc:
            with self._lock:
                self._stats["shared_agent_start_failed"] += 1
            logger.error("kvbm_plugin: the shared tier (%s=%s) is off for this engine: its "
                         "agent did not start (announcements on %s): %s", SHARED_TIER,
                         settings.store, endpoint, exc)
            return
        with self._lock:  # (its counters are in the leader's stats from now on)
            if self._closed:
                agent.close()
                return
            self.agent = agent

    @property
    def enabled(self) -> bool:
        return self.agent is not None

    def take_saves(self) -> tuple[SharedSaveOp | SharedSaveOpRun, ...]:
        """The write-throughs scheduled since the last call (this iteration's metadata)."""
        out = tuple(self.pending_saves)
        self.pending_saves = []
        return out

    # ------------------------------------------------------------ match (executor thread)

    def match(self, state: Any, start: int, last: int) -> None:
        """Continue ``state.plan`` (blocks ``..start - 1``) with the shared blocks
        ``start..last - 1`` the directory offers now, pinning each."""
        agent, pins = self.agent, self.pins
        if agent is None or pins is None or start >= last or not agent.available:
            return
        digests = state.digests  # (the match's keys': hashed with them)
        directory = self.directory
        assert directory is not None
        for i in range(start, last):
            if directory.lookup(digests[i]) is None:
                return
            hold = SharedHold(digests[i])
            if not pins.pin(hold):
                return
            state.plan.append((i, TIER_SHARED, hold))

    # ------------------------------------------------------------ write-through

    def follow(self, state: Any, index: int, entry: Any) -> None:
        """Block ``index`` of the request is resident in the host tier (``entry``): write it
        through to the shared tier in the next metadata, unless the shared tier has it or is
        writing it already. So a block whose write-through failed (the store was down) is
        written again the next time a request uses its host copy. Executor thread."""
        digests = state.digests
        if index >= len(digests) or not self._ready(1):
            return
        digest = digests[index]
        assert self.directory is not None
        if entry.key in self._by_key or digest in self._in_hand \
                or self.directory.is_tracked(digest):
            return
        self._write_resident(state, [index], [entry])

    def follow_resident(self, state: Any, start: int, stop: int, host: Any) -> None:
        """:meth:`follow` of each of the request's blocks ``start..stop - 1``, resident in
        the host tier ``host`` (a match's run, which touched them): the directory asked once
        for the run, and only a block the shared tier lacks looked up in ``host`` (a pending
        one is not written through, as :meth:`follow` is not called for it). Executor
        thread."""
        digests = state.digests
        if not self._ready(stop - start):
            return
        stop = min(stop, len(digests))
        if stop <= start:
            return
        assert self.directory is not None
        run = digests[start:stop]
        tracked = self.directory.tracked(run)
        if False not in tracked:
            return  # (most runs loaded back: every block written through before)
        keys, by_key, in_hand = state.keys, self._by_key, self._in_hand
        indices: list[int] = []
        entries: list[Any] = []
        for k, digest in enumerate(run):
            if tracked[k] or keys[start + k] in by_key or digest in in_hand:
                continue
            entry, _ = host.probe(keys[start + k])
            if entry is not None:
                indices.append(start + k)
                entries.append(entry)
        if indices:
            self._write_resident(state, indices, entries)

    def follow_run(self, state: Any, start: int, entries: Sequence[Any], first_op: int,
                   blocks: Sequence[int]) -> None:
        """:meth:`follow` of each host save of a run the planner scheduled together: block
        ``start + k`` into ``entries[k]`` by op ``first_op + k`` from device block
        ``blocks[k]``, as one :class:`SharedRun` and one
        :class:`~kvbm_plugin.connector.meta.SharedSaveOpRun` (the workers stage each block in
        the host copy batch of its save). The directory is asked once for the run (under one
        hold of its lock); the run's scope is one (one ``reserve_chain``'s). Where no block
        of the run is tracked or being written (a prompt's new blocks), the records are made
        from slices of the request's digests and keys, not block by block. Executor
        thread."""
        digests = state.digests
        if not self._ready(len(entries)):
            return
        n = min(len(entries), len(digests) - start)
        if n <= 0:
            return
        assert self.directory is not None
        run = digests[start:start + n]
        tracked = self.directory.tracked(run)
        keys = state.keys[start:start + n]
        parents = digests[start - 1:start + n - 1] if start else [None, *run[:-1]]
        by_key, in_hand = self._by_key, self._in_hand
        # (each dict asked only where it holds anything: a lookup per block is a cache miss)
        if True in tracked or (by_key and not by_key.keys().isdisjoint(keys)) \
                or (in_hand and not in_hand.keys().isdisjoint(run)):
            keep = [k for k in range(n)
                    if not (tracked[k] or keys[k] in by_key or run[k] in in_hand)]
            if not keep:
                return
            run = [run[k] for k in keep]
            parents = [parents[k] for k in keep]
            keys = [keys[k] for k in keep]
            after = tuple(first_op + k for k in keep)
            devices = tuple(blocks[k] for k in keep)
        else:
            after = tuple(range(first_op, first_op + n))
            devices = tuple(blocks[:n])
        m = len(run)
        written = self._ops.new_shared_run(run, parents, keys, [entries[0].scope] * m,
                                           state.salt, [None] * m)
        first = written.first
        for key in keys:  # (a plain loop: dict.update of pairs is slower)
            by_key[key] = written
        # (built from its fields' tuple: no NamedTuple __new__; one write: its op)
        self.pending_saves.append(
            record(SharedSaveOp, (first, after[0], devices[0], run[0], -1, 0)) if m == 1
            else record(SharedSaveOpRun, (first, after, devices, tuple(run))))
        self._inflight += m
        self._stats["shared_saves_scheduled"] += m

    def _write_resident(self, state: Any, indices: list[int], entries: list[Any]) -> None:
        """Write the request's blocks ``indices`` through from their resident host copies
        ``entries`` (one :class:`SharedRun`; a ``SharedSaveOp`` each, staged by every rank
        from the host slot). A copy already announced gives the write its name now."""
        digests = state.digests
        run = [digests[i] for i in indices]
        keys = [entry.key for entry in entries]
        waiting_for_name = self._tiers.waiting_for_name
        names = [None if (TIER_HOST, entry.key) in waiting_for_name
                 else (entry.event_hash, entry.parent_event_hash, tuple(entry.token_ids))
                 for entry in entries]
        written = self._ops.new_shared_run(
            run, [digests[i - 1] if i else None for i in indices], keys,
            [entry.scope for entry in entries], state.salt, names)
        first = written.first
        by_key = self._by_key
        for key in keys:
            by_key[key] = written
        pending = self.pending_saves
        for k, entry in enumerate(entries):
            pending.append(SharedSaveOp(first + k, -1, -1, run[k], entry.slot, entry.key))
        self._inflight += len(run)
        self._stats["shared_saves_scheduled"] += len(run)

    def _ready(self, n: int) -> bool:
        """Whether blocks are written through now: False (counted for ``n`` blocks where the
        store is unavailable) when nothing is."""
        agent = self.agent
        if agent is None:
            return False
        if not agent.available:
            self._stats["shared_saves_skipped_unavailable"] += n
            return False
        return True

    def host_copy_announced(self, index: Any,
                            announced: list[tuple[Any, tuple[Any, ...]]]) -> None:
        """Host copies were announced, each ``(entry, its final name: (event hash, parent
        event hash, token ids))`` (``OffloadTiers.announce_all``): a write-through of one
        waiting for the name is committed now."""
        if index is not self._tiers.host or not self._by_key:
            return
        by_key = self._by_key
        for entry, name in announced:
            run = by_key.get(entry.key)
            if run is None:
                continue
            k = run.position(entry.key)
            event_hash, parent_hash, tokens = name
            run.names[k] = (event_hash, parent_hash, tuple(tokens))
            if run.done[k]:
                self._commit(run, k)

    def run_done(self, run: SharedRun) -> None:
        """Every rank reported every block of ``run`` (leader, under its lock): each write
        that every rank did is committed (or waits for its host copy's name); any other is
        forgotten."""
        errors = run.errors
        n = len(run.entries)
        self._inflight -= n
        if errors is None and self.agent is not None:
            # Every write succeeded: each named one committed here (_save_done and _commit
            # inline, each scope's extra keys made once), the others as any.
            commits, by_key, waiting = self._commits, self._by_key, self._waiting
            digests, parents, keys, names = run.entries, run.parents, run.keys, run.names
            scopes, key_scope, done, first = run.scopes, run.key_scope, run.done, run.first
            scope, extra = None, None
            committed = 0
            for k in range(n):
                name = names[k]
                if name is None:
                    self._save_done(run, k)
                    continue
                done[k] = 1
                if scopes[k] is not scope:
                    scope = scopes[k]
                    extra = scope_extra_keys(scope)
                commits.append(((digests[k], parents[k], name[0], name[1], name[2], scope[0],
                                 extra), key_scope))
                committed += 1
                if waiting:
                    waiting.pop(first + k, None)
                if by_key.get(keys[k]) is run:
                    del by_key[keys[k]]
            self._stats["shared_saves_committed"] += committed
            return
        for k in range(n):
            if errors is not None and errors[k]:
                self._stats["shared_saves_failed"] += 1
                if errors[k] >> ERR_DROPPED & 1:
                    self._stats["shared_writes_dropped"] += 1  # a rank's write queue was full
                self._forget(run, k)
            else:
                self._save_done(run, k)

    def _save_done(self, run: SharedRun, k: int) -> None:
        """Every rank wrote write ``k`` of ``run`` through."""
        run.done[k] = 1
        if run.names[k] is not None:
            self._commit(run, k)
            return
        host = self._tiers.host.get(run.keys[k]) if self._tiers.host is not None else None
        if host is None:
            self._stats["shared_saves_unnamed"] += 1
            self._forget(run, k)
            return
        self._waiting[run.first + k] = run  # its host copy is announced later
        while len(self._waiting) > MAX_WAITING:
            op_id, oldest = next(iter(self._waiting.items()))
            self._stats["shared_saves_unnamed"] += 1
            self._forget(oldest, op_id - oldest.first)

    def _commit(self, run: SharedRun, k: int) -> None:
        name = run.names[k]
        assert name is not None and self.agent is not None
        event_hash, parent_hash, tokens = name
        scope = run.scopes[k]
        # (the block's fields: the agent's thread makes and checks the block when it takes
        # wake_agent's hand-over)
        self._commits.append(((
            run.entries[k], run.parents[k], event_hash, parent_hash, tokens, scope[0],
            scope_extra_keys(scope)), run.key_scope))
        self._stats["shared_saves_committed"] += 1
        self._forget(run, k)

    def wake_agent(self, forget_queued: bool = True) -> None:
        """Hand the agent the blocks committed since the last call and wake its thread once:
        called by the leader after each batch of reports and by :meth:`sync` (a commit of a
        block whose host copy was named late), not once per block (each wake-up is a write to
        its pipe, and the thread it wakes takes the GIL from the executor thread).
        ``forget_queued``: first drop the digests the agent has queued since from those in
        hand (a dict pop per block: :meth:`sync`, every iteration on the executor thread,
        leaves that to the next batch of reports, usually the keeper's; until then such a
        block is tracked by the directory anyway, so nothing is written through twice)."""
        handed = self._handed
        if forget_queued and handed and self.agent is not None:
            done = self.agent.wakes_handled
            while handed and handed[0][0] <= done:
                for digest in handed.popleft()[1]:
                    self._in_hand.pop(digest, None)
        if not self._commits:
            return
        commits, self._commits = self._commits, []
        agent = self.agent
        if agent is None:
            return
        # The agent's thread checks and queues them (SharedAgent.hand_over). Until it has,
        # their digests are in hand here, so that follow writes none of them through again.
        ticket = agent.hand_over(commits)
        if ticket:
            digests = [fields[0] for fields, _ in commits]
            handed.append((ticket, digests))
            in_hand = self._in_hand
            for digest in digests:
                in_hand[digest] = None

    def _forget(self, run: SharedRun, k: int) -> None:
        op_id, key = run.first + k, run.keys[k]
        self._waiting.pop(op_id, None)
        if self._by_key.get(key) is run:
            del self._by_key[key]

    # ------------------------------------------------------------ events, stats, shutdown

    def sync(self) -> None:
        """Register the agent's residency changes with medium EXTERNAL (executor thread or
        idle keeper, under the leader's lock), parents before children as the agent made
        them; give up waiting writes whose host copy left the tier unannounced. Starts the
        agent as soon as rank 0's worker published its layout, so an idle engine already
        learns the blocks the others announce. Wakes the agent for the blocks committed
        since the last wake-up (:meth:`wake_agent`)."""
        if self.agent is None:
            if self._starter is None and self.settings is not None \
                    and shared_layout(self._group) is not None:
                self.start()
            return
        self.take_agent_events()
        # commits of blocks whose host copy was named since (announce_named)
        self.wake_agent(forget_queued=False)
        if self._waiting and self._tiers.host is not None:
            for op_id, run in list(self._waiting.items()):
                k = op_id - run.first
                if self._tiers.host.get(run.keys[k]) is None:
                    self._stats["shared_saves_unnamed"] += 1
                    self._forget(run, k)

    def take_agent_events(self) -> None:
        """Register the residency changes the agent queued (for a target that is not
        thread-safe), in the agent's order. Under the leader's lock: the keeper's apply as soon
        as the agent told it (``on_agent_events``), else :meth:`sync` in a hook."""
        events = self._agent_events
        # (asked first: most calls find it empty, and an Empty raised and caught each time
        # cost the executor thread more than the rest of this method; the only reader is
        # whoever holds the leader's lock)
        while not events.empty():
            kind, item = events.get_nowait()
            if kind == "store":
                self._register_store(item)
            else:
                self._register_remove(item)

    def _on_store(self, block: SharedBlock) -> None:
        """The agent made ``block`` resident (agent thread). A thread-safe target (the
        in-process consolidator: its ``register_*`` queue for its ingest thread) is told here,
        so the executor thread never pays for it; any other target (the TierEventPublisher,
        a recorder) is told under the leader's lock, by the keeper it nudges
        (:meth:`take_agent_events`) or a hook's :meth:`sync`, whichever comes first."""
        if self._direct:
            self._register_store(block)
        else:
            self._agent_events.put(("store", block))
            self.on_agent_events()

    def _on_remove(self, blocks: Sequence[SharedBlock]) -> None:
        """The agent dropped ``blocks`` (agent thread); as :meth:`_on_store`."""
        if self._direct:
            self._register_remove(blocks)
        else:
            self._agent_events.put(("remove", blocks))
            self.on_agent_events()

    def _register_remove(self, blocks: Sequence[SharedBlock]) -> None:
        if blocks:
            self._tier_events.register_remove(MEDIUM_EXTERNAL, self._dp_rank,
                                              [b.event_hash for b in blocks])
            self._stats["shared_removes_registered"] += len(blocks)

    def _register_store(self, block: SharedBlock) -> None:
        # The scope only when there is one, as for host/disk blocks (OffloadTiers.announce).
        scope: dict[str, Any] = {}
        if block.lora_id is not None:
            scope["lora_id"] = block.lora_id
        if block.extra_keys is not None:
            scope["extra_keys"] = tuple(block.extra_keys)
        self._tier_events.register_store(MEDIUM_EXTERNAL, self._dp_rank, block.event_hash,
                                         block.parent_event_hash, block.token_ids,
                                         self._block_size, **scope)
        self._stats["shared_stores_registered"] += 1

    def resident_hashes(self) -> set[int]:
        """Event hashes the directory holds resident (what this engine advertises as
        EXTERNAL, once registered); tests and the demo."""
        if self.directory is None:
            return set()
        return {b.event_hash for b in self.directory.blocks()}

    def stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        if self.directory is not None:
            out.update({f"shared_dir_{k}": v for k, v in self.directory.stats().items()})
        if self.agent is not None:
            out.update({f"shared_agent_{k}": v for k, v in self.agent.stats().items()})
        out["shared_writes_inflight"] = self._inflight
        return out

    def close(self, timeout: float) -> None:
        """Leader shutdown (outside the leader's lock, after the idle keeper stopped): stop the
        agent, register what it changed last, close the client."""
        with self._lock:
            self._closed = True  # an agent that starts from now on is closed at once
        starter = self._starter
        if starter is not None:  # (shutdown runs outside the lock the starter takes)
            starter.join(timeout)
        if self.agent is not None:
            self.agent.close()
            self.sync()
        if self._store is not None:
            self._store.close()

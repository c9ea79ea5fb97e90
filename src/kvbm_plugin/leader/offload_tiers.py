"""The leader's offload tiers: the host and disk slot indexes, lookups, evictions (REMOVEs),
demotions to disk, and under which name each committed block's STORE is announced.

:class:`OffloadTiers` is owned by :class:`~kvbm_plugin.connector_leader.KvbmConnectorLeader`
(one per leader: rank 0, or each attention-DP rank); every method runs under the leader's lock,
on the executor thread or the leader's idle keeper thread. It reads the request states and the
leader's op table only as arguments and the lent :class:`~kvbm_plugin.leader.requests.OpTable`.
Never imports torch.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import Any

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.connector.meta import DemoteOp, TierLayout, pool_layout
from kvbm_plugin.consolidator_config import CPU_CACHE_GB, DISK_CACHE_GB, ConfigError, TierSettings
from kvbm_plugin.leader.requests import Op, OpTable
from kvbm_plugin.naming.names import BlockNaming
from kvbm_plugin.tiers.base import (
    TIER_DISK,
    TIER_HOST,
    TierEntry,
    TierIndex,
    block_path,
    stat_signature,
)
from kvbm_plugin.wire.events import MEDIUM_CPU, MEDIUM_DISK
from kvbm_plugin.wire.identity import scope_extra_keys

# One block write as finish_writes takes it: (kind "save" | "demote", tier, the entry written,
# every rank succeeded, {rank: disk signature} or None, its request terminated unannounced).
Write = tuple[str, str, "TierEntry | None", bool, "dict[int, tuple[int, int]] | None", bool]
# A Write's kind for a run of saves every rank wrote: its entry is the run's list of entries
# (OffloadTiers.finish_writes).
RUN_OF_SAVES = "saves"

logger = logging.getLogger("kvbm_plugin.connector_leader")
MEDIUM = {TIER_HOST: MEDIUM_CPU, TIER_DISK: MEDIUM_DISK}
_NO_SCOPE = (None, None)  # no adapter, no salt, no multimodal item: a new index row's scope
# Eviction ahead of need (OffloadTiers.evict_ahead): in a tier of at least this many blocks,
# the keeper keeps this many slots free, evicting at most EVICT_AHEAD_STEP per call (about
# 2 µs each under the leader's lock: a hook that needs the lock meanwhile waits at most
# that long, counted in hook_lock_waits).
EVICT_AHEAD_MIN_CAPACITY = 16384
EVICT_AHEAD_SLOTS = 256
EVICT_AHEAD_STEP = 128
# Demotion ahead of need (OffloadTiers.demote_ahead): the host tier's next victims (leaves)
# whose chains are copied to disk ahead, at most EVICT_AHEAD_STEP blocks per call. A leaf's
# ancestors follow it out as they become leaves, so a few leaves cover the next evictions of
# long chains; more would hold copies on disk long before their host blocks leave.
DEMOTE_AHEAD_VICTIMS = 16
# After a demotion failed (a failing disk: full, read-only, gone), demotions ahead of need
# pause for this long, doubling at each failure after a pause up to DEMOTE_AHEAD_PAUSE_MAX_S,
# back to the first once one commits: the victims stay in host, so without it the keeper
# would copy the same victims again at every apply, each copy failing (seconds).
DEMOTE_AHEAD_PAUSE_S = 1.0
DEMOTE_AHEAD_PAUSE_MAX_S = 60.0


def _scope_fields(block_scope: tuple[Any, ...]) -> tuple[int | None, Any]:
    """(LoRA id, extra keys) of a tier block's scope as its STORE carries them."""
    if block_scope == _NO_SCOPE:
        return None, None
    return block_scope[0], scope_extra_keys(block_scope)


class OffloadTiers:
    """The host and disk tier indexes of one leader and the tier events they cause.

    Sized on first use (:meth:`ensure`); ``host``/``disk`` are None until then or when the tier
    is off. Committed blocks whose TensorRT-LLM name is not known yet wait among the naming's
    unnamed stores (:class:`~kvbm_plugin.naming.names.UnnamedStores`, bounded), announced once
    named.
    ``on_announced(index, [(entry, name), ...])`` is called after each call that registers
    tier STOREs, each block with the name it went out under, ``(event hash, parent event
    hash, token ids)`` (the shared tier's write-through waits for its host copy's name)."""

    def __init__(self, settings: TierSettings, *, group: str, tp_size: int, attention_dp: bool,
                 dp_rank: int, block_size: int, stats: dict[str, int], tier_events: Any,
                 naming: BlockNaming, ops: OpTable, log: RateLimitedLog) -> None:
        self._settings = settings
        self._group = group
        self._tp_size = tp_size
        self._attention_dp = attention_dp
        self._dp_rank = dp_rank
        self._block_size = block_size
        self._stats = stats
        self._tier_events = tier_events
        self._naming = naming
        self._ops = ops
        self._log = log
        self.host: TierIndex | None = None
        self.disk: TierIndex | None = None
        self.layout: TierLayout | None = None
        self.disk_dir: str | None = None
        self._own_disk_dir = False
        self.pending_demotes: list[DemoteOp] = []  # for the next metadata
        # demote_ahead's pause after a failed demotion: the counters last seen, the pause's
        # end (monotonic seconds) and its next length
        self._demotes_seen = (0, 0)
        self._demote_pause_until = 0.0
        self._demote_pause_s = DEMOTE_AHEAD_PAUSE_S
        # (medium, event hash) of the advertised blocks evicted since flush_evicted
        self._evicted: list[tuple[str, int]] = []
        self.on_announced: Callable[[TierIndex, list[tuple[TierEntry, tuple[Any, ...]]]],
                                    None] | None = None

    def index_of(self, tier: str) -> TierIndex | None:
        return self.host if tier == TIER_HOST else self.disk

    def take_demotes(self) -> tuple[DemoteOp, ...]:
        """The demotions scheduled since the last call (for this iteration's metadata)."""
        out = tuple(self.pending_demotes)
        self.pending_demotes = []
        return out

    def close(self) -> None:
        """Remove a temporary disk directory this leader made (leader shutdown)."""
        if self._own_disk_dir and self.disk_dir and os.path.isdir(self.disk_dir):
            shutil.rmtree(self.disk_dir, ignore_errors=True)

    def ensure(self) -> TierLayout:
        """Size the tier indexes on first use (rank 0's worker has registered the pool by then:
        TRT-LLM calls register_kv_caches before the first iteration)."""
        if self.layout is not None:
            return self.layout
        settings = self._settings
        layout = pool_layout(self._group)
        bytes_per_block = layout[1] if layout else 0
        needs_bytes = ((settings.host_enabled and not settings.cpu_num_blocks)
                       or (settings.disk_enabled and not settings.disk_num_blocks))
        if needs_bytes and not bytes_per_block:
            raise ConfigError(f"{CPU_CACHE_GB}/{DISK_CACHE_GB} need the block size in bytes, but "
                              "no worker registered a KV pool in this process; set "
                              "DYN_KVBM_*_OVERRIDE_NUM_BLOCKS instead")
        host_blocks = settings.host_blocks(bytes_per_block) if settings.host_enabled else 0
        disk_blocks = settings.disk_blocks(bytes_per_block) if settings.disk_enabled else 0
        if host_blocks:
            self.host = TierIndex(TIER_HOST, host_blocks)
        if disk_blocks:
            # Nothing copies a disk block to another tier: its tokens are needed only until its
            # STORE is registered (64 B per block of a 16-token block at rest otherwise).
            self.disk = TierIndex(TIER_DISK, disk_blocks, keep_tokens=False)
            if settings.disk_cache_dir:
                self.disk_dir = settings.disk_cache_dir
                if self._attention_dp:
                    # Each attention-DP rank's own share: its slot files never meet another's.
                    self.disk_dir = os.path.join(self.disk_dir, f"dp{self._dp_rank}")
                    os.makedirs(self.disk_dir, exist_ok=True)
            else:
                self.disk_dir = tempfile.mkdtemp(prefix="kvbm-plugin-disk-")
                self._own_disk_dir = True
                atexit.register(shutil.rmtree, self.disk_dir, True)
        self.layout = TierLayout(host_blocks, disk_blocks, self.disk_dir)
        return self.layout

    def lookup(self, key: int) -> tuple[str, TierEntry] | None:
        if self.host is not None:
            entry = self.host.lookup(key)
            if entry is not None:
                return TIER_HOST, entry
        entry = self._lookup_disk(key)
        return None if entry is None else (TIER_DISK, entry)

    def _lookup_disk(self, key: int) -> TierEntry | None:
        """The disk tier's resident entry for ``key`` whose files are intact (a stale one is
        forgotten, counted), or None."""
        if self.disk is None:
            return None
        entry = self.disk.lookup(key)
        if entry is None:
            return None
        if self.disk_intact(entry):
            return entry
        self._stats["stale_disk_blocks"] += 1
        self.drop(self.disk, entry)
        return None

    def match(self, keys: Sequence[int], first: int, last: int,
              ) -> list[tuple[int, str, TierEntry]]:
        """``(block index, tier, entry)`` of blocks ``first..`` of ``keys`` (before ``last``),
        each found in the host tier, else the disk tier (:meth:`lookup`), up to the first
        that is in neither; each is pinned and marked most recently used (the leader's
        match, executor thread)."""
        plan: list[tuple[int, str, TierEntry]] = []
        host, disk = self.host, self.disk
        i = first
        while i < last:
            if host is not None:
                run = host.take_resident(keys, i, last)
                if len(run) == 1:  # (a one-block run: no iterators to make)
                    plan.append((i, TIER_HOST, run[0]))
                elif run:
                    plan.extend(zip(range(i, i + len(run)), repeat(TIER_HOST), run))
                i += len(run)
                if i >= last:
                    break
            entry = self._lookup_disk(keys[i])  # not resident in the host tier
            if entry is None:
                break
            disk.pin(entry)  # type: ignore[union-attr]
            plan.append((i, TIER_DISK, entry))
            i += 1
        return plan

    def disk_intact(self, entry: TierEntry) -> bool:
        """Every rank's file still has the size and mtime it had when written: one stat() per
        rank, no data read (a rewritten, truncated or deleted file fails it; bit rot is caught
        by the workers' checksum)."""
        assert self.disk_dir is not None
        for rank in range(self._tp_size):
            expected = entry.signatures.get(rank)
            if expected is None:
                continue  # that rank's worker is on another host; its checksum still guards
            if stat_signature(block_path(self.disk_dir, rank, entry.slot)) != expected:
                return False
        return True

    def drop(self, index: TierIndex, entry: TierEntry) -> None:
        """Forget a block and its descendants in ``index`` (a tier holds prefix-closed chains
        only) and register the REMOVEs of the resident ones, children first."""
        self.flush_evicted()
        gone = index.discard(entry.key)
        self._stats["cascade_drops"] += max(0, len(gone) - 1)
        unnamed = self._naming.unnamed
        hashes = [e.event_hash for e in gone
                  if e.resident and not unnamed.forget(index.name, e.key)]
        if hashes:
            self._tier_events.register_remove(MEDIUM[index.name], self._dp_rank, hashes)

    def announce(self, index: TierIndex, entry: TierEntry, fields: Any = None) -> None:
        """Register the tier STORE of a committed, named block (its parent is advertised), on
        a tier-event target without ``register_stores`` (:meth:`announce_all` calls it);
        ``fields``: its ``store_fields`` where the caller read them already."""
        event_hash, parent_hash, tokens, block_scope = \
            index.store_fields(entry) if fields is None else fields
        lora_id, extra_keys = _scope_fields(block_scope)
        # The scope only when there is one: a recorder written for the plain six-argument
        # call keeps working for unscoped blocks.
        scope: dict[str, Any] = {}
        if lora_id is not None:
            scope["lora_id"] = lora_id
        if extra_keys is not None:
            scope["extra_keys"] = extra_keys
        self._tier_events.register_store(MEDIUM[index.name], self._dp_rank, event_hash,
                                         parent_hash, tokens, self._block_size, **scope)
        self._announced(index, [(entry, (event_hash, parent_hash, tokens))])

    def _announced(self, index: TierIndex,
                   announced: list[tuple[TierEntry, tuple[Any, ...]]]) -> None:
        """``announced``: (entry, its name as registered) of each block just announced."""
        if self.on_announced is not None:
            # The shared tier's write-through takes the name (the row is read once).
            self.on_announced(index, announced)
        if not index.keeps_tokens:  # the host tier keeps them (demotions copy them)
            for entry, _ in announced:
                entry.drop_tokens()

    def announce_all(self, done: list[tuple[TierIndex, TierEntry, Any]]) -> None:
        """Register the tier STOREs of the committed, named blocks of ``done`` (index, entry,
        its store fields as read at the commit or None), in order: each run of one tier's
        blocks as one ``register_stores`` where the target has it (the consolidator, the tier
        publisher), else :meth:`announce` of each; then ``on_announced`` of each."""
        self.flush_evicted()
        register_stores = getattr(self._tier_events, "register_stores", None)
        if register_stores is None:
            for index, entry, fields in done:
                self.announce(index, entry, fields)
            return
        start = 0
        while start < len(done):
            index = done[start][0]
            end = start + 1
            while end < len(done) and done[end][0] is index:
                end += 1
            store_fields = index.store_fields
            stores: list[tuple[Any, ...]] = []
            for _, entry, fields in done[start:end]:
                event_hash, parent_hash, tokens, block_scope = \
                    store_fields(entry) if fields is None else fields
                stores.append((event_hash, parent_hash, tokens, None, None)
                              if block_scope == _NO_SCOPE  # the common case: no call
                              else (event_hash, parent_hash, tokens,
                                    *_scope_fields(block_scope)))
            register_stores(MEDIUM[index.name], self._dp_rank, stores, self._block_size)
            if self.on_announced is not None or not index.keeps_tokens:
                self._announced(index, [(entry, store[:3]) for (_, entry, _), store
                                        in zip(done[start:end], stores, strict=True)])
            start = end

    @property
    def waiting_for_name(self) -> Any:
        """The committed blocks waiting for their name (``(tier, key) in``, ``len``)."""
        return self._naming.unnamed

    def announce_named(self) -> None:
        """Announce the unnamed blocks whose names are known now, in commit order."""
        self.announce_all([(index, entry, None) for index, entry in self._naming.unnamed
                           .named_now({TIER_HOST: self.host, TIER_DISK: self.disk})])

    def reserve(self, index: TierIndex, key: int, event_hash: int, parent: int | None,
                tokens: Sequence[int], parent_key: int | None,
                scope: tuple[Any, ...] = _NO_SCOPE) -> TierEntry | None:
        """A pending slot in ``index`` (``parent_key`` must be in it) for a block of ``scope``
        (LoRA, salt[, multimodal digests]: ``naming.names.block_scope``), None when the tier
        is full; an evicted host block is demoted to disk. One block of
        :meth:`reserve_chain`."""
        entries = self.reserve_chain(index, (key,), (event_hash,), parent, tokens,
                                     len(tokens), parent_key, scope)
        return entries[0] if entries else None

    def reserve_chain(self, index: TierIndex, keys: Sequence[int],
                      event_hashes: Sequence[int], parent: int | None, tokens: Sequence[int],
                      width: int, parent_key: int | None,
                      scope: tuple[Any, ...] = _NO_SCOPE) -> list[TierEntry]:
        """Pending slots in ``index`` for a chain of blocks of one ``scope``
        (:meth:`TierIndex.reserve_chain`: block ``k``'s tokens are ``tokens[k * width:(k + 1)
        * width]``, its parent block ``k - 1``, the first one's ``parent_key``), fewer than
        ``keys`` when the tier is full. Each block evicted for them is handled as it goes (its
        REMOVE queued for :meth:`flush_evicted`, a host block demoted to disk)."""
        return index.reserve_chain(keys, event_hashes, parent, tokens, width, parent_key,
                                   self._evicted_from, scope)

    def _evicted_from(self, index: TierIndex, slot: int) -> None:
        """The block in ``slot`` leaves ``index`` to make room (called by the index at once,
        its row still there)."""
        name = index.name
        self._stats["host_evictions" if name == TIER_HOST else "disk_evictions"] += 1
        key, event_hash = index.evicting(slot)
        # REMOVE before the metadata that reuses the slot leaves the planner's caller
        # (flush_evicted; none for a block that was never advertised).
        if not self._naming.unnamed.forget(name, key):
            self._evicted.append((MEDIUM[name], event_hash))
        if name == TIER_HOST and self.disk is not None and key not in self.disk:
            self.demote(index.at(slot))

    def evict_ahead(self) -> int:
        """Keep a few slots free in each full tier, off the executor thread: the leader's
        keeper calls this after it applied reports (and when idle), under the leader's lock.
        The executor thread's saves then take free slots, as into a tier with room, instead of
        evicting one block per save inline (each eviction's bookkeeping and REMOVE cost it
        about 2 µs per block; docs/performance.md). Only in a tier of at least
        :data:`EVICT_AHEAD_MIN_CAPACITY` blocks, where the slots kept free are at most 1/64 of
        it; a burst bigger than them still evicts inline, as before. The victims are those the
        next saves would have evicted (least recently used leaves first), their REMOVEs
        registered here, before any save can reuse a slot. The host tier in front of a disk
        tier gives up only victims the disk holds, committed (:meth:`demote_ahead` put them
        there), and stops at the first it does not: a victim demoted here would be an op
        leaving with the next metadata, which an idle engine never builds. Returns the blocks
        evicted."""
        done = 0
        for index in (self.disk, self.host):
            if index is None or index.capacity < EVICT_AHEAD_MIN_CAPACITY:
                continue
            # The host tier in front of a disk tier: its victims the disk holds already (demoted
            # ahead, demote_ahead), which leave with a REMOVE only.
            ready = self._on_disk if index is self.host and self.disk is not None else None
            done += index.evict_ahead(EVICT_AHEAD_SLOTS, EVICT_AHEAD_STEP, self._evicted_from,
                                      ready)
        if done:
            self._stats["evicted_ahead"] += done
            self.flush_evicted()
        return done

    def _on_disk(self, slot: int) -> bool:
        """Whether the disk tier holds the host block in ``slot``, committed (evict_ahead)."""
        key, _ = self.host.evicting(slot)  # type: ignore[union-attr]
        return self.disk.resident(key)  # type: ignore[union-attr]

    def demote_ahead(self) -> int:
        """Where a host tier is in front of a disk tier: copy the host tier's next victims
        that the disk lacks to disk ahead of their eviction, off the executor thread (the
        leader's keeper calls this after it applied reports, under the leader's lock). Only
        in a host tier of at least :data:`EVICT_AHEAD_MIN_CAPACITY` blocks with fewer than
        :data:`EVICT_AHEAD_SLOTS` slots free: its next :data:`DEMOTE_AHEAD_VICTIMS` victims,
        at most :data:`EVICT_AHEAD_STEP` blocks per call. Each block stays in the host tier
        (resident, loadable, where it was in the eviction order) until :meth:`evict_ahead`
        takes it once the disk holds it, with a REMOVE only; where a save evicts it first,
        the disk has it or has it coming, and that eviction is a REMOVE only too, not a
        demotion made on the executor thread (a disk slot reserved, an op made: 18.7 µs per
        offloaded block against 6.5 for a host tier alone, stop 54; docs/performance.md).
        The demotions leave with the next metadata, and the worker copies a job's demotions
        out before its saves reuse a host slot, as for those made inline. Those an idle
        engine never sends are withdrawn at its idle tick (:meth:`withdraw_demotes`). After
        a demotion failed they pause (:meth:`_demotes_paused`). Returns the blocks whose
        demotion was made."""
        host, disk = self.host, self.disk
        if host is None or disk is None or host.capacity < EVICT_AHEAD_MIN_CAPACITY \
                or self._demotes_paused():
            return 0
        stats = self._stats
        before = stats["demotes_scheduled"]
        for slot in host.next_victims(DEMOTE_AHEAD_VICTIMS, EVICT_AHEAD_SLOTS):
            key, _ = host.evicting(slot)
            if key in disk:
                continue  # demoted already (or on its way)
            self.demote(host.at(slot))  # (with its ancestors the disk lacks: up to a chain)
            if stats["demotes_scheduled"] - before >= EVICT_AHEAD_STEP:
                break
        done = stats["demotes_scheduled"] - before
        stats["demoted_ahead"] += done
        self.flush_evicted()  # the disk blocks the reservations evicted, if any
        return done

    def _demotes_paused(self) -> bool:
        """Whether demotions ahead of need pause: a demotion failed since the last call and
        no pause runs (one starts), or a pause runs. The failures a pause's own start left in
        flight end within it and start none; one after it doubles the next
        (:data:`DEMOTE_AHEAD_PAUSE_S`). Each pause counted in ``demotes_ahead_paused``."""
        stats = self._stats
        seen = (stats["demotes_committed"], stats["demotes_failed"])
        committed, failed = seen[0] - self._demotes_seen[0], seen[1] - self._demotes_seen[1]
        self._demotes_seen = seen
        now = time.monotonic()
        if now < self._demote_pause_until:
            return True
        if failed:
            self._demote_pause_until = now + self._demote_pause_s
            self._demote_pause_s = min(2 * self._demote_pause_s, DEMOTE_AHEAD_PAUSE_MAX_S)
            stats["demotes_ahead_paused"] += 1
            return True
        if committed:
            self._demote_pause_s = DEMOTE_AHEAD_PAUSE_S  # the disk takes blocks again
        return False

    def withdraw_demotes(self) -> int:
        """Forget the demotions no metadata took (made ahead of need after the engine's last
        iteration): their ops and their pending disk slots; the blocks stay in the host tier.
        The leader's idle tick (keeper thread, under the lock): an idle engine builds no
        metadata, and nothing is left in flight while it idles. Returns how many."""
        pending, self.pending_demotes = self.pending_demotes, []
        disk = self.disk
        for demote in pending:
            op = self._ops.pop(demote.op_id, None)
            entry = op.entry if type(op) is Op else None
            if disk is not None and entry is not None and disk.holds(entry):
                self.drop(disk, entry)  # pending: no REMOVE (its descendants too)
        self._stats["demotes_withdrawn"] += len(pending)
        return len(pending)

    def flush_evicted(self) -> None:
        """Register the REMOVEs of the blocks :meth:`reserve` evicted since the last call, in
        eviction order, one call per run of one medium's: called by the planner at the end of
        each request's offloads (before the metadata that reuses their slots leaves the
        leader), and before any other tier event this class registers."""
        evicted = self._evicted
        if not evicted:
            return
        self._evicted = []
        start = 0
        while start < len(evicted):
            medium = evicted[start][0]
            end = start + 1
            while end < len(evicted) and evicted[end][0] == medium:
                end += 1
            self._tier_events.register_remove(medium, self._dp_rank,
                                              [h for _, h in evicted[start:end]])
            start = end

    def demote(self, evicted: TierEntry) -> None:
        """Demote an evicted host block to disk, keeping the disk tier prefix-closed: the
        ancestors the disk lacks are copied there too, root first, in the same job (they stay
        in the host tier as well). The host tier evicts leaves only, so every ancestor of
        ``evicted`` is resident in host and can be read before this job's saves reuse slots."""
        assert self.host is not None and self.disk is not None
        chain = [evicted]
        parent_key = evicted.parent_key
        while parent_key is not None and parent_key not in self.disk:
            ancestor = self.host.get(parent_key)
            if ancestor is None or not ancestor.resident:
                self._stats["demotes_skipped"] += 1  # not expected: the host chain is closed
                return
            chain.append(ancestor)
            parent_key = ancestor.parent_key
        for source in reversed(chain):
            target = self.reserve(self.disk, source.key, source.event_hash,
                                   source.parent_event_hash, source.token_ids, source.parent_key,
                                   source.scope)
            if target is None:
                self._stats["demotes_skipped"] += 1  # disk full of pending/pinned blocks
                return
            op_id = self._ops.new("demote", TIER_DISK, source.key, None, target)
            self.pending_demotes.append(DemoteOp(op_id, source.slot, target.slot, source.key))
            self._stats["demotes_scheduled"] += 1
            if source is not evicted:
                self._stats["chain_demotes"] += 1

    def finish_writes(self, writes: Iterable[Write]) -> None:
        """Every rank reported each block write of ``writes`` (saves and demotions, in op-id
        order: the leader's batch of reports; each ``(kind, tier, entry, ok, signatures,
        tainted)``, or a run of saves every rank wrote, ``(RUN_OF_SAVES, tier, run, True, None,
        False)``, ``run`` a ``SaveRun``: its ``entries`` and the ``tokens`` they were reserved
        with): commit its entry and announce it (or let it wait for its name), or
        forget it and its descendants (:meth:`_not_committed`). The STOREs of the
        blocks committed and named in a row are announced together (:meth:`announce_all`).
        What may register a REMOVE (a failed or orphaned write, an unnamed block past its
        bound) first announces what is committed before it, so the tier events keep their
        order."""
        done: list[tuple[TierIndex, TierEntry, Any]] = []
        unnamed, stats = self._naming.unnamed, self._stats
        for kind, tier, entry, ok, signatures, tainted in writes:
            if kind != RUN_OF_SAVES:
                self._finish_write(done, kind, tier, entry, ok, signatures, tainted)
                continue
            # A run every rank wrote (``entry``: its SaveRun): its named blocks committed in
            # one index call while no block waits for a name; the rest of the run (from an
            # unnamed block, one forgotten meanwhile, ...) one by one, as any write.
            run: Any = entry
            entries = run.entries
            index = self.host if tier == TIER_HOST else self.disk
            rows = index.commit_named(entries, run.tokens, self._block_size) \
                if index is not None and not len(unnamed) else []
            if rows:
                done.extend(zip(repeat(index), entries, rows))
                stats["saves_committed"] += len(rows)
            for rest in entries[len(rows):]:
                self._finish_write(done, "save", tier, rest, True, None, False)
        if done:
            self.announce_all(done)

    def _finish_write(self, done: list[tuple[TierIndex, TierEntry, Any]], kind: str, tier: str,
                      entry: TierEntry | None, ok: bool,
                      signatures: dict[int, tuple[int, int]] | None, tainted: bool) -> None:
        """One block write of :meth:`finish_writes` (``done``: the blocks it announces
        together, announced and emptied here before anything that may register a REMOVE)."""
        index = self.host if tier == TIER_HOST else self.disk
        # Committed only while it is still the entry this op wrote (not forgotten meanwhile
        # with an ancestor, nor replaced by a later reservation of the same block in
        # another slot) and its parent is resident: ops finish in id order along a chain,
        # so a parent is resident already and the tier's STOREs are prefix-closed too.
        row = None if not ok or tainted or index is None or entry is None \
            else index.commit_row(entry, signatures)
        if row is None:
            if done:
                self.announce_all(done)
                done.clear()
            self._not_committed(kind, ok, tainted, index, entry, index is not None
                                and entry is not None and index.holds(entry))
            return
        assert index is not None and entry is not None
        unnamed = self._naming.unnamed
        key, parent_key, event_hash, parent_hash, tokens, scope = row
        if unnamed.named_ready(index.name, key, parent_key, event_hash, parent_hash):
            done.append((index, entry, (event_hash, parent_hash, tokens, scope)))
        elif unnamed.ready(index, entry):  # named now: its row is read again
            done.append((index, entry, None))
        else:
            if done:
                self.announce_all(done)
                done.clear()
            for tier, oldest in unnamed.overflow():
                self.drop(self.host if tier == TIER_HOST else self.disk, oldest)  # type: ignore[arg-type]
        self._stats["saves_committed" if kind == "save" else "demotes_committed"] += 1

    def _not_committed(self, kind: str, ok: bool, tainted: bool, index: TierIndex | None,
                       entry: TierEntry | None, current: bool) -> None:
        """A write that is not committed: failed on some rank, tainted (its request was
        terminated before the copy read the device block), forgotten meanwhile, or written
        while its parent is not resident (unusable). Never advertised: no REMOVE for it; a
        current entry is forgotten with the descendants written after it."""
        if tainted:
            ok = False
            self._stats["saves_discarded_terminated"] += 1
            if current:
                self.drop(index, entry)  # type: ignore[arg-type]
        elif current:
            if ok:
                ok = False  # written, but its parent is not resident: unusable
                self._stats["orphan_commits_dropped"] += 1
            self.drop(index, entry)  # type: ignore[arg-type]
        if kind == "save":
            self._stats["saves_committed" if ok else "saves_failed"] += 1
        else:
            self._stats["demotes_committed" if ok else "demotes_failed"] += 1

    def resident_hashes(self, tier: str) -> set[int]:
        """Event hashes resident (advertised) in ``tier`` ("host"/"disk"); tests and demo."""
        index = self.host if tier == TIER_HOST else self.disk
        if index is None:
            return set()
        return {e.event_hash for e in index.resident_entries()
                if (index.name, e.key) not in self._naming.unnamed}

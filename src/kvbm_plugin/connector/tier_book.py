"""The leader's tier bookkeeping: sizing the tier indexes, lookups, evictions (REMOVEs),
demotions to disk, and which committed block's STORE is announced under which name.

A mixin of :class:`~kvbm_plugin.connector_leader.KvbmConnectorLeader` (its state lives
there); every method runs under the leader's lock, on the executor thread or the leader's idle
keeper thread. Never imports torch.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

from kvbm_plugin.connector.meta import DemoteOp, TierLayout, pool_layout
from kvbm_plugin.consolidator_config import CPU_CACHE_GB, DISK_CACHE_GB, ConfigError
from kvbm_plugin.tiers.base import (
    TIER_DISK,
    TIER_HOST,
    TierEntry,
    TierFullError,
    TierIndex,
    block_path,
    stat_signature,
)
from kvbm_plugin.wire.events import MEDIUM_CPU, MEDIUM_DISK
from kvbm_plugin.wire.identity import salt_extra_key

MEDIUM = {TIER_HOST: MEDIUM_CPU, TIER_DISK: MEDIUM_DISK}


class TierBookkeeping:
    """Tier methods of the leader (see the module docstring)."""

    _host: TierIndex | None
    _disk: TierIndex | None
    _naming: Any  # naming.names.BlockNaming: its .unnamed holds the blocks waiting for a name
    _stats: dict[str, int]
    _tier_events: Any
    _dp_rank: int
    _block_size: int
    _pending_demotes: list[DemoteOp]
    _index_of: Any  # SharedBook: the index holding a plan tier's pins

    def _ensure_tiers(self) -> TierLayout:
        """Size the tier indexes on first use (rank 0's worker has registered the pool by then:
        TRT-LLM calls register_kv_caches before the first iteration)."""
        if self._layout is not None:
            return self._layout
        settings = self._tier_settings
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
            self._host = TierIndex(TIER_HOST, host_blocks)
        if disk_blocks:
            # Nothing copies a disk block to another tier: its tokens are needed only until its
            # STORE is registered (64 B per block of a 16-token block at rest otherwise).
            self._disk = TierIndex(TIER_DISK, disk_blocks, keep_tokens=False)
            if settings.disk_cache_dir:
                self._disk_dir = settings.disk_cache_dir
                if self._par.attention_dp:
                    # Each attention-DP rank's own share: its slot files never meet another's.
                    self._disk_dir = os.path.join(self._disk_dir, f"dp{self._dp_rank}")
                    os.makedirs(self._disk_dir, exist_ok=True)
            else:
                self._disk_dir = tempfile.mkdtemp(prefix="kvbm-plugin-disk-")
                self._own_disk_dir = True
                atexit.register(shutil.rmtree, self._disk_dir, True)
        self._layout = TierLayout(host_blocks, disk_blocks, self._disk_dir)
        self._start_shared()  # type: ignore[attr-defined]
        return self._layout

    def _lookup(self, key: int) -> tuple[str, TierEntry] | None:
        if self._host is not None:
            entry = self._host.lookup(key)
            if entry is not None:
                return TIER_HOST, entry
        if self._disk is not None:
            entry = self._disk.lookup(key)
            if entry is not None:
                if self._disk_intact(entry):
                    return TIER_DISK, entry
                self._stats["stale_disk_blocks"] += 1
                self._drop(self._disk, entry)
        return None

    def _disk_intact(self, entry: TierEntry) -> bool:
        """Every rank's file still has the size and mtime it had when written: one stat() per
        rank, no data read (a rewritten, truncated or deleted file fails it; bit rot is caught
        by the workers' checksum)."""
        assert self._disk_dir is not None
        for rank in range(self._par.tp_size):
            expected = entry.signatures.get(rank)
            if expected is None:
                continue  # that rank's worker is on another host; its checksum still guards
            if stat_signature(block_path(self._disk_dir, rank, entry.slot)) != expected:
                return False
        return True

    def _drop(self, index: TierIndex, entry: TierEntry) -> None:
        """Forget a block and its descendants in ``index`` (a tier holds prefix-closed chains
        only) and register the REMOVEs of the resident ones, children first."""
        gone = index.discard(entry.key)
        self._stats["cascade_drops"] += max(0, len(gone) - 1)
        unnamed = self._naming.unnamed
        hashes = [e.event_hash for e in gone
                  if e.resident and not unnamed.forget(index.name, e.key)]
        if hashes:
            self._tier_events.register_remove(MEDIUM[index.name], self._dp_rank, hashes)

    def _announce(self, index: TierIndex, entry: TierEntry) -> None:
        """Register the tier STORE of a committed, named block (its parent is advertised)."""
        # The scope only when there is one: a recorder written for the plain six-argument
        # call keeps working for unscoped blocks.
        lora, salt = entry.scope
        scope: dict[str, Any] = {}
        if lora is not None:
            scope["lora_id"] = lora
        if salt is not None:
            scope["extra_keys"] = (salt_extra_key(salt),)
        self._tier_events.register_store(
            MEDIUM[index.name], self._dp_rank, entry.event_hash, entry.parent_event_hash,
            entry.token_ids, self._block_size, **scope)
        self._shared_named(index, entry)  # type: ignore[attr-defined]  # write-through's name
        entry.drop_tokens()  # a no-op where the index keeps them (the host tier: demotions)

    def _announce_or_wait(self, index: TierIndex, entry: TierEntry) -> None:
        """Announce a committed block's STORE, or let it wait for its name
        (:class:`~kvbm_plugin.naming.names.UnnamedStores`; the oldest past its bound leaves
        its tier unannounced)."""
        unnamed = self._naming.unnamed
        if unnamed.ready(index, entry):
            self._announce(index, entry)
            return
        for tier, oldest in unnamed.overflow():
            self._drop(self._host if tier == TIER_HOST else self._disk, oldest)  # type: ignore[arg-type]

    def _announce_named_now(self) -> None:
        """Announce the unnamed blocks whose names are known now, in commit order."""
        for index, entry in self._naming.unnamed.named_now({TIER_HOST: self._host,
                                                            TIER_DISK: self._disk}):
            self._announce(index, entry)

    def _reserve(self, index: TierIndex, key: int, event_hash: int, parent: int | None,
                 tokens: Sequence[int], parent_key: int | None,
                 scope: tuple[int | None, int | None] = (None, None)) -> TierEntry | None:
        """A pending slot in ``index`` (``parent_key`` must be in it) for a block of ``scope``
        (LoRA, salt); an evicted host block is demoted to disk."""
        try:
            entry, evicted = index.reserve(key, event_hash, parent, tokens, parent_key)
        except TierFullError:
            return None
        entry.scope = scope
        if evicted is not None:
            self._stats["host_evictions" if index.name == TIER_HOST else "disk_evictions"] += 1
            # REMOVE before the metadata that reuses the slot leaves this method's caller (none
            # for a block that was never advertised).
            if not self._naming.unnamed.forget(index.name, evicted.key):
                self._tier_events.register_remove(MEDIUM[index.name], self._dp_rank,
                                                  [evicted.event_hash])
            if index.name == TIER_HOST and self._disk is not None \
                    and evicted.key not in self._disk:
                self._demote(evicted)
        return entry

    def _demote(self, evicted: TierEntry) -> None:
        """Demote an evicted host block to disk, keeping the disk tier prefix-closed: the
        ancestors the disk lacks are copied there too, root first, in the same job (they stay
        in the host tier as well). The host tier evicts leaves only, so every ancestor of
        ``evicted`` is resident in host and can be read before this job's saves reuse slots."""
        assert self._host is not None and self._disk is not None
        chain = [evicted]
        parent_key = evicted.parent_key
        while parent_key is not None and parent_key not in self._disk:
            ancestor = self._host.get(parent_key)
            if ancestor is None or not ancestor.resident:
                self._stats["demotes_skipped"] += 1  # not expected: the host chain is closed
                return
            chain.append(ancestor)
            parent_key = ancestor.parent_key
        for source in reversed(chain):
            target = self._reserve(self._disk, source.key, source.event_hash,
                                   source.parent_event_hash, source.token_ids, source.parent_key,
                                   source.scope)
            if target is None:
                self._stats["demotes_skipped"] += 1  # disk full of pending/pinned blocks
                return
            op_id = self._new_op("demote", TIER_DISK, source.key, None, target)
            self._pending_demotes.append(DemoteOp(op_id, source.slot, target.slot, source.key))
            self._stats["demotes_scheduled"] += 1
            if source is not evicted:
                self._stats["chain_demotes"] += 1

    def _release_plan(self, state: Any) -> None:
        if state.load is None:
            for _, tier, entry in state.plan:
                index = self._index_of(tier)
                if index is not None and entry.pins > 0:
                    index.unpin(entry)
        state.plan = []

    def resident_hashes(self, tier: str) -> set[int]:
        """Event hashes resident (advertised) in ``tier`` ("host"/"disk"); tests and demo."""
        index = self._host if tier == TIER_HOST else self._disk
        if index is None:
            return set()
        return {e.event_hash for e in index.resident_entries()
                if (index.name, e.key) not in self._naming.unnamed}

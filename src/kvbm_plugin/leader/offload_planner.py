"""What the leader learns of a request each iteration (:meth:`OffloadPlanner.absorb`: its new
tokens, pages, hashes) and which of its newly full blocks it offloads, where.

:class:`OffloadPlanner` is owned by :class:`~kvbm_plugin.connector_leader.KvbmConnectorLeader`
and called by its ``build_connector_meta`` (executor thread, rank 0 or each attention-DP rank,
under the leader's lock) once per scheduled request. It keeps no state of its own: each
request's progress is in its :class:`~kvbm_plugin.leader.requests.RequestState`
(``offload_next``), the slots in the :class:`~kvbm_plugin.leader.offload_tiers.OffloadTiers`,
the ops in the :class:`~kvbm_plugin.leader.requests.OpTable`. Never imports torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvbm_plugin.connector.meta import DISK, HOST, SaveOp, SaveOpRun, record
from kvbm_plugin.leader.layer_groups import LayerGroupPages
from kvbm_plugin.leader.offload_tiers import OffloadTiers
from kvbm_plugin.leader.requests import OpTable, RequestState
from kvbm_plugin.leader.shared_tier import LeaderSharedTier
from kvbm_plugin.naming.names import BlockNaming, block_scope
from kvbm_plugin.tiers.base import TIER_HOST, TierIndex, block_keys

logger = logging.getLogger(__name__)


class OffloadPlanner:
    """Schedules offloads (saves into the first tier, write-through to the shared tier)."""

    def __init__(self, *, block_size: int, tiers: OffloadTiers, shared: LeaderSharedTier,
                 pages: LayerGroupPages, naming: BlockNaming, ops: OpTable,
                 stats: dict[str, int], on_learning: Callable[[], None]) -> None:
        """``on_learning``: called once, when names start to be learned from events (the
        leader's ``GpuTierEvents.learn_from_flushes``)."""
        self._block_size = block_size
        self._on_learning = on_learning
        self._tiers = tiers
        self._shared = shared
        self._pages = pages
        self._naming = naming
        self._ops = ops
        self._stats = stats

    def absorb(self, state: RequestState, rd: Any, sink: Any) -> None:
        """Fold one RequestData delta into the request's state (before :meth:`schedule`);
        ``sink``: this rank's GPU-tier event sink (None: no GPU stream here)."""
        state.tokens.extend(rd.new_tokens)
        self._pages.absorb_block_ids(state, rd)  # flat, or every layer group's pages
        hashes = getattr(rd, "block_hashes", None)
        if hashes:
            # The cumulative chain of the full blocks: copied when it grew (a generation step
            # that fills no block repeats it: copying it each time is O(context) per step).
            if len(hashes) != len(state.event_hashes):
                state.event_hashes = list(hashes)
        elif not self._naming.learning and len(state.tokens) >= self._block_size:
            # No block_hashes: learn TRT-LLM's names from its events (for requests whose hash
            # cannot be computed, and as the cross-check of those computed).
            self._naming.learning = True
            self._on_learning()  # the sink's flushes are kept for the name table
        valid = rd.computed_position + rd.num_scheduled_tokens
        if not state.reported:  # its first report (later ones: a step each, O(1))
            if state.match_base is not None:
                # The first report subtracts connector-loaded tokens from computed_position.
                valid = max(valid, state.match_base + rd.num_scheduled_tokens)
            failed = state.load_failed_at
            if failed is not None and rd.computed_position > failed * self._block_size:
                state.offload_stop = failed  # computed on a block its failed load left unfilled
            state.prompt_tokens = len(state.tokens)  # all prompt tokens come first
            state.reported = True
        state.valid_tokens = max(state.valid_tokens, min(valid, len(state.tokens)))
        naming = self._naming
        if state.lora_root_pending:
            naming.name_root(state, sink)  # the sink's LoRA names
        bs = self._block_size
        if len(state.keys) < len(state.tokens) // bs:
            _extend_keys(state, bs)
        if naming.v2_stream:
            naming.v2_extend(state)  # TensorRT-LLM's own stream: its names, computed

    def finish(self, state: RequestState, tokens: list[int]) -> None:
        """A request ends (``request_finished``, executor thread, under the leader's lock):
        where TensorRT-LLM's own stream is the source, name the blocks its last generated
        tokens filled. TensorRT-LLM stores those blocks at release and publishes them in a
        later iteration, and no RequestData reported those tokens: without their scope
        registered now, a salted request's last blocks would reach the consolidator
        unscoped (folded into the unsalted tenant's) and its next turn's prefix would stop
        there for the router."""
        if not self._naming.v2_stream or len(tokens) <= len(state.tokens) \
                or tokens[:len(state.tokens)] != state.tokens:
            return
        state.tokens.extend(tokens[len(state.tokens):])
        bs = self._block_size
        if len(state.keys) < len(state.tokens) // bs:
            _extend_keys(state, bs)
        self._naming.v2_extend(state)

    def event_hash(self, state: RequestState, index: int) -> int:
        """The hash the tier events name block ``index`` by: TRT-LLM's (see
        :mod:`kvbm_plugin.naming.names`); the plugin's content key only as a placeholder
        while TRT-LLM's is not known (such a block's STORE is held back until it is)."""
        h = self._naming.hash_of(state, index)
        return state.keys[index] if h is None else h

    def schedule(self, state: RequestState, index: TierIndex,
                 saves: list[SaveOp | SaveOpRun]) -> None:
        """Offload the request's newly full blocks into ``index`` (the first tier), in chain
        order. A tier holds prefix-closed chains only: a block is offloaded only while its
        parent is in the same tier (pending or resident) or is offloaded in this same job, so
        a parent that left the tier since it was passed is offloaded again first, from its
        device block (the request still holds it). The REMOVEs of the blocks its slots were
        taken from are registered together at the end."""
        if state.offload_next >= min(state.valid_tokens // self._block_size,
                                     len(state.block_ids), len(state.keys)):
            return  # no block newly full: most generation steps (nothing reserved, evicted)
        try:
            self._schedule(state, index, saves)
        finally:
            self._tiers.flush_evicted()

    def _schedule(self, state: RequestState, index: TierIndex,
                  saves: list[SaveOp | SaveOpRun]) -> None:
        bs = self._block_size
        tiers, shared, pages, stats = self._tiers, self._shared, self._pages, self._stats
        host = tiers.host
        keys, tokens = state.keys, state.tokens
        limit = min(state.valid_tokens // bs, len(state.block_ids), len(keys))
        if state.offload_stop is not None:
            limit = min(limit, state.offload_stop)
        tier_code = HOST if index.name == TIER_HOST else DISK
        write_through = index is host and shared.enabled
        new_run, req_id, tier_name = self._ops.new_run, state.req_id, index.name
        grouped = bool(state.group_pages)
        # The scope of every block of a request without multimodal items is the same.
        inputs = state.name_inputs
        scope = None if inputs is not None and inputs.mm else block_scope(state, 0, bs)
        # The parent of the next block is in ``index``: just checked, reserved or found.
        parent_in = False
        named, named_hash = -1, 0  # the last block reserved here, and its event hash
        matched = state.host_matched if index is host else None
        while state.offload_next < limit:
            i = state.offload_next
            key = keys[i]
            if matched is not None and i >= matched[0]:
                # The blocks loaded from this tier were touched and pinned by the match:
                # passed in one step where the last is still here (so is every block before
                # it: a tier holds prefix-closed chains only); with the write-through on, those
                # the shared tier lacks are written through from their host copies.
                hi = min(matched[1], limit)
                matched = state.host_matched = None
                if i < hi and keys[hi - 1] in index:
                    if write_through:
                        shared.follow_resident(state, i, hi, index)
                    state.offload_next = hi
                    parent_in = True
                    continue
            # Already here: a resident block's LRU place is refreshed (in use again).
            if write_through:
                present, here = index.probe(key)
                if here:
                    if present is not None:  # not in the shared tier yet?
                        shared.follow(state, i, present)
                    state.offload_next += 1
                    parent_in = True
                    continue
            else:
                present_run = index.skip_present(keys, i, limit if matched is None
                                                 else min(limit, matched[0]))
                if present_run:
                    state.offload_next = i + present_run
                    parent_in = True
                    continue
            parent_key = keys[i - 1] if i else None
            if parent_key is not None and not parent_in and parent_key not in index:
                if pages.can_resave(state, index, i - 1):
                    state.offload_next = i - 1  # the parent was evicted as a leaf meanwhile
                    stats["parent_resaves"] += 1
                else:
                    # No device copy of the parent to offload: this block would be an orphan.
                    stats["orphan_saves_skipped"] += 1
                    state.offload_next += 1
                parent_in = False
                continue
            block = pages.save_block(state, i)  # -1: some layer group has no live page
            if block < 0:
                state.offload_next += 1
                parent_in = False
                continue
            # The run from ``i``: every block up to the limit or a block with no live page.
            # None of them is in the tier: block ``i`` is not, and a block there has its
            # parent there. A multimodal request's blocks each have their own scope: one each.
            if scope is not None and not grouped:
                # One layer group: the run is every block up to the limit or the first with
                # no device block; the names are RequestData's where it gave them
                # (event_hash's first rule).
                j = limit
                blocks = [int(b) for b in state.block_ids[i:j]]
                if min(blocks) < 0:  # no device block from there on (as save_block says)
                    j = i + next(k for k, b in enumerate(blocks) if b < 0)
                    del blocks[j - i:]
                event_hashes = state.event_hashes
                hashes = [int(h) for h in event_hashes[i:j]] if len(event_hashes) >= j \
                    else [self.event_hash(state, k) for k in range(i, j)]
            else:
                blocks = [int(block)]
                hashes = [self.event_hash(state, i)]
                j = i + 1
                while j < limit and scope is not None:
                    block = pages.save_block(state, j)
                    if block < 0:
                        break
                    blocks.append(int(block))
                    hashes.append(self.event_hash(state, j))
                    j += 1
            if not i:
                parent = None
            elif named == i - 1:  # (event_hash has no effect that would change it since)
                parent = named_hash
            else:
                parent = self.event_hash(state, i - 1)
            run_tokens = tokens[i * bs:j * bs]
            entries = tiers.reserve_chain(index, keys[i:j], hashes, parent, run_tokens, bs,
                                          parent_key, block_scope(state, i, bs) if scope is None
                                          else scope)
            if entries:
                # op ids first, first + 1 ...; the run's STOREs take their tokens from the
                # list its rows were written from
                first = new_run(tier_name, req_id, entries, run_tokens).first
                state.saves_inflight.add(first)
                n = len(entries)  # (entry k holds keys[i + k]; fewer than blocks: tier full)
                # One record for the run (a one-block run: its SaveOp), each built from its
                # fields' tuple (no NamedTuple __new__)
                if n == 1:
                    saves.append(record(SaveOp, (
                        first, req_id, blocks[0], tier_code, entries[0].slot, keys[i],
                        pages.save_pages(state, i) if grouped else ())))
                else:
                    saves.append(record(SaveOpRun, (
                        first, req_id, tier_code, tuple(blocks[:n]),
                        tuple([entry.slot for entry in entries]), tuple(keys[i:i + n]),
                        tuple([pages.save_pages(state, i + k) for k in range(n)]) if grouped
                        else ())))
                if write_through:  # to the shared tier, when there is one
                    shared.follow_run(state, i, entries, first, blocks)
            stats["saves_scheduled"] += len(entries)
            state.offload_next += len(entries)
            if len(entries) < len(blocks):
                stats["tier_full_skips"] += 1
                return  # retry from this block next iteration
            named, named_hash = j - 1, hashes[-1]
            parent_in = True


def _extend_keys(state: RequestState, block_size: int) -> None:
    """Hash the request's full blocks past its keys, its digests extended with them (the chain
    continues from the last digest). The two lists are set, extended and reset together (the
    match, here, a salt adopted); where they disagree (a bug) it is logged and both are hashed
    again from the prompt's first block: never a key chained from the wrong parent, never an
    exception in TensorRT-LLM's loop."""
    keys, digests = state.keys, state.digests
    n = len(keys)
    if len(digests) != n:
        logger.error("kvbm_plugin: request %s had %d content keys but %d digests: both hashed "
                     "again from its first block", state.req_id, n, len(digests))
        keys.clear()
        digests.clear()
        n = 0
    keys.extend(block_keys(state.tokens, block_size, state.salt, start=n,
                           parent=digests[-1] if n else None, digests=digests))

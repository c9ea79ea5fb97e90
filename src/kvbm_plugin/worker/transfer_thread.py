"""A worker's transfer thread: runs each iteration's loads and saves, in metadata order.

The executor thread queues a job per iteration (:meth:`TransferThread.put_loads` from
``start_load_kv``, :meth:`TransferThread.put_saves` once the forward's event is recorded);
this thread turns them into copies and never makes the executor thread wait:

* host ↔ device copies go to the copy engine (worker/copy_engine.py) in batches, contiguous
  runs of blocks coalesced into one copy;
* disk loads and disk writes (a demotion's host slot, a save straight from the device when there
  is no host tier) go to the disk thread (worker/disk_io.py);
* shared-tier loads and write-through staging go to the shared tier's I/O
  (worker/shared_io.py).

Job order = metadata order, so a demotion reads a host slot before a later save of the same or
a later iteration overwrites it. Every op reaches a terminal state and is reported once, and
every request's in-flight count is brought down with it (``RequestProgress``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbm_plugin.connector.meta import (
    DISK,
    ERR_FAILED,
    HOST,
    SHARED,
    ConnectorMetadata,
    DemoteOp,
    LoadCopy,
    LoadOp,
    SaveOp,
    SharedSaveOp,
    ops_of,
)
from kvbm_plugin.tiers.base import OffloadTier
from kvbm_plugin.worker.copy_engine import CopyEngine
from kvbm_plugin.worker.copy_runs import chunked, runs
from kvbm_plugin.worker.disk_io import DiskIO
from kvbm_plugin.worker.job_queue import JobQueue
from kvbm_plugin.worker.layer_group_copies import GroupPages
from kvbm_plugin.worker.layer_groups import (
    GroupSaveBarrier,
    SaveIssue,
    group_host_pairs,
)
from kvbm_plugin.worker.op_reports import OpReporter
from kvbm_plugin.worker.request_progress import RequestProgress
from kvbm_plugin.worker.shared_io import SharedIO
from kvbm_plugin.worker.transfer_counters import TransferCounters

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("kvbm_plugin.connector_worker")


@dataclass(frozen=True)
class DevicePool:
    """The rank's device pool as the transfer thread addresses it: the tensor, one view per
    block (made once: two views per copied block on every batch cost ~2 us per block) and,
    with several layer groups, every group's pages (then the blocks are never addressed)."""

    tensor: torch.Tensor
    blocks: tuple[torch.Tensor, ...]
    groups: GroupPages | None
    block_bytes: int  # of one tier slot


@dataclass(frozen=True)
class TierIO:
    """What a job can move blocks to or from on this rank (None: that tier is off)."""

    host: OffloadTier | None
    host_blocks: tuple[torch.Tensor, ...]  # one view per host slot, made once
    disk: DiskIO
    shared: SharedIO | None


class TransferThread:
    """One rank's transfer thread (see the module docstring)."""

    def __init__(self, rank: int, pool: DevicePool, tiers: TierIO, copies: CopyEngine,
                 barrier: GroupSaveBarrier | None, progress: RequestProgress,
                 reporter: OpReporter, counters: TransferCounters) -> None:
        self._rank = rank
        self._pool = pool
        self._tiers = tiers
        self._copies = copies
        self._barrier = barrier
        self._progress = progress
        self._reporter = reporter
        self._counters = counters
        self.batch_blocks = copies.batch_blocks  # 0: a job's host copies are one batch
        self._jobs = JobQueue()  # counts jobs queued or running (idle())
        self.thread = threading.Thread(target=self._loop, name=f"kvbm-transfer-r{rank}",
                                       daemon=True)
        self.thread.start()

    # ------------------------------------------------------------ executor thread

    def put_loads(self, loads: Sequence[LoadOp]) -> None:
        self._jobs.put(("load", loads))

    def put_saves(self, meta: ConnectorMetadata, fwd_event: Any,
                  issue: SaveIssue | None) -> None:
        """Queue one iteration's demotions and saves behind ``fwd_event`` (CUDA: recorded at
        the end of its forward; None on CPU); ``issue``: several layer groups only."""
        self._jobs.put(("save", meta, fwd_event, issue))

    def idle(self) -> bool:
        """No job queued or running (any thread)."""
        return self._jobs.idle()

    def stop(self) -> None:
        """The thread ends after the jobs queued before this (``shutdown``)."""
        self._jobs.put_stop()

    # ------------------------------------------------------------ transfer thread

    def _loop(self) -> None:
        """Runs jobs in order and, between them, fails copy batches past their deadline."""
        copies = self._copies
        while True:
            try:
                job = self._jobs.get(0.05)
            except queue.Empty:
                job = None
            if job is not None:
                if job[0] == "stop":
                    break
                try:
                    if job[0] == "load":
                        self._run_loads(job[1])
                    elif job[0] == "save":
                        self._run_save_job(job[1], job[2], job[3])
                except Exception:  # never lose the thread; the job's ops were failed inside
                    self._counters.add(jobs_failed=1)
                    logger.exception("rank %d: transfer job failed", self._rank)
                finally:
                    self._jobs.done()
            if copies.has_pending():
                copies.fail_overdue(time.monotonic())
        copies.finish_issued()  # the completion thread finishes what was issued, then stops

    def _run_save_job(self, meta: ConnectorMetadata, fwd_event: Any,
                      issue: SaveIssue | None) -> None:
        meta = ops_of(meta)  # a run's records read as its ops, here, off the executor thread
        if issue is None or self._barrier is None:
            self._run_saves(meta, fwd_event)
            return
        try:  # (a save wait_for_save gave up on: its saves fail)
            self._run_saves(self._barrier.claim(meta, issue), fwd_event)
        finally:
            self._barrier.issued(issue)

    def _run_loads(self, loads: Sequence[LoadOp]) -> None:
        tiers, progress, report = self._tiers, self._progress, self._reporter.report
        host = tiers.host
        host_copies: list[tuple[LoadCopy, int]] = []
        for load in loads:
            shared: list[LoadCopy] = []
            # Not fenced: its host copies count as writing from now until their done().
            fenced = not progress.begin_writing(load.req_id,
                                                sum(c.tier == HOST for c in load.copies))
            for copy in load.copies:
                if fenced:  # TensorRT-LLM freed the blocks: never write them
                    report(copy.op_id, False, ERR_FAILED)
                    progress.load_ended((load.req_id,))
                elif copy.tier == HOST and host is not None and 0 <= copy.slot < host.capacity:
                    host_copies.append((copy, load.req_id))
                elif copy.tier == DISK and tiers.disk.tier is not None:
                    tiers.disk.load(copy, load.req_id)
                elif copy.tier == SHARED and tiers.shared is not None:
                    shared.append(copy)
                else:
                    if copy.tier == HOST:
                        progress.written((load.req_id,))
                    progress.load_failed(load.req_id, (copy.device_block,))
                    report(copy.op_id, False, ERR_FAILED)
                    progress.load_ended((load.req_id,))
            if shared:
                tiers.shared.submit_load(shared, load.req_id)  # type: ignore[union-attr]
        for chunk in chunked(host_copies, self.batch_blocks):
            self._load_from_host(chunk)

    def _load_from_host(self, host_copies: Sequence[tuple[LoadCopy, int]]) -> None:
        host, pool, progress = self._tiers.host, self._pool, self._progress
        assert host is not None
        host_pool = host.pool  # type: ignore[attr-defined]
        if pool.groups is None:
            pool_blocks, host_blocks = pool.blocks, self._tiers.host_blocks
            copies = [(pool_blocks[d], host_blocks[s]) if n == 1
                      else (pool.tensor[d:d + n], host_pool[s:s + n])
                      for s, d, n in runs((c.slot, c.device_block) for c, _ in host_copies)]
        else:
            copies = group_host_pairs(pool.groups, self._tiers.host_blocks,
                                      [(c.pages or (c.device_block,), c.slot)
                                       for c, _ in host_copies], load=True)
        keys_ok = {c.op_id: host.keys[c.slot] == c.key for c, _ in host_copies}  # type: ignore[attr-defined]

        def done(ok: bool) -> None:
            results = [(copy.op_id, ok and keys_ok[copy.op_id]) for copy, _ in host_copies]
            progress.written([req_id for _, req_id in host_copies])
            for (copy, req_id), (_, good) in zip(host_copies, results, strict=True):
                if not good:
                    progress.load_failed(req_id, (copy.device_block,))
            self._reporter.report_all(results)
            progress.load_ended([req_id for _, req_id in host_copies])
            moved = sum(good for _, good in results)
            self._counters.add(bytes_onboarded=moved * pool.block_bytes,
                               blocks_onboarded=moved, copies_issued=len(copies))

        self._copies.issue(copies, None, done, "onboard")

    def _run_saves(self, meta: ConnectorMetadata, fwd_event: Any) -> None:
        tiers, report = self._tiers, self._reporter.report
        host = tiers.host
        # 1. Demotions: copy the host slot out *now*, before this job's saves reuse it.
        for op in meta.demotes:
            self._demote(op)
        # 2. Saves into the host pool, batched; saves straight to disk via a CPU copy.
        host_ops: list[SaveOp] = []
        # Write-through to the shared tier: staged from its host slot now (before this job's
        # saves may reuse it), or in the host copy batch of the same block.
        followers = {op.after: op for op in meta.shared_saves if op.after >= 0}
        from_host = [op for op in meta.shared_saves if op.after < 0]
        for op in from_host if tiers.shared is None else ():
            report(op.op_id, False, ERR_FAILED)
        if from_host and tiers.shared is not None:
            tiers.shared.stage_from_host(from_host, host)
        for op in meta.saves:
            if op.tier == HOST and host is not None and 0 <= op.slot < host.capacity:
                host_ops.append(op)
            elif op.tier == DISK and tiers.disk.tier is not None:
                self._save_to_disk(op, fwd_event)
            else:
                report(op.op_id, False, ERR_FAILED)
                self._progress.save_ended((op.req_id,))
        for chunk in chunked(host_ops, self.batch_blocks):
            self._save_to_host(chunk, fwd_event, followers)
        for follower in followers.values():  # its host save did not run here
            report(follower.op_id, False, ERR_FAILED)

    def _save_to_host(self, host_ops: Sequence[SaveOp], fwd_event: Any,
                      followers: dict[int, SharedSaveOp]) -> None:
        host, pool, shared = self._tiers.host, self._pool, self._tiers.shared
        assert host is not None
        host_pool = host.pool  # type: ignore[attr-defined]
        pool_blocks, host_blocks = pool.blocks, self._tiers.host_blocks
        if pool.groups is None:
            copies = [(host_blocks[s], pool_blocks[d]) if n == 1
                      else (host_pool[s:s + n], pool.tensor[d:d + n])
                      for d, s, n in runs((o.device_block, o.slot) for o in host_ops)]
        else:
            copies = group_host_pairs(pool.groups, host_blocks,
                                      [(o.pages or (o.device_block,), o.slot) for o in host_ops],
                                      load=False)
        staged = shared.stage(host_ops, followers) if followers and shared is not None else []
        copies += [(buf, pool_blocks[op.device_block]) for op, buf in staged]

        def done(ok: bool) -> None:
            keys = host.keys  # type: ignore[attr-defined]
            for op in host_ops:
                keys[op.slot] = op.key if ok else None
            self._reporter.report_all([(op.op_id, ok) for op in host_ops])
            if staged:
                shared.staged_done(staged, ok)  # type: ignore[union-attr]
            self._progress.save_ended([op.req_id for op in host_ops])
            if ok:
                self._counters.add(bytes_offloaded=len(host_ops) * pool.block_bytes,
                                   blocks_offloaded=len(host_ops))
            self._counters.add(copies_issued=len(copies))

        self._copies.issue(copies, fwd_event, done, "offload")

    def _demote(self, op: DemoteOp) -> None:
        """Host slot → a CPU copy now → the disk thread (which reports the op)."""
        import torch

        host, disk = self._tiers.host, self._tiers.disk
        if host is None or disk.tier is None or not 0 <= op.host_slot < host.capacity:
            self._reporter.report(op.op_id, False, ERR_FAILED)
            return
        staging = torch.empty(host.spec.block_shape, dtype=host.spec.dtype)
        if not host.read(op.host_slot, op.key, staging):
            self._reporter.report(op.op_id, False, ERR_FAILED)
            return
        disk.write(op.op_id, None, op.disk_slot, op.key, staging, True)

    def _save_to_disk(self, op: SaveOp, fwd_event: Any) -> None:
        """No host tier: device block → CPU copy (background sync is fine here) → disk."""
        pool = self._pool.tensor
        try:
            side_stream = self._copies.side_stream
            if side_stream is not None:
                import torch

                with torch.cuda.stream(side_stream):
                    if fwd_event is not None:
                        side_stream.wait_event(fwd_event)
                    staging = pool[op.device_block].to("cpu", non_blocking=False)
            else:
                staging = pool[op.device_block].clone()
        except Exception:
            logger.exception("rank %d: device → staging copy failed", self._rank)
            self._reporter.report(op.op_id, False, ERR_FAILED)
            self._progress.save_ended((op.req_id,))
            return
        self._tiers.disk.write(op.op_id, op.req_id, op.slot, op.key, staging, False)

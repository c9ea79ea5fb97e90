"""The worker's disk thread: block files written atomically and read back verified.

:class:`DiskIO` owns one rank's disk tier (opened when the leader's first layout names one),
its job queue, its thread and its staging block (worker/device_copy.py). The transfer thread
queues :meth:`DiskIO.write` and :meth:`DiskIO.load` jobs; the disk thread runs them in order,
never on the executor thread, and reports each op once (``OpReporter``) and ends it for its
request (``RequestProgress``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.connector.meta import ERR_CORRUPT, ERR_FAILED, ERR_NONE, LoadCopy
from kvbm_plugin.connector.metrics import Metrics
from kvbm_plugin.tiers.base import OffloadTier
from kvbm_plugin.wire.events import MEDIUM_DISK
from kvbm_plugin.worker.device_copy import DiskStaging
from kvbm_plugin.worker.job_queue import JobQueue
from kvbm_plugin.worker.op_reports import OpReporter
from kvbm_plugin.worker.request_progress import RequestProgress
from kvbm_plugin.worker.transfer_counters import TransferCounters

logger = logging.getLogger("kvbm_plugin.connector_worker")
# Failures that can repeat once per block (a full or failing disk): one line per interval each.
_repeating = RateLimitedLog(logger)


class DiskIO:
    """One rank's disk tier and the thread that reads and writes it (see the module)."""

    def __init__(self, rank: int, block_bytes: int, staging: DiskStaging,
                 progress: RequestProgress, reporter: OpReporter, counters: TransferCounters,
                 metrics: Metrics) -> None:
        self._rank = rank
        self._block_bytes = block_bytes
        self.staging = staging
        self._progress = progress
        self._reporter = reporter
        self._counters = counters
        self._metrics = metrics
        # Opened by the executor thread when the layout names a disk tier; read by the
        # transfer thread (is there one?) and used by the disk thread only.
        self.tier: OffloadTier | None = None
        self._jobs = JobQueue()  # counts jobs queued or running (idle())
        self.thread = threading.Thread(target=self._loop, name=f"kvbm-disk-r{rank}",
                                       daemon=True)
        self.thread.start()

    # ------------------------------------------------------------ transfer thread

    def write(self, op_id: int, req_id: int | None, slot: int, key: int, block: Any,
              demotion: bool) -> None:
        """Queue ``block`` (a host tensor this job owns) for disk ``slot`` under ``key``;
        ``req_id`` None: a demotion, which no request waits for."""
        self._jobs.put(("write", op_id, req_id, slot, key, block, demotion))

    def load(self, copy: LoadCopy, req_id: int) -> None:
        """Queue one disk → device block load of ``req_id``."""
        self._jobs.put(("load", copy, req_id))

    def idle(self) -> bool:
        """No job queued or running (any thread)."""
        return self._jobs.idle()

    def stop(self) -> None:
        """After what is queued, the thread ends (``shutdown``, after the transfer thread)."""
        self._jobs.put_stop()

    # ------------------------------------------------------------ disk thread

    def _loop(self) -> None:
        while True:
            try:
                job = self._jobs.get(0.05)
            except queue.Empty:
                continue
            if job[0] == "stop":
                break
            try:
                if job[0] == "write":
                    self._write(*job[1:])
                elif job[0] == "load":
                    self._load(job[1], job[2])
            except Exception:
                self._counters.add(jobs_failed=1)
                logger.exception("rank %d: disk job failed", self._rank)
            finally:
                self._jobs.done()

    def _write(self, op_id: int, req_id: int | None, slot: int, key: int, block: Any,
               demotion: bool) -> None:
        disk = self.tier
        ok, signature = False, None
        started = time.perf_counter()
        if disk is not None and 0 <= slot < disk.capacity:
            try:
                result = disk.write(slot, key, block)
                ok, signature = result.ok, result.signature
                if not ok:
                    _repeating.log(logging.WARNING, f"disk-write-{self._rank}", "rank %d: disk "
                                   "write of slot %d failed: %s", self._rank, slot,
                                   result.error)
            except Exception:
                logger.exception("rank %d: disk write of slot %d failed", self._rank, slot)
        if ok:
            self._metrics.observe_transfer("demote" if demotion else "offload", MEDIUM_DISK,
                                           time.perf_counter() - started, self._block_bytes)
            if demotion:
                self._counters.add(bytes_demoted=self._block_bytes, blocks_demoted=1)
            else:
                self._counters.add(bytes_offloaded=self._block_bytes, blocks_offloaded=1)
        self._reporter.report(op_id, ok, ERR_NONE if ok else ERR_FAILED, signature)
        if req_id is not None:
            self._progress.save_ended((req_id,))

    def _load(self, copy: LoadCopy, req_id: int) -> None:
        """Read, verify, copy into the device block through the staging block (waited for)."""
        disk, staging, progress = self.tier, self.staging, self._progress
        ok, error = False, ERR_FAILED
        started = time.perf_counter()
        try:
            if progress.is_fenced(req_id):
                pass  # TensorRT-LLM freed the blocks: never write them
            elif disk is not None and 0 <= copy.slot < disk.capacity:
                if disk.read(copy.slot, copy.key, staging.buffer):
                    # A fence that arrived during the read wins.
                    if progress.begin_writing(req_id):
                        try:
                            ok = staging.to_device(copy.device_block, copy.pages)
                        finally:
                            progress.written((req_id,))
                else:
                    error = ERR_CORRUPT
                    self._counters.add(corrupt_blocks=1)
        except Exception:
            logger.exception("rank %d: disk load of slot %d failed", self._rank, copy.slot)
        if ok:
            self._metrics.observe_transfer("onboard", MEDIUM_DISK,
                                           time.perf_counter() - started, self._block_bytes)
            self._counters.add(bytes_onboarded=self._block_bytes, blocks_onboarded=1)
        else:  # a read error, a failed check, a copy timeout (a fenced request: ignored)
            progress.load_failed(req_id, (copy.device_block,))
        self._reporter.report(copy.op_id, ok, ERR_NONE if ok else error)
        progress.load_ended((req_id,))

    def close(self) -> None:
        """Close the tier (``shutdown``, after the thread stopped)."""
        if self.tier is not None:
            self.tier.close()

"""The worker's disk thread: block files written atomically and read back verified.

A mixin of :class:`~kvbm_plugin.connector_worker.KvbmConnectorWorker` (its state lives there):
the worker's transfer thread queues ``("write", ...)`` and ``("load", ...)`` jobs on
``_disk_jobs``; :meth:`DiskJobs._disk_loop` runs them on the rank's disk thread, never on the
executor thread, and reports each op once.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.connector.meta import ERR_CORRUPT, ERR_FAILED, ERR_NONE, LoadCopy
from kvbm_plugin.wire.events import MEDIUM_DISK

logger = logging.getLogger("kvbm_plugin.connector_worker")
# Failures that can repeat once per block (a full or failing disk): one line per interval each.
_repeating = RateLimitedLog(logger)

class DiskJobs:
    """The disk-thread methods of the worker (see the module docstring)."""

    _disk: Any
    _pool: Any
    _disk_staging: Any
    _disk_stream: Any
    _disk_jobs: queue.SimpleQueue[tuple[Any, ...]]
    _cuda: bool
    _rank: int
    _block_bytes: int
    _metrics: Any
    _staging_to_device: Any  # the worker's (disk staging → device block, waited for)
    _load_errors_add: Any  # connector/load_errors.py

    def _disk_loop(self) -> None:
        """Owns file I/O: atomic block writes and verified reads; never touches the executor
        thread. A disk→device load goes through one pinned staging buffer on its own stream."""
        while True:
            try:
                job = self._disk_jobs.get(timeout=0.05)
            except queue.Empty:
                continue
            if job[0] == "stop":
                break
            try:
                if job[0] == "write":
                    self._disk_write(*job[1:])
                elif job[0] == "load":
                    self._disk_load(job[1], job[2])
            except Exception:
                self._count(jobs_failed=1)
                logger.exception("rank %d: disk job failed", self._rank)

    def _disk_write(self, op_id: int, req_id: int | None, slot: int, key: int, block: Any,
                    demotion: bool) -> None:
        disk = self._disk
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
                self._count(bytes_demoted=self._block_bytes, blocks_demoted=1)
            else:
                self._count(bytes_offloaded=self._block_bytes, blocks_offloaded=1)
        self._report(op_id, ok, ERR_NONE if ok else ERR_FAILED, signature)
        if req_id is not None:
            self._save_terminal(req_id)

    def _disk_load(self, copy: LoadCopy, req_id: int) -> None:
        disk, pool, staging = self._disk, self._pool, self._disk_staging
        ok, error = False, ERR_FAILED
        started = time.perf_counter()
        try:
            with self._lock:
                fenced = req_id in self._fenced
            if fenced:
                pass  # TRT-LLM freed the blocks: never write them
            elif disk is not None and pool is not None and staging is not None \
                    and 0 <= copy.slot < disk.capacity:
                if disk.read(copy.slot, copy.key, staging):
                    with self._lock:  # a fence that arrived during the read wins
                        fenced = req_id in self._fenced
                        if not fenced:
                            self._writing[req_id] = self._writing.get(req_id, 0) + 1
                    if not fenced:
                        try:
                            # (every layer group's pages, where there are several)
                            ok = self._staging_to_device(staging, copy.device_block,
                                                         *((copy.pages,) if copy.pages else ()))
                        finally:
                            self._written((req_id,))
                else:
                    error = ERR_CORRUPT
                    self._count(corrupt_blocks=1)
        except Exception:
            logger.exception("rank %d: disk load of slot %d failed", self._rank, copy.slot)
        if ok:
            self._metrics.observe_transfer("onboard", MEDIUM_DISK,
                                           time.perf_counter() - started, self._block_bytes)
            self._count(bytes_onboarded=self._block_bytes, blocks_onboarded=1)
        else:  # a read error, a failed check, a copy timeout (a fenced request: ignored)
            self._load_errors_add(req_id, (copy.device_block,))
        self._report(copy.op_id, ok, ERR_NONE if ok else error)
        self._load_terminal(req_id)

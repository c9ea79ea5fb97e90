"""The worker's entry for a cache of several KV layer groups, and the copies that go with it
(a mixin of :class:`~kvbm_plugin.connector_worker.KvbmConnectorWorker`; the byte layout of a
tier slot is :mod:`kvbm_plugin.connector.layer_group_copies`).

``register_kv_cache_layout`` is what TensorRT-LLM calls instead of ``register_kv_caches`` under
KVCacheManagerV2 (``connectors/kv_cache_connector.py`` @ 035ab91cad04, stored id 68382362537):
with one group of one region it forwards ``layout.as_single_pool_tensor()`` to
``register_kv_caches`` as upstream's default does (the flat path, unchanged); with several
groups it keeps every group's regions and sizes tier slots to hold a block of each.

A sliding group's page leaves the request once its window has passed, at TensorRT-LLM's next
allocation, without ``request_finished`` (which holds only the pages it still reports). So an
iteration's offloads of a several-group model must have read their pages before the next
forward writes into a page handed to another request: ``wait_for_save`` (executor thread)
waits until the transfer thread has *issued* them (on CUDA: enqueued on the side stream; the
forward stream then waits for them on the device, no host sync; on CPU the copy itself),
at most ``ISSUE_TIMEOUT_S``. One-group models never wait. A save job that wait gave up on
is never issued: its saves fail (counted, ``saves_abandoned``; its demotions, which read host
slots only, still run), since by the time the transfer thread reached it the pages may hold
another request's KV. Whether the transfer thread or the executor thread decides first is
settled under the worker's lock (a job claimed for issue is waited for once more).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.connector.layer_group_copies import GroupPages
from kvbm_plugin.connector.layer_groups import publish_group_windows
from kvbm_plugin.connector.meta import ERR_FAILED

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

ISSUE_TIMEOUT_S = 60.0  # the longest wait_for_save waits for a several-group save's issue


class LayerGroupWorker:
    """``register_kv_cache_layout`` and the several-group copy paths (see module docstring)."""

    _groups_io: GroupPages | None = None
    _env: Any
    _pool: Any
    _pool_blocks: tuple[Any, ...]
    _last_layer: int
    _rank: int
    _group: str
    _cuda: bool
    _host_blocks: tuple[Any, ...]
    _disk_stream: Any
    _side_stream: Any
    _disk_staging: Any
    _lock: Any
    _stats: dict[str, int]
    _disk_identity: str

    def register_kv_cache_layout(self, layout: Any) -> None:
        """Called once per rank (main thread, before the first iteration) by TensorRT-LLM
        revisions with KVCacheManagerV2 instead of ``register_kv_caches``. One group of one
        region: that pool tensor goes to ``register_kv_caches`` (the flat path). Several
        groups: every group's page of a block shares one tier slot. A hybrid model (recurrent
        state roles) raises ValueError naming them."""
        # (One group of several regions, e.g. block scales beside K/V: the composite path
        # below with one group; its ops are flat, the device block being the page.)
        single = layout.as_single_pool_tensor() if len(layout.groups) == 1 else None
        if single is not None:
            self.register_kv_caches(single)  # type: ignore[attr-defined]
            return
        import torch

        from kvbm_plugin.shared_settings import load_shared_settings

        if load_shared_settings(self._env) is not None:  # its keys name one device page
            raise ValueError(f"kvbm_plugin: the shared tier does not support a KV cache of "
                             f"{len(layout.groups)} layer group(s) and "
                             f"{sum(len(g.regions) for g in layout.groups)} regions yet; "
                             "unset DYN_KVBM_SHARED_TIER")
        io = self._groups_io = GroupPages(layout)
        self._disk_identity += io.identity  # read when the disk tier opens (_apply_layout)
        with self._lock:
            self._stats.setdefault("saves_abandoned", 0)
        first = io.segments[0].region
        self._pool = first  # bring-up done (its blocks are never addressed: see _group_copies)
        self._pool_blocks = ()
        self._last_layer = io.last_layer
        if self._rank == 0:
            publish_group_windows(self._group, io.windows)
        logger.info("kvbm_plugin rank %d: %d KV layer groups (%s); a tier slot holds %d B",
                    self._rank, len(io.windows), io.describe(), io.block_bytes)
        self._start_tiers(first, (io.block_bytes,), torch.uint8, io.num_slots)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ transfer thread

    def _group_copies(self, items: list[tuple[tuple[int, ...], int]],
                      load: bool) -> list[tuple[Any, Any]]:
        """(dst, src) pairs for ``(pages, host slot)`` items: every group's live page (one
        group of several regions: the op's device block is its page)."""
        io = self._groups_io
        assert io is not None
        out: list[tuple[Any, Any]] = []
        for pages, slot in items:
            host_slot = self._host_blocks[slot]
            out.extend(io.load_pairs(pages, host_slot) if load
                       else io.save_pairs(pages, host_slot))
        return out

    def _group_staging_to_device(self, staging: Any, pages: tuple[int, ...],
                                 timeout: float) -> bool:
        """Disk staging → every group's live page of a block; on CUDA waited for on this
        (disk) thread, at most ``timeout`` s: the staging buffer is reused by the next read.
        On CUDA the disk stream first waits for what the side stream holds now: a sliding
        page can come back to another request (this load) while an earlier iteration's save
        of it still waits there, behind the forward or other copies; the save was issued
        before this load reached the disk thread (job order), so it reads the page first."""
        io = self._groups_io
        assert io is not None
        if not self._cuda:
            io.scatter(staging, pages)
            return True
        import torch

        with torch.cuda.stream(self._disk_stream):
            self._disk_stream.wait_stream(self._side_stream)
            io.scatter(staging, pages, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._disk_stream)
        deadline = time.monotonic() + timeout
        while not event.query():
            if time.monotonic() > deadline:
                # Later reads get a buffer of their own (the pending copy keeps this one).
                self._disk_staging = torch.empty(staging.shape, dtype=staging.dtype,
                                                 pin_memory=True)
                return False
            time.sleep(0.0002)
        return True

    # ------------------------------------------------------------------ the issue barrier

    def _issue_barrier(self) -> list[Any] | None:
        """A box the transfer thread fills when a save job is issued (several groups only):
        [issued, side-stream event, state: "pending" | "claimed" | "abandoned"]."""
        return [threading.Event(), None, "pending"] if self._groups_io is not None else None

    def _claim(self, meta: Any, box: list[Any] | None) -> Any:
        """Transfer thread, before a save job: the job to run. One wait_for_save gave up on
        (abandoned) keeps its demotions only; its saves are failed here, unread. A save
        naming a page its group's pool does not have fails alone (a slot missing a group's
        bytes must never be stored under the block's key)."""
        if box is None:
            return meta
        with self._lock:
            abandoned = box[2] == "abandoned"
            if not abandoned:
                box[2] = "claimed"
        io = self._groups_io
        assert io is not None
        failed = []
        for op in meta.saves:
            bad = None if abandoned else io.bad_page(op.pages or (op.device_block,))
            if abandoned or bad is not None:
                failed.append(op)
            if bad is not None:
                _log.log(logging.ERROR, f"bad-page-{self._rank}", "rank %d: a save of block %d "
                         "names page %d of layer group %d, outside its pool: failed",
                         self._rank, op.key, bad[1], bad[0])
        if not failed:
            return meta
        for op in failed:
            self._report(op.op_id, False, ERR_FAILED)  # type: ignore[attr-defined]
            self._save_terminal(op.req_id)  # type: ignore[attr-defined]
        for op in meta.shared_saves if abandoned else ():
            self._report(op.op_id, False, ERR_FAILED)  # type: ignore[attr-defined]
        if abandoned:
            self._count(saves_abandoned=len(meta.saves))  # type: ignore[attr-defined]
            return dataclasses.replace(meta, saves=(), shared_saves=())
        return dataclasses.replace(meta, saves=tuple(op for op in meta.saves
                                                     if op not in failed))

    def _issued(self, box: list[Any] | None) -> None:
        """Transfer thread, after a save job's copies were issued: on CUDA record where the
        side stream stands, then release the executor thread."""
        if box is None:
            return
        if self._cuda and self._side_stream is not None:
            import torch

            event = torch.cuda.Event()
            event.record(self._side_stream)
            box[1] = event
        box[0].set()

    def _await_issue(self, box: list[Any] | None, stream: Any) -> None:
        """Executor thread (wait_for_save): wait until the job was issued; on CUDA make the
        forward stream wait for its copies on the device (the next forward may write a page
        the window released)."""
        if box is None:
            return
        if not box[0].wait(ISSUE_TIMEOUT_S):
            with self._lock:
                claimed = box[2] == "claimed"
                if not claimed:
                    box[2] = "abandoned"
            if not claimed or not box[0].wait(ISSUE_TIMEOUT_S):
                logger.error("rank %d: a several-group save was not issued within %.1f s; "
                             "%s", self._rank, ISSUE_TIMEOUT_S, "its saves fail" if not claimed
                             else "its pages may be rewritten before it reads them")
                return
        if box[1] is not None:
            import torch

            (stream if stream is not None else torch.cuda.current_stream()).wait_event(box[1])

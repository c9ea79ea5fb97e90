"""The worker's side of a cache of several KV layer groups: bring-up, host copy pairs and
the save-issue barrier (the byte layout of a tier slot is
:mod:`kvbm_plugin.worker.layer_group_copies`; the disk staging copy is
``worker.device_copy.DiskStaging``).

``register_kv_cache_layout`` is what TensorRT-LLM calls instead of ``register_kv_caches`` under
KVCacheManagerV2 (``connectors/kv_cache_connector.py`` @ 035ab91cad04, stored id 68382362537):
with one group of one region it forwards ``layout.as_single_pool_tensor()`` to
``register_kv_caches`` as upstream's default does (the flat path, unchanged); with several
groups the worker's ``register_kv_cache_layout`` keeps every group's regions
(:func:`open_group_pages`) and sizes tier slots to hold a block of each.

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
settled under the barrier's lock (a job claimed for issue is waited for once more):
:class:`GroupSaveBarrier`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Mapping
from typing import Any

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.connector.meta import ERR_FAILED, ConnectorMetadata
from kvbm_plugin.leader.layer_groups import publish_group_windows
from kvbm_plugin.worker.layer_group_copies import GroupPages
from kvbm_plugin.worker.op_reports import OpReporter
from kvbm_plugin.worker.request_progress import RequestProgress
from kvbm_plugin.worker.transfer_counters import TransferCounters

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

ISSUE_TIMEOUT_S = 60.0  # the longest wait_for_save waits for a several-group save's issue


def open_group_pages(layout: Any, env: Mapping[str, str], rank: int, group: str) -> GroupPages:
    """Several groups (``register_kv_cache_layout``, main thread): every group's regions as one
    tier slot per block; rank 0 publishes the groups' windows for its leader. Raises ValueError
    for a hybrid model (naming its recurrent-state roles) or with the shared tier on."""
    from kvbm_plugin.settings.shared import load_shared_settings

    if load_shared_settings(env) is not None:  # its keys name one device page
        raise ValueError(f"kvbm_plugin: the shared tier does not support a KV cache of "
                         f"{len(layout.groups)} layer group(s) and "
                         f"{sum(len(g.regions) for g in layout.groups)} regions yet; "
                         "unset DYN_KVBM_SHARED_TIER")
    pages = GroupPages(layout)
    if rank == 0:
        publish_group_windows(group, pages.windows)
    logger.info("kvbm_plugin rank %d: %d KV layer groups (%s); a tier slot holds %d B",
                rank, len(pages.windows), pages.describe(), pages.block_bytes)
    return pages


def group_host_pairs(pages: GroupPages, host_blocks: tuple[Any, ...],
                     items: list[tuple[tuple[int, ...], int]], load: bool) -> list[tuple[Any, Any]]:
    """(dst, src) pairs for ``(pages, host slot)`` items: every group's live page (one group of
    several regions: the op's device block is its page). Transfer thread."""
    out: list[tuple[Any, Any]] = []
    for block_pages, slot in items:
        host_slot = host_blocks[slot]
        out.extend(pages.load_pairs(block_pages, host_slot) if load
                   else pages.save_pairs(block_pages, host_slot))
    return out


@dataclasses.dataclass
class SaveIssue:
    """One save job's issue, as the executor thread waits for it."""

    issued: threading.Event = dataclasses.field(default_factory=threading.Event)
    side_event: Any = None  # CUDA: where the side stream stood once the job was issued
    state: str = "pending"  # "pending" | "claimed" (transfer thread) | "abandoned" (executor)


class GroupSaveBarrier:
    """The executor thread's wait for a several-group save job's issue (see the module)."""

    def __init__(self, pages: GroupPages, rank: int, side_stream: Any,
                 progress: RequestProgress, reporter: OpReporter,
                 counters: TransferCounters) -> None:
        self._pages = pages
        self._rank = rank
        self._side_stream = side_stream  # None on CPU
        self._progress = progress
        self._reporter = reporter
        self._counters = counters
        self._lock = threading.Lock()
        counters.declare("saves_abandoned")

    def claim(self, meta: ConnectorMetadata, issue: SaveIssue) -> ConnectorMetadata:
        """Transfer thread, before a save job: the job to run. One wait_for_save gave up on
        (abandoned) keeps its demotions only; its saves are failed here, unread. A save
        naming a page its group's pool does not have fails alone (a slot missing a group's
        bytes must never be stored under the block's key)."""
        with self._lock:
            abandoned = issue.state == "abandoned"
            if not abandoned:
                issue.state = "claimed"
        failed = []
        for op in meta.saves:
            bad = None if abandoned else self._pages.bad_page(op.pages or (op.device_block,))
            if abandoned or bad is not None:
                failed.append(op)
            if bad is not None:
                _log.log(logging.ERROR, f"bad-page-{self._rank}", "rank %d: a save of block %d "
                         "names page %d of layer group %d, outside its pool: failed",
                         self._rank, op.key, bad[1], bad[0])
        if not failed:
            return meta
        for op in failed:
            self._reporter.report(op.op_id, False, ERR_FAILED)
            self._progress.save_ended((op.req_id,))
        for op in meta.shared_saves if abandoned else ():
            self._reporter.report(op.op_id, False, ERR_FAILED)
        if abandoned:
            self._counters.add(saves_abandoned=len(meta.saves))
            return dataclasses.replace(meta, saves=(), shared_saves=())
        return dataclasses.replace(meta, saves=tuple(op for op in meta.saves
                                                     if op not in failed))

    def issued(self, issue: SaveIssue) -> None:
        """Transfer thread, after a save job's copies were issued: on CUDA record where the
        side stream stands, then release the executor thread."""
        if self._side_stream is not None:
            import torch

            event = torch.cuda.Event()
            event.record(self._side_stream)
            issue.side_event = event
        issue.issued.set()

    def await_issue(self, issue: SaveIssue, stream: Any) -> None:
        """Executor thread (wait_for_save): wait until the job was issued; on CUDA make the
        forward stream wait for its copies on the device (the next forward may write a page
        the window released)."""
        if not issue.issued.wait(ISSUE_TIMEOUT_S):
            with self._lock:
                claimed = issue.state == "claimed"
                if not claimed:
                    issue.state = "abandoned"
            if not claimed or not issue.issued.wait(ISSUE_TIMEOUT_S):
                logger.error("rank %d: a several-group save was not issued within %.1f s; "
                             "%s", self._rank, ISSUE_TIMEOUT_S, "its saves fail" if not claimed
                             else "its pages may be rewritten before it reads them")
                return
        if issue.side_event is not None:
            import torch

            (stream if stream is not None else torch.cuda.current_stream()).wait_event(
                issue.side_event)

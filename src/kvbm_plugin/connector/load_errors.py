"""The worker's load errors: device blocks a promised load did not fill, for TensorRT-LLM to
recompute.

A mixin of :class:`~kvbm_plugin.connector_worker.KvbmConnectorWorker` (its ``_lock``,
``_fenced``, ``_stats`` and ``_load_errors`` live there). Every load path adds the device
blocks of its failed copies before it reports them and before the request can come back from
``get_finished`` (:meth:`LoadErrors._load_errors_add`: the transfer thread for host copies,
the disk thread, the shared tier's reader thread); TensorRT-LLM's executor thread takes them
with :meth:`LoadErrors.get_block_ids_with_load_errors`, which only swaps a set under the lock.

Causes: a host copy whose slot no longer holds its block or whose batch failed or timed out
(``OP_TIMEOUT_S``); a disk read error, a file that fails its check, a disk→device copy that
timed out; a shared-tier object gone, of another size or failing its check
(``tiers.shared.frame``), a staging→device copy that timed out; an op that reached a rank
without the tier it names. A request fenced by a cancel is not reported: TensorRT-LLM freed its
blocks already, so they are no longer its (another request may hold them now, and its own
forward fills them).

Upstream: the worker's ``get_block_ids_with_load_errors()`` (the ABC default returns ``[]``)
and the manager's ``handle_load_errors(requests, kv_cache_manager)``, which calls it once and
returns the requests whose ``kv_cache_manager.get_cache_indices(req)`` hold any of those
blocks, skipping a request whose indices cannot be read: TensorRT-LLM's
``tests/unittest/_torch/test_connector.py`` (stored id 56134997080: ``test_handle_load_errors_*``,
``test_get_block_ids_with_load_errors_default_returns_empty``). The revisions this project
cites (``connectors/kv_cache_connector.py`` @ 035ab91cad04, ``kv_cache_connector.py`` @
00fdcbff5ad8) have neither: there nothing calls this method, and a failed load stays a counted
failure computed on unfilled blocks (docs/operations.md#limitations).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from kvbm_plugin._util.ratelimit import RateLimitedLog

logger = logging.getLogger("kvbm_plugin.connector_worker")
_log = RateLimitedLog(logger)


class LoadErrors:
    """Load-error bookkeeping of the worker (see the module docstring)."""

    _lock: threading.Lock
    _fenced: set[int]
    _stats: dict[str, int]
    _load_errors: set[int]
    _rank: int

    def _load_errors_add(self, req_id: int, device_blocks: Iterable[int]) -> None:
        """The loads of ``req_id`` into ``device_blocks`` failed (any transfer thread; before
        their reports). Ignored for a fenced request: its blocks are no longer its."""
        blocks = [b for b in device_blocks if b >= 0]
        with self._lock:
            if req_id in self._fenced or not blocks:
                return
            self._load_errors.update(blocks)
            self._stats["load_error_blocks"] += len(blocks)
        _log.log(logging.WARNING, f"load-errors-{self._rank}", "rank %d: %d block(s) of "
                 "request %d were not loaded; reported as load errors (TensorRT-LLM recomputes "
                 "the request where its version asks get_block_ids_with_load_errors)",
                 self._rank, len(blocks), req_id)

    def get_block_ids_with_load_errors(self) -> list[int]:
        """Device block ids whose promised load failed since the last call (each reported
        once). Called by TensorRT-LLM's connector manager (``handle_load_errors``) on the
        rank's executor thread; no I/O, no wait: swaps a set under the worker's lock."""
        with self._lock:
            if not self._load_errors:
                return []
            errors, self._load_errors = self._load_errors, set()
        return sorted(errors)

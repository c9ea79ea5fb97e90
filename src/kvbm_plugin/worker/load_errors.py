"""The worker's load errors: device blocks a promised load did not fill, for TensorRT-LLM to
recompute.

:class:`LoadErrorRecord` owns the set; one per worker. Every load path adds the device blocks
of its failed copies before it reports them and before the request can come back from
``get_finished``, through ``RequestProgress.load_failed`` (worker/request_progress.py: the
transfer thread for host copies, the disk thread, the shared tier's reader thread), which
drops a fenced request's blocks; TensorRT-LLM's executor thread takes them with the worker's
``get_block_ids_with_load_errors`` (:meth:`LoadErrorRecord.take`, which only swaps a set under
the record's lock).

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
from collections.abc import Sequence

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.worker.transfer_counters import TransferCounters

logger = logging.getLogger("kvbm_plugin.connector_worker")
_log = RateLimitedLog(logger)


class LoadErrorRecord:
    """Device blocks whose promised load failed, not yet taken by TensorRT-LLM (see the
    module docstring). Its lock is a leaf: ``RequestProgress`` calls :meth:`add` under its own
    lock, so the fence check and the add are one step."""

    def __init__(self, rank: int, counters: TransferCounters) -> None:
        self._rank = rank
        self._counters = counters
        self._lock = threading.Lock()
        self._blocks: set[int] = set()

    def add(self, blocks: Sequence[int]) -> None:
        """Record ``blocks`` (non-negative device block ids; any transfer thread)."""
        with self._lock:
            self._blocks.update(blocks)
        self._counters.add(load_error_blocks=len(blocks))

    def warn(self, req_id: int, n_blocks: int) -> None:
        """The rate-limited line for one request's failed loads (outside every lock)."""
        _log.log(logging.WARNING, f"load-errors-{self._rank}", "rank %d: %d block(s) of "
                 "request %d were not loaded; reported as load errors (TensorRT-LLM recomputes "
                 "the request where its version asks get_block_ids_with_load_errors)",
                 self._rank, n_blocks, req_id)

    def take(self) -> list[int]:
        """The blocks recorded since the last call, sorted, each returned once. The worker's
        ``get_block_ids_with_load_errors`` (executor thread): no I/O, no wait."""
        with self._lock:
            if not self._blocks:
                return []
            blocks, self._blocks = self._blocks, set()
        return sorted(blocks)

"""Where a worker tells its leader that an op is terminal on this rank.

Every op the leader put in the metadata reaches a terminal state on every rank and is reported
once (connector/meta.py's ``OpReport``). :class:`OpReporter` is that channel for one rank: the
in-process completion hub where the leader runs in this process, else (tensor-parallel ranks in
other processes) a ZMQ sender to the leader's report port. Called from the worker's transfer,
completion and disk threads and the shared tier's threads; never from the executor thread.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvbm_plugin.connector import llm_args as _llm_args
from kvbm_plugin.connector.meta import (
    ERR_FAILED,
    ERR_NONE,
    CompletionHub,
    OpReport,
    ZmqReportSender,
    find_hub,
)
from kvbm_plugin.worker.transfer_counters import TransferCounters

logger = logging.getLogger("kvbm_plugin.connector_worker")


class OpReporter:
    """One rank's reports to its leader; counts failed ops (``ops_failed``)."""

    def __init__(self, group: str, par: _llm_args.Parallel, env: Mapping[str, str],
                 counters: TransferCounters) -> None:
        self._group = group
        self._par = par
        self._rank = par.tp_rank
        self._env = env
        self._counters = counters
        self._channel: Any = None
        self._warned = False

    def report(self, op_id: int, ok: bool, error: int = ERR_NONE,
               signature: tuple[int, int] | None = None) -> None:
        """Op ``op_id`` is terminal on this rank. Never raises: it runs in done callbacks,
        where raising would leave the rest of a batch unreported and its requests waiting."""
        if not ok:
            self._counters.add(ops_failed=1)
        try:
            channel = self._channel_or_none()
            if channel is not None:
                channel.put(OpReport(op_id, self._rank, ok, error, signature))
        except Exception:
            logger.exception("rank %d: could not report op %d", self._rank, op_id)

    def report_all(self, results: Sequence[tuple[int, bool]]) -> None:
        """:meth:`report` for a whole copy batch: ``(op_id, ok)`` pairs, one hand-off."""
        failed = sum(not ok for _, ok in results)
        if failed:
            self._counters.add(ops_failed=failed)
        rank = self._rank
        try:
            channel = self._channel_or_none()
            if isinstance(channel, CompletionHub):  # in process: the leader folds it whole
                channel.put_batch(rank, [op_id for op_id, _ in results],
                                  [ok for _, ok in results])
            elif channel is not None:
                channel.put_many([OpReport(op_id, rank, ok, ERR_NONE if ok else ERR_FAILED)
                                  for op_id, ok in results])
        except Exception:
            logger.exception("rank %d: could not report %d ops", self._rank, len(results))

    def _channel_or_none(self) -> Any:
        """The in-process hub, else (ranks in other processes) the ZMQ channel to the
        leader; None (logged once) when there is neither."""
        if self._channel is None:
            hub = find_hub(self._group)
            if hub is not None:
                self._channel = hub
            elif self._par.tp_size > 1:
                env = self._env
                self._channel = ZmqReportSender(
                    f"tcp://{_llm_args.leader_host(env)}:{_llm_args.report_port(env, self._par)}")
            else:
                if not self._warned:
                    logger.error("rank %d: no leader found for group %r; tier blocks "
                                 "written by this worker will not be advertised",
                                 self._rank, self._group)
                    self._warned = True
                return None
        return self._channel

    def close(self) -> None:
        """Close the ZMQ channel if this rank opened one (the hub is the leader's)."""
        if isinstance(self._channel, ZmqReportSender):
            self._channel.close()

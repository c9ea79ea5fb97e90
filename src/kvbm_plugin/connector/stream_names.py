"""TensorRT-LLM's block names for an attention-DP rank other than 0, read off its own stream.

Under attention DP TensorRT-LLM gathers every rank's KV events onto rank 0 (see
``connector/assembly.py``), so the leader of rank r > 0 never sees its rank's events in
process, and rank 0's leader publishes them on rank r's GPU-tier endpoint. Where TensorRT-LLM
hands the connector no ``RequestData.block_hashes``, rank r's leader still needs those names
(to confirm the V1 hashes it computes, or to learn the ones it cannot compute:
``connector/naming.py``): :class:`StreamNames` subscribes to rank r's GPU-tier endpoint and
feeds every batch it receives to the naming's ``BlockNames.observe``, as rank 0's sink does
with ``on_flush``. A batch sent before the subscription reached the publisher is not seen;
only its blocks' names wait for a later confirmation.

Owned by the leader of rank r; :meth:`poll` runs under the leader's lock (executor thread in
``build_connector_meta``, or the idle keeper's thread), reads without blocking and does
O(events) work.
"""

from __future__ import annotations

import logging
from typing import Any

import msgpack
import zmq

from kvbm_plugin._util.ratelimit import RateLimitedLog

logger = logging.getLogger(__name__)

MAX_MESSAGES_PER_POLL = 256  # bounds one call's work; the rest waits for the next


class StreamNames:
    """A SUB on one rank's GPU-tier stream, feeding ``names.observe``."""

    def __init__(self, endpoint: str, names: Any, hwm: int = 100000) -> None:
        self._names = names
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, hwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self.endpoint = endpoint
        self.batches = 0
        self.malformed = 0
        self._log = RateLimitedLog(logger)

    @classmethod
    def for_rank(cls, par: Any, config: Any, names: Any, events_source: str
                 ) -> StreamNames | None:
        """The reader for attention-DP rank ``par.dp_rank`` > 0 (None elsewhere, or where no
        GPU-tier stream is published: ``events_source`` off, no endpoint)."""
        if not par.attention_dp or par.dp_rank == 0 or events_source == "off" \
                or config.gpu_events is None:
            return None
        return cls(config.publish_endpoint(par.dp_rank).connect, names,
                   config.publisher.hwm)

    def poll(self) -> int:
        """Observe the batches that arrived (at most :data:`MAX_MESSAGES_PER_POLL`)."""
        n = 0
        while n < MAX_MESSAGES_PER_POLL:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            try:
                _ts, events, rank = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
                self._names.observe(int(rank), events)
                self.batches += 1
            except Exception as exc:  # a bad batch names nothing; the next ones still do
                self.malformed += 1
                self._log.log(logging.WARNING, "malformed", "kvbm_plugin: GPU-tier batch on "
                              "%s not usable for block names (%s: %s)", self.endpoint,
                              type(exc).__name__, exc)
        return n

    def close(self) -> None:
        self._sub.close()
        self._ctx.term()

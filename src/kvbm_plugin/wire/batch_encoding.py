"""Encoding a publisher's batches so that one bad event never loses the others.

Who calls what: ``ZmqEventPublisher`` (wire/publisher.py) calls :meth:`BatchEncoding.payload`
for every batch, on the thread that encodes it (the caller's, its publisher thread, or the
inline owner's); its ``stats`` read the counters (any thread: snapshots).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin._util.saferepr import saferepr
from kvbm_plugin.wire.events import batch_payload, salvage_batch


class BatchEncoding:
    """A batch's payload, or when the whole batch cannot be encoded, the batch without the
    events that cannot be (``wire.events.salvage_batch``): those are dropped, counted in
    :attr:`events_unencodable` and logged rate-limited. A batch with nothing left to encode is
    lost (counted in :attr:`errors`; consumers see the seq gap)."""

    def __init__(self, owner: str, log: RateLimitedLog) -> None:
        self._owner = owner
        self._log = log
        self.errors = 0  # batches lost: nothing of them could be encoded
        self.events_unencodable = 0  # events dropped from batches published without them

    def payload(self, encode: Callable[[Any], bytes], seq: int, ts: float,
                events: Sequence[Any], rank: int) -> tuple[bytes | None, Sequence[Any]]:
        """``(payload, events it holds)``; payload None when the batch is lost."""
        try:
            return batch_payload(encode, ts, events, rank), events
        except Exception:
            pass
        payload, kept, dropped, first_error = salvage_batch(encode, ts, events, rank)
        if payload is None:
            self.errors += 1
            self._log.log(logging.ERROR, "encode", "%s: batch seq %d (%d events, dp_rank %s) "
                          "cannot be encoded, lost (consumers see a gap): %s", self._owner,
                          seq, len(events), saferepr(rank, 40), saferepr(first_error))
            return None, events
        self.events_unencodable += dropped
        self._log.log(logging.ERROR, "encode-event", "%s: batch seq %d: %d of %d events cannot "
                      "be encoded and were dropped, the others published: %s", self._owner,
                      seq, dropped, len(events), saferepr(first_error))
        return payload, kept


__all__ = ["BatchEncoding"]

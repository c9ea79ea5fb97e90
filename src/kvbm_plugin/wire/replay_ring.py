"""The batches a publisher keeps for replay, bounded in batches and in bytes.

Who calls what: ``ZmqEventPublisher`` (wire/publisher.py) calls :meth:`ReplayRing.keep` on the
thread that sends (the caller's, its publisher thread, or the inline owner's), for every batch,
sent or not (a replay can then fill a live gap); its replay thread answers requests from
snapshots of :attr:`ReplayRing.entries` (``list(deque)``, atomic under the GIL).
"""

from __future__ import annotations

from collections import deque


class ReplayRing:
    """The newest ``steps`` batches ``(seq, payload)``, of at most ``max_bytes`` payload bytes
    together (the newest batch always stays): a step bound alone would let large batches hold
    hundreds of MB."""

    def __init__(self, steps: int, max_bytes: int) -> None:
        self.entries: deque[tuple[int, bytes]] = deque(maxlen=steps)
        self.bytes = 0  # payload bytes in entries
        self._max_bytes = max_bytes

    def keep(self, seq: int, payload: bytes) -> None:
        """Append one batch, then drop the oldest ones past the byte bound."""
        entries = self.entries
        size = self.bytes + len(payload)
        if len(entries) == entries.maxlen:  # append drops the oldest: its bytes leave too
            size -= len(entries[0][1])
        entries.append((seq, payload))
        if size > self._max_bytes:
            while size > self._max_bytes and len(entries) > 1:
                size -= len(entries.popleft()[1])
        self.bytes = size


__all__ = ["ReplayRing"]

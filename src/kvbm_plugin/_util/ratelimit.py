"""Rate-limited logging for losses and bad input on hot paths.

A loss (a dropped batch, a malformed event) must be visible in the log, but a storm of them must
not turn into a storm of log lines on TensorRT-LLM's executor thread. ``RateLimitedLog`` emits
the first occurrence of each key at once and afterwards at most one line per ``interval``
seconds, carrying the number of occurrences it held back.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any


class RateLimitedLog:
    """One line per key per ``interval`` seconds, with the count of suppressed repeats.

    Thread-safe (a tiny lock around the per-key bookkeeping; never held while logging).
    """

    __slots__ = ("_logger", "_interval", "_lock", "_state")

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._logger = logger
        self._interval = interval
        self._lock = threading.Lock()
        self._state: dict[str, list[float | int]] = {}  # key -> [last emit time, suppressed]

    def log(self, level: int, key: str, msg: str, *args: Any) -> None:
        """Log ``msg % args`` now, or count it if ``key`` was logged less than interval ago."""
        now = time.monotonic()
        with self._lock:
            state = self._state.get(key)
            if state is not None and now - state[0] < self._interval:
                state[1] += 1
                return
            suppressed = 0 if state is None else int(state[1])
            self._state[key] = [now, 0]
        if suppressed:
            msg = msg + " (%d similar messages suppressed)"
            args = (*args, suppressed)
        self._logger.log(level, msg, *args)

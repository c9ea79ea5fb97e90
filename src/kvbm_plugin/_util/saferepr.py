"""Bounded ``repr`` for values that came off the wire, for log lines and error messages.

``repr`` of a decoded message is unsafe to put in a log: a 1 KB msgpack list nested 1,000 deep
makes it raise ``RecursionError``, a 10 MB string makes a 10 MB log line, and an int with more
than 4,300 digits makes it raise ``ValueError``. :func:`saferepr` never raises and never
recurses deeper than a few levels: containers are cut after a few items and levels, long strings
and ints are abbreviated, and the whole result is cut at ``limit`` characters.

Called by every place that formats wire data into a log line or a WireFormatError message (the
consolidator's socket shell, the publisher, ``subscribe``, the sidecar), from any thread.
"""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = ["saferepr"]


class _BoundedRepr(reprlib.Repr):
    """reprlib with small limits; anything reprlib does not know is cut at ``maxother``."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 4
        self.maxtuple = self.maxlist = self.maxarray = 8
        self.maxdict = self.maxset = self.maxfrozenset = self.maxdeque = 8
        self.maxstring = 80
        self.maxlong = 40
        self.maxother = 80

    def repr_int(self, x: int, level: int) -> str:
        # builtins.repr raises ValueError beyond sys.get_int_max_str_digits() digits.
        if x.bit_length() > 128:
            return f"<int of {x.bit_length()} bits>"
        return super().repr_int(x, level)

    def repr_bytes(self, x: bytes, level: int) -> str:
        return self._cut_bytes(x)

    def repr_bytearray(self, x: bytearray, level: int) -> str:
        return self._cut_bytes(bytes(x[:self.maxstring]) if len(x) > self.maxstring else bytes(x))

    def repr_memoryview(self, x: memoryview, level: int) -> str:
        return f"<memoryview of {x.nbytes} bytes>"

    def _cut_bytes(self, x: bytes) -> str:
        if len(x) <= self.maxstring:
            return repr(x)
        return repr(x[:self.maxstring]) + f"...({len(x)} bytes)"


_REPR = _BoundedRepr()


def saferepr(value: Any, limit: int = 200) -> str:
    """A ``repr`` of ``value`` of at most ``limit`` characters (plus "..."); never raises."""
    try:
        text = _REPR.repr(value)
    except Exception as exc:  # a foreign object's __repr__ may raise anything
        text = f"<{type(value).__name__} (repr failed: {type(exc).__name__})>"
    if len(text) > limit:
        text = text[:limit] + "..."
    return text

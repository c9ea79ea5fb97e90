"""Fixtures shared by the socket tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq


class _KeepingContext(zmq.Context):
    """Holds every socket it made until the fixture closes it: a test's local socket must not be
    finalized unclosed (ResourceWarning) before the context is destroyed."""

    made: list[zmq.Socket] = []  # declared on the class: pyzmq maps other names to options

    def __init__(self) -> None:
        super().__init__()
        self.made = []

    def socket(self, *args: Any, **kwargs: Any) -> zmq.Socket:
        sock = super().socket(*args, **kwargs)
        self.made.append(sock)
        return sock


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    """A private ZMQ context; every socket made from it is closed (linger 0) after the test."""
    context = _KeepingContext()
    yield context
    for sock in context.made:
        sock.close(linger=0)
    context.destroy(linger=0)

"""Fixtures shared by the socket tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    """A private ZMQ context, destroyed (sockets closed, linger 0) after the test."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


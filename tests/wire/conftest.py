"""Fixtures shared by the wire tests: tcp endpoints on free loopback ports, and publishers shut
down after the test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _kvwire import free_port

from kvbm_plugin.consolidator_config import Endpoint
from kvbm_plugin.wire.publisher import ZmqEventPublisher


@pytest.fixture
def tcp() -> tuple[Endpoint, Endpoint]:
    """A publish and a replay endpoint, each on a free loopback port."""
    return (Endpoint("tcp", host="127.0.0.1", port=free_port()),
            Endpoint("tcp", host="127.0.0.1", port=free_port()))


@pytest.fixture
def publishers() -> Iterator[list[ZmqEventPublisher]]:
    """A list the test appends its publishers to; each is shut down after the test."""
    made: list[ZmqEventPublisher] = []
    yield made
    for pub in made:
        pub.shutdown(2.0)

"""Fixtures shared by the wire tests: tcp endpoints on free loopback ports, and publishers shut
down after the test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from _kvwire import free_port

from kvbm_plugin.consolidator_config import Endpoint
from kvbm_plugin.wire import conn_gate
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


def compiled_gate_or_skip() -> None:
    """Skip where the compiled gate cannot run (installed without a C compiler), unless
    KVBM_REQUIRE_NATIVE=1 (CI's main run) makes that a failure."""
    if conn_gate._start_compiled() is None:
        if os.environ.get("KVBM_REQUIRE_NATIVE") == "1":
            pytest.fail("the compiled connection gate (wire/_gate_c.c) cannot run")
        pytest.skip("the compiled connection gate was not built")


@pytest.fixture(params=["compiled", "python"])
def gate(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs the test with each connection gate (wire/conn_gate.py) under the caps it makes."""
    if request.param == "compiled":
        compiled_gate_or_skip()
    else:
        monkeypatch.setattr(conn_gate, "USE_COMPILED", False)
    return str(request.param)

"""Fixtures shared by the tests: ZMQ contexts, and the guard that fails a test on an ERROR it
did not expect; a short base directory for the run's temporary paths."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvbm_plugin.wire.conn_watch import WATCH

_OWN_BASETEMP = "_kvbm_own_basetemp"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Give the run a short base directory of its own for ``tmp_path``: an ipc endpoint's path
    must fit a Unix socket address (107 bytes), and pytest's default
    (``/tmp/pytest-of-<user>/pytest-<n>/``, plus ``popen-gw<k>/`` under pytest-xdist's
    ``-n 2``, which pyproject.toml's addopts set) left tests with long names and nested
    directories past it. A fresh ``mkdtemp`` per run, so concurrent runs never share one;
    removed when the run ends. Runs in the controller before pytest's tmpdir plugin reads the
    option; xdist's workers are handed ``<base>/popen-gw<k>``."""
    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        config.option.basetemp = tempfile.mkdtemp(prefix="kvbm-t")
        setattr(config, _OWN_BASETEMP, config.option.basetemp)


def pytest_unconfigure(config: pytest.Config) -> None:
    own = getattr(config, _OWN_BASETEMP, None)
    if own is not None and os.path.isdir(own):
        shutil.rmtree(own, ignore_errors=True)


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
    WATCH.release(context)  # monitors of caps a failed test left open: the watch lets go first
    for sock in context.made:
        sock.close(linger=0)
    context.destroy(linger=0)


class ErrorRecorder(logging.Handler):
    """Collects the ERROR records of ``kvbm_plugin`` loggers and the exceptions that escaped a
    thread (``threading.excepthook``) while one test runs."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []
        self.thread_exceptions: list[threading.ExceptHookArgs] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def on_thread_exception(self, args: threading.ExceptHookArgs) -> None:
        self.thread_exceptions.append(args)

    def messages(self) -> list[str]:
        return [record.getMessage() for record in self.records]

    def wait_for(self, text: str, timeout: float = 10.0) -> bool:
        """True once an ERROR record containing ``text`` arrived (polled until ``timeout``: a
        background thread may log just after the counter the test waited on moved)."""
        deadline = time.monotonic() + timeout
        while True:
            if any(text in message for message in self.messages()):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def describe(self) -> str:
        lines = [f"{r.name} {r.levelname}: {r.getMessage()}" + (
            f" ({r.exc_info[0].__name__}: {r.exc_info[1]})" if r.exc_info and r.exc_info[0]
            else "") for r in self.records]
        lines += [f"thread {a.thread.name if a.thread else '?'}: "
                  f"{a.exc_type.__name__}: {a.exc_value}" for a in self.thread_exceptions]
        return "\n".join(lines)


_ERRORS_KEY = pytest.StashKey[ErrorRecorder]()


@pytest.fixture(autouse=True)
def _no_unexpected_errors(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test in which a ``kvbm_plugin`` logger emitted an ERROR, or an exception escaped
    a thread, unless the test asked for :func:`expect_errors` (and asserts on what it got) or
    carries ``@pytest.mark.expect_errors`` (where it cannot take a fixture: a Hypothesis test
    fed malformed input on purpose).

    Runs first and is torn down last, so errors logged by other fixtures' teardown (engine or
    publisher shutdown) count too.
    """
    recorder = ErrorRecorder()
    request.node.stash[_ERRORS_KEY] = recorder
    expected = "expect_errors" in request.fixturenames \
        or request.node.get_closest_marker("expect_errors") is not None
    plugin_logger = logging.getLogger("kvbm_plugin")
    plugin_logger.addHandler(recorder)
    previous_hook = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        recorder.on_thread_exception(args)
        if not expected:  # an expected one is the test's to judge, not a warning
            previous_hook(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous_hook
        plugin_logger.removeHandler(recorder)
    if (recorder.records or recorder.thread_exceptions) and not expected:
        pytest.fail("unexpected errors during the test (use the expect_errors fixture where "
                    "the test provokes them and asserts on them):\n" + recorder.describe(),
                    pytrace=False)


@pytest.fixture
def expect_errors(request: pytest.FixtureRequest) -> ErrorRecorder:
    """Opt-out of the unexpected-error guard: the ERROR records and thread exceptions the test
    provokes, for it to assert on."""
    return request.node.stash[_ERRORS_KEY]


# The leader's idle keeper applies what completes while TensorRT-LLM's loop blocks
# (leader/keeper.py); run_until_idle waits for it after every request wave. At the shipped
# period (0.1 s) that is up to 0.2 s per wait, which summed to tens of seconds of idle wall time
# over the suite; the tests run it every 10 ms. The keeper's own bound is tested at the shipped
# period (tests/connector/test_idle_keeper.py puts it back). Engines in child processes
# (EngineProcess, the CLI's) keep the shipped period.
TEST_IDLE_PERIOD_S = 0.01


@pytest.fixture(autouse=True)
def _prompt_idle_keeper(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbm_plugin.connector_leader import KvbmConnectorLeader

    monkeypatch.setattr(KvbmConnectorLeader, "IDLE_PERIOD_S", TEST_IDLE_PERIOD_S)


@pytest.fixture
def make_engine() -> Iterator[Any]:
    """Builds simulated engines from EngineConfig keywords; shuts each down after the test.
    (Imported here, not at the top: most tests never build an engine, and this file is also
    copied into pytester runs where the package's test helpers are not importable.)"""
    from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine

    engines: list[SimulatedEngine] = []

    def make(**kw: Any) -> SimulatedEngine:
        engine = SimulatedEngine(EngineConfig(**kw))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()

"""Fixtures of the shared-tier tests: private store servers and clients of them.

A Mooncake master or Redis server is started per test that asks for one, on free loopback
ports (its log in the test's tmp dir), and killed after the test, once the clients made from it
are closed. Both happen on one background thread, in teardown order, while the next tests run;
the session waits for it at its end. Mooncake's client close() takes 1-2 s with the GIL held
(it stalls whatever test runs meanwhile), so a test that only needs working clients borrows
them from ``mooncake_lender`` instead: clients held for the whole session on one private
master with Mooncake's defaults, closed at the session's end; a test that closes a client,
stops the master or needs a master of its own settings (a lease, a client TTL, an empty pool)
builds its own with ``mooncake_store_factory``. Where the wheel or binary is missing the tests
skip with the reason, unless ``KVBM_REQUIRE_SHARED=1`` (CI's run sets it): then a missing store
is a failure, so CI never passes by skipping them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _require import unavailable

from kvbm_plugin.settings.shared import SharedSettings
from kvbm_plugin.testing.local_server import ServerError


def settings_for(store: str, address: str, **kw: Any) -> SharedSettings:
    """Shared-tier settings for a test client (small segments, a short lease by default)."""
    kw.setdefault("segment_bytes", 32 << 20)
    kw.setdefault("buffer_bytes", 0)
    kw.setdefault("model_key", "test-model")
    return SharedSettings(store=store, address=address, **kw)


class _Retirer:
    """One thread that runs teardown jobs in the order they were handed over (a test's
    clients closed, then its servers killed), off the test thread."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.failures: list[str] = []

    def hand_over(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvbm-test-retirer",
                                            daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception as exc:  # reported at the session's end
                self.failures.append(repr(exc))

    def finish(self, timeout: float = 120.0) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._jobs.put(None)
        thread.join(timeout)
        assert not thread.is_alive(), "shared-tier teardown still running after 120 s"
        assert not self.failures, self.failures


_RETIRER = _Retirer()


@pytest.fixture(scope="session", autouse=True)
def _retired_at_the_end() -> Iterator[None]:
    yield
    _RETIRER.finish()


def _started(server_class: Any, tmp_path: Path, prefix: str) -> Iterator[Callable[..., Any]]:
    """The body of a server factory fixture: yields ``make(**kw)``, which starts a
    ``server_class`` in its own tmp dir (skipping, or failing under KVBM_REQUIRE_SHARED, when
    it cannot start), and stops every one started in teardown."""
    servers: list[Any] = []

    def make(**kw: Any) -> Any:
        try:
            server = server_class(tmp_path / f"{prefix}{len(servers)}", **kw)
        except ServerError as exc:
            unavailable(str(exc))
        servers.append(server)
        return server.start()

    yield make

    def kill() -> None:
        for server in servers:
            server.kill()  # its data is the test's; a SIGTERM'd mooncake_master takes ~1 s

    _RETIRER.hand_over(kill)


def _closed_after(build: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """The body of a store factory fixture: yields ``build`` keeping what it made, and has
    all of it closed after the test, one after another (Mooncake's close() takes 1-2 s each
    and holds the GIL throughout: closing on several threads at once saves nothing)."""
    stores: list[Any] = []

    def make(*args: Any, **kw: Any) -> Any:
        store = build(*args, **kw)
        stores.append(store)
        return store

    yield make

    def close() -> None:
        for store in stores:
            store.close()

    _RETIRER.hand_over(close)


def _require_mooncake() -> None:
    """Skip (or fail under KVBM_REQUIRE_SHARED) unless Mooncake's client library loads."""
    from kvbm_plugin.consolidator_config import ConfigError
    from kvbm_plugin.tiers.shared.mooncake import import_client

    try:
        import_client()  # the client library must load (it needs Debian's libibverbs1)
    except ConfigError as exc:
        unavailable(f"Mooncake is not installed ({exc}): pip install '.[mooncake]' and "
                    "Debian's libibverbs1")


@pytest.fixture
def mooncake_master_factory(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Starts ``MooncakeMaster(**kw)`` masters (each in its own tmp dir); stops them all."""
    from kvbm_plugin.testing.mooncake_master import MooncakeMaster

    _require_mooncake()
    yield from _started(MooncakeMaster, tmp_path, "master")


@pytest.fixture
def mooncake_master(mooncake_master_factory: Callable[..., Any]) -> Any:
    """One master with Mooncake's defaults."""
    return mooncake_master_factory()


@pytest.fixture
def mooncake_store_factory(mooncake_master_factory: Callable[..., Any]
                           ) -> Iterator[Callable[..., Any]]:
    """``make(master, **settings)``: a MooncakeStore on ``master``; closed after the test
    (before the masters stop: this fixture depends on theirs)."""
    from kvbm_plugin.tiers.shared.mooncake import MooncakeStore

    def build(master: Any, **kw: Any) -> MooncakeStore:
        kw.setdefault("metrics_address", master.metrics_address)
        return MooncakeStore(settings_for("mooncake", master.address, **kw), env={})

    yield from _closed_after(build)


class _MooncakePool:
    """The session's lent Mooncake clients (default settings: a 32 MiB segment each) on one
    private master; built on the test thread when first borrowed, closed at the session's
    end."""

    def __init__(self, master: Any) -> None:
        self.master = master
        self.clients: list[Any] = []
        self.lends = 0

    def client(self, i: int) -> Any:
        from kvbm_plugin.tiers.shared.mooncake import MooncakeStore

        while len(self.clients) <= i:
            self.clients.append(MooncakeStore(settings_for(
                "mooncake", self.master.address,
                metrics_address=self.master.metrics_address), env={}))
        return self.clients[i]


@pytest.fixture(scope="session")
def _mooncake_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_MooncakePool]:
    from kvbm_plugin.testing.mooncake_master import MooncakeMaster

    _require_mooncake()
    try:
        master = MooncakeMaster(tmp_path_factory.mktemp("lent-master")).start()
    except ServerError as exc:
        unavailable(str(exc))
    pool = _MooncakePool(master)
    yield pool
    try:
        for client in pool.clients:
            client.close()
    finally:
        master.kill()


class MooncakeLender:
    """What ``mooncake_lender`` gives a test: ``master`` (shared: never stop it), ``client()``
    (the test's next distinct client: the first call gives client 0, the next client 1, ...)
    and ``salt``, a scope string no other test uses: the master keeps every test's objects,
    so a borrowing test names its keys under it (digests with this scope, or it as the model
    key) to start from an empty key space."""

    def __init__(self, pool: _MooncakePool, monkeypatch: pytest.MonkeyPatch) -> None:
        self.master = pool.master
        pool.lends += 1
        self.salt = f"lent{pool.lends}"
        self._pool = pool
        self._monkeypatch = monkeypatch
        self._lent: list[tuple[Any, set[int]]] = []

    def client(self) -> Any:
        """A real MooncakeStore, fresh as far as the test can tell: zero stats, its own rate
        limit on log lines; whatever the test registers is unregistered after it. Not to be
        closed by the test (the session closes it)."""
        from kvbm_plugin._util.ratelimit import RateLimitedLog
        from kvbm_plugin.tiers.shared import mooncake

        store = self._pool.client(len(self._lent))
        registered: set[int] = set()
        register, unregister = store.register, store.unregister

        def tracked_register(address: int, size: int) -> None:
            register(address, size)
            registered.add(address)

        def tracked_unregister(address: int) -> None:
            registered.discard(address)
            unregister(address)

        def refused_close() -> None:
            raise AssertionError("a lent Mooncake client is closed by the session, not a test: "
                                 "build your own with mooncake_store_factory")

        mp = self._monkeypatch  # undone after the test, after the lender's teardown
        mp.setattr(store, "register", tracked_register)
        mp.setattr(store, "unregister", tracked_unregister)
        mp.setattr(store, "close", refused_close)
        mp.setattr(store, "_stats", dict.fromkeys(store.stats(), 0))
        mp.setattr(store, "_rl", RateLimitedLog(mooncake.log))
        self._lent.append((store, registered))
        return store

    def give_back(self) -> None:
        """Unregisters what the test left registered (its memory is freed after it)."""
        for store, registered in self._lent:
            for address in list(registered):
                store.unregister(address)


@pytest.fixture
def mooncake_lender(_mooncake_pool: _MooncakePool, monkeypatch: pytest.MonkeyPatch
                    ) -> Iterator[MooncakeLender]:
    """Real Mooncake clients on a master shared by the session (see :class:`MooncakeLender`),
    for tests that only put, check and read: nothing closes them or stops their master."""
    lender = MooncakeLender(_mooncake_pool, monkeypatch)
    yield lender
    lender.give_back()


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Starts ``RedisServer(**kw)`` servers; stops them all."""
    try:
        import redis  # noqa: F401
    except ImportError as exc:
        unavailable(f"the redis client is not installed ({exc}): pip install '.[redis]'")
    from kvbm_plugin.testing.redis_server import RedisServer

    yield from _started(RedisServer, tmp_path, "redis")


@pytest.fixture
def redis_server(redis_server_factory: Callable[..., Any]) -> Any:
    return redis_server_factory()


@pytest.fixture
def redis_store_factory(redis_server_factory: Callable[..., Any]
                        ) -> Iterator[Callable[..., Any]]:
    """``make(address, **settings)``: a RedisStore; closed after the test."""
    from kvbm_plugin.tiers.shared.redis_store import RedisStore

    yield from _closed_after(lambda address, **kw: RedisStore(settings_for("redis", address,
                                                                           **kw)))

"""Fixtures of the shared-tier tests: private store servers and clients of them.

A Mooncake master or Redis server is started per test on free loopback ports (its log in the
test's tmp dir) and killed in teardown, after the clients made from it are closed. Where the
wheel or binary is missing the tests skip with the reason, unless ``KVBM_REQUIRE_SHARED=1``
(CI's run sets it): then a missing store is a failure, so CI never passes by skipping them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _require import unavailable

from kvbm_plugin.shared_settings import SharedSettings
from kvbm_plugin.testing.local_server import ServerError


def settings_for(store: str, address: str, **kw: Any) -> SharedSettings:
    """Shared-tier settings for a test client (small segments, a short lease by default)."""
    kw.setdefault("segment_bytes", 32 << 20)
    kw.setdefault("buffer_bytes", 0)
    return SharedSettings(store=store, model_key="test-model", address=address, **kw)


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
    for server in servers:
        server.kill()  # its data is the test's; a SIGTERM'd mooncake_master takes ~1 s to go


def _closed_after(build: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """The body of a store factory fixture: yields ``build`` keeping what it made, and
    closes all of it in teardown, side by side (Mooncake's close() takes 1-2 s each)."""
    stores: list[Any] = []

    def make(*args: Any, **kw: Any) -> Any:
        store = build(*args, **kw)
        stores.append(store)
        return store

    yield make
    threads = [threading.Thread(target=s.close) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.fixture
def mooncake_master_factory(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Starts ``MooncakeMaster(**kw)`` masters (each in its own tmp dir); stops them all."""
    from kvbm_plugin.consolidator_config import ConfigError
    from kvbm_plugin.testing.mooncake_master import MooncakeMaster
    from kvbm_plugin.tiers.shared.mooncake import import_client

    try:
        import_client()  # the client library must load (it needs Debian's libibverbs1)
    except ConfigError as exc:
        unavailable(f"Mooncake is not installed ({exc}): pip install '.[mooncake]' and "
                    "Debian's libibverbs1")
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

"""open_store: the shared-tier store client named by the settings, behind a circuit breaker.

Called at start-up on the caller's thread: by each worker (its rank's client), by the leader
(its existence-check client, built from ``dataclasses.replace(settings, segment_bytes=0,
buffer_bytes=0)``), by ``doctor`` and the benchmarks. The store class is the
``kvbm_plugin.tiers`` entry point named by ``DYN_KVBM_SHARED_TIER`` (``mooncake``, ``redis``,
or a third party's), which must be a SharedStore; constructing it connects (and raises
ConfigError naming the variable when it cannot).
"""

from __future__ import annotations

from typing import Any

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin._util.plugins import PluginLoadError, get_plugin
from kvbm_plugin.consolidator_config import ConfigError
from kvbm_plugin.settings.shared import SharedSettings
from kvbm_plugin.tiers.shared.breaker import GuardedStore
from kvbm_plugin.tiers.shared.store import SharedStore


def store_class(name: str) -> type[SharedStore]:
    """The SharedStore class registered as ``name``; ConfigError naming DYN_KVBM_SHARED_TIER
    for an unknown name or an entry point that is not a shared store."""
    try:
        cls = get_plugin(cc.TIERS_GROUP, name)
    except PluginLoadError as exc:
        raise ConfigError(f"{cc.SHARED_TIER}={name!r}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, SharedStore)):
        raise ConfigError(f"{cc.SHARED_TIER}={name!r} names {cls.__module__}."
                          f"{cls.__qualname__}, an offload tier, not a shared store "
                          "(mooncake, redis)")
    return cls


def open_store(settings: SharedSettings, *, guarded: bool = True,
               **breaker: Any) -> SharedStore:
    """A connected client of the store ``settings.store`` names, behind a GuardedStore
    (``breaker``: its keyword arguments) unless ``guarded`` is False."""
    store = store_class(settings.store)(settings)
    return GuardedStore(store, **breaker) if guarded else store

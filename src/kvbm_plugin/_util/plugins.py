"""Extension points: event publishers, offload tiers and shared-tier stores, discovered through
entry points.

Called at start-up (leader, worker, consolidator, ``doctor``) on the calling thread.

Built-ins are registered by this package's own entry points (see pyproject.toml), exactly as a
third-party distribution would register its own. A broken entry point is an error that names the
distribution, the group and the entry point; there is no silent fallback.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any, Final

import importlib_metadata

from kvbm_plugin.consolidator_config import PUBLISHERS_GROUP, TIERS_GROUP

# Each group's base classes (an entry point subclasses one of them), named as "module", "class"
# and imported only when the group is loaded: this module sits below the folders that define them
# (wire, tiers). The tiers group holds offload tiers (host, disk) and the shared tier's store
# clients (mooncake, redis).
_BASES: Final = {
    PUBLISHERS_GROUP: (("kvbm_plugin.wire.publisher_base", "EventPublisher"),),
    TIERS_GROUP: (("kvbm_plugin.tiers.base", "OffloadTier"),
                  ("kvbm_plugin.tiers.shared.store", "SharedStore")),
}


class PluginLoadError(RuntimeError):
    """An entry point could not be used. The message names distribution, group and name."""


@dataclass(frozen=True)
class Plugin:
    name: str
    group: str
    value: str  # "module:attr"
    distribution: str
    obj: Any


def _describe(ep: importlib_metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    dist_name = f"{dist.name} {dist.version}" if dist is not None else "<unknown distribution>"
    return dist_name, f"{ep.name} = {ep.value}"


def _base_types(group: str) -> tuple[type, ...]:
    if group not in _BASES:
        raise PluginLoadError(f"unknown entry-point group {group!r}")
    return tuple(getattr(importlib.import_module(module), name)
                 for module, name in _BASES[group])


_cache: dict[str, dict[str, Plugin]] = {}
_lock = threading.Lock()


def load_group(group: str, *, refresh: bool = False) -> dict[str, Plugin]:
    """Every entry point of ``group``, imported and type-checked, by name."""
    with _lock:
        if not refresh and group in _cache:
            return _cache[group]
        bases = _base_types(group)
        found: dict[str, Plugin] = {}
        for ep in importlib_metadata.entry_points(group=group):
            dist_name, spec = _describe(ep)
            where = f"entry point '{spec}' in group '{group}' of distribution '{dist_name}'"
            if ep.name in found:
                other = found[ep.name]
                if other.value == ep.value and other.distribution == dist_name:
                    continue  # the same distribution seen twice on sys.path
                raise PluginLoadError(f"duplicate name {ep.name!r}: {where} clashes with "
                                      f"'{other.value}' from distribution '{other.distribution}'")
            try:
                obj = ep.load()
            except Exception as exc:
                raise PluginLoadError(f"cannot import {where}: {type(exc).__name__}: {exc}") \
                    from exc
            if not (isinstance(obj, type) and issubclass(obj, bases)):
                names = " or ".join(f"{b.__module__}.{b.__qualname__}" for b in bases)
                raise PluginLoadError(f"{where} is {obj!r}, not a subclass of {names}")
            found[ep.name] = Plugin(ep.name, group, ep.value, dist_name, obj)
        _cache[group] = found
        return found


def get_plugin(group: str, name: str) -> Any:
    """The class registered as ``name`` in ``group``; an error lists the known names."""
    plugins = load_group(group)
    if name not in plugins:
        known = ", ".join(sorted(plugins)) or "none"
        raise PluginLoadError(f"no entry point named {name!r} in group '{group}' "
                              f"(known: {known})")
    return plugins[name].obj

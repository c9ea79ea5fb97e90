"""Which host and disk tier implementations a worker runs: ``kvbm_plugin.tiers`` entry points
chosen by name.

``DYN_KVBM_HOST_TIER`` (default ``host``) and ``DYN_KVBM_DISK_TIER`` (default ``disk``) name an
entry point of the ``kvbm_plugin.tiers`` group, so a third-party distribution can register a
tier of its own under its own name (a disk tier on another file layout, O_DIRECT or a
GPU-direct path; a host tier on memory of its choosing) and select it without replacing this
package's ``host``/``disk`` (a second ``host`` entry point is refused as a duplicate, by
design: one name, one class). The shared tier's store is chosen the same way
(``DYN_KVBM_SHARED_TIER``, tiers/shared/factory.py).

What each must be: a disk tier an :class:`~kvbm_plugin.tiers.base.OffloadTier` (the disk thread
calls ``write``/``read``/``close``; its ``spec`` carries the directory and the identity its
files must carry); a host tier a :class:`~kvbm_plugin.tiers.host.HostTier` subclass, because
the transfer thread copies straight between the device pool and its ``pool`` tensor and checks
its ``keys``, which the OffloadTier interface does not have. The leader needs nothing of
either: it sizes and names the tiers' slots itself.

Called by the worker's constructor (any thread, once per rank): an unknown name or a class of
the wrong kind is a ConfigError naming the variable and value before anything is allocated.
"""

from __future__ import annotations

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin._util.plugins import PluginLoadError, get_plugin
from kvbm_plugin.consolidator_config import ConfigError, TierSettings
from kvbm_plugin.tiers.base import OffloadTier
from kvbm_plugin.tiers.host import HostTier


def _tier_class(variable: str, name: str, base: type[OffloadTier], what: str) -> type:
    try:
        cls = get_plugin(cc.TIERS_GROUP, name)
    except PluginLoadError as exc:
        raise ConfigError(f"{variable}={name!r}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(f"{variable}={name!r} names {cls.__module__}.{cls.__qualname__}, "
                          f"which is not {what} (a subclass of {base.__module__}."
                          f"{base.__qualname__})")
    return cls


def host_tier_class(settings: TierSettings) -> type[HostTier]:
    """The class ``DYN_KVBM_HOST_TIER`` names (ConfigError naming it otherwise)."""
    return _tier_class(cc.HOST_TIER, settings.host_tier, HostTier, "a host tier")


def disk_tier_class(settings: TierSettings) -> type[OffloadTier]:
    """The class ``DYN_KVBM_DISK_TIER`` names (ConfigError naming it otherwise)."""
    return _tier_class(cc.DISK_TIER, settings.disk_tier, OffloadTier, "an offload tier")

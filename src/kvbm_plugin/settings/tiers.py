"""The host and disk offload tiers' settings (``DYN_KVBM_CPU_CACHE_*``, ``DYN_KVBM_DISK_*``,
``DYN_KVBM_HOST_TIER``, ``DYN_KVBM_DISK_TIER``): sizes in GiB or blocks, the disk directory
and the tier classes by entry-point name, read and validated.

Called by the leader's and every worker's constructor (on the thread constructing them) and
by ``kvbm-plugin doctor``; ``TierSettings.host_blocks``/``disk_blocks`` by both once the block
size is known. Standard library only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvbm_plugin.settings.values import ConfigError, parse_float, parse_int
from kvbm_plugin.settings.variables import (
    CPU_CACHE_GB,
    CPU_CACHE_NUM_BLOCKS,
    DISK_CACHE_DIR,
    DISK_CACHE_GB,
    DISK_CACHE_NUM_BLOCKS,
    DISK_TIER,
    HOST_TIER,
    env_value,
)


@dataclass(frozen=True)
class TierSettings:
    """Offload tier sizes; blocks override GiB; nothing set = no tier."""

    cpu_cache_gb: float = 0.0
    cpu_num_blocks: int | None = None
    disk_cache_gb: float = 0.0
    disk_num_blocks: int | None = None
    disk_cache_dir: str | None = None
    host_tier: str = "host"  # kvbm_plugin.tiers entry point names (tiers/selection.py)
    disk_tier: str = "disk"

    @property
    def host_enabled(self) -> bool:
        return bool(self.cpu_num_blocks) or self.cpu_cache_gb > 0

    @property
    def disk_enabled(self) -> bool:
        return bool(self.disk_num_blocks) or self.disk_cache_gb > 0

    def host_blocks(self, bytes_per_block: int) -> int:
        return _blocks(self.cpu_num_blocks, self.cpu_cache_gb, bytes_per_block, CPU_CACHE_GB,
                       CPU_CACHE_NUM_BLOCKS)

    def disk_blocks(self, bytes_per_block: int) -> int:
        return _blocks(self.disk_num_blocks, self.disk_cache_gb, bytes_per_block, DISK_CACHE_GB,
                       DISK_CACHE_NUM_BLOCKS)


def _blocks(override: int | None, gib: float, bytes_per_block: int, gib_name: str,
            blocks_name: str) -> int:
    if override:
        return override
    blocks = int(gib * (1 << 30)) // max(1, bytes_per_block)
    if gib > 0 and blocks == 0:
        raise ConfigError(f"{gib_name}={gib!r} is smaller than one KV block ({bytes_per_block} "
                          f"bytes); raise it or set {blocks_name}")
    return blocks


def check_disk_cache_dir(path: str) -> None:
    """Start-up's check of ``DYN_KVBM_DISK_CACHE_DIR``, without side effects: the directory
    exists and is writable, or it can be created (its nearest existing ancestor is a writable
    directory). Raises ConfigError naming the variable and value."""
    target = os.path.abspath(path)
    if os.path.lexists(target):
        if not os.path.isdir(target):
            raise ConfigError(f"{DISK_CACHE_DIR}={path!r} exists and is not a directory")
        if not os.access(target, os.W_OK | os.X_OK):
            raise ConfigError(f"{DISK_CACHE_DIR}={path!r}: the directory is not writable")
        return
    ancestor = os.path.dirname(target)
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ConfigError(f"{DISK_CACHE_DIR}={path!r} cannot be created: {ancestor} is not a "
                          "directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"{DISK_CACHE_DIR}={path!r} cannot be created: {ancestor} is not "
                          "writable")


def load_tier_settings(env: Mapping[str, str] | None = None) -> TierSettings:
    """Tier sizes and the disk directory (checked usable when the disk tier is on); raises
    ConfigError naming the variable and value."""
    env = os.environ if env is None else env

    def optional_int(name: str) -> int | None:
        value = env_value(env, name)
        return None if value is None else parse_int(name, value, minimum=0)

    def optional_float(name: str) -> float:
        value = env_value(env, name)
        return 0.0 if value is None else parse_float(name, value)

    directory = env_value(env, DISK_CACHE_DIR)
    settings = TierSettings(
        cpu_cache_gb=optional_float(CPU_CACHE_GB),
        cpu_num_blocks=optional_int(CPU_CACHE_NUM_BLOCKS),
        disk_cache_gb=optional_float(DISK_CACHE_GB),
        disk_num_blocks=optional_int(DISK_CACHE_NUM_BLOCKS),
        disk_cache_dir=directory.strip() if directory else None,
        host_tier=(env_value(env, HOST_TIER) or "host").strip(),
        disk_tier=(env_value(env, DISK_TIER) or "disk").strip(),
    )
    if settings.disk_enabled and settings.disk_cache_dir is not None:
        check_disk_cache_dir(settings.disk_cache_dir)
    return settings

"""A leader's shared-tier residency for tests: directory + agent over a given store, with the
callbacks recorded."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from _kvwire import wait_until
from _shared_blocks import layouts

from kvbm_plugin.settings.shared import SharedSettings
from kvbm_plugin.tiers.shared.agent import SharedAgent
from kvbm_plugin.tiers.shared.block import SharedBlock
from kvbm_plugin.tiers.shared.directory import SharedDirectory
from kvbm_plugin.tiers.shared.store import SharedStore

LEASE = 9.0
MARGIN = 2.0
PERIOD = LEASE / 3
SECRET = b"test-announce-secret-of-32-bytes!"  # every test engine's announcement secret
SETTINGS = SharedSettings(store="memory", model_key="m", lease_s=LEASE, load_margin_s=MARGIN,
                          announce_secret=SECRET)


class Leader:
    """One engine's leader: its directory, agent and what the agent reported."""

    def __init__(self, store: SharedStore, clock: Callable[[], float], *, capacity: int = 100,
                 world: int = 2, endpoint: str | None = None, peers: tuple[str, ...] = (),
                 model_key: str = "m", lease: tuple[float, float] = (LEASE, MARGIN),
                 page: int = 64, **settings_kw: Any) -> None:
        self.store = store
        self.clock: Any = clock
        self.layouts = layouts(world, model_key=model_key, page=page)
        self.directory = SharedDirectory(capacity, lease[0], lease[1], clock)
        self._lock = threading.Lock()
        self.stored: list[SharedBlock] = []
        self.removed: list[list[SharedBlock]] = []
        settings = dataclasses.replace(SETTINGS, lease_s=lease[0], load_margin_s=lease[1],
                                       **settings_kw)
        self.agent = SharedAgent(settings, store, self.layouts, self.directory,
                                 self._on_store, self._on_remove, endpoint, peers)

    def _on_store(self, block: SharedBlock) -> None:
        with self._lock:
            self.stored.append(block)

    def _on_remove(self, blocks: list[SharedBlock]) -> None:
        with self._lock:
            self.removed.append(list(blocks))

    def removed_flat(self) -> list[SharedBlock]:
        with self._lock:
            return [b for batch in self.removed for b in batch]

    def keys(self, block: SharedBlock) -> list[str]:
        return [layout.key(block.digest) for layout in self.layouts]

    def write(self, blocks: list[SharedBlock], ranks: tuple[int, ...] | None = None) -> None:
        """Every rank's object of each block in the store (as the workers' puts would)."""
        for block in blocks:
            for rank, key in enumerate(self.keys(block)):
                if ranks is None or rank in ranks:
                    self.store.put_bytes(key, block.digest * 4)  # type: ignore[attr-defined]

    def commit(self, blocks: list[SharedBlock]) -> None:
        self.write(blocks)
        for block in blocks:
            self.agent.committed(block)

    def stat(self, name: str) -> int:
        return self.agent.stats()[name]

    def wait_stat(self, name: str, value: int, timeout: float = 10.0) -> None:
        wait_until(lambda: self.stat(name) >= value, timeout,
                   f"{name} >= {value} (stats: {self.agent.stats()})")

    def sweep(self, advance: float = PERIOD) -> None:
        """Move the clock on and wait for the renewal sweep that is then due."""
        before = self.stat("renewal_sweeps")
        self.clock.advance(advance)
        self.agent.wake()
        self.wait_stat("renewal_sweeps", before + 1)

    def settle(self) -> None:
        """Wait for a whole turn of the agent after now (it has seen the clock's time)."""
        ticket = self.agent.wake()
        self.wait_stat("wakes_handled", ticket)

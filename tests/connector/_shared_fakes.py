"""In-process stand-ins for the shared tier's store clients and agent, for the connector's tests.

* :class:`Client`: one process's client of a shared :class:`MemoryStore` (every worker and
  leader of every engine in the test gets its own; closing one leaves the store up).
* :class:`BusAgent`: a SharedAgent with the same API on a thread of its own, confirming each
  committed or announced block with ``exists()`` on every rank's key before it makes it
  resident (as the real agent does), renewing leases, and announcing its own confirmed blocks
  to the other agents of one :class:`Bus` (the engines of one test).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvbm_plugin.testing.memory_store import MemoryStore
from kvbm_plugin.tiers.shared.block import SharedBlock, make_block
from kvbm_plugin.tiers.shared.directory import SharedDirectory
from kvbm_plugin.tiers.shared.keys import SharedLayout
from kvbm_plugin.tiers.shared.store import SharedStore


class Client(SharedStore):
    """A client of ``store``; ``down`` makes this one client's calls fail as unavailable."""

    name = "memory-client"

    def __init__(self, store: MemoryStore, role: str) -> None:
        self.store = store
        self.role = role
        self.registered: list[tuple[int, int]] = []
        self.closed = False

    @property
    def lease_s(self) -> float:
        return self.store.lease_s

    def register(self, address: int, size: int) -> None:
        self.registered.append((address, size))

    def exists(self, keys: Sequence[str]) -> list[int]:
        return self.store.exists(keys)

    def put(self, keys: Sequence[str], buffers: Sequence[tuple[int, int]]) -> list[int]:
        return self.store.put(keys, buffers)

    def get_into(self, keys: Sequence[str], buffers: Sequence[tuple[int, int]]) -> list[int]:
        return self.store.get_into(keys, buffers)

    def remove_if(self, key: str, fingerprint: str) -> int:
        return self.store.remove_if(key, fingerprint)

    def remove_if_size_not(self, key: str, size: int) -> int:
        return self.store.remove_if_size_not(key, size)

    def health(self) -> str | None:
        return self.store.health()

    def close(self) -> None:
        self.closed = True


class Bus:
    """The announcement channel between the agents of one test."""

    def __init__(self) -> None:
        self.agents: list[BusAgent] = []
        self.lock = threading.Lock()

    def announce(self, sender: BusAgent, block: SharedBlock) -> None:
        with self.lock:
            others = [a for a in self.agents if a is not sender]
        for agent in others:
            agent.heard(block)


class BusAgent:
    """The SharedAgent API (``start``, ``committed``, ``hand_over``, ``wake``, ``available``,
    ``stats``, ``close``)."""

    def __init__(self, bus: Bus, settings: Any, store: SharedStore,
                 layouts: Sequence[SharedLayout], directory: SharedDirectory,
                 on_store: Callable[[SharedBlock], None],
                 on_remove: Callable[[list[SharedBlock]], None],
                 announce_endpoint: str | None, peers: Sequence[str]) -> None:
        self.bus = bus
        self.settings = settings
        self.store = store
        self.layouts = list(layouts)
        self.directory = directory
        self.on_store = on_store
        self.on_remove = on_remove
        self.endpoint = announce_endpoint
        self.committed_blocks: list[SharedBlock] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bus-agent", daemon=True)
        self._n = {"confirmed": 0, "heard": 0, "absent": 0}
        self._tickets = 0
        with bus.lock:
            bus.agents.append(self)

    def start(self) -> None:
        self._thread.start()

    @property
    def available(self) -> bool:
        return self.directory.available

    def committed(self, block: SharedBlock, scope: str | None = None, *,
                  wake: bool = True) -> None:
        self.committed_blocks.append(block)
        self.directory.enqueue(block, True)

    def committed_many(self, blocks: list[tuple[SharedBlock, str | None]]) -> int:
        for block, scope in blocks:
            self.committed(block, scope)
        return len(blocks)

    def hand_over(self, blocks: list[tuple[Any, str | None]]) -> int:
        """Queued at once (then woken, as the real one is): the ticket returned is handled
        already. A block given as its fields (the leader's) is made first, as the real agent's
        thread makes it."""
        self.committed_many([(make_block(*block) if type(block) is tuple else block, scope)
                             for block, scope in blocks])
        self.wake()
        self._tickets += 1
        return self._tickets

    @property
    def wakes_handled(self) -> int:
        return self._tickets

    def wake(self) -> int:
        return 0  # its thread polls the directory every 2 ms

    def heard(self, block: SharedBlock) -> None:
        self._n["heard"] += 1
        self.directory.enqueue(block, False)

    def stats(self) -> dict[str, int]:
        return dict(self._n)

    def idle(self) -> bool:
        return not self.directory.has_pending()

    def _run(self) -> None:
        last_renew = time.monotonic()
        while not self._stop.wait(0.002):
            pending = self.directory.take_pending(256)
            if pending:
                started = time.monotonic()
                present = []
                for block, own, _ in pending:
                    codes = self.store.exists([lay.key(block.digest) for lay in self.layouts])
                    if all(c == 1 for c in codes):
                        present.append((block, own))
                    else:
                        self._n["absent"] += 1
                        self.directory.forget([block.digest])
                admitted = self.directory.admit([b for b, _ in present],
                                                started + self.directory.lease_s)
                for block in admitted.resident:
                    self._n["confirmed"] += 1
                    self.on_store(block)
                if admitted.evicted:
                    self.on_remove(admitted.evicted)
                own = {b.digest for b, o in present if o}
                for block in admitted.resident:
                    if block.digest in own:
                        self.bus.announce(self, block)
            if time.monotonic() - last_renew > self.directory.lease_s / 3:
                last_renew = started = time.monotonic()
                digests = [b.digest for b in self.directory.blocks()]
                gone = [d for d in digests
                        if not all(c == 1 for c in self.store.exists(
                            [lay.key(d) for lay in self.layouts]))]
                self.directory.renew([d for d in digests if d not in gone],
                                     started + self.directory.lease_s)
                dropped = self.directory.drop(gone) if gone else []
                dropped += self.directory.expire()
                if dropped:
                    self.on_remove(dropped)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        with self.bus.lock:
            if self in self.bus.agents:
                self.bus.agents.remove(self)

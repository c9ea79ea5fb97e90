"""The event-publisher interface, apart from its implementations and from plugin discovery.

:class:`EventPublisher` is what every publisher implements (the built-in ones in
:mod:`kvbm_plugin.wire.publisher`, third-party ones through the ``kvbm_plugin.publishers`` entry
points). It lives here, below both :mod:`kvbm_plugin.wire.publisher` (which builds publishers
by name through the registry) and :mod:`kvbm_plugin._util.plugins` (which checks every
entry point against it), so neither imports the other's module to see it. Callers import it from
:mod:`kvbm_plugin.wire.publisher`, which re-exports it, as it does :class:`NullEventPublisher`
(kept here to hold that module's size down). No zmq, torch or TensorRT-LLM import.
"""

from __future__ import annotations

import errno
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvbm_plugin.wire.events import event_count

if TYPE_CHECKING:
    from kvbm_plugin.consolidator_config import Endpoint, PublisherSettings

__all__ = ["EventPublisher", "NullEventPublisher", "WireEvent"]

WireEvent = dict[str, Any]  # one event in wire form (see events.BlockStored.to_wire)


class EventPublisher(ABC):
    """Publishes batches of wire-form events; one instance per stream.

    Constructed by the leader (GPU tier: one per rank; consolidated output: one per leader).

    ``accepts_encoded_events``: whether ``publish`` may be handed an ``events.EncodedBatch``,
    whose ``EncodedEvents`` items are runs of events already encoded (the event sink's compiled
    batch writes the common events that way). A publisher that builds its payload with
    ``events.batch_payload`` and counts with ``events.event_count`` can take it as it is; any
    other (the default) is handed every event as its map.
    """

    accepts_encoded_events: bool = False

    def __init__(self, settings: PublisherSettings, endpoint: Endpoint | None = None,
                 replay_endpoint: Endpoint | None = None, data_parallel_rank: int = 0) -> None:
        self.settings = settings
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.data_parallel_rank = data_parallel_rank

    @abstractmethod
    def publish(self, events: Sequence[WireEvent], data_parallel_rank: int | None = None) -> bool:
        """Queue one batch (one engine iteration); never blocks.

        Returns False when the batch was lost (counted; consumers see a seq gap).
        """

    @abstractmethod
    def shutdown(self, timeout: float = 5.0) -> None:
        """Drain what is queued within ``timeout`` seconds, close sockets; idempotent."""

    def stats(self) -> dict[str, int]:
        """Counters for metrics and tests."""
        return {}


class NullEventPublisher(EventPublisher):
    """Accepts and discards every batch (events disabled); still counts them."""

    accepts_encoded_events = True  # counts events, never reads them

    def __init__(self, settings: PublisherSettings, endpoint: Endpoint | None = None,
                 replay_endpoint: Endpoint | None = None, data_parallel_rank: int = 0) -> None:
        super().__init__(settings, endpoint, replay_endpoint, data_parallel_rank)
        self._batches = 0
        self._events = 0

    def publish(self, events: Sequence[WireEvent], data_parallel_rank: int | None = None) -> bool:
        self._batches += 1
        self._events += event_count(events)
        return True

    def shutdown(self, timeout: float = 5.0) -> None:
        return None

    def stats(self) -> dict[str, int]:
        return {"batches_published": self._batches, "events_published": self._events}


def bind_error(addr: str, source: str, exc: BaseException) -> str:
    """Why ``addr`` (from the variable ``source``) did not bind, in one line that names what to
    change: ZMQ says "No such device" for a tcp host that is not an address of this machine or
    does not resolve."""
    where = f"{addr} ({source})" if source else addr
    if getattr(exc, "errno", None) == errno.ENODEV and addr.startswith("tcp://"):
        return (f"{where}: {exc}: its host does not resolve or is not an address of this "
                "machine")
    return f"{where}: {exc}"

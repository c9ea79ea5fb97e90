"""Event publishers: the transport that carries wire-format batches to consumers.

``EventPublisher`` is the interface (one per stream: a rank's GPU tier, or the consolidated
output); implementations are found by name in the ``kvbm_plugin.publishers`` entry points and
built by :func:`create_publisher`. ``publish`` is called on TensorRT-LLM's executor thread, so
it never blocks: it reserves the batch's sequence number and hands the batch to a bounded queue.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from kvbm_plugin.consolidator_config import Endpoint, PublisherSettings
from kvbm_plugin.registry import PUBLISHERS_GROUP, get_plugin

WireEvent = dict[str, Any]  # one event in wire form (see events.BlockStored.to_wire)


class EventPublisher(ABC):
    """Publishes batches of wire-form events; one instance per stream.

    Constructed by the leader (GPU tier: one per rank; consolidated output: one per leader).
    """

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

    def __init__(self, settings: PublisherSettings, endpoint: Endpoint | None = None,
                 replay_endpoint: Endpoint | None = None, data_parallel_rank: int = 0) -> None:
        super().__init__(settings, endpoint, replay_endpoint, data_parallel_rank)
        self._batches = 0
        self._events = 0

    def publish(self, events: Sequence[WireEvent], data_parallel_rank: int | None = None) -> bool:
        self._batches += 1
        self._events += len(events)
        return True

    def shutdown(self, timeout: float = 5.0) -> None:
        return None

    def stats(self) -> dict[str, int]:
        return {"batches_published": self._batches, "events_published": self._events}


class ZmqEventPublisher(EventPublisher):
    """ZMQ PUB (+ optional replay ROUTER) fed by a background thread."""

    def publish(self, events: Sequence[WireEvent], data_parallel_rank: int | None = None) -> bool:
        raise NotImplementedError

    def shutdown(self, timeout: float = 5.0) -> None:
        raise NotImplementedError


def create_publisher(settings: PublisherSettings, endpoint: Endpoint | None = None,
                     replay_endpoint: Endpoint | None = None,
                     data_parallel_rank: int = 0) -> EventPublisher:
    """Build the publisher named by ``settings.kind`` from the entry points."""
    cls = get_plugin(PUBLISHERS_GROUP, settings.kind)
    return cls(settings, endpoint, replay_endpoint, data_parallel_rank)

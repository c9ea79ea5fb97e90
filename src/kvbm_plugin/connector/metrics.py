"""Prometheus metrics: the counters the components already keep, plus transfer latency histograms.

Components do not update Prometheus objects on hot paths: each registers a ``stats()`` callable
and the collector reads it at scrape time (on the HTTP server's thread). Only transfer latencies,
which need a distribution, are observed into histograms, once per transfer batch.

Enabled with ``DYN_KVBM_METRICS=1``; served on ``DYN_KVBM_METRICS_PORT`` (default 6880).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvbm_plugin.consolidator_config import MetricsSettings, load_metrics_settings

logger = logging.getLogger(__name__)

StatsSource = Callable[[], Mapping[str, int | float]]

# Stats keys that are levels (they go down as well as up), not monotonic totals: exported as
# gauges. A counter that decreases reads as a reset to Prometheus' rate().
_GAUGE_SUFFIXES = ("_high_water", "_depth", "_used", "_inflight", "_buffered", "_queued",
                   "_tracked", "_visible")
_GAUGE_PREFIXES = ("pending_",)
_NAME_OK = re.compile(r"[^a-zA-Z0-9_]")


class _StatsCollector(Collector):
    """Turns every registered ``stats()`` mapping into counters/gauges at scrape time."""

    def __init__(self) -> None:
        self._sources: dict[tuple[str, tuple[tuple[str, str], ...]], StatsSource] = {}
        self._lock = threading.Lock()

    def add(self, component: str, labels: Mapping[str, str], source: StatsSource) -> None:
        with self._lock:
            self._sources[(component, tuple(sorted(labels.items())))] = source

    def remove(self, component: str, labels: Mapping[str, str]) -> None:
        with self._lock:
            self._sources.pop((component, tuple(sorted(labels.items()))), None)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        with self._lock:
            sources = list(self._sources.items())
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for (component, labels), source in sources:
            try:
                stats = source()
            except Exception:  # a closed component must not break the scrape
                logger.debug("stats source %s failed", component, exc_info=True)
                continue
            names = [k for k, _ in labels]
            values = [v for _, v in labels]
            for key, value in stats.items():
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                metric = _NAME_OK.sub("_", f"kvbm_{component}_{key}")
                family = families.get(metric)
                if family is None:
                    if key.endswith(_GAUGE_SUFFIXES) or key.startswith(_GAUGE_PREFIXES):
                        family = GaugeMetricFamily(metric, f"{component} {key}", labels=names)
                    else:
                        family = CounterMetricFamily(metric, f"{component} {key}", labels=names)
                    families[metric] = family
                family.add_metric(values, float(value))
        yield from families.values()


class Metrics:
    """The plugin's metrics registry; one per process (see :func:`get_metrics`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._stats = _StatsCollector()
        self.registry.register(self._stats)
        self.transfer_seconds = Histogram(
            "kvbm_transfer_seconds", "Latency of one batched block transfer",
            ["direction", "tier"], registry=self.registry,
            buckets=(1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 5.0))
        self.transfer_bytes = Histogram(
            "kvbm_transfer_bytes", "Bytes moved by one batched block transfer",
            ["direction", "tier"], registry=self.registry,
            buckets=tuple(float(1 << s) for s in range(16, 36, 2)))
        self._server_port: int | None = None
        self._server_lock = threading.Lock()

    def register_stats(self, component: str, source: StatsSource, **labels: str) -> None:
        """Expose ``source()``'s keys as ``kvbm_<component>_<key>{labels}``."""
        self._stats.add(component, labels, source)

    def unregister_stats(self, component: str, **labels: str) -> None:
        self._stats.remove(component, labels)

    def observe_transfer(self, direction: str, tier: str, seconds: float, nbytes: int) -> None:
        """Called by the worker once per completed transfer batch (not per block)."""
        self.transfer_seconds.labels(direction, tier).observe(seconds)
        self.transfer_bytes.labels(direction, tier).observe(nbytes)

    def serve(self, settings: MetricsSettings | None = None) -> int | None:
        """Start the HTTP endpoint once if metrics are enabled; returns the port or None."""
        settings = settings or load_metrics_settings()
        if not settings.enabled:
            return None
        with self._server_lock:
            if self._server_port is None:
                start_http_server(settings.port, registry=self.registry)
                self._server_port = settings.port
                logger.info("kvbm_plugin metrics on :%d/metrics", settings.port)
            return self._server_port


_metrics: Metrics | None = None
_metrics_lock = threading.Lock()


def get_metrics() -> Metrics:
    """The process-wide metrics registry."""
    global _metrics
    with _metrics_lock:
        if _metrics is None:
            _metrics = Metrics()
        return _metrics

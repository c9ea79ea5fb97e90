"""Process-wide switches that belong to no one feature: Prometheus metrics (``DYN_KVBM_METRICS``,
``DYN_KVBM_METRICS_PORT``) and the compiled loops (``DYN_KVBM_NATIVE``).

``load_metrics_settings`` is called by the leader's constructor (rank 0) and the metrics server
it starts; ``compiled_loops_enabled`` by :mod:`kvbm_plugin._util.compiled` when a module asks
for its compiled loop, and by the CLI commands (``demo``, ``consolidate``, ``sidecar``) at
start-up, to refuse a bad value before any loop reads it. Both run on the calling thread.
Standard library only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvbm_plugin.settings.values import parse_bool, parse_port
from kvbm_plugin.settings.variables import METRICS, METRICS_PORT, NATIVE, env_value


@dataclass(frozen=True)
class MetricsSettings:
    enabled: bool = False
    port: int = 6880


def load_metrics_settings(env: Mapping[str, str] | None = None) -> MetricsSettings:
    env = os.environ if env is None else env
    return MetricsSettings(
        enabled=parse_bool(METRICS, env_value(env, METRICS) or "false"),
        port=parse_port(METRICS_PORT, env_value(env, METRICS_PORT) or ""),
    )


def compiled_loops_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether the compiled loops may be used (``DYN_KVBM_NATIVE``; they still need to have
    been built)."""
    env = os.environ if env is None else env
    return parse_bool(NATIVE, env_value(env, NATIVE) or "")

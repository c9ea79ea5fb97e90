"""A private ``mooncake_master`` on free loopback ports, for tests, the demo and benchmarks.

Usage (the caller's thread; no thread of its own)::

    with MooncakeMaster(tmp_path, lease_ms=2000) as master:
        settings = SharedSettings(store="mooncake", model_key="m", address=master.address,
                                  metrics_address=master.metrics_address)

The master's binary ships in the ``mooncake-transfer-engine-non-cuda`` wheel (extra
``.[mooncake]``, Debian ``libibverbs1`` at run time) as ``mooncake/mooncake_master``; the
console script of the same name ``execv``s it, so either way the child's pid is the master's.
Its metrics port is always passed: the default (9003, every interface) collides between two
masters. Readiness is ``GET /health`` on that port answering ``service_ready: true``.
Flags from ``mooncake_master --helpfull`` (0.3.13.post1): ``-default_kv_lease_ttl`` (ms, read
lease after is_exist/get), ``-eviction_high_watermark_ratio`` (0.9), ``-eviction_ratio`` (0.05),
``-client_ttl`` (s until a silent client's segment is unmounted).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from kvbm_plugin.testing.local_server import LocalServer, ServerError, free_port

__all__ = ["INSTALL_HINT", "MooncakeMaster", "ServerError", "master_binary"]

INSTALL_HINT = ("pip install '.[mooncake]' (mooncake-transfer-engine-non-cuda) and Debian's "
                "libibverbs1")


def master_binary() -> str:
    """Path of the ``mooncake_master`` binary; raises ServerError naming the extra."""
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "mooncake_master"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    found = shutil.which("mooncake_master", path=path)
    if found:
        return found
    raise ServerError(f"no mooncake_master binary: {INSTALL_HINT}")


class MooncakeMaster(LocalServer):
    """One ``mooncake_master`` bound to ``host`` (RPC and metrics ports picked free)."""

    kind = "mooncake_master"

    def __init__(self, directory: str | os.PathLike[str], *, host: str = "127.0.0.1",
                 lease_ms: int | None = None, eviction_high_watermark: float | None = None,
                 eviction_ratio: float | None = None, client_ttl_s: int | None = None,
                 extra_args: Sequence[str] = (), ready_timeout_s: float = 20.0) -> None:
        super().__init__(directory, ready_timeout_s)
        self.host = host
        self.lease_ms = lease_ms
        self.eviction_high_watermark = eviction_high_watermark
        self.eviction_ratio = eviction_ratio
        self.client_ttl_s = client_ttl_s
        self.extra_args = tuple(extra_args)
        self.binary = master_binary()
        self.rpc_port = 0
        self.metrics_port = 0

    @property
    def address(self) -> str:
        """The master's RPC address (``DYN_KVBM_SHARED_ADDRESS``)."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def metrics_address(self) -> str:
        """The master's HTTP metrics address (``DYN_KVBM_SHARED_METRICS_ADDRESS``)."""
        return f"{self.host}:{self.metrics_port}"

    def _pick_ports(self) -> None:
        self.rpc_port = free_port(self.host)
        self.metrics_port = free_port(self.host)
        while self.metrics_port == self.rpc_port:
            self.metrics_port = free_port(self.host)

    def _command(self) -> list[str]:
        command = [self.binary, "-rpc_address", self.host, "-rpc_port", str(self.rpc_port),
                   "-metrics_host", self.host, "-metrics_port", str(self.metrics_port)]
        if self.lease_ms is not None:
            command += ["-default_kv_lease_ttl", str(int(self.lease_ms))]
        if self.eviction_high_watermark is not None:
            command += ["-eviction_high_watermark_ratio", repr(self.eviction_high_watermark)]
        if self.eviction_ratio is not None:
            command += ["-eviction_ratio", repr(self.eviction_ratio)]
        if self.client_ttl_s is not None:
            command += ["-client_ttl", str(int(self.client_ttl_s))]
        return command + list(self.extra_args)

    def _ready(self) -> bool:
        # /health answers from the metrics server, which can be up before the RPC listener
        # (a client's setup() then finds the RPC port refused): both must answer.
        try:
            if not json.loads(self.http("/health")).get("service_ready"):
                return False
            with socket.create_connection((self.host, self.rpc_port), timeout=1.0):
                return True
        except (OSError, ValueError):
            return False

    def http(self, path: str, timeout_s: float = 1.0) -> str:
        """GET ``path`` on the metrics port (``/health``, ``/metrics/summary``,
        ``/get_all_keys``, ...); raises OSError when it does not answer 200."""
        url = f"http://{self.metrics_address}{path}"
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read().decode("utf-8", "replace")

    def summary(self) -> str:
        """The master's one-line summary (storage used/total, keys, clients, evictions)."""
        return self.http("/metrics/summary").strip()

    def keys(self) -> list[str]:
        """Every key the master holds now (``/get_all_keys``: one per line)."""
        return [line for line in self.http("/get_all_keys").splitlines() if line.strip()]

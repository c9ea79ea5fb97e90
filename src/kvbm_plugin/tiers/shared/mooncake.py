"""MooncakeStore: the shared tier's client of a Mooncake Store (``mooncake_master`` plus the
segments its clients contribute), entry point ``mooncake`` in ``kvbm_plugin.tiers``.

Who calls it: every worker process has one (its rank's puts and reads, from its writer and
reader threads, contributing ``segment_bytes`` of its memory to the pool); the leader has one
more in rank 0's process for existence checks and lease renewal (the shared agent's thread),
built from ``dataclasses.replace(settings, segment_bytes=0, buffer_bytes=0)``: Mooncake 0.3.13
accepts a client with no segment and no transfer buffer (its checks and reads work; a put of
its would land in another client's segment). A segment is 0 or at least 16 MiB (smaller ones
fail set-up). Never called on TensorRT-LLM's executor thread. The Mooncake calls release the
GIL, so a slow one (about 4.5 s each while the master is down) stalls only its caller;
GuardedStore (:mod:`.breaker`) keeps it to one such call per outage.

Behaviour relied on (``mooncake-transfer-engine-non-cuda`` 0.3.13.post1, checked on loopback;
error codes from ``mooncake-store/include/types.h``, kvcache-ai/Mooncake@00aabe0):

* ``setup()`` with no master blocks about 90 s, so the master's RPC port is probed first (a TCP
  connect, 1 s) and an absent master is a ConfigError naming ``DYN_KVBM_SHARED_ADDRESS``.
* Puts use ``batch_put_from`` with ``preferred_segment`` = this client's own segment name, so a
  worker's writes stay in its own memory (the default placement is random over every segment).
  ``-200`` (NO_AVAILABLE_HANDLE: the pool is full until the asynchronous evictor, ~10 ms
  cadence, frees room) is retried once after 20 ms, then reported FULL. A put of a key that
  exists returns 0 and keeps the old bytes: right for content-named blocks.
* ``batch_is_exist`` returns 1 / 0 / a negative code per key (compared ``== 1``), and grants
  or renews the key's read lease (``-default_kv_lease_ttl``; :attr:`lease_s` is the operator's
  ``DYN_KVBM_SHARED_LEASE_S``, which must match it). A leased object is not evicted.
* ``batch_get_into`` returns the object's size or a negative code; a size other than the
  caller's buffer is a FAILED read here, never a load. An object whose owner was killed stays
  listed for ``-client_ttl`` (~11 s: ``is_exist`` 1) but reads fail with -800 (TRANSFER_FAIL):
  FAILED; once the master unmounted the segment, MISSING. Buffers are used in place; on ``tcp``
  unregistered memory works too, ``rdma`` needs :meth:`register` first.
* glog writes several INFO lines per client to stderr: ``MC_LOG_LEVEL`` (Mooncake's own
  variable, read when the module loads) defaults to ``ERROR`` here unless the operator set it.

``MOONCAKE_CONFIG_PATH``: the JSON TensorRT-LLM's, vLLM's and SGLang's Mooncake connectors read
(``mooncake-wheel/mooncake/mooncake_config.py``, kvcache-ai/Mooncake@01220c9: keys
``local_hostname``, ``metadata_server``, ``global_segment_size``, ``local_buffer_size`` (bytes,
or a string like ``"4gb"``), ``protocol``, ``device_name``, ``master_server_address``). Its
values fill the DYN_KVBM_SHARED_* variables left unset; a variable set to another value than
the file's is a ConfigError naming both, so one deployment points every engine at one pool and
a mismatch never goes unnoticed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.consolidator_config import ConfigError
from kvbm_plugin.settings.shared import SharedSettings
from kvbm_plugin.tiers.shared.store import (
    FAILED,
    FULL,
    MISSING,
    OK,
    UNAVAILABLE,
    Buffer,
    SharedStore,
)

log = logging.getLogger(__name__)

EXTRA_HINT = ("pip install 'kvbm-plugin[mooncake]' (mooncake-transfer-engine-non-cuda; a GPU "
              "machine uses mooncake-transfer-engine) and Debian's libibverbs1")
FULL_RETRY_DELAY_S = 0.02
# The transports Mooncake's transfer engine names (mooncake-wheel/mooncake/mooncake_config.py).
PROTOCOLS = ("tcp", "rdma", "nvmeof", "nvlink", "nvlink_intra", "hip", "barex", "cxl", "ascend")
MIN_SEGMENT_BYTES = 16 << 20  # smaller segments fail setup (client_buffer_allocation.cpp)
MAX_SEGMENT_BYTES = 1 << 40
PROBE_TIMEOUT_S = 1.0

# Mooncake ErrorCode (types.h) -> store.py codes; anything else is FAILED.
_NO_AVAILABLE_HANDLE = -200
_OBJECT_ALREADY_EXISTS = -705
_REPLICA_IS_NOT_READY = -703
_CODES: dict[int, int] = {
    -704: MISSING,  # OBJECT_NOT_FOUND
    -710: MISSING,  # REPLICA_NOT_FOUND
    -712: MISSING,  # REPLICA_IS_GONE
    _REPLICA_IS_NOT_READY: MISSING,  # another writer's put of the key is not finished
    _NO_AVAILABLE_HANDLE: FULL,
    -101: FULL,  # SEGMENT_NOT_FOUND: no segment mounted (a restarted master, before re-mount)
    -900: UNAVAILABLE,  # RPC_FAIL: the master does not answer
    -1010: UNAVAILABLE,  # UNAVAILABLE_IN_CURRENT_STATUS
    -1011: UNAVAILABLE,  # UNAVAILABLE_IN_CURRENT_MODE
}
_HEALTH = {1: "the Mooncake client is not set up (or closed)",
           2: "the Mooncake master does not answer the client"}


def mooncake_code(code: int) -> int:
    """The store.py code of a negative Mooncake error code."""
    return _CODES.get(code, FAILED)


def parse_host_port(variable: str, value: str) -> tuple[str, int]:
    """``host:port`` (IPv6 as ``[addr]:port``); ConfigError naming ``variable`` otherwise."""
    host, sep, port_text = value.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"{variable}={value!r}: expected host:port of the Mooncake master")
    return host, int(port_text)


def _size_bytes(key: str, value: Any, path: str) -> int:
    """A size as Mooncake's config reader takes it: bytes, or a number with kb/mb/gb/tb."""
    if isinstance(value, bool):
        raise ConfigError(f"{cc.MOONCAKE_CONFIG_PATH}={path!r}: {key}={value!r} is not a size")
    if isinstance(value, (int, float)):
        return int(value)
    text = str(value).strip().lower()
    for suffix, scale in (("kb", 1 << 10), ("mb", 1 << 20), ("gb", 1 << 30), ("tb", 1 << 40),
                          ("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30), ("t", 1 << 40),
                          ("b", 1)):
        if text.endswith(suffix):
            text, factor = text[: -len(suffix)].strip(), scale
            break
    else:
        factor = 1
    try:
        return int(float(text) * factor)
    except ValueError:
        raise ConfigError(f"{cc.MOONCAKE_CONFIG_PATH}={path!r}: {key}={value!r} is not a size "
                          "(bytes, or a number with kb/mb/gb/tb)") from None


# JSON key -> (variable, SharedSettings field, is a size)
_CONFIG_KEYS: tuple[tuple[str, str, str, bool], ...] = (
    ("master_server_address", cc.SHARED_ADDRESS, "address", False),
    ("metadata_server", cc.SHARED_METADATA_SERVER, "metadata_server", False),
    ("protocol", cc.SHARED_PROTOCOL, "protocol", False),
    ("device_name", cc.SHARED_DEVICE, "device", False),
    ("local_hostname", cc.SHARED_LOCAL_HOSTNAME, "local_hostname", False),
    ("global_segment_size", cc.SHARED_SEGMENT_GB, "segment_bytes", True),
    ("local_buffer_size", cc.SHARED_BUFFER_GB, "buffer_bytes", True),
)


def apply_mooncake_config(settings: SharedSettings,
                          env: Mapping[str, str] | None = None) -> SharedSettings:
    """``settings`` with the unset DYN_KVBM_SHARED_* values taken from the JSON file named by
    ``MOONCAKE_CONFIG_PATH`` (unchanged when it is unset). Raises ConfigError for an unreadable
    file and for a variable that is set to another value than the file's (naming both)."""
    env = os.environ if env is None else env
    path = (env.get(cc.MOONCAKE_CONFIG_PATH) or "").strip()
    if not path:
        return settings
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{cc.MOONCAKE_CONFIG_PATH}={path!r}: cannot read it as JSON: "
                          f"{exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{cc.MOONCAKE_CONFIG_PATH}={path!r}: expected a JSON object")
    changes: dict[str, Any] = {}
    for key, variable, field, is_size in _CONFIG_KEYS:
        if key not in config or config[key] is None:
            continue
        value = _size_bytes(key, config[key], path) if is_size else str(config[key]).strip()
        if (env.get(variable) or "").strip():
            if getattr(settings, field) != value:
                mine = env[variable].strip()
                raise ConfigError(f"{variable}={mine!r} conflicts with {key}={config[key]!r} in "
                                  f"{cc.MOONCAKE_CONFIG_PATH}={path!r}: unset one of them or "
                                  "make them agree")
            continue
        changes[field] = value
    return dataclasses.replace(settings, **changes) if changes else settings


def probe_tcp(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when something accepts a TCP connection at ``host:port``, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def master_http(metrics_address: str, path: str, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """GET ``path`` on the master's metrics port; raises OSError/ValueError on failure."""
    url = f"http://{metrics_address}{path}"
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode("utf-8", "replace")


def master_http_health(metrics_address: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when the master's ``/health`` says it serves, else why not (naming the variable)."""
    where = f"{cc.SHARED_METRICS_ADDRESS}={metrics_address!r}: GET /health"
    try:
        body = json.loads(master_http(metrics_address, "/health", timeout_s))
    except (OSError, ValueError) as exc:
        return f"{where}: {exc}"
    if not (isinstance(body, dict) and body.get("service_ready")):
        return f"{where}: not serving: {body!r:.200}"
    return None


def local_address_toward(host: str, port: int) -> str:
    """The local IP address this host uses to reach ``host:port`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])


def _check_lengths(keys: Sequence[str], buffers: Sequence[Buffer]) -> None:
    if len(keys) != len(buffers):
        raise ValueError(f"{len(keys)} keys for {len(buffers)} buffers")


def import_client() -> tuple[Any, Any]:
    """Mooncake's client and replica-config classes; ConfigError naming the extra when the
    wheel (or Debian's libibverbs1) is missing. Mooncake reads ``MC_LOG_LEVEL`` when its
    library loads: without it glog writes every INFO line to stderr."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as exc:
        raise ConfigError(f"{cc.SHARED_TIER}='mooncake' needs the Mooncake client: "
                          f"{EXTRA_HINT} ({exc})") from None
    return MooncakeDistributedStore, ReplicateConfig


class MooncakeStore(SharedStore):
    """One Mooncake client (see the module docstring). Thread-safe: the client's calls may
    run on several threads at once; the counters take a short lock."""

    name: ClassVar[str] = "mooncake"

    def __init__(self, settings: SharedSettings, *,
                 env: Mapping[str, str] | None = None) -> None:
        settings = apply_mooncake_config(settings, env)
        if not settings.address:
            raise ConfigError(f"{cc.SHARED_ADDRESS} is unset: the Mooncake master's host:port "
                              f"(or {cc.MOONCAKE_CONFIG_PATH}, a JSON with "
                              "master_server_address)")
        self.settings = settings
        self._rl = RateLimitedLog(log)  # per client: one client's losses hide no other's
        self._host, self._port = parse_host_port(cc.SHARED_ADDRESS, settings.address)
        if settings.metrics_address:
            parse_host_port(cc.SHARED_METRICS_ADDRESS, settings.metrics_address)
        if settings.segment_bytes != 0 and not MIN_SEGMENT_BYTES <= settings.segment_bytes \
                <= MAX_SEGMENT_BYTES:
            gib = settings.segment_bytes / (1 << 30)
            raise ConfigError(f"{cc.SHARED_SEGMENT_GB}={gib:g} ({settings.segment_bytes} bytes): "
                              "Mooncake takes 0 (no segment) or 16 MiB .. 1 TiB (0.015625 .. "
                              "1024)")
        if settings.protocol not in PROTOCOLS:
            raise ConfigError(f"{cc.SHARED_PROTOCOL}={settings.protocol!r}: Mooncake transfers "
                              f"over {', '.join(PROTOCOLS)}")
        client_type, self._config_type = import_client()
        problem = probe_tcp(self._host, self._port)
        if problem is not None:
            raise ConfigError(f"{cc.SHARED_ADDRESS}={settings.address!r}: no Mooncake master "
                              f"answers there ({problem}); start mooncake_master or fix the "
                              "address")
        local = settings.local_hostname
        if not local:
            try:
                local = local_address_toward(self._host, self._port)
            except OSError as exc:
                raise ConfigError(f"{cc.SHARED_LOCAL_HOSTNAME} is unset and no local address "
                                  f"reaches {settings.address} ({exc}); set it") from None
        self._client: Any = client_type()
        started = time.monotonic()
        rc = self._client.setup(local, settings.metadata_server, settings.segment_bytes,
                                settings.buffer_bytes, settings.protocol, settings.device,
                                settings.address)
        if rc != 0:
            self._client = None
            raise ConfigError(f"{cc.SHARED_ADDRESS}={settings.address!r}: Mooncake client "
                              f"setup failed with code {rc} after "
                              f"{time.monotonic() - started:.1f} s (local address {local!r}, "
                              f"protocol {settings.protocol!r}, metadata server "
                              f"{settings.metadata_server!r})")
        self.segment_name: str = self._client.get_hostname()
        self._replicate = self._config_type()
        if settings.segment_bytes > 0:
            self._replicate.preferred_segment = self.segment_name
        self._lock = threading.Lock()
        self._stats = {"full_retries": 0, "size_mismatches": 0, "errors": 0,
                       "register_failures": 0}
        log.info("Mooncake client %s joined master %s (segment %d bytes, buffer %d bytes, %s)",
                 self.segment_name, settings.address, settings.segment_bytes,
                 settings.buffer_bytes, settings.protocol)

    @property
    def lease_s(self) -> float | None:
        return self.settings.lease_s

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    def stats(self) -> dict[str, int]:
        """Client-side counts: FULL retries, size mismatches, calls that raised."""
        with self._lock:
            return dict(self._stats)

    def _call(self, what: str, n: int, *args: Any) -> list[int]:
        """Batch call ``what`` of the client with ``n`` per-key results; on a closed client,
        an exception or a result of the wrong length: one code for every key, logged."""
        client = self._client
        if client is None:
            return [UNAVAILABLE] * n
        try:
            result = list(getattr(client, what)(*args))
        except Exception as exc:  # a pybind argument error: a bug here, reported per key
            self._count("errors")
            self._rl.log(logging.ERROR, f"mooncake.{what}", "Mooncake %s raised %s: %s", what,
                         type(exc).__name__, exc)
            return [FAILED] * n
        if len(result) != n:
            self._count("errors")
            self._rl.log(logging.ERROR, f"mooncake.{what}.len", "Mooncake %s returned %d results "
                         "for %d keys", what, len(result), n)
            return [FAILED] * n
        return result

    def register(self, address: int, size: int) -> None:
        client = self._client
        if client is None:
            return
        rc = client.register_buffer(address, size)
        if rc != 0:
            self._count("register_failures")
            self._rl.log(logging.WARNING, "mooncake.register", "Mooncake register_buffer(%#x, %d) "
                         "failed with code %d: transfers from it fail on rdma", address, size, rc)

    def unregister(self, address: int) -> None:
        client = self._client
        if client is not None:
            client.unregister_buffer(address)

    def exists(self, keys: Sequence[str]) -> list[int]:
        if not keys:
            return []
        return [1 if r == 1 else 0 if r == 0 else mooncake_code(r) if r < 0 else FAILED
                for r in self._call("batch_is_exist", len(keys), list(keys))]

    def put(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[int]:
        _check_lengths(keys, buffers)
        if not keys:
            return []
        keys = list(keys)
        ptrs = [b[0] for b in buffers]
        sizes = [b[1] for b in buffers]
        raw = self._call("batch_put_from", len(keys), keys, ptrs, sizes, self._replicate)
        full = [i for i, r in enumerate(raw) if r == _NO_AVAILABLE_HANDLE]
        if full:
            self._count("full_retries", len(full))
            time.sleep(FULL_RETRY_DELAY_S)  # the evictor runs every ~10 ms; one more try
            again = self._call("batch_put_from", len(full), [keys[i] for i in full],
                               [ptrs[i] for i in full], [sizes[i] for i in full],
                               self._replicate)
            for i, r in zip(full, again, strict=True):
                raw[i] = r
        return [OK if r in (0, _OBJECT_ALREADY_EXISTS, _REPLICA_IS_NOT_READY)
                else mooncake_code(r) if r < 0 else FAILED for r in raw]

    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[int]:
        _check_lengths(keys, buffers)
        if not keys:
            return []
        sizes = [b[1] for b in buffers]
        result = self._call("batch_get_into", len(keys), list(keys), [b[0] for b in buffers],
                            sizes)
        out: list[int] = []
        for key, r, size in zip(keys, result, sizes, strict=True):
            if r < 0:
                out.append(FAILED if r == -600 else mooncake_code(r))
            elif r != size:
                self._count("size_mismatches")
                self._rl.log(logging.ERROR, "mooncake.size", "shared-tier object %s has %d bytes, "
                             "expected %d: not loaded", key, r, size)
                out.append(FAILED)
            else:
                out.append(r)
        return out

    def remove_if_size_not(self, key: str, size: int) -> int:
        """As :meth:`remove_if` (no compare either): called after a read found another size."""
        return self.remove_if(key, "")

    def remove_if(self, key: str, fingerprint: str) -> int:
        """Remove a refused object: Mooncake has no compare-and-delete, so ``remove(key,
        force=True)`` (the reader's own read just leased it). A put of a present key keeps the
        old bytes, so between the refused read and this call the key can only hold other bytes
        if someone else removed it and a correct writer wrote it again: removing that costs one
        miss, never a wrong load."""
        client = self._client
        if client is None:
            return UNAVAILABLE
        try:
            rc = client.remove(key, True)
        except Exception as exc:
            self._count("errors")
            self._rl.log(logging.ERROR, "mooncake.remove", "Mooncake remove raised %s: %s",
                         type(exc).__name__, exc)
            return FAILED
        if rc == 0:
            return OK
        return mooncake_code(rc) if rc < 0 else FAILED

    def health(self) -> str | None:
        client = self._client
        if client is None:
            return "the Mooncake client is closed"
        problem = probe_tcp(self._host, self._port, 0.5)
        if problem is not None:
            return f"Mooncake master {self.settings.address}: {problem}"
        rc = client.health_check()
        if rc != 0:
            return _HEALTH.get(rc, f"Mooncake health_check() = {rc}")
        if self.settings.metrics_address:
            return master_http_health(self.settings.metrics_address, 0.5)
        return None

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

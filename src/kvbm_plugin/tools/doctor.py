"""``kvbm-plugin doctor``: is this machine ready to run the plugin? Exit 1 on any problem."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvbm_plugin import consolidator_config as cc


@dataclass
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail"
    detail: str


def _port_free(port: int) -> str | None:
    """None when ``port`` can be bound on all interfaces now, else the reason.

    Probed the way the real bind happens: libzmq's TCP listener sets SO_REUSEADDR before it
    binds on every system but Windows (zeromq/libzmq src/tcp_listener.cpp,
    ``tcp_listener_t::create_socket``), so a port whose last connections are still in
    TIME_WAIT (for a minute after any run with a subscriber) binds fine and is free here too;
    a port another socket listens on is still refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        if os.name != "nt":
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _ipc_problem(address: str) -> str | None:
    """Why an ipc socket cannot be bound at ``address`` (its directory), or None."""
    directory = os.path.dirname(os.path.abspath(address)) or "."
    if not os.path.isdir(directory):
        return f"{directory} does not exist" if not os.path.lexists(directory) \
            else f"{directory} is not a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{directory} is not writable"
    return None


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _memory_bytes() -> tuple[int, int] | None:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo, or None where there is none."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo if ":" in line)
        return (int(fields["MemTotal"].split()[0]) * 1024,
                int(fields["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        return None


def _write_probe(directory: str) -> str | None:
    """Why no file can be written in ``directory`` (tried for real: permission bits do not
    tell for /proc, a read-only mount or a full disk), or None. The probe file is removed."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".kvbm-doctor-"):
            pass
    except OSError as exc:
        return f"cannot write a file in {directory}: {exc.strerror or exc}"
    return None


def _tier_checks(tiers: cc.TierSettings) -> list[Check]:
    """Offload off, or each tier against what this machine has: host cache in GiB against
    its memory, disk cache against the free space of its directory, which must take files."""
    if not tiers.host_enabled and not tiers.disk_enabled:
        return [Check("offload tiers", "warn",
                      f"none configured ({cc.CPU_CACHE_GB} / {cc.CPU_CACHE_NUM_BLOCKS}, "
                      f"{cc.DISK_CACHE_GB} / {cc.DISK_CACHE_NUM_BLOCKS} unset or 0): offload "
                      "is off, the plugin only publishes GPU-tier events")]
    checks: list[Check] = []
    if tiers.host_enabled:
        checks.append(_host_check(tiers))
    if tiers.disk_enabled:
        checks.append(_disk_check(tiers))
    return checks


def _host_check(tiers: cc.TierSettings) -> Check:
    if tiers.cpu_num_blocks:
        return Check("host tier", "ok", f"{cc.CPU_CACHE_NUM_BLOCKS}={tiers.cpu_num_blocks} "
                     "blocks (their size is the engine's: not compared with memory here)")
    want = tiers.cpu_cache_gb * (1 << 30)
    memory = _memory_bytes()
    if memory is None:
        return Check("host tier", "warn", f"{cc.CPU_CACHE_GB}={tiers.cpu_cache_gb:g}: this "
                     "machine's memory is unknown (no /proc/meminfo)")
    total, available = memory
    detail = (f"{cc.CPU_CACHE_GB}={tiers.cpu_cache_gb:g} ({_gib(want)} pinned host memory); "
              f"this machine has {_gib(total)}, {_gib(available)} available")
    if want >= total:
        return Check("host tier", "fail", detail + ": more than the machine has")
    if want > available:
        return Check("host tier", "warn", detail + ": more than is available now")
    return Check("host tier", "ok", detail)


def _disk_check(tiers: cc.TierSettings) -> Check:
    directory = tiers.disk_cache_dir
    if directory is None:
        where = tempfile.gettempdir()
        named = f"{cc.DISK_CACHE_DIR} unset: a temporary directory under {where}"
    else:
        where = os.path.abspath(directory)
        named = f"{cc.DISK_CACHE_DIR}={directory!r}"
    existing = where
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    problem = _write_probe(existing)
    if problem is not None:
        return Check("disk tier", "fail", f"{named}: {problem}")
    created = "" if existing == where else f" (created at start-up under {existing})"
    if tiers.disk_num_blocks:
        return Check("disk tier", "ok", f"{named}{created}; {cc.DISK_CACHE_NUM_BLOCKS}="
                     f"{tiers.disk_num_blocks} blocks (their size is the engine's)")
    want = tiers.disk_cache_gb * (1 << 30)
    free = shutil.disk_usage(existing).free
    detail = (f"{named}{created}; {cc.DISK_CACHE_GB}={tiers.disk_cache_gb:g} "
              f"({_gib(want)}), {_gib(free)} free there")
    if want > free:
        return Check("disk tier", "fail", detail + ": more than the free space")
    return Check("disk tier", "ok", detail)


def _mooncake_summary(metrics_address: str) -> str:
    """The pool as the master's ``/metrics/summary`` line reports it (storage, keys, clients)."""
    import re

    from kvbm_plugin.tiers.shared.mooncake import master_http

    line = master_http(metrics_address, "/metrics/summary").strip()
    parts = [m.group(0).strip() for pattern in (r"Mem Storage: [^|]+", r"Keys: [^|]+",
                                                r"Clients: \d+")
             if (m := re.search(pattern, line))]
    evicted = re.search(r"^master_evicted_key_count (\S+)$",
                        master_http(metrics_address, "/metrics"), re.M)
    if evicted:
        parts.append(f"evicted keys: {float(evicted.group(1)):.0f}")
    return "; ".join(parts) or line[:200]


def _shared_check() -> Check:
    """The shared tier, when configured: its settings, the store reachable (a client of it
    connected and asked, with no segment of this machine's memory), and what it reports."""
    import dataclasses

    try:
        settings = cc.load_shared_settings()
    except cc.ConfigError as exc:
        return Check("shared tier", "fail", str(exc))
    if settings is None:
        return Check("shared tier", "ok", f"off ({cc.SHARED_TIER} unset)")
    from kvbm_plugin._util.plugins import PluginLoadError
    from kvbm_plugin.tiers.shared.factory import store_class

    name = f"shared tier ({settings.store})"
    try:
        cls = store_class(settings.store)
        if settings.store == "mooncake":
            from kvbm_plugin.tiers.shared.mooncake import apply_mooncake_config

            settings = apply_mooncake_config(settings)
            settings = dataclasses.replace(settings, segment_bytes=0, buffer_bytes=0)
        store = cls(settings)
    except (cc.ConfigError, PluginLoadError) as exc:
        return Check(name, "fail", str(exc))
    try:
        problem = store.health()
        if problem is not None:
            named = problem if "DYN_KVBM_" in problem \
                else f"{cc.SHARED_ADDRESS}={settings.address!r}: {problem}"
            return Check(name, "fail", named)
        keys = f"model key {settings.model_key!r}, namespace {settings.namespace!r}"
        if settings.store == "mooncake":
            if not settings.metrics_address:
                return Check(name, "ok", f"master {settings.address} answers ({keys}); set "
                             f"{cc.SHARED_METRICS_ADDRESS} to its -metrics_port to see the pool")
            try:
                report = _mooncake_summary(settings.metrics_address)
            except (OSError, ValueError) as exc:
                return Check(name, "fail", f"{cc.SHARED_METRICS_ADDRESS}="
                             f"{settings.metrics_address!r}: {exc}")
            return Check(name, "ok", f"master {settings.address} serving: {report} ({keys}; "
                         f"lease {settings.lease_s:g} s: the master's -default_kv_lease_ttl "
                         "must match)")
        info = getattr(store, "info", None)
        facts = info() if callable(info) else {}
        report = ", ".join(f"{k} {v}" for k, v in facts.items()) or "up"
        policy = str(facts.get("maxmemory_policy", ""))
        if policy.startswith("allkeys"):
            return Check(name, "warn", f"{settings.address} answers: {report} ({keys}); "
                         f"maxmemory-policy {policy} evicts without telling: a block the "
                         "leader checked can be gone at its load (a counted failed load)")
        return Check(name, "ok", f"{settings.address} answers: {report} ({keys})")
    finally:
        store.close()


def _endpoint_checks(config: cc.ConsolidatorConfig, metrics: cc.MetricsSettings) -> list[Check]:
    endpoints: list[tuple[str, cc.Endpoint]] = []
    for rank in range(config.num_ranks):
        if config.gpu_events is not None:
            endpoints.append((f"rank {rank} GPU-tier publisher", config.publish_endpoint(rank)))
        replay = config.replay_endpoint(rank)
        if replay is not None:
            endpoints.append((f"rank {rank} GPU-tier replay", replay))
    endpoints.append(("consolidated output", config.output))
    if config.output_replay is not None:
        endpoints.append(("consolidated output replay", config.output_replay))
    if metrics.enabled:
        # prometheus_client's HTTP server listens on every interface (scraped from elsewhere).
        endpoints.append(("metrics", cc.Endpoint("tcp", port=metrics.port, source=cc.METRICS_PORT,
                                                 bind_host="*")))
    checks = []
    for role, endpoint in endpoints:
        if endpoint.scheme == "tcp":
            problem = _port_free(endpoint.port)
        elif endpoint.scheme == "ipc":
            problem = _ipc_problem(endpoint.address)
        else:
            problem = None
        if problem:
            checks.append(Check(f"{role} {endpoint.bind}", "fail", problem))
        elif endpoint.every_interface:
            checks.append(Check(f"{role} {endpoint.bind}", "warn", "free; open to every "
                                "interface: anyone who reaches this host can connect"))
        else:
            checks.append(Check(f"{role} {endpoint.bind}", "ok", "free"))
    return checks


_SOURCE_DETAIL = {
    "auto": "drains TRT-LLM's KV-event buffer each iteration until another reader "
            "(LLM.get_kv_cache_events, /kv_cache_events, Dynamo's publisher) calls it, then "
            "publishes what that reader drains (V2 hooks: never drains)",
    "drain": "drains TRT-LLM's KV-event buffer each iteration: TRT-LLM's own readers "
             "(LLM.get_kv_cache_events, /kv_cache_events, Dynamo's publisher) get nothing",
    "tap": "never drains: publishes only what TRT-LLM's own readers drain (nothing while "
           "none runs)",
    "off": "no GPU-tier events from the leader (run `kvbm-plugin sidecar` or another "
           "publisher)",
}


def _events_source_check() -> Check:
    """Which GPU-tier event source the leader will use, and what the engine must provide."""
    try:
        source = cc.load_events_source()
    except cc.ConfigError as exc:
        return Check("KV event source", "fail", str(exc))
    detail = (f"{cc.EVENTS_SOURCE}={source}: {_SOURCE_DETAIL[source]}. The leader finds "
              "TRT-LLM's KV cache manager as PyExecutor.kv_cache_manager in its caller's "
              "frames at the first iteration and warns once when there is none (an executor "
              "that does not wire KV events, e.g. PyExecutorCoro)")
    return Check("KV event source", "ok", detail)


def run_checks(num_ranks: int, require_trtllm: bool) -> list[Check]:
    """Every check, in order. The settings are read by the loaders start-up itself uses (the
    leader's and the workers'), so a value start-up would refuse fails here too: the publisher
    name against the registered entry points, the disk directory (a file, or a directory that
    cannot be created or written), every number, switch and endpoint."""
    from kvbm_plugin._util.plugins import PluginLoadError

    checks: list[Check] = []
    try:
        config = cc.load_consolidator_config(num_ranks=num_ranks)
        checks.append(Check("consolidator config", "ok",
                            f"enabled={config.enabled} mode={config.mode} ranks={num_ranks}"))
    except (cc.ConfigError, PluginLoadError) as exc:
        config = None
        checks.append(Check("consolidator config", "fail", str(exc)))
    # The event source has its own check below (what it means, not only its value).
    tiers: cc.TierSettings | None = None
    for name, loader in (("publisher settings", cc.load_publisher_settings),
                         ("tier settings", cc.load_tier_settings),
                         ("metrics settings", cc.load_metrics_settings)):
        try:
            value = loader()
            checks.append(Check(name, "ok", repr(value)))
            if isinstance(value, cc.TierSettings):
                tiers = value
        except (cc.ConfigError, PluginLoadError) as exc:
            checks.append(Check(name, "fail", str(exc)))
    if tiers is not None:
        checks.extend(_tier_checks(tiers))
    checks.append(_shared_check())
    if config is not None:
        try:
            metrics = cc.load_metrics_settings()
        except cc.ConfigError:
            metrics = cc.MetricsSettings()
        checks.extend(_endpoint_checks(config, metrics))

    checks.append(_events_source_check())

    from kvbm_plugin._util import native as _native

    try:
        in_use, detail = _native.describe()
        checks.append(Check("compiled fast paths", "ok" if in_use else "warn", detail))
    except cc.ConfigError as exc:
        checks.append(Check("compiled fast paths", "fail", str(exc)))

    from kvbm_plugin.connector.trtllm_compat import COMPAT

    if COMPAT.error:
        checks.append(Check("TensorRT-LLM", "fail",
                            f"installed ({COMPAT.trtllm_version}) but not importable: "
                            f"{COMPAT.error}"))
    elif not COMPAT.installed:
        checks.append(Check("TensorRT-LLM", "fail" if require_trtllm else "warn",
                            "not installed (from the plugin's checkout: pip install "
                            "'.[trtllm]' --extra-index-url https://pypi.nvidia.com); stand-in "
                            "base classes"))
    else:
        checks.append(Check("TensorRT-LLM", "ok",
                            f"{COMPAT.trtllm_version}, connector API from {COMPAT.module}"))
    try:
        import torch

        cuda = torch.cuda.is_available()
        detail = f"torch {torch.__version__}, CUDA " + (
            f"available ({torch.cuda.device_count()} device(s), {torch.version.cuda})"
            if cuda else "not available (CPU only)")
        checks.append(Check("torch", "ok", detail))
    except Exception as exc:
        checks.append(Check("torch", "fail", f"{type(exc).__name__}: {exc}"))

    from kvbm_plugin._util.plugins import PUBLISHERS_GROUP, TIERS_GROUP, load_group

    for group in (PUBLISHERS_GROUP, TIERS_GROUP):
        try:
            plugins = load_group(group, refresh=True)
            listing = ", ".join(f"{p.name} ({p.distribution})" for p in plugins.values())
            checks.append(Check(f"entry points {group}", "ok" if plugins else "fail",
                                listing or "none found"))
        except Exception as exc:
            checks.append(Check(f"entry points {group}", "fail", str(exc)))
    return checks


def main_doctor(argv: Sequence[str] | None = None) -> int:
    from kvbm_plugin.tools.cli import ArgumentParser

    parser = ArgumentParser(prog="kvbm-plugin doctor",
                                     description="Check env vars, ports, TensorRT-LLM, torch/CUDA "
                                                 "and entry points; exit 1 on a problem.")
    parser.add_argument("--num-ranks", type=int, default=1,
                        help="attention-DP ranks whose ports to check (default 1)")
    parser.add_argument("--require-trtllm", action="store_true",
                        help="treat a missing TensorRT-LLM as a failure")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    if args.num_ranks < 1:
        parser.error(f"argument --num-ranks: {args.num_ranks} must be >= 1")
    checks = run_checks(args.num_ranks, args.require_trtllm)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for check in checks:
            print(f"[{check.status.upper():4}] {check.name.ljust(width)}  {check.detail}")
    failed = [c for c in checks if c.status == "fail"]
    if not args.json:
        print(f"\n{len(failed)} problem(s)" if failed else "\nno problems found")
    return 1 if failed else 0

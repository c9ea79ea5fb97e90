"""``kvbm-plugin doctor``: is this machine ready to run the plugin? Exit 1 on any problem."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.cli.doctor_shared import DEFAULT_TIMEOUT_S, Check, bounded_shared_check
from kvbm_plugin.cli.doctor_shared import shared_check as _shared_check  # noqa: F401 (tests)
from kvbm_plugin.consolidator_config import ConfigError
from kvbm_plugin.events.trtllm_publisher import (
    TrtllmPublisher,
    gpu_source_line,
    trtllm_streams,
)
from kvbm_plugin.leader.dynamo_streaming import load_moved_endpoint, take_yaml_endpoint
from kvbm_plugin.settings.shared import load_shared_settings


def _port_free(port: int, host: str = "0.0.0.0") -> str | None:
    """None when ``port`` can be bound on ``host`` (an address; all interfaces by default)
    now, else the reason.

    Probed the way the real bind happens: libzmq's TCP listener sets SO_REUSEADDR before it
    binds on every system but Windows (zeromq/libzmq src/tcp_listener.cpp,
    ``tcp_listener_t::create_socket``), so a port whose last connections are still in
    TIME_WAIT (for a minute after any run with a subscriber) binds fine and is free here too;
    a port another socket listens on is still refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        if os.name != "nt":
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _bind_address(endpoint: cc.Endpoint) -> tuple[str | None, str | None]:
    """(the address a tcp endpoint's socket binds, or None; why it cannot bind, or None).

    libzmq binds an IP address, ``*``, an interface name (``eth0``) or a host name it resolves;
    a name that does not resolve fails the bind with "No such device". A name is resolved here
    the same way (the system resolver: bounded by its own timeouts)."""
    host = (endpoint.bind_host or endpoint.host).strip("[]")
    if endpoint.every_interface or host in ("*", "0.0.0.0", "::"):
        return "0.0.0.0", None
    if host in {name for _, name in socket.if_nameindex()}:
        return "0.0.0.0", None  # an interface name: any busy port there is busy on 0.0.0.0
    try:
        infos = socket.getaddrinfo(host, endpoint.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        return None, (f"{endpoint.source}: host {host!r} does not resolve "
                      f"({getattr(exc, 'strerror', None) or exc}): ZMQ cannot bind it "
                      "(\"No such device\"); use an address, an interface name or *")
    return str(infos[0][4][0]), None


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


# A KV block of any real model is far larger (e.g. 32 tokens x 24 layers x 2 KV heads x 64 x
# 2 bytes x K and V = 384 KiB): a tier under this size, measured in GiB, is a typo.
MIN_TIER_BYTES = 1 << 20


def _too_small(gib: float, gib_name: str, blocks_name: str, block_bytes: int | None
               ) -> str | None:
    """Why a tier of ``gib`` GiB holds no block (start-up refuses it), or None."""
    size = int(gib * (1 << 30))
    if block_bytes is not None:
        if size < block_bytes:
            return (f"{gib_name}={gib:g} is {size} bytes, smaller than one KV block "
                    f"(--block-bytes {block_bytes}); start-up refuses it: raise it or set "
                    f"{blocks_name}")
        return None
    if size < MIN_TIER_BYTES:
        return (f"{gib_name}={gib:g} is {size} bytes, smaller than a KV block of any real "
                f"model; start-up refuses a tier smaller than one block: raise it, set "
                f"{blocks_name}, or pass --block-bytes N to check against the engine's block")
    return None


def _tier_checks(tiers: cc.TierSettings, block_bytes: int | None = None) -> list[Check]:
    """Offload off, or each tier against what this machine has: host cache in GiB against
    its memory, disk cache against the free space of its directory, which must take files."""
    if not tiers.host_enabled and not tiers.disk_enabled:
        # The workers resolve the tier classes even with offload off: a bad name fails there
        classes = _tier_class_check(tiers)
        return [Check("offload tiers", "warn",
                      f"none configured ({cc.CPU_CACHE_GB} / {cc.CPU_CACHE_NUM_BLOCKS}, "
                      f"{cc.DISK_CACHE_GB} / {cc.DISK_CACHE_NUM_BLOCKS} unset or 0): offload "
                      "is off, the plugin only publishes GPU-tier events"),
                *([classes] if classes.status == "fail" else [])]
    checks: list[Check] = []
    if tiers.host_enabled:
        small = None if tiers.cpu_num_blocks else _too_small(
            tiers.cpu_cache_gb, cc.CPU_CACHE_GB, cc.CPU_CACHE_NUM_BLOCKS, block_bytes)
        checks.append(Check("host tier", "fail", small) if small else _host_check(tiers))
    if tiers.disk_enabled:
        small = None if tiers.disk_num_blocks else _too_small(
            tiers.disk_cache_gb, cc.DISK_CACHE_GB, cc.DISK_CACHE_NUM_BLOCKS, block_bytes)
        checks.append(Check("disk tier", "fail", small) if small else _disk_check(tiers))
    checks.append(_tier_class_check(tiers))
    return checks


def _tier_class_check(tiers: cc.TierSettings) -> Check:
    """The host and disk tier classes the settings name (tiers/selection.py): what the
    workers' constructors would refuse, found here first."""
    from kvbm_plugin.tiers.selection import disk_tier_class, host_tier_class

    try:
        named = [f"{var}={name!r}: {cls.__module__}.{cls.__qualname__}"
                 for var, name, cls, on in (
                     (cc.HOST_TIER, tiers.host_tier, host_tier_class(tiers), tiers.host_enabled),
                     (cc.DISK_TIER, tiers.disk_tier, disk_tier_class(tiers), tiers.disk_enabled))
                 if on]
    except cc.ConfigError as exc:
        return Check("tier classes", "fail", str(exc))
    return Check("tier classes", "ok", "; ".join(named))


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


def _shared_needs_host(tiers: cc.TierSettings | None) -> list[Check]:
    """The shared tier writes through the host tier: start-up refuses it without one."""
    try:
        settings = load_shared_settings()
    except cc.ConfigError:
        return []  # reported by the shared tier's own check
    if settings is None or tiers is None or tiers.host_enabled:
        return []
    return [Check("shared tier needs the host tier", "fail",
                  f"{cc.SHARED_TIER}={settings.store!r} writes through the host tier, which is "
                  f"off: set {cc.CPU_CACHE_GB} or {cc.CPU_CACHE_NUM_BLOCKS} (start-up refuses "
                  "this)")]


def _endpoint_checks(config: cc.ConsolidatorConfig, metrics: cc.MetricsSettings) -> list[Check]:
    endpoints: list[tuple[str, cc.Endpoint]] = []
    for rank, stream, replay in config.gpu_streams:  # bound by TRT-LLM: free before it starts
        endpoints.append((f"rank {rank} TensorRT-LLM publisher", stream))
        if replay is not None:
            endpoints.append((f"rank {rank} TensorRT-LLM replay", replay))
    for rank in range(config.num_ranks):
        if config.gpu_events is not None:
            endpoints.append((f"rank {rank} GPU-tier publisher", config.publish_endpoint(rank)))
        replay = config.replay_endpoint(rank)
        if replay is not None:
            endpoints.append((f"rank {rank} GPU-tier replay", replay))
    endpoints.append(("consolidated output", config.output))
    if config.output_replay is not None:
        endpoints.append(("consolidated output replay", config.output_replay))
    for rank, role, endpoint in cc.dp_rank_sockets(os.environ, config.num_ranks):
        if role == "shared-tier announce endpoint":
            endpoints.append((f"rank {rank} {role}", endpoint))
    if metrics.enabled:
        # prometheus_client's HTTP server listens on every interface (scraped from elsewhere).
        endpoints.append(("metrics", cc.Endpoint("tcp", port=metrics.port, source=cc.METRICS_PORT,
                                                 bind_host="*")))
    checks = []
    for role, endpoint in endpoints:
        if endpoint.scheme == "tcp":
            address, problem = _bind_address(endpoint)
            if address is not None:
                problem = _port_free(endpoint.port, address)
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


# TensorRT-LLM's own switch (tensorrt_llm/runtime/kv_cache_manager_v2/__init__.py, stored id
# 57009499785: default "cpp"); read here to say what it means, never set by the plugin.
V2_BACKEND_VAR = "TLLM_KV_CACHE_MANAGER_V2_BACKEND"

_SOURCE_DETAIL = {
    "auto": "drains TRT-LLM's KV-event buffer (every 5 ms while the engine iterates, on the "
            "leader's event pump thread) until another reader "
            "(LLM.get_kv_cache_events, /kv_cache_events, Dynamo's publisher) calls it, then "
            "publishes what that reader drains (V2 hooks: never drains)",
    "drain": "drains TRT-LLM's KV-event buffer (every 5 ms while the engine iterates, on the "
             "leader's event pump thread) until another reader "
             "(LLM.get_kv_cache_events, /kv_cache_events, Dynamo's publisher) calls it, then "
             "warns and publishes what that reader drains (two drainers split the stream)",
    "tap": "never drains: publishes only what TRT-LLM's own readers drain (nothing while "
           "none runs)",
    "off": "no GPU-tier events from the leader (run `kvbm-plugin sidecar` or another "
           "publisher)",
}


def _events_source_check(trtllm_pub: TrtllmPublisher | None = None) -> Check:
    """Which GPU-tier event source the leader will use, and what the engine must provide."""
    try:
        source = cc.load_events_source()
    except cc.ConfigError as exc:
        return Check("KV event source", "fail", str(exc))
    if trtllm_pub is not None:
        return Check("KV event source", "ok", f"{cc.EVENTS_SOURCE}={source}: not used: with "
                     "kv_cache_config.kv_events_config on, TensorRT-LLM's pull API is empty "
                     "and the leader reads no TensorRT-LLM events")
    detail = (f"{cc.EVENTS_SOURCE}={source}: {_SOURCE_DETAIL[source]}. The leader finds "
              "TRT-LLM's KV cache manager as PyExecutor.kv_cache_manager in its caller's "
              "frames at the first iteration and warns once when there is none (an executor "
              "that does not wire KV events, e.g. PyExecutorCoro). " + _v2_backend_note())
    return Check("KV event source", "ok", detail)


def _v2_backend_note() -> str:
    """What KVCacheManagerV2's backend means for the plugin's hooks (issue 26, item 2)."""
    backend = (os.environ.get(V2_BACKEND_VAR) or "cpp").strip().lower()
    if backend == "python":
        return (f"KVCacheManagerV2: {V2_BACKEND_VAR}=python: its Python event hooks are "
                "wrapped; the leader's self-check warns if none is called")
    return (f"KVCacheManagerV2: {V2_BACKEND_VAR}={backend} (C++, TensorRT-LLM's default): its "
            "radix tree calls the event sink natively, so the leader refuses to wrap the hooks "
            "and publishes no GPU-tier events itself; turn on kv_cache_config.kv_events_config "
            "(TensorRT-LLM's own publisher, consolidated by the plugin). Where the backend "
            "cannot be told, the leader's self-check warns and counts "
            "gpu_source_silent_iterations (the C++ KVCacheManager is not affected)")


def read_llm_api_options(path: str) -> Any:
    """The engine's LLM-API options file (YAML or JSON, what ``trtllm-serve`` takes as
    ``--extra_llm_api_options``), parsed; ConfigError names the file and the problem. Used by
    ``doctor`` and ``consolidate`` (``--llm-api-options``)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"--llm-api-options {path}: {exc.strerror or exc}") from None
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        import yaml  # type: ignore[import-untyped]  # TensorRT-LLM's own dependency
    except ImportError:
        # A fresh install without TensorRT-LLM: the block YAML `kvbm-plugin yaml` writes is
        # read without PyYAML; anything fancier asks for it.
        from kvbm_plugin._util.mini_yaml import MiniYamlError, parse

        try:
            return parse(text)
        except MiniYamlError as exc:
            raise ConfigError(f"--llm-api-options {path} is not JSON and not the plain YAML "
                              f"read without PyYAML ({exc}): pip install pyyaml") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--llm-api-options {path}: {exc}") from None


def _gpu_source_check(config: cc.ConsolidatorConfig | None, trtllm_pub: TrtllmPublisher | None,
                      options: Any, num_ranks: int) -> Check:
    """Which GPU-tier source the leader will use (the words of its start-up log)."""
    host = (os.environ.get(cc.LEADER_ZMQ_HOST) or "127.0.0.1").strip()
    try:
        source = cc.load_events_source()
    except cc.ConfigError:
        source = "auto"  # reported by the KV event source check
    detail = gpu_source_line(trtllm_pub, source, config, 0, host)
    if trtllm_pub is not None and trtllm_pub.streams and num_ranks > 1:
        detail += "; " + ", ".join(f"rank {r} at {trtllm_pub.connect_endpoint(r, host).connect}"
                                   for r in range(1, num_ranks))
    if options is None:
        detail += (". Whether TensorRT-LLM publishes the GPU tier itself "
                   "(kv_cache_config.kv_events_config) is not known here: pass "
                   "--llm-api-options with the engine's options file")
    usable = trtllm_pub.streams if trtllm_pub is not None else (
        source == "off" or (config is not None and config.gpu_events is not None))
    return Check("GPU-tier KV events", "ok" if usable else "warn", detail)


def run_checks(num_ranks: int, require_trtllm: bool,
               llm_api_options: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
               block_bytes: int | None = None) -> list[Check]:
    """Every check, in order. The settings are read by the loaders start-up itself uses (the
    leader's and the workers'), so a value start-up would refuse fails here too: the publisher
    name against the registered entry points, the disk directory (a file, or a directory that
    cannot be created or written), every number, switch and endpoint. ``llm_api_options``:
    the engine's options file, read for TensorRT-LLM's own KV-event publisher."""
    from kvbm_plugin._util.plugins import PluginLoadError

    checks: list[Check] = []
    options: Any = None
    trtllm_pub: TrtllmPublisher | None = None
    env: Any = os.environ  # with DYN_KVBM_KV_EVENTS_TRTLLM_MOVED_ENDPOINT: the leader's view
    if llm_api_options is not None:
        try:
            options = read_llm_api_options(llm_api_options)
            trtllm_pub, env, _ = take_yaml_endpoint(options, os.environ, num_ranks > 1, num_ranks)
        except cc.ConfigError as exc:
            checks.append(Check("LLM-API options", "fail", str(exc)))
    host = (os.environ.get(cc.LEADER_ZMQ_HOST) or "127.0.0.1").strip()
    streams = tuple(s for r in range(num_ranks) for s in trtllm_streams(trtllm_pub, r, host))
    try:
        # --num-ranks counts attention-DP ranks: there each rank's consolidator reads rank 0's
        # stream of it, so the GPU-tier endpoint is needed (one leader hands its own over)
        config = cc.load_consolidator_config(env, num_ranks=num_ranks, gpu_streams=streams,
                                             attention_dp=num_ranks > 1)
        checks.append(Check("consolidator config", "ok",
                            f"enabled={config.enabled} mode={config.mode} ranks={num_ranks}"))
    except (cc.ConfigError, PluginLoadError) as exc:
        config = None
        checks.append(Check("consolidator config", "fail", str(exc)))
    # The event source has its own check below (what it means, not only its value).
    tiers: cc.TierSettings | None = None
    for name, loader in (("publisher settings", cc.load_publisher_settings),
                         ("tier settings", cc.load_tier_settings),
                         ("metrics settings", cc.load_metrics_settings),
                         ("Dynamo STREAMING takeover", load_moved_endpoint)):
        try:
            value = loader()
            checks.append(Check(name, "ok", repr(value)))
            if isinstance(value, cc.TierSettings):
                tiers = value
        except (cc.ConfigError, PluginLoadError) as exc:
            checks.append(Check(name, "fail", str(exc)))
    if tiers is not None:
        checks.extend(_tier_checks(tiers, block_bytes))
    checks.append(bounded_shared_check(timeout_s))
    checks.extend(_shared_needs_host(tiers))
    if config is not None:
        try:
            metrics = cc.load_metrics_settings()
        except cc.ConfigError:
            metrics = cc.MetricsSettings()
        checks.extend(_endpoint_checks(config, metrics))

    checks.append(_events_source_check(trtllm_pub))
    checks.append(_gpu_source_check(config, trtllm_pub, options, num_ranks))

    from kvbm_plugin._util import compiled as _compiled

    try:
        in_use, detail = _compiled.describe()
        checks.append(Check("compiled loops", "ok" if in_use else "warn", detail))
    except cc.ConfigError as exc:
        checks.append(Check("compiled loops", "fail", str(exc)))

    from kvbm_plugin.wire import conn_gate

    compiled_gate, detail = conn_gate.describe()
    checks.append(Check("connection gate", "ok" if compiled_gate else "warn", detail))

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
    from kvbm_plugin.cli.main import ArgumentParser

    parser = ArgumentParser(prog="kvbm-plugin doctor",
                                     description="Check env vars, ports, TensorRT-LLM, torch/CUDA "
                                                 "and entry points; exit 1 on a problem.")
    parser.add_argument("--num-ranks", type=int, default=1,
                        help="attention-DP ranks whose ports to check (default 1)")
    parser.add_argument("--require-trtllm", action="store_true",
                        help="treat a missing TensorRT-LLM as a failure")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--llm-api-options", metavar="PATH",
                        help="the engine's LLM-API options (YAML/JSON, as trtllm-serve "
                             "--extra_llm_api_options): read for TensorRT-LLM's own KV-event "
                             "publisher (kv_cache_config.kv_events_config)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help="the longest the shared tier's store may take to answer "
                             "(default %(default)g)")
    parser.add_argument("--block-bytes", type=int, default=None, metavar="N",
                        help="the engine's KV bytes per block and rank: tiers sized in GiB "
                             "are checked to hold at least one (default: only a size under "
                             "1 MiB fails)")
    args = parser.parse_args(argv)
    if args.num_ranks < 1:
        parser.error(f"argument --num-ranks: {args.num_ranks} must be >= 1")
    if not args.timeout > 0:
        parser.error(f"argument --timeout: {args.timeout:g} must be > 0 seconds")
    if args.block_bytes is not None and args.block_bytes < 1:
        parser.error(f"argument --block-bytes: {args.block_bytes} must be >= 1")
    checks = run_checks(args.num_ranks, args.require_trtllm, args.llm_api_options,
                        timeout_s=args.timeout, block_bytes=args.block_bytes)
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

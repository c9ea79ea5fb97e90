"""``kvbm-plugin doctor``'s shared-tier check, bounded in time.

:func:`shared_check` reads the shared tier's settings the way start-up does, opens a client of
the store (no segment of this machine's memory) and asks what it reports. A store client can
wait without end: Mooncake's ``setup`` on an address where something accepts connections and
never answers waits as long as that peer keeps the connection open (issue 27: still running at
180 s). So :func:`bounded_shared_check` runs it in a child interpreter (``python -m
kvbm_plugin.cli.doctor_shared``) and kills it after ``timeout_s``: the only bound that holds
for a call inside a C++ client, which no thread can interrupt. The child's stderr (Mooncake's
glog lines) is shown only when it fails. Called by ``doctor`` on the CLI's thread.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.settings.shared import SharedSettings, load_shared_settings

#: What ``doctor --timeout`` defaults to: a master that answers sets up a client in well
#: under a second; Redis clients give up after their own 1 s connect / 5 s socket timeouts.
DEFAULT_TIMEOUT_S = 10.0


@dataclass
class Check:
    name: str
    status: str  # "ok" | "warn" | "fail"
    detail: str


def mooncake_summary(metrics_address: str) -> str:
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


def _segment_problem(settings: SharedSettings) -> str | None:
    """Mooncake's segment: 0 (none) or 16 MiB .. 1 TiB, as every worker's client sets it up
    (the doctor's own client mounts none, so its setup would not find out)."""
    from kvbm_plugin.tiers.shared.mooncake import MAX_SEGMENT_BYTES, MIN_SEGMENT_BYTES

    size = settings.segment_bytes
    if size == 0 or MIN_SEGMENT_BYTES <= size <= MAX_SEGMENT_BYTES:
        return None
    given = os.environ.get(cc.SHARED_SEGMENT_GB, "")
    return (f"{cc.SHARED_SEGMENT_GB}={given!r} is {size} bytes: Mooncake takes 0 (no segment) "
            "or 16 MiB .. 1 TiB (0.015625 .. 1024); start-up refuses it")


def _settings() -> SharedSettings | Check:
    """The shared-tier settings, or the check that ends doctor's look at the tier here: a
    settings problem, or the tier off."""
    try:
        settings = load_shared_settings()
    except cc.ConfigError as exc:
        return Check("shared tier", "fail", str(exc))
    if settings is None:
        return Check("shared tier", "ok", f"off ({cc.SHARED_TIER} unset)")
    return settings


def shared_check() -> Check:
    """The shared tier, when configured: its settings, the store reachable (a client of it
    connected and asked, with no segment of this machine's memory), and what it reports.
    Unbounded in time: see :func:`bounded_shared_check`."""
    settings = _settings()
    if isinstance(settings, Check):
        return settings
    from kvbm_plugin._util.plugins import PluginLoadError
    from kvbm_plugin.tiers.shared.factory import store_class

    name = f"shared tier ({settings.store})"
    try:
        cls = store_class(settings.store)
        if settings.store == "mooncake":
            from kvbm_plugin.tiers.shared.mooncake import apply_mooncake_config

            settings = apply_mooncake_config(settings)
            problem = _segment_problem(settings)
            if problem is not None:
                return Check(name, "fail", problem)
            settings = dataclasses.replace(settings, segment_bytes=0, buffer_bytes=0)
        store = cls(settings)
    except (cc.ConfigError, PluginLoadError) as exc:
        return Check(name, "fail", str(exc))
    try:
        return _report(name, settings, store)
    finally:
        store.close()


def _report(name: str, settings: SharedSettings, store: object) -> Check:
    problem = store.health()  # type: ignore[attr-defined]
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
            report = mooncake_summary(settings.metrics_address)
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


def bounded_shared_check(timeout_s: float = DEFAULT_TIMEOUT_S) -> Check:
    """:func:`shared_check` in a child interpreter killed after ``timeout_s``. Settings
    problems and "off" are found here without a child."""
    settings = _settings()
    if isinstance(settings, Check):
        return settings
    name = f"shared tier ({settings.store})"
    env = dict(os.environ)
    env.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's glog: errors only
    proc = subprocess.Popen([sys.executable, "-m", "kvbm_plugin.cli.doctor_shared"],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return Check(name, "fail", f"{cc.SHARED_ADDRESS}={settings.address!r}: no answer "
                     f"within {timeout_s:g} s (doctor --timeout): something there accepts "
                     f"connections but does not answer as a {settings.store} server, or is "
                     "too slow; check the address and the server")
    try:
        return Check(**json.loads(out.strip().splitlines()[-1]))
    except (IndexError, ValueError, TypeError):
        last = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        return Check(name, "fail", f"the store check died: {last[:300]}")


if __name__ == "__main__":
    print(json.dumps(asdict(shared_check())), flush=True)

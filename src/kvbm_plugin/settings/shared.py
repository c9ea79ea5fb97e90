"""The shared tier's settings (DYN_KVBM_SHARED_*), read and validated in one place.

The variables themselves are in :data:`kvbm_plugin.settings.variables.ENV_VARS` with every
other one. Read by the leader's and every worker's constructor and by ``kvbm-plugin doctor``,
on the calling thread. Standard library only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from kvbm_plugin.settings.values import (
    ENDPOINT_SCHEMES,
    FALSE_WORDS,
    ConfigError,
    parse_float,
    parse_int,
)
from kvbm_plugin.settings.variables import (
    SHARED_ADDRESS,
    SHARED_ANNOUNCE_ENDPOINT,
    SHARED_ANNOUNCE_RATE,
    SHARED_ANNOUNCE_SECRET_FILE,
    SHARED_BUFFER_GB,
    SHARED_DEVICE,
    SHARED_LEASE_S,
    SHARED_LOAD_MARGIN_S,
    SHARED_LOCAL_HOSTNAME,
    SHARED_METADATA_SERVER,
    SHARED_METRICS_ADDRESS,
    SHARED_MODEL_KEY,
    SHARED_NAMESPACE,
    SHARED_PEERS,
    SHARED_PROTOCOL,
    SHARED_QUEUE_BLOCKS,
    SHARED_SEGMENT_GB,
    SHARED_TIER,
    SHARED_TRACKED_BLOCKS,
    env_value,
)


@dataclass(frozen=True)
class SharedSettings:
    """The shared tier (G4): which store, where, and the names every key carries.

    Read by the leader (directory, announcements) and by every worker (its store client)."""

    store: str  # entry-point name in kvbm_plugin.tiers (mooncake, redis)
    model_key: str
    namespace: str = "kvbm"
    address: str = ""
    protocol: str = "tcp"
    device: str = ""
    metadata_server: str = "P2PHANDSHAKE"
    metrics_address: str = ""  # Mooncake master's HTTP metrics host:port; "" = not known
    local_hostname: str = ""  # "" = the local address that reaches the master
    segment_bytes: int = 1 << 30
    buffer_bytes: int = 1 << 28
    peers: tuple[str, ...] = ()
    announce_endpoint: str | None = None  # None: tcp://LEADER_ZMQ_HOST:(leader port + 2000)
    tracked_blocks: int = 100000
    queue_blocks: int = 1024
    lease_s: float = 10.0
    load_margin_s: float = 3.0
    # The announcement secret (DYN_KVBM_SHARED_ANNOUNCE_SECRET_FILE's content); None: this
    # engine neither announces nor hears. Never in a repr (logs, tracebacks).
    announce_secret: bytes | None = field(default=None, repr=False)
    announce_rate: float = 20000.0  # blocks per second heard from one peer, at most


# An announcement secret: at least 256 bits; a file much larger is not a secret file.
SECRET_MIN_BYTES: Final = 32
SECRET_MAX_BYTES: Final = 4096


def read_announce_secret(path: str) -> bytes:
    """The secret in the file ``path`` (surrounding whitespace stripped, so that
    ``head -c 32 /dev/urandom | base64 > FILE`` works); ConfigError naming
    DYN_KVBM_SHARED_ANNOUNCE_SECRET_FILE and the path when it cannot be read or is too short
    or too long."""
    name = SHARED_ANNOUNCE_SECRET_FILE
    try:
        with open(path, "rb") as f:
            data = f.read(SECRET_MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{name}={path!r}: cannot read it ({exc.strerror or exc})") from None
    secret = data.strip()
    if len(data) > SECRET_MAX_BYTES:
        raise ConfigError(f"{name}={path!r}: more than {SECRET_MAX_BYTES} bytes; expected a "
                          f"secret of {SECRET_MIN_BYTES}+ bytes (e.g. head -c 32 /dev/urandom "
                          "| base64 > FILE)")
    if len(secret) < SECRET_MIN_BYTES:
        raise ConfigError(f"{name}={path!r}: holds {len(secret)} bytes, at least "
                          f"{SECRET_MIN_BYTES} are needed (e.g. head -c 32 /dev/urandom | "
                          "base64 > FILE)")
    return secret


# Key parts are joined with "/": a model key or namespace must not contain one.
_KEY_PART = re.compile(r"[A-Za-z0-9._:@+=-]{1,200}")


def load_shared_settings(env: Mapping[str, str] | None = None) -> SharedSettings | None:
    """The shared tier's settings, or None when DYN_KVBM_SHARED_TIER is unset; raises
    ConfigError naming the variable and value (a shared tier without a model key included)."""
    env = os.environ if env is None else env
    store = (env_value(env, SHARED_TIER) or "").strip().lower()
    if not store or store in FALSE_WORDS:
        return None

    def part(name: str) -> str:
        value = (env_value(env, name) or "").strip()
        if not _KEY_PART.fullmatch(value):
            raise ConfigError(f"{name}={env.get(name)!r}: expected 1-200 characters of "
                              "A-Z a-z 0-9 . _ : @ + = - (it is part of every shared-tier key)")
        return value

    if env_value(env, SHARED_MODEL_KEY) is None:
        raise ConfigError(f"{SHARED_TIER}={env.get(SHARED_TIER)!r} needs {SHARED_MODEL_KEY}: a "
                          "name for the model and its weights (e.g. llama-3.1-8b-instruct@rev), "
                          "so that engines of another model never load these blocks")
    peers = tuple(p.strip() for p in (env_value(env, SHARED_PEERS) or "").split(",") if p.strip())
    for peer in peers:
        if not peer.startswith(ENDPOINT_SCHEMES):
            raise ConfigError(f"{SHARED_PEERS}={env.get(SHARED_PEERS)!r}: {peer!r} is not a "
                              "tcp://, ipc:// or inproc:// endpoint")
    lease = parse_float(SHARED_LEASE_S, env_value(env, SHARED_LEASE_S) or "")
    margin = parse_float(SHARED_LOAD_MARGIN_S, env_value(env, SHARED_LOAD_MARGIN_S) or "")
    if not 0 < margin < lease:
        raise ConfigError(f"{SHARED_LOAD_MARGIN_S}={margin!r} must be above 0 and below "
                          f"{SHARED_LEASE_S}={lease!r}")
    announce = env_value(env, SHARED_ANNOUNCE_ENDPOINT)
    secret_path = (env_value(env, SHARED_ANNOUNCE_SECRET_FILE) or "").strip()
    secret = read_announce_secret(secret_path) if secret_path else None
    if peers and secret is None:
        raise ConfigError(f"{SHARED_PEERS}={env.get(SHARED_PEERS)!r} needs "
                          f"{SHARED_ANNOUNCE_SECRET_FILE}: a file with the secret every engine "
                          "signs its announcements with (the same file on every engine; e.g. "
                          "head -c 32 /dev/urandom | base64 > FILE)")
    rate = parse_float(SHARED_ANNOUNCE_RATE, env_value(env, SHARED_ANNOUNCE_RATE) or "")
    if rate <= 0:
        raise ConfigError(f"{SHARED_ANNOUNCE_RATE}={env.get(SHARED_ANNOUNCE_RATE)!r} must be "
                          "above 0 (blocks per second per peer)")
    if announce is not None and not announce.strip().startswith(ENDPOINT_SCHEMES):
        raise ConfigError(f"{SHARED_ANNOUNCE_ENDPOINT}={announce!r} is not a tcp://, ipc:// or "
                          "inproc:// endpoint")
    return SharedSettings(
        store=store,
        model_key=part(SHARED_MODEL_KEY),
        namespace=part(SHARED_NAMESPACE),
        address=(env_value(env, SHARED_ADDRESS) or "").strip(),
        protocol=(env_value(env, SHARED_PROTOCOL) or "tcp").strip(),
        device=(env_value(env, SHARED_DEVICE) or "").strip(),
        metadata_server=(env_value(env, SHARED_METADATA_SERVER) or "P2PHANDSHAKE").strip(),
        metrics_address=(env_value(env, SHARED_METRICS_ADDRESS) or "").strip(),
        local_hostname=(env_value(env, SHARED_LOCAL_HOSTNAME) or "").strip(),
        segment_bytes=int(parse_float(SHARED_SEGMENT_GB, env_value(env, SHARED_SEGMENT_GB) or "")
                          * (1 << 30)),
        buffer_bytes=int(parse_float(SHARED_BUFFER_GB, env_value(env, SHARED_BUFFER_GB) or "")
                         * (1 << 30)),
        peers=peers,
        announce_endpoint=announce.strip() if announce else None,
        tracked_blocks=parse_int(SHARED_TRACKED_BLOCKS, env_value(env, SHARED_TRACKED_BLOCKS) or "",
                                 minimum=1),
        queue_blocks=parse_int(SHARED_QUEUE_BLOCKS, env_value(env, SHARED_QUEUE_BLOCKS) or "",
                               minimum=1),
        lease_s=lease,
        load_margin_s=margin,
        announce_secret=secret,
        announce_rate=rate,
    )

"""Every environment variable kvbm_plugin reads, parsed and validated in one place.

``ENV_VARS`` is the single source of truth: the code reads variables only through it, the
table in docs/operations.md is checked against it by a test, and ``kvbm-plugin env`` prints it.

Nothing here imports torch or TensorRT-LLM; it runs at CLI start-up and in the leader's
constructor.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal

from kvbm_plugin.setting_values import ENDPOINT_SCHEMES as ENDPOINT_SCHEMES
from kvbm_plugin.setting_values import FALSE_WORDS as FALSE_WORDS
from kvbm_plugin.setting_values import TRUE_WORDS as TRUE_WORDS
from kvbm_plugin.setting_values import ConfigError as ConfigError
from kvbm_plugin.setting_values import Endpoint as Endpoint
from kvbm_plugin.setting_values import parse_bool as parse_bool
from kvbm_plugin.setting_values import parse_endpoint as parse_endpoint
from kvbm_plugin.setting_values import parse_float as parse_float
from kvbm_plugin.setting_values import parse_int as parse_int
from kvbm_plugin.setting_values import parse_port as parse_port

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its name, its default (None = unset) and what it means."""

    name: str
    default: str | None
    meaning: str
    group: str


# Entry-point groups through which publishers and offload tiers are registered (pyproject.toml).
PUBLISHERS_GROUP: Final = "kvbm_plugin.publishers"
TIERS_GROUP: Final = "kvbm_plugin.tiers"

ENABLE_CONSOLIDATOR = "DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR"
CONSOLIDATOR_MODE = "DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE"
TRTLLM_ZMQ_PORT = "DYN_KVBM_TRTLLM_ZMQ_PORT"
LEADER_ZMQ_PUB_PORT = "DYN_KVBM_LEADER_ZMQ_PUB_PORT"
LEADER_ZMQ_HOST = "DYN_KVBM_LEADER_ZMQ_HOST"
EVENTS_ENDPOINT = "DYN_KVBM_KV_EVENTS_ENDPOINT"
REPLAY_ENDPOINT = "DYN_KVBM_KV_EVENTS_REPLAY_ENDPOINT"
OUTPUT_ENDPOINT = "DYN_KVBM_KV_EVENTS_OUTPUT_ENDPOINT"
OUTPUT_REPLAY_ENDPOINT = "DYN_KVBM_KV_EVENTS_OUTPUT_REPLAY_ENDPOINT"
PUBLISHER = "DYN_KVBM_KV_EVENTS_PUBLISHER"
BUFFER_STEPS = "DYN_KVBM_KV_EVENTS_BUFFER_STEPS"
BUFFER_BYTES = "DYN_KVBM_KV_EVENTS_BUFFER_BYTES"
HWM = "DYN_KVBM_KV_EVENTS_HWM"
MAX_QUEUE_SIZE = "DYN_KVBM_KV_EVENTS_MAX_QUEUE_SIZE"
TOPIC = "DYN_KVBM_KV_EVENTS_TOPIC"
SALT_FORM = "DYN_KVBM_KV_EVENTS_SALT_FORM"
LORA_NAMES = "DYN_KVBM_LORA_NAMES"
OUTPUT_REPLAY_ROLLED = "DYN_KVBM_KV_EVENTS_OUTPUT_REPLAY_ROLLED"
WINDOW_SIZE = "DYN_KVBM_KV_EVENTS_WINDOW_SIZE"
ZMQ_ALLOW = "DYN_KVBM_ZMQ_ALLOW"
ZMQ_MAX_PEERS = "DYN_KVBM_ZMQ_MAX_PEERS"
CPU_CACHE_GB = "DYN_KVBM_CPU_CACHE_GB"
CPU_CACHE_NUM_BLOCKS = "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS"
DISK_CACHE_GB = "DYN_KVBM_DISK_CACHE_GB"
DISK_CACHE_NUM_BLOCKS = "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS"
DISK_CACHE_DIR = "DYN_KVBM_DISK_CACHE_DIR"
HOST_TIER = "DYN_KVBM_HOST_TIER"
DISK_TIER = "DYN_KVBM_DISK_TIER"
METRICS = "DYN_KVBM_METRICS"
METRICS_PORT = "DYN_KVBM_METRICS_PORT"
NATIVE = "DYN_KVBM_NATIVE"
EVENTS_SOURCE = "DYN_KVBM_KV_EVENTS_SOURCE"
TRTLLM_MOVED_ENDPOINT = "DYN_KVBM_KV_EVENTS_TRTLLM_MOVED_ENDPOINT"
SHARED_TIER = "DYN_KVBM_SHARED_TIER"
SHARED_MODEL_KEY = "DYN_KVBM_SHARED_MODEL_KEY"
SHARED_NAMESPACE = "DYN_KVBM_SHARED_NAMESPACE"
SHARED_ADDRESS = "DYN_KVBM_SHARED_ADDRESS"
SHARED_PROTOCOL = "DYN_KVBM_SHARED_PROTOCOL"
SHARED_DEVICE = "DYN_KVBM_SHARED_DEVICE"
SHARED_METADATA_SERVER = "DYN_KVBM_SHARED_METADATA_SERVER"
SHARED_METRICS_ADDRESS = "DYN_KVBM_SHARED_METRICS_ADDRESS"
SHARED_LOCAL_HOSTNAME = "DYN_KVBM_SHARED_LOCAL_HOSTNAME"
SHARED_SEGMENT_GB = "DYN_KVBM_SHARED_SEGMENT_GB"
SHARED_BUFFER_GB = "DYN_KVBM_SHARED_BUFFER_GB"
SHARED_PEERS = "DYN_KVBM_SHARED_PEERS"
SHARED_ANNOUNCE_ENDPOINT = "DYN_KVBM_SHARED_ANNOUNCE_ENDPOINT"
SHARED_ANNOUNCE_SECRET_FILE = "DYN_KVBM_SHARED_ANNOUNCE_SECRET_FILE"
SHARED_ANNOUNCE_RATE = "DYN_KVBM_SHARED_ANNOUNCE_RATE"
SHARED_TRACKED_BLOCKS = "DYN_KVBM_SHARED_TRACKED_BLOCKS"
SHARED_QUEUE_BLOCKS = "DYN_KVBM_SHARED_QUEUE_BLOCKS"
SHARED_LEASE_S = "DYN_KVBM_SHARED_LEASE_S"
SHARED_LOAD_MARGIN_S = "DYN_KVBM_SHARED_LOAD_MARGIN_S"
MOONCAKE_CONFIG_PATH = "MOONCAKE_CONFIG_PATH"

ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(ENABLE_CONSOLIDATOR, "true", "Run the de-duplicating consolidator in the leader "
           "(1/true/on/yes or 0/false/off/no).", "consolidator"),
    EnvVar(CONSOLIDATOR_MODE, "dedup", "`dedup`: a block is stored once while any tier holds it; "
           "`passthrough`: every tier's events forwarded with their own medium.", "consolidator"),
    EnvVar(TRTLLM_ZMQ_PORT, None, "Base TCP port of the per-rank GPU-tier publishers (rank r "
           "binds base + r). Required under attention DP with the consolidator on, unless "
           f"{EVENTS_ENDPOINT} is set; unset otherwise, no GPU-tier stream leaves the "
           "process (the consolidated output still carries the GPU tier).", "consolidator"),
    EnvVar(LEADER_ZMQ_PUB_PORT, "56001", "KVBM leader port; the consolidated output binds "
           "this + 1000 (attention-DP rank r: + 1000 + r).", "consolidator"),
    EnvVar(LEADER_ZMQ_HOST, "127.0.0.1", "Host the consolidator and the TP workers connect to; "
           "sockets given by a bare port bind it (default: loopback only; tcp://*:PORT listens on "
           "every interface).", "consolidator"),
    EnvVar(EVENTS_ENDPOINT, None, "Base endpoint of the GPU-tier publishers instead of "
           f"{TRTLLM_ZMQ_PORT}: tcp://host:port, ipc://path or inproc://name (rank r: port + r, "
           "or suffix _dp{r}).", "consolidator"),
    EnvVar(REPLAY_ENDPOINT, None, "Base endpoint of the GPU-tier replay ROUTER sockets "
           "(same per-rank rule); unset = no replay.", "consolidator"),
    EnvVar(OUTPUT_ENDPOINT, None, "Endpoint of the consolidated output instead of "
           f"{LEADER_ZMQ_PUB_PORT} + 1000 (attention-DP rank r: port + r, or suffix _dp{{r}}).",
           "consolidator"),
    EnvVar(OUTPUT_REPLAY_ENDPOINT, None, "Replay ROUTER endpoint of the consolidated output; "
           "unset = no replay.", "consolidator"),
    EnvVar(OUTPUT_REPLAY_ROLLED, "oldest", "What the consolidated output's replay answers when "
           "the requested start has left the buffer: `oldest`, every batch still buffered "
           "(Dynamo applies them); `empty`, the end marker alone (llm-d then applies the live "
           "stream, instead of resetting and dropping it while the buffer has rolled).",
           "consolidator"),
    EnvVar(PUBLISHER, "zmq", "Event transport, by name in the kvbm_plugin.publishers entry "
           "points (zmq, null).", "publisher"),
    EnvVar(BUFFER_STEPS, "10000", "Batches kept for replay.", "publisher"),
    EnvVar(BUFFER_BYTES, str(16 << 20), "Payload bytes kept for replay, at most (the oldest "
           "batches leave first; the newest batch is always kept): bounds the replay "
           "buffer's heap whatever the batches' size.", "publisher"),
    EnvVar(HWM, "100000", "ZMQ send high-water mark (messages).", "publisher"),
    EnvVar(MAX_QUEUE_SIZE, "100000", "Batches queued for a publisher thread, where the "
           "publisher sends on one (only where libzmq cannot be called keeping the GIL; by "
           "default batches are sent on the engine thread and nothing is queued); a full queue "
           "loses a batch visibly (seq gap, counted).", "publisher"),
    EnvVar(TOPIC, "", "ZMQ topic frame of every message; for llm-d `kv@<pod>@<model>` (see "
           "\"llm-d\" above); `{dp_rank}` in it becomes each attention-DP rank's number (one "
           "output per rank: `kvbm-plugin consolidate --num-ranks` > 1 refuses it).",
           "publisher"),
    EnvVar(SALT_FORM, "client", "How the consolidated output names a salted block: `client`: "
           "the salt string the request carried, as a top-level `cache_salt` (Dynamo) and in "
           "the first block's `extra_keys` (llm-d, vLLM); `id`: `dynamo-cache-salt:<16 hex of "
           "the salt id>` in every block's `extra_keys` (see \"Cache salts and adapter "
           "names\" above).",
           "publisher"),
    EnvVar(LORA_NAMES, None, "The names requests use for LoRA adapters, `<task id>=<name>,...`: "
           "the consolidated output's `lora_name` (Dynamo and llm-d key an adapter's blocks by "
           "it); an adapter not named keeps `lora-<task id>` (so that name is refused for another "
           "task id).", "publisher"),
    EnvVar(WINDOW_SIZE, None, "Attention window whose events are published (sliding-window "
           "models); unset = the largest window.", "publisher"),
    EnvVar(ZMQ_ALLOW, None, "Comma-separated IP addresses admitted (ZAP, at each handshake) "
           "to every tcp socket the plugin binds; unset = whoever reaches the bind address.",
           "publisher"),
    EnvVar(ZMQ_MAX_PEERS, "64", "Connections each bound publishing or replay socket keeps; "
           "more are cut at once (bounds what outsiders make it hold).", "publisher"),
    EnvVar(CPU_CACHE_GB, None, "Host-memory (G2) tier size in GiB.", "tiers"),
    EnvVar(CPU_CACHE_NUM_BLOCKS, None, "Host tier size in blocks (overrides the GiB size).",
           "tiers"),
    EnvVar(DISK_CACHE_GB, None, "Disk (G3) tier size in GiB.", "tiers"),
    EnvVar(DISK_CACHE_NUM_BLOCKS, None, "Disk tier size in blocks (overrides the GiB size).",
           "tiers"),
    EnvVar(DISK_CACHE_DIR, None, "Disk tier directory; unset = a temporary directory removed "
           "at exit.", "tiers"),
    EnvVar(HOST_TIER, "host", "Host tier implementation, by name in the kvbm_plugin.tiers "
           "entry points (a tiers.host.HostTier subclass).", "tiers"),
    EnvVar(DISK_TIER, "disk", "Disk tier implementation, by name in the kvbm_plugin.tiers "
           "entry points (a tiers.base.OffloadTier subclass).", "tiers"),
    EnvVar(METRICS, "false", "Serve Prometheus metrics (1/true/on/yes).", "metrics"),
    EnvVar(METRICS_PORT, "6880", "Prometheus metrics port.", "metrics"),
    EnvVar(NATIVE, "true", "Use the compiled loops (the C extensions) where they were built at "
           "install (1/true/on/yes); 0/false/off/no runs the pure-Python reference loops.",
           "runtime"),
    EnvVar(EVENTS_SOURCE, "auto", "Where the leader gets GPU-tier events: `auto` drains "
           "TRT-LLM's KV-event buffer until another reader (LLM.get_kv_cache_events, "
           "/kv_cache_events, Dynamo's publisher) shows up, then only taps what that reader "
           "drains; `drain` the same, warning when another reader appears (two drainers "
           "split the stream); `tap` never drains (copies what others read); "
           "`off` publishes none (sidecar or another publisher serves them). V2 hooks never "
           "drain.", "publisher"),
    EnvVar(TRTLLM_MOVED_ENDPOINT, None, "For Dynamo's STREAMING mode: move TensorRT-LLM's own "
           "publisher (kv_cache_config.kv_events_config) to this endpoint (its rank r by "
           "TensorRT-LLM's rule) and bind the consolidated output at the endpoint and topic the "
           "YAML names, which Dynamo relays per rank (+ r). Unset: nothing moved.", "runtime"),
    EnvVar(SHARED_TIER, None, "Shared tier (G4) behind the host tier, by name in the "
           "kvbm_plugin.tiers entry points (mooncake, redis); unset = none.", "shared tier"),
    EnvVar(SHARED_MODEL_KEY, None, "Names the model (and its weights) in every shared-tier "
           "key; required with a shared tier: engines share blocks only under the same key.",
           "shared tier"),
    EnvVar(SHARED_NAMESPACE, "kvbm", "First part of every shared-tier key.", "shared tier"),
    EnvVar(SHARED_ADDRESS, None, "The store: Mooncake master host:port, or a Redis URL "
           "(redis://host:port, unix:///path). Required unless "
           f"{MOONCAKE_CONFIG_PATH} names it.", "shared tier"),
    EnvVar(SHARED_PROTOCOL, "tcp", "Mooncake transfer protocol (tcp, rdma).", "shared tier"),
    EnvVar(SHARED_DEVICE, "", "Mooncake RDMA device names (protocol rdma).", "shared tier"),
    EnvVar(SHARED_METADATA_SERVER, "P2PHANDSHAKE", "Mooncake metadata server "
           "(P2PHANDSHAKE needs none).", "shared tier"),
    EnvVar(SHARED_METRICS_ADDRESS, None, "The Mooncake master's HTTP metrics host:port (its "
           "-metrics_port): health checks and `doctor` read /health and /metrics/summary "
           "there; unset = the client's own health check only.", "shared tier"),
    EnvVar(SHARED_LOCAL_HOSTNAME, None, "The address other engines reach this process's "
           "Mooncake segment at; unset = the local address this host uses to reach the "
           "master.", "shared tier"),
    EnvVar(SHARED_SEGMENT_GB, "1", "GiB of this process's memory each worker contributes to "
           "the Mooncake pool (0 = none).", "shared tier"),
    EnvVar(SHARED_BUFFER_GB, "0.25", "GiB of each worker's Mooncake transfer buffer.",
           "shared tier"),
    EnvVar(SHARED_PEERS, "", "Comma-separated announcement endpoints of the other engines "
           "sharing the store: their writes become loadable here.", "shared tier"),
    EnvVar(SHARED_ANNOUNCE_ENDPOINT, None, "Where this leader announces its shared-tier "
           f"writes; unset = {LEADER_ZMQ_PUB_PORT} + 2000.", "shared tier"),
    EnvVar(SHARED_ANNOUNCE_SECRET_FILE, None, "File holding the deployment's announcement "
           "secret (at least 32 bytes, the same on every engine): every announcement is signed "
           "with it (HMAC-SHA256) and unsigned ones are dropped. Required with "
           f"{SHARED_PEERS}; unset = this engine announces nothing.", "shared tier"),
    EnvVar(SHARED_ANNOUNCE_RATE, "20000", "Announced blocks per second heard from one peer, at "
           "most (twice that in a burst); more are dropped (counted).", "shared tier"),
    EnvVar(SHARED_TRACKED_BLOCKS, "100000", "Shared-tier blocks the leader tracks, keeps "
           "leased and advertises (least recently used dropped first).", "shared tier"),
    EnvVar(SHARED_QUEUE_BLOCKS, "1024", "Shared-tier writes a worker queues; more are dropped "
           "(counted).", "shared tier"),
    EnvVar(SHARED_LEASE_S, "10", "How long the store keeps a block after a read "
           "(Mooncake's -default_kv_lease_ttl, in s); leases are renewed well within it.",
           "shared tier"),
    EnvVar(SHARED_LOAD_MARGIN_S, "3", "A shared block is offered only while its lease has at "
           "least this long (s) to run.", "shared tier"),
    EnvVar(MOONCAKE_CONFIG_PATH, None, "Mooncake client JSON (the file TensorRT-LLM's and "
           "vLLM's Mooncake connectors read); its values fill the unset DYN_KVBM_SHARED_* "
           "variables.", "shared tier"),
)
ENV_VARS_BY_NAME: dict[str, EnvVar] = {var.name: var for var in ENV_VARS}

# Dynamo's KV-cache connector module, which reads the same variables.
DYNAMO_CONNECTOR_MODULE = "kvbm.trtllm_integration.connector"
PLUGIN_MODULE = "kvbm_plugin"

ConsolidatorMode = Literal["dedup", "passthrough"]
_MODES: tuple[ConsolidatorMode, ...] = ("dedup", "passthrough")


def env_value(env: Mapping[str, str], name: str) -> str | None:
    """The variable's value, or its default when unset or empty."""
    value = env.get(name)
    if value is None or value.strip() == "":
        return ENV_VARS_BY_NAME[name].default
    return value


@dataclass(frozen=True)
class PublisherSettings:
    """How a publisher queues, buffers and frames batches (vLLM's defaults; ``buffer_bytes``,
    a byte bound on the replay buffer, is this project's)."""

    kind: str = "zmq"
    buffer_steps: int = 10000
    buffer_bytes: int = 16 << 20  # payload bytes kept for replay, at most
    hwm: int = 100000
    max_queue_size: int = 100000
    topic: str = ""
    window_size: int | None = None
    allow: tuple[str, ...] = ()  # IP addresses admitted to the bound tcp sockets; () = any
    max_peers: int = 64  # connections each publishing or replay socket keeps
    salt_form: str = "client"  # how the consolidated output names a salt (wire.router_forms)
    lora_names: tuple[tuple[int, str], ...] = ()  # (task id, the adapter's name) pairs
    output_replay_rolled: str = "oldest"  # the consolidated output's answer to a rolled start


@dataclass(frozen=True)
class TierSettings:
    """Offload tier sizes; blocks override GiB; nothing set = no tier."""

    cpu_cache_gb: float = 0.0
    cpu_num_blocks: int | None = None
    disk_cache_gb: float = 0.0
    disk_num_blocks: int | None = None
    disk_cache_dir: str | None = None
    host_tier: str = "host"  # kvbm_plugin.tiers entry point names (tiers/selection.py)
    disk_tier: str = "disk"

    @property
    def host_enabled(self) -> bool:
        return bool(self.cpu_num_blocks) or self.cpu_cache_gb > 0

    @property
    def disk_enabled(self) -> bool:
        return bool(self.disk_num_blocks) or self.disk_cache_gb > 0

    def host_blocks(self, bytes_per_block: int) -> int:
        return _blocks(self.cpu_num_blocks, self.cpu_cache_gb, bytes_per_block, CPU_CACHE_GB,
                       CPU_CACHE_NUM_BLOCKS)

    def disk_blocks(self, bytes_per_block: int) -> int:
        return _blocks(self.disk_num_blocks, self.disk_cache_gb, bytes_per_block, DISK_CACHE_GB,
                       DISK_CACHE_NUM_BLOCKS)


def _blocks(override: int | None, gib: float, bytes_per_block: int, gib_name: str,
            blocks_name: str) -> int:
    if override:
        return override
    blocks = int(gib * (1 << 30)) // max(1, bytes_per_block)
    if gib > 0 and blocks == 0:
        raise ConfigError(f"{gib_name}={gib!r} is smaller than one KV block ({bytes_per_block} "
                          f"bytes); raise it or set {blocks_name}")
    return blocks


@dataclass(frozen=True)
class MetricsSettings:
    enabled: bool = False
    port: int = 6880


@dataclass(frozen=True)
class ConsolidatorConfig:
    """Where every rank publishes, where the consolidator listens and publishes, and how."""

    enabled: bool
    mode: ConsolidatorMode
    num_ranks: int
    gpu_events: Endpoint | None  # base of the per-rank GPU-tier publishers
    gpu_replay: Endpoint | None
    output: Endpoint
    output_replay: Endpoint | None
    publisher: PublisherSettings = field(default_factory=PublisherSettings)
    # The GPU-tier streams the consolidator reads when they are not the plugin's own per-rank
    # publishers: (dp rank, endpoint, replay endpoint) of each, e.g. TensorRT-LLM's own
    # streaming publisher (kv_cache_config.kv_events_config). Empty: ranks 0..num_ranks-1 at
    # publish_endpoint / replay_endpoint.
    gpu_streams: tuple[tuple[int, Endpoint, Endpoint | None], ...] = ()
    ranks: tuple[int, ...] | None = None  # the dp ranks subscribed (attention DP); None: all

    def stream_ranks(self) -> tuple[int, ...]:
        """The dp ranks whose GPU-tier streams the consolidator subscribes to."""
        if self.gpu_streams:
            found = tuple(rank for rank, _, _ in self.gpu_streams)
        else:
            found = tuple(range(self.num_ranks))
        return found if self.ranks is None else tuple(r for r in found if r in self.ranks)

    def stream_endpoint(self, rank: int) -> Endpoint:
        """Where the consolidator connects for dp rank ``rank``'s GPU-tier stream."""
        for stream_rank, endpoint, _ in self.gpu_streams:
            if stream_rank == rank:
                return endpoint
        return self.publish_endpoint(rank)

    def stream_replay(self, rank: int) -> Endpoint | None:
        for stream_rank, _, replay in self.gpu_streams:
            if stream_rank == rank:
                return replay
        return self.replay_endpoint(rank)

    def for_dp_rank(self, r: int) -> ConsolidatorConfig:
        """Attention-DP rank ``r``'s own consolidator: rank r's GPU-tier stream in, rank r's
        output out (``Endpoint.for_rank``: by default LEADER_ZMQ_PUB_PORT + 1000 + r)."""
        replay = self.output_replay
        return replace(self, ranks=(r,), output=self.output.for_rank(r),
                       output_replay=None if replay is None else replay.for_rank(r),
                       publisher=replace(self.publisher,
                                         topic=topic_for_rank(self.publisher.topic, r)))

    def publish_endpoint(self, rank: int) -> Endpoint:
        """The endpoint rank ``rank``'s GPU-tier publisher binds (and the consolidator joins)."""
        if self.gpu_events is None:
            raise ConfigError(f"no GPU-tier endpoint configured: set {TRTLLM_ZMQ_PORT} or "
                              f"{EVENTS_ENDPOINT}")
        return self.gpu_events.for_rank(rank)

    def replay_endpoint(self, rank: int) -> Endpoint | None:
        return None if self.gpu_replay is None else self.gpu_replay.for_rank(rank)


def check_publisher_name(kind: str) -> None:
    """Start-up's check of ``DYN_KVBM_KV_EVENTS_PUBLISHER``: a name registered in the
    ``kvbm_plugin.publishers`` entry points. Raises ConfigError naming the variable for an
    unknown name. Only names are read here (nothing is imported): the publisher factory loads
    and type-checks the entry point, and names a broken one."""
    import importlib_metadata

    known = {ep.name for ep in importlib_metadata.entry_points(group=PUBLISHERS_GROUP)}
    if kind not in known:
        raise ConfigError(f"{PUBLISHER}={kind!r} is not a registered publisher; known: "
                          + (", ".join(sorted(known)) or "none")
                          + f" (entry-point group {PUBLISHERS_GROUP})")


def check_disk_cache_dir(path: str) -> None:
    """Start-up's check of ``DYN_KVBM_DISK_CACHE_DIR``, without side effects: the directory
    exists and is writable, or it can be created (its nearest existing ancestor is a writable
    directory). Raises ConfigError naming the variable and value."""
    target = os.path.abspath(path)
    if os.path.lexists(target):
        if not os.path.isdir(target):
            raise ConfigError(f"{DISK_CACHE_DIR}={path!r} exists and is not a directory")
        if not os.access(target, os.W_OK | os.X_OK):
            raise ConfigError(f"{DISK_CACHE_DIR}={path!r}: the directory is not writable")
        return
    ancestor = os.path.dirname(target)
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ConfigError(f"{DISK_CACHE_DIR}={path!r} cannot be created: {ancestor} is not a "
                          "directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"{DISK_CACHE_DIR}={path!r} cannot be created: {ancestor} is not "
                          "writable")


DP_RANK_FIELD: Final = "{dp_rank}"


def topic_for_rank(topic: str, dp_rank: int) -> str:
    """``topic`` with every ``{dp_rank}`` replaced by ``dp_rank``: one pod per attention-DP
    rank for llm-d, which drops a batch's dp rank and names the pod by the topic
    (``kv@<pod>-dp{dp_rank}@<model>``)."""
    return topic.replace(DP_RANK_FIELD, str(dp_rank))


def check_topic(topic: str) -> str:
    """``topic``, or ConfigError if it starts with llm-d's ``kv@`` and llm-d could not read
    ``kv@<pod>@<model>`` from it (llm-d-router @ebab6879, engineadapter/common.go parseTopic:
    not exactly three "@" parts = pod is the whole topic, model "", which no request names)."""
    parts = topic_for_rank(topic, 0).split("@")
    if len(parts) > 1 and parts[0] == "kv" and (len(parts) != 3 or not all(parts)):
        raise ConfigError(f"{TOPIC}={topic!r}: llm-d reads a topic starting 'kv@' as "
                          "'kv@<pod>@<model>' (three non-empty '@'-separated parts)")
    return topic


def load_publisher_settings(env: Mapping[str, str] | None = None) -> PublisherSettings:
    """Publisher settings, each variable validated (the publisher name against the registered
    entry points); raises ConfigError naming the variable and value."""
    env = os.environ if env is None else env
    window = env_value(env, WINDOW_SIZE)
    kind = (env_value(env, PUBLISHER) or "zmq").strip()
    check_publisher_name(kind)
    return PublisherSettings(
        kind=kind,
        buffer_steps=parse_int(BUFFER_STEPS, env_value(env, BUFFER_STEPS) or "", minimum=1),
        buffer_bytes=parse_int(BUFFER_BYTES, env_value(env, BUFFER_BYTES) or "", minimum=1),
        hwm=parse_int(HWM, env_value(env, HWM) or "", minimum=1),
        max_queue_size=parse_int(MAX_QUEUE_SIZE, env_value(env, MAX_QUEUE_SIZE) or "", minimum=1),
        topic=check_topic(env.get(TOPIC, ENV_VARS_BY_NAME[TOPIC].default or "")),
        window_size=None if window is None else parse_int(WINDOW_SIZE, window, minimum=1),
        allow=load_allowlist(env),
        max_peers=load_max_peers(env),
        salt_form=load_salt_form(env),
        lora_names=load_lora_names(env),
        output_replay_rolled=_choice(env, OUTPUT_REPLAY_ROLLED, ("oldest", "empty")),
    )


def _choice(env: Mapping[str, str], name: str, allowed: tuple[str, ...]) -> str:
    text = (env_value(env, name) or "").strip().lower()
    if text not in allowed:
        raise ConfigError(f"{name}={env.get(name)!r} is not one of " + " | ".join(allowed))
    return text


def load_lora_names(env: Mapping[str, str]) -> tuple[tuple[int, str], ...]:
    """``DYN_KVBM_LORA_NAMES``: ``<task id>=<name>`` pairs, comma-separated; each id and each
    name at most once (two adapters under one name would be one adapter to a router)."""
    text = env_value(env, LORA_NAMES)
    if text is None:
        return ()
    pairs: dict[int, str] = {}
    for part in text.split(","):
        task, sep, name = (x.strip() for x in part.partition("="))
        # ASCII digits only: str.isdigit() also admits '²', which int() then refuses.
        if not sep or not (task.isascii() and task.isdigit()) or not name \
                or int(task) >= 1 << 64:
            raise ConfigError(f"{LORA_NAMES}={text!r}: {part.strip()!r} is not "
                              "'<task id>=<adapter name>'")
        if int(task) in pairs or name in pairs.values():
            raise ConfigError(f"{LORA_NAMES}={text!r}: task id {task} or name {name!r} is "
                              "given twice")
        other = name[len("lora-"):] if name.startswith("lora-") else ""
        if other.isascii() and other.isdigit() and int(other) != int(task):
            # An adapter not named here goes out as lora-<its task id>: this name would make
            # two adapters one to a router.
            raise ConfigError(f"{LORA_NAMES}={text!r}: {name!r} is the name adapter "
                              f"{int(other)} goes out under; give task id {task} another")
        pairs[int(task)] = name
    return tuple(pairs.items())


def load_salt_form(env: Mapping[str, str]) -> str:
    """``DYN_KVBM_KV_EVENTS_SALT_FORM``: ``client`` or ``id`` (case-insensitive)."""
    text = (env_value(env, SALT_FORM) or "").strip().lower()
    if text not in ("client", "id"):
        raise ConfigError(f"{SALT_FORM}={env.get(SALT_FORM)!r} is not one of client | id")
    return text


def load_max_peers(env: Mapping[str, str] | None = None) -> int:
    """``DYN_KVBM_ZMQ_MAX_PEERS``, checked; raises ConfigError naming the variable."""
    value = env_value(os.environ if env is None else env, ZMQ_MAX_PEERS) or ""
    return parse_int(ZMQ_MAX_PEERS, value, minimum=1)


def load_allowlist(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The IP addresses of ``DYN_KVBM_ZMQ_ALLOW`` (() when unset); ConfigError names a bad one."""
    value = env_value(os.environ if env is None else env, ZMQ_ALLOW) or ""
    try:
        return tuple(str(ipaddress.ip_address(t.strip())) for t in value.split(",") if t.strip())
    except ValueError as exc:
        raise ConfigError(f"{ZMQ_ALLOW}={value!r}: {exc} (IP addresses only)") from None


def load_tier_settings(env: Mapping[str, str] | None = None) -> TierSettings:
    """Tier sizes and the disk directory (checked usable when the disk tier is on); raises
    ConfigError naming the variable and value."""
    env = os.environ if env is None else env

    def optional_int(name: str) -> int | None:
        value = env_value(env, name)
        return None if value is None else parse_int(name, value, minimum=0)

    def optional_float(name: str) -> float:
        value = env_value(env, name)
        return 0.0 if value is None else parse_float(name, value)

    directory = env_value(env, DISK_CACHE_DIR)
    settings = TierSettings(
        cpu_cache_gb=optional_float(CPU_CACHE_GB),
        cpu_num_blocks=optional_int(CPU_CACHE_NUM_BLOCKS),
        disk_cache_gb=optional_float(DISK_CACHE_GB),
        disk_num_blocks=optional_int(DISK_CACHE_NUM_BLOCKS),
        disk_cache_dir=directory.strip() if directory else None,
        host_tier=(env_value(env, HOST_TIER) or "host").strip(),
        disk_tier=(env_value(env, DISK_TIER) or "disk").strip(),
    )
    if settings.disk_enabled and settings.disk_cache_dir is not None:
        check_disk_cache_dir(settings.disk_cache_dir)
    return settings


def load_metrics_settings(env: Mapping[str, str] | None = None) -> MetricsSettings:
    env = os.environ if env is None else env
    return MetricsSettings(
        enabled=parse_bool(METRICS, env_value(env, METRICS) or "false"),
        port=parse_port(METRICS_PORT, env_value(env, METRICS_PORT) or ""),
    )


EventsSource = Literal["auto", "drain", "tap", "off"]
EVENTS_SOURCES: tuple[EventsSource, ...] = ("auto", "drain", "tap", "off")


def load_events_source(env: Mapping[str, str] | None = None) -> EventsSource:
    """DYN_KVBM_KV_EVENTS_SOURCE, validated (ConfigError names the variable and value)."""
    env = os.environ if env is None else env
    value = (env_value(env, EVENTS_SOURCE) or "auto").strip().lower()
    if value not in EVENTS_SOURCES:
        raise ConfigError(f"{EVENTS_SOURCE}={env.get(EVENTS_SOURCE)!r}: expected one of "
                          f"{' | '.join(EVENTS_SOURCES)}")
    return value  # type: ignore[return-value]


def compiled_loops_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether the compiled loops may be used (``DYN_KVBM_NATIVE``; they still need to have
    been built)."""
    env = os.environ if env is None else env
    return parse_bool(NATIVE, env_value(env, NATIVE) or "")


def consolidator_enabled(env: Mapping[str, str] | None = None) -> bool:
    """The env switch alone (default on)."""
    env = os.environ if env is None else env
    return parse_bool(ENABLE_CONSOLIDATOR, env_value(env, ENABLE_CONSOLIDATOR) or "")


def load_consolidator_config(
    env: Mapping[str, str] | None = None, *, num_ranks: int = 1,
    require_gpu_events: bool = False, attention_dp: bool = False,
    gpu_streams: tuple[tuple[int, Endpoint, Endpoint | None], ...] = (),
) -> ConsolidatorConfig:
    """Read and validate every consolidator/publisher variable for ``num_ranks`` ranks.

    Raises ConfigError naming the variable and value for anything unusable, including a missing
    GPU-tier port while the consolidator is on under attention DP (elsewhere each leader's
    consolidator takes its rank's batches by direct call, and without the port no GPU-tier
    stream leaves the process) and any two sockets sharing a port or path.
    ``require_gpu_events``: the caller needs the GPU-tier endpoint whatever the consolidator
    switch says (``kvbm-plugin consolidate``, ``kvbm-plugin sidecar``); the error for a
    missing endpoint then does not point at the switch. ``attention_dp``: the ``num_ranks``
    ranks each have their own leader, whose sockets the check covers too. ``gpu_streams``: the
    GPU-tier streams come from elsewhere (TensorRT-LLM's own publisher), so no plugin GPU-tier
    endpoint is required; their ports count in the collision check.
    """
    env = os.environ if env is None else env
    if num_ranks < 1:
        raise ConfigError(f"num_ranks={num_ranks} must be >= 1")
    enabled = consolidator_enabled(env)
    mode_text = (env_value(env, CONSOLIDATOR_MODE) or "").strip().lower()
    if mode_text not in _MODES:
        raise ConfigError(f"{CONSOLIDATOR_MODE}={env.get(CONSOLIDATOR_MODE)!r} is not one of "
                          + " | ".join(_MODES))
    mode: ConsolidatorMode = "dedup" if mode_text == "dedup" else "passthrough"
    host = (env_value(env, LEADER_ZMQ_HOST) or "127.0.0.1").strip()
    if not host or any(c in host for c in "/ ") or host.isdigit():
        raise ConfigError(f"{LEADER_ZMQ_HOST}={env.get(LEADER_ZMQ_HOST)!r} is not a host name")

    def optional_endpoint(name: str) -> Endpoint | None:
        value = env_value(env, name)
        return None if value is None else parse_endpoint(name, value, default_host=host)

    gpu_events = optional_endpoint(EVENTS_ENDPOINT)
    if gpu_events is None:
        port_text = env_value(env, TRTLLM_ZMQ_PORT)
        if port_text is not None:
            gpu_events = Endpoint("tcp", host=host, port=parse_port(TRTLLM_ZMQ_PORT, port_text),
                                  source=TRTLLM_ZMQ_PORT)
    if gpu_events is None and require_gpu_events:
        raise ConfigError(
            f"the GPU-tier publishers' endpoint is not set: set "
            f"{TRTLLM_ZMQ_PORT} to their base port (rank r binds base + r, e.g. "
            f"{TRTLLM_ZMQ_PORT}=20081) or {EVENTS_ENDPOINT} (tcp://host:port, ipc://path)")
    # Each leader's consolidator takes its own rank's GPU-tier batches by direct call; only
    # an attention-DP rank's consolidator reads another process's stream (rank 0 publishes
    # every rank's), so only there is the GPU-tier endpoint needed for consolidating.
    if enabled and gpu_events is None and not gpu_streams and attention_dp and num_ranks > 1:
        raise ConfigError(
            f"{ENABLE_CONSOLIDATOR} is on under attention DP but {TRTLLM_ZMQ_PORT} is not set: "
            f"rank 0 publishes every rank's GPU-tier stream and each rank's consolidator reads "
            f"its own from there; set it to the base port of the per-rank GPU-tier publishers "
            f"(e.g. {TRTLLM_ZMQ_PORT}=20081), or set {EVENTS_ENDPOINT}, or "
            f"{ENABLE_CONSOLIDATOR}=false. There is no default: the usual fallback "
            f"({LEADER_ZMQ_PUB_PORT}) is the KVBM leader's own port.")
    leader_port = parse_port(LEADER_ZMQ_PUB_PORT, env_value(env, LEADER_ZMQ_PUB_PORT) or "")
    output = optional_endpoint(OUTPUT_ENDPOINT)
    if output is None:
        if leader_port + 1000 > 65535:
            raise ConfigError(f"{LEADER_ZMQ_PUB_PORT}={leader_port}: the consolidated output "
                              f"port {leader_port} + 1000 exceeds 65535")
        output = Endpoint("tcp", host=host, port=leader_port + 1000,
                          source=f"{LEADER_ZMQ_PUB_PORT}+1000")
    config = ConsolidatorConfig(
        enabled=enabled,
        mode=mode,
        num_ranks=num_ranks,
        gpu_events=gpu_events,
        gpu_replay=optional_endpoint(REPLAY_ENDPOINT),
        output=output,
        output_replay=optional_endpoint(OUTPUT_REPLAY_ENDPOINT),
        publisher=load_publisher_settings(env),
        gpu_streams=tuple(gpu_streams),
    )
    _check_collisions(config, leader_port, dp_rank_sockets(env, num_ranks) if attention_dp
                      else None, leader_sockets=dp_rank_sockets(env, 1)[1:])
    return config


def dp_rank_sockets(env: Mapping[str, str], dp_size: int) -> list[tuple[int, str, Endpoint]]:
    """``(dp rank, role, endpoint)`` of each attention-DP rank's own leader sockets, by the
    rule of every per-rank socket (``Endpoint.for_rank``, rank r = base + r): reports at
    LEADER_ZMQ_PUB_PORT + r (bound only by a group spanning processes, never under attention
    DP), shared-tier announcements at SHARED_ANNOUNCE_ENDPOINT or LEADER_ZMQ_PUB_PORT + 2000
    (+ r), metrics at METRICS_PORT + r (each where enabled)."""
    host = (env_value(env, LEADER_ZMQ_HOST) or "127.0.0.1").strip()
    port = parse_port(LEADER_ZMQ_PUB_PORT, env_value(env, LEADER_ZMQ_PUB_PORT) or "")
    bases = [("completion-report port", Endpoint("tcp", host=host, port=port,
                                                  source=LEADER_ZMQ_PUB_PORT))]
    if (env_value(env, SHARED_TIER) or "").strip().lower() not in ("", *FALSE_WORDS):
        text = env_value(env, SHARED_ANNOUNCE_ENDPOINT)
        bases.append(("shared-tier announce endpoint", parse_endpoint(
            SHARED_ANNOUNCE_ENDPOINT, text, default_host=host) if text else Endpoint(
            "tcp", host=host, port=port + 2000, source=f"{LEADER_ZMQ_PUB_PORT}+2000")))
    if parse_bool(METRICS, env_value(env, METRICS) or "false"):
        bases.append(("metrics port", Endpoint("tcp", host=host, port=parse_port(
            METRICS_PORT, env_value(env, METRICS_PORT) or ""), source=METRICS_PORT)))
    return [(r, role, base.for_rank(r)) for r in range(dp_size) for role, base in bases]


# The variables that place sockets: what ``kvbm-plugin demo`` takes from the user's environment
# (everything else it sets itself).
ENDPOINT_VARS: Final = (EVENTS_ENDPOINT, TRTLLM_ZMQ_PORT, REPLAY_ENDPOINT, LEADER_ZMQ_PUB_PORT,
                        LEADER_ZMQ_HOST, OUTPUT_ENDPOINT, OUTPUT_REPLAY_ENDPOINT)


def user_endpoint_settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The socket-placing variables (:data:`ENDPOINT_VARS`) set to a non-empty value in ``env``
    (default ``os.environ``), as given; validation happens when a config is loaded from them."""
    env = os.environ if env is None else env
    return {name: env[name] for name in ENDPOINT_VARS if env.get(name, "").strip()}


def _check_collisions(config: ConsolidatorConfig, leader_port: int,
                      dp_sockets: list[tuple[int, str, Endpoint]] | None = None,
                      leader_sockets: Sequence[tuple[int, str, Endpoint]] = ()) -> None:
    """Refuse any two sockets of any rank that would bind the same port or ipc/inproc path
    (``dp_sockets``: attention DP, with one consolidated output per rank; else
    ``leader_sockets``: the one leader's shared-tier announce and metrics sockets)."""
    owners: dict[tuple[str, str | int], str] = {}
    if dp_sockets is None:
        owners[("tcp", leader_port)] = f"{LEADER_ZMQ_PUB_PORT} (KVBM leader port {leader_port})"

    def claim(endpoint: Endpoint, role: str) -> None:
        previous = owners.get(endpoint.key)
        if previous is not None:
            where = endpoint.port if endpoint.scheme == "tcp" else endpoint.address
            raise ConfigError(f"{role} from {endpoint.source} ({where}) collides with "
                              f"{previous}")
        owners[endpoint.key] = f"{role} from {endpoint.source}"

    for rank in range(config.num_ranks):
        if config.gpu_events is not None:
            claim(config.publish_endpoint(rank), f"rank {rank} GPU-tier publish endpoint")
        replay = config.replay_endpoint(rank)
        if replay is not None:
            claim(replay, f"rank {rank} GPU-tier replay endpoint")
    for rank, endpoint, replay in config.gpu_streams:
        claim(endpoint, f"rank {rank} GPU-tier stream")
        if replay is not None:
            claim(replay, f"rank {rank} GPU-tier stream replay")
    if dp_sockets is None:
        claim(config.output, "consolidated output endpoint")
        if config.output_replay is not None:
            claim(config.output_replay, "consolidated output replay endpoint")
        for _, role, endpoint in leader_sockets:
            claim(endpoint, role)
        return
    for rank in range(config.num_ranks):
        ranked = config.for_dp_rank(rank)
        claim(ranked.output, f"dp rank {rank} consolidated output endpoint")
        if ranked.output_replay is not None:
            claim(ranked.output_replay, f"dp rank {rank} consolidated output replay endpoint")
    for rank, role, endpoint in dp_sockets:
        claim(endpoint, f"dp rank {rank} {role}")


def _connector_module(arg: Any) -> str | None:
    """The connector module named by a dict, a KvCacheConnectorConfig-like object or llm_args."""
    if arg is None:
        return None
    if isinstance(arg, Mapping):
        if "connector_module" in arg:
            return arg.get("connector_module")
        return _connector_module(arg.get("kv_connector_config"))
    if hasattr(arg, "connector_module"):
        return getattr(arg, "connector_module", None)
    if hasattr(arg, "kv_connector_config"):
        return _connector_module(arg.kv_connector_config)
    return None


def is_supported_connector_module(module: str | None) -> bool:
    if not module:
        return False
    return module in (PLUGIN_MODULE, DYNAMO_CONNECTOR_MODULE) or module.startswith(
        PLUGIN_MODULE + ".")


def should_enable_consolidator(arg: Any, env: Mapping[str, str] | None = None) -> bool:
    """True when the env switch is on and ``arg`` configures this plugin (or Dynamo's) connector.

    ``arg``: a dict arg map, a KvCacheConnectorConfig-like object, or llm_args carrying
    ``.kv_connector_config``. The reason for False is logged.
    """
    if not consolidator_enabled(env):
        logger.info("KV event consolidator disabled via %s", ENABLE_CONSOLIDATOR)
        return False
    module = _connector_module(arg)
    if not is_supported_connector_module(module):
        logger.info("KV event consolidator not enabled: connector module %r is neither %s nor %s",
                    module, PLUGIN_MODULE, DYNAMO_CONNECTOR_MODULE)
        return False
    return True


def env_table_markdown() -> str:
    """The env-var table as Markdown (README and ``kvbm-plugin env``)."""
    lines = ["| Variable | Default | Meaning |", "|---|---|---|"]
    for var in ENV_VARS:
        if var.default is None:
            default = "(unset)"
        else:
            default = f"`{var.default}`" if var.default else '`""`'
        lines.append(f"| `{var.name}` | {default} | {var.meaning} |")
    return "\n".join(lines)

"""The table of every environment variable kvbm_plugin reads: its name, default and meaning.

``ENV_VARS`` is the single source of truth: the settings modules read variables only through
:func:`env_value`, the table in docs/operations.md is checked against it by a test, and
``kvbm-plugin env`` prints it (:func:`env_table_markdown`). Imported by every settings module
(:mod:`kvbm_plugin.consolidator_config`, :mod:`kvbm_plugin.settings.publisher`,
:mod:`kvbm_plugin.settings.tiers`, :mod:`kvbm_plugin.settings.runtime`,
:mod:`kvbm_plugin.settings.shared`) on whatever thread reads a setting: CLI start-up, the
leader's and every worker's constructor. Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final


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


def env_value(env: Mapping[str, str], name: str) -> str | None:
    """The variable's value, or its default when unset or empty."""
    value = env.get(name)
    if value is None or value.strip() == "":
        return ENV_VARS_BY_NAME[name].default
    return value


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

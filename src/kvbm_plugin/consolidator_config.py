"""The consolidator's configuration, and the face of every setting kvbm_plugin reads.

This module owns where every rank's GPU-tier publisher binds, where the consolidator listens
and publishes, and the check that no two sockets of any rank collide
(:func:`load_consolidator_config`, :func:`dp_rank_sockets`), plus whether a connector
configuration asks for the consolidator (:func:`should_enable_consolidator`). It is called at
CLI start-up and in the leader's constructor (rank 0, the thread constructing it).

It is also the settings' face: the variable table (:mod:`kvbm_plugin.settings.variables`), the
publisher settings (:mod:`kvbm_plugin.settings.publisher`), the host/disk tier settings
(:mod:`kvbm_plugin.settings.tiers`), the process-wide switches
(:mod:`kvbm_plugin.settings.runtime`) and the parsed values (:mod:`kvbm_plugin.settings.values`)
are re-exported here, so ``from kvbm_plugin.consolidator_config import ENV_VARS,
ConfigError, load_tier_settings`` keeps working for TensorRT-LLM users and the tests.

Nothing here imports torch or TensorRT-LLM: the standard library only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal

from kvbm_plugin.settings.publisher import DP_RANK_FIELD as DP_RANK_FIELD
from kvbm_plugin.settings.publisher import EVENTS_SOURCES as EVENTS_SOURCES
from kvbm_plugin.settings.publisher import EventsSource as EventsSource
from kvbm_plugin.settings.publisher import (  # re-exported: the face's names
    PublisherSettings as PublisherSettings,
)
from kvbm_plugin.settings.publisher import check_publisher_name as check_publisher_name
from kvbm_plugin.settings.publisher import check_topic as check_topic
from kvbm_plugin.settings.publisher import load_allowlist as load_allowlist
from kvbm_plugin.settings.publisher import load_events_source as load_events_source
from kvbm_plugin.settings.publisher import load_lora_names as load_lora_names
from kvbm_plugin.settings.publisher import load_max_peers as load_max_peers
from kvbm_plugin.settings.publisher import load_publisher_settings as load_publisher_settings
from kvbm_plugin.settings.publisher import load_salt_form as load_salt_form
from kvbm_plugin.settings.publisher import topic_for_rank as topic_for_rank
from kvbm_plugin.settings.runtime import (  # re-exported: the face's names
    MetricsSettings as MetricsSettings,
)
from kvbm_plugin.settings.runtime import compiled_loops_enabled as compiled_loops_enabled
from kvbm_plugin.settings.runtime import load_metrics_settings as load_metrics_settings
from kvbm_plugin.settings.tiers import (  # re-exported: the face's names
    TierSettings as TierSettings,
)
from kvbm_plugin.settings.tiers import check_disk_cache_dir as check_disk_cache_dir
from kvbm_plugin.settings.tiers import load_tier_settings as load_tier_settings
from kvbm_plugin.settings.values import ENDPOINT_SCHEMES as ENDPOINT_SCHEMES
from kvbm_plugin.settings.values import FALSE_WORDS as FALSE_WORDS
from kvbm_plugin.settings.values import TRUE_WORDS as TRUE_WORDS
from kvbm_plugin.settings.values import ConfigError as ConfigError
from kvbm_plugin.settings.values import Endpoint as Endpoint
from kvbm_plugin.settings.values import parse_bool as parse_bool
from kvbm_plugin.settings.values import parse_endpoint as parse_endpoint
from kvbm_plugin.settings.values import parse_float as parse_float
from kvbm_plugin.settings.values import parse_int as parse_int
from kvbm_plugin.settings.values import parse_port as parse_port
from kvbm_plugin.settings.variables import BUFFER_BYTES as BUFFER_BYTES
from kvbm_plugin.settings.variables import BUFFER_STEPS as BUFFER_STEPS
from kvbm_plugin.settings.variables import CONSOLIDATOR_MODE as CONSOLIDATOR_MODE
from kvbm_plugin.settings.variables import CPU_CACHE_GB as CPU_CACHE_GB
from kvbm_plugin.settings.variables import CPU_CACHE_NUM_BLOCKS as CPU_CACHE_NUM_BLOCKS
from kvbm_plugin.settings.variables import DISK_CACHE_DIR as DISK_CACHE_DIR
from kvbm_plugin.settings.variables import DISK_CACHE_GB as DISK_CACHE_GB
from kvbm_plugin.settings.variables import DISK_CACHE_NUM_BLOCKS as DISK_CACHE_NUM_BLOCKS
from kvbm_plugin.settings.variables import DISK_TIER as DISK_TIER
from kvbm_plugin.settings.variables import ENABLE_CONSOLIDATOR as ENABLE_CONSOLIDATOR
from kvbm_plugin.settings.variables import ENV_VARS as ENV_VARS
from kvbm_plugin.settings.variables import ENV_VARS_BY_NAME as ENV_VARS_BY_NAME
from kvbm_plugin.settings.variables import EVENTS_ENDPOINT as EVENTS_ENDPOINT
from kvbm_plugin.settings.variables import EVENTS_SOURCE as EVENTS_SOURCE
from kvbm_plugin.settings.variables import HOST_TIER as HOST_TIER
from kvbm_plugin.settings.variables import HWM as HWM
from kvbm_plugin.settings.variables import LEADER_ZMQ_HOST as LEADER_ZMQ_HOST
from kvbm_plugin.settings.variables import LEADER_ZMQ_PUB_PORT as LEADER_ZMQ_PUB_PORT
from kvbm_plugin.settings.variables import LORA_NAMES as LORA_NAMES
from kvbm_plugin.settings.variables import MAX_QUEUE_SIZE as MAX_QUEUE_SIZE
from kvbm_plugin.settings.variables import METRICS as METRICS
from kvbm_plugin.settings.variables import METRICS_PORT as METRICS_PORT
from kvbm_plugin.settings.variables import MOONCAKE_CONFIG_PATH as MOONCAKE_CONFIG_PATH
from kvbm_plugin.settings.variables import NATIVE as NATIVE
from kvbm_plugin.settings.variables import OUTPUT_ENDPOINT as OUTPUT_ENDPOINT
from kvbm_plugin.settings.variables import OUTPUT_REPLAY_ENDPOINT as OUTPUT_REPLAY_ENDPOINT
from kvbm_plugin.settings.variables import OUTPUT_REPLAY_ROLLED as OUTPUT_REPLAY_ROLLED
from kvbm_plugin.settings.variables import PUBLISHER as PUBLISHER
from kvbm_plugin.settings.variables import PUBLISHERS_GROUP as PUBLISHERS_GROUP
from kvbm_plugin.settings.variables import REPLAY_ENDPOINT as REPLAY_ENDPOINT
from kvbm_plugin.settings.variables import SALT_FORM as SALT_FORM
from kvbm_plugin.settings.variables import SHARED_ADDRESS as SHARED_ADDRESS
from kvbm_plugin.settings.variables import SHARED_ANNOUNCE_ENDPOINT as SHARED_ANNOUNCE_ENDPOINT
from kvbm_plugin.settings.variables import SHARED_ANNOUNCE_RATE as SHARED_ANNOUNCE_RATE
from kvbm_plugin.settings.variables import (
    SHARED_ANNOUNCE_SECRET_FILE as SHARED_ANNOUNCE_SECRET_FILE,
)
from kvbm_plugin.settings.variables import SHARED_BUFFER_GB as SHARED_BUFFER_GB
from kvbm_plugin.settings.variables import SHARED_DEVICE as SHARED_DEVICE
from kvbm_plugin.settings.variables import SHARED_LEASE_S as SHARED_LEASE_S
from kvbm_plugin.settings.variables import SHARED_LOAD_MARGIN_S as SHARED_LOAD_MARGIN_S
from kvbm_plugin.settings.variables import SHARED_LOCAL_HOSTNAME as SHARED_LOCAL_HOSTNAME
from kvbm_plugin.settings.variables import SHARED_METADATA_SERVER as SHARED_METADATA_SERVER
from kvbm_plugin.settings.variables import SHARED_METRICS_ADDRESS as SHARED_METRICS_ADDRESS
from kvbm_plugin.settings.variables import SHARED_MODEL_KEY as SHARED_MODEL_KEY
from kvbm_plugin.settings.variables import SHARED_NAMESPACE as SHARED_NAMESPACE
from kvbm_plugin.settings.variables import SHARED_PEERS as SHARED_PEERS
from kvbm_plugin.settings.variables import SHARED_PROTOCOL as SHARED_PROTOCOL
from kvbm_plugin.settings.variables import SHARED_QUEUE_BLOCKS as SHARED_QUEUE_BLOCKS
from kvbm_plugin.settings.variables import SHARED_SEGMENT_GB as SHARED_SEGMENT_GB
from kvbm_plugin.settings.variables import SHARED_TIER as SHARED_TIER
from kvbm_plugin.settings.variables import SHARED_TRACKED_BLOCKS as SHARED_TRACKED_BLOCKS
from kvbm_plugin.settings.variables import TIERS_GROUP as TIERS_GROUP
from kvbm_plugin.settings.variables import TOPIC as TOPIC
from kvbm_plugin.settings.variables import TRTLLM_MOVED_ENDPOINT as TRTLLM_MOVED_ENDPOINT
from kvbm_plugin.settings.variables import TRTLLM_ZMQ_PORT as TRTLLM_ZMQ_PORT
from kvbm_plugin.settings.variables import WINDOW_SIZE as WINDOW_SIZE
from kvbm_plugin.settings.variables import ZMQ_ALLOW as ZMQ_ALLOW
from kvbm_plugin.settings.variables import ZMQ_MAX_PEERS as ZMQ_MAX_PEERS
from kvbm_plugin.settings.variables import (  # re-exported: the face's names
    EnvVar as EnvVar,
)
from kvbm_plugin.settings.variables import env_table_markdown as env_table_markdown
from kvbm_plugin.settings.variables import env_value as env_value

logger = logging.getLogger(__name__)


# Dynamo's KV-cache connector module, which reads the same variables.
DYNAMO_CONNECTOR_MODULE = "kvbm.trtllm_integration.connector"
PLUGIN_MODULE = "kvbm_plugin"

ConsolidatorMode = Literal["dedup", "passthrough"]
_MODES: tuple[ConsolidatorMode, ...] = ("dedup", "passthrough")


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



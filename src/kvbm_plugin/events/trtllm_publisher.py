"""TensorRT-LLM's own streaming KV-event publisher: whether it is on, and where each rank's is.

``kv_cache_config.kv_events_config`` (TensorRT-LLM's ``KVEventsConfig``, added by PR #17023,
merged) makes the KV cache manager itself publish the GPU tier over ZMQ: every rank that has a
KV event manager (rank 0, or each attention-DP rank) binds a PUB socket and sends one batch per
iteration; the pull API (``get_latest_events``) then returns ``[]``. Where that publisher runs
the plugin must not publish a second GPU-tier stream of the same blocks, and its consolidator
subscribes to TensorRT-LLM's endpoints instead of the plugin's own.

What is read, and the rules followed (upstream, read in the stored source index):

* on/off: ``enable_kv_cache_events`` (default False), ``publisher`` (None means ``"zmq"`` when
  enabled, ``"null"`` otherwise; ``"null"`` builds the streaming manager with a publisher that
  sends nothing). TensorRT-LLM's ``KVEventsConfig`` reference page
  (nvidia.github.io/TensorRT-LLM/llm-api/reference/KVEventsConfig.html); Dynamo resolves it the
  same way (``components/src/dynamo/trtllm/workers/llm_worker.py``,
  ``_resolve_streaming_kv_events_config``, stored file id 58281061292).
* per-rank endpoint: ``ZmqEventPublisher.offset_endpoint_port`` in
  ``tensorrt_llm/_torch/pyexecutor/kv_cache_events.py`` (@ 44004b3864a7, PR #17023, and the
  later revisions, stored ids 68762347738 and 71400586074 @ 13599e98c71c): rank 0 binds the
  endpoint as given; rank r > 0 binds tcp port + r, or an ipc/inproc address + ``"_dp{r}"``.
* where a subscriber connects: a bind wildcard host (``*``, ``0.0.0.0``, ``::``) is not
  connectable; Dynamo's own subscriber connects to loopback on a single node
  (``_streaming_kv_event_connect_endpoint`` in ``components/src/dynamo/trtllm/publisher.py``,
  stored id 58272634303). The plugin's consolidator runs in the process of the rank whose
  stream it reads, so it connects to ``DYN_KVBM_LEADER_ZMQ_HOST`` (default loopback).

Called by the leader's constructor (rank 0 or each attention-DP rank, a thread-pool thread) and
by ``kvbm-plugin doctor``. Reads attributes or mapping keys alike (a ``TorchLlmArgs`` or the
YAML/JSON of ``--extra_llm_api_options``). Pure Python, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbm_plugin.consolidator_config import ConfigError, Endpoint, parse_endpoint

FIELD = "kv_cache_config.kv_events_config"
DEFAULT_ENDPOINT = "tcp://*:5557"  # KVEventsConfig.endpoint's default
_WILDCARDS = frozenset({"*", "0.0.0.0", "::", "[::]", ""})


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


@dataclass(frozen=True)
class TrtllmPublisher:
    """TensorRT-LLM's streaming publisher as configured: ``publisher`` is ``"zmq"`` (each
    rank's stream at :meth:`bind_endpoint`) or ``"null"`` (no stream at all)."""

    publisher: str
    endpoint: str
    replay_endpoint: str | None
    topic: str

    @property
    def streams(self) -> bool:
        """Whether TensorRT-LLM sends GPU-tier events anywhere (``publisher="zmq"``)."""
        return self.publisher == "zmq"

    def bind_endpoint(self, rank: int) -> str:
        """The endpoint rank ``rank``'s publisher binds (upstream's offset rule)."""
        return offset_endpoint(self.endpoint, rank, "endpoint")

    def bind_replay(self, rank: int) -> str | None:
        if self.replay_endpoint is None:
            return None
        return offset_endpoint(self.replay_endpoint, rank, "replay_endpoint")

    def connect_endpoint(self, rank: int, host: str) -> Endpoint:
        """Where a subscriber in rank ``rank``'s process connects (a wildcard bind host
        becomes ``host``)."""
        return _connectable(self.bind_endpoint(rank), host, "endpoint")

    def connect_replay(self, rank: int, host: str) -> Endpoint | None:
        bound = self.bind_replay(rank)
        return None if bound is None else _connectable(bound, host, "replay_endpoint")

    def describe(self, rank: int, host: str) -> str:
        """In words, for the start-up log and ``doctor``."""
        if not self.streams:
            return (f"TensorRT-LLM's own publisher ({FIELD}) with publisher='null': it "
                    "publishes nothing and its pull API returns [], so no process publishes "
                    "GPU-tier events")
        replay = self.connect_replay(rank, host)
        return (f"TensorRT-LLM's own publisher ({FIELD}): rank {rank} at "
                f"{self.connect_endpoint(rank, host).connect}"
                + (f" (replay {replay.connect})" if replay is not None else " (no replay)")
                + (f", topic {self.topic!r}" if self.topic else ""))


def offset_endpoint(endpoint: str, rank: int, name: str = "endpoint") -> str:
    """TensorRT-LLM's ``offset_endpoint_port``: rank 0 as given; rank r: tcp port + r, or
    ipc/inproc + ``"_dp{r}"``. ConfigError (naming the field) for an endpoint it refuses."""
    where = f"{FIELD}.{name}={endpoint!r}"
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint if rank == 0 else f"{endpoint}_dp{rank}"
    if not endpoint.startswith("tcp://"):
        raise ConfigError(f"{where}: TensorRT-LLM accepts only tcp://, ipc:// or inproc:// "
                          "endpoints")
    if ":" not in endpoint[len("tcp://"):]:
        raise ConfigError(f"{where}: a tcp endpoint needs a port")
    base, _, port_text = endpoint.rpartition(":")
    if not (port_text.isdigit() and 1 <= int(port_text) <= 65535):
        raise ConfigError(f"{where}: the port must be in [1, 65535]")
    port = int(port_text) + rank
    if port > 65535:
        raise ConfigError(f"{where}: rank {rank} binds port {port}, above 65535")
    return endpoint if rank == 0 else f"{base}:{port}"


def _connectable(bound: str, host: str, name: str) -> Endpoint:
    source = f"{FIELD}.{name}"
    if bound.startswith("tcp://"):
        bind_host, _, port = bound[len("tcp://"):].rpartition(":")
        if bind_host in _WILDCARDS:
            bound = f"tcp://{host}:{port}"
    return parse_endpoint(source, bound, default_host=host)


def read_trtllm_publisher(llm_args: Any) -> TrtllmPublisher | None:
    """TensorRT-LLM's streaming publisher configured in ``llm_args`` (a ``TorchLlmArgs``, or
    its mapping form), or None where ``kv_events_config`` is absent or not enabled.
    ConfigError names the field and value TensorRT-LLM itself would refuse."""
    kv_cache_config = _get(llm_args, "kv_cache_config")
    config = _get(kv_cache_config, "kv_events_config") if kv_cache_config is not None else None
    if config is None:
        return None
    enabled = _get(config, "enable_kv_cache_events", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"{FIELD}.enable_kv_cache_events={enabled!r} is not a boolean")
    if not enabled:
        return None
    publisher = _get(config, "publisher") or "zmq"
    if publisher not in ("zmq", "null"):
        raise ConfigError(f"{FIELD}.publisher={publisher!r}: TensorRT-LLM publishes with "
                          "'zmq' or 'null'")
    endpoint = _get(config, "endpoint") or DEFAULT_ENDPOINT
    replay = _get(config, "replay_endpoint") or None
    topic = _get(config, "topic") or ""
    for name, value in (("endpoint", endpoint), ("replay_endpoint", replay), ("topic", topic)):
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{FIELD}.{name}={value!r} is not a string")
    engine_pub = TrtllmPublisher(publisher, endpoint.strip(), None if replay is None
                             else replay.strip(), topic)
    engine_pub.bind_endpoint(0)  # refuse a malformed endpoint at construction, naming the field
    engine_pub.bind_replay(0)
    return engine_pub


def trtllm_streams(engine_pub: TrtllmPublisher | None, dp_rank: int,
                   host: str) -> tuple[tuple[int, Endpoint, Endpoint | None], ...]:
    """The consolidator's GPU-tier stream for ``dp_rank``'s leader when TensorRT-LLM
    publishes it (``ConsolidatorConfig.gpu_streams``): the rank's own endpoint only, as the
    leader of that rank runs in its process; ``()`` when TensorRT-LLM does not stream."""
    if engine_pub is None or not engine_pub.streams:
        return ()
    return ((dp_rank, engine_pub.connect_endpoint(dp_rank, host),
             engine_pub.connect_replay(dp_rank, host)),)


def gpu_source_line(engine_pub: TrtllmPublisher | None, events_source: str, config: Any,
                    rank: int, host: str) -> str:
    """Which GPU-tier source is in use, in words (the leader's start-up log and
    ``event_source_status``, ``kvbm-plugin doctor``): TensorRT-LLM's publisher at which
    endpoint, the plugin's own (where, under which DYN_KVBM_KV_EVENTS_SOURCE), or none.
    ``config``: the ConsolidatorConfig (the plugin's own endpoint), or None."""
    from kvbm_plugin.consolidator_config import EVENTS_SOURCE

    if engine_pub is not None:
        return (engine_pub.describe(rank, host) + f"; the plugin publishes no GPU-tier stream "
                f"({EVENTS_SOURCE}={events_source} not used)")
    if events_source == "off":
        return f"none from the plugin ({EVENTS_SOURCE}=off)"
    if config is None or config.gpu_events is None:
        where = "no endpoint configured: counted, not published"
    else:
        where = f"rank {rank} at {config.publish_endpoint(rank).bind}"
    return f"the plugin's own publisher ({where}; {EVENTS_SOURCE}={events_source})"


def log_gpu_source(log: Any, engine_pub: TrtllmPublisher | None, line: str,
                   consolidate: bool) -> None:
    """The leader's start-up line about its GPU-tier source: a warning where TensorRT-LLM's
    stream is not merged (``publisher='null'``, or no consolidator)."""
    odd = engine_pub is not None and not (engine_pub.streams and consolidate)
    log.log(30 if odd else 20, "kvbm_plugin: GPU-tier KV events: %s%s", line,
            "" if consolidate else "; no consolidator: the offload tiers' events go out on "
            "their own")


class TrtllmNameFeed:
    """Stored-block events handed from another thread to the leader (:meth:`drain`, under the
    leader's lock), which learns from them the names its tier events must carry: TensorRT-LLM's
    own stream from the consolidator's ingest thread (:meth:`observe`, its
    ``engine_observer``), and this rank's sink's batches from whichever thread flushed it (the
    sink's ``on_flush``: the leader's event pump). Bounded: past ``max_batches`` unread batches
    one is dropped and counted (``dropped``)."""

    def __init__(self, max_batches: int = 4096) -> None:
        import collections

        self._batches: collections.deque[tuple[int, list[dict[str, Any]]]] = \
            collections.deque()
        self._max = max_batches
        self.dropped = 0

    def observe(self, dp_rank: int, events: list[Any]) -> None:
        stored = [e for e in events if _names_a_block(e)]
        if not stored:
            return
        if len(self._batches) >= self._max:
            self.dropped += 1  # only the ingest thread writes it
            return
        self._batches.append((dp_rank, stored))  # deque.append: atomic under the GIL

    def drain(self) -> list[tuple[int, list[dict[str, Any]]]]:
        out = []
        batches = self._batches
        while batches:
            out.append(batches.popleft())
        return out


def _names_a_block(event: Any) -> bool:
    """A BlockStored map the name table can read (the consolidator counted any other)."""
    if not isinstance(event, dict) or event.get("type") != "BlockStored":
        return False
    size, tokens, hashes = event.get("block_size"), event.get("token_ids"), \
        event.get("block_hashes")
    parent = event.get("parent_block_hash")
    return (type(size) is int and size > 0 and isinstance(tokens, list)
            and isinstance(hashes, list) and len(tokens) == size * len(hashes)
            and all(type(h) is int for h in hashes) and (parent is None or type(parent) is int))


class TrtllmNameReader:
    """Reads TensorRT-LLM's stream of one rank for the names alone, where no consolidator
    does (``DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR=false``): its own thread
    (``kvbm-trtllm-names-r<rank>``) owns a SUB at ``endpoint`` and hands each batch's events
    to ``observe`` (a :class:`TrtllmNameFeed`'s). Built and stopped by the leader (through
    ``leader.event_path``); it never touches TensorRT-LLM state and holds no lock. A payload
    it cannot decode is counted (``malformed``) and skipped. ``forms``: normalises each batch's
    events first (an ``EngineForms``, as the consolidator does), or None."""

    def __init__(self, endpoint: Endpoint, topic: str, observe: Any, rank: int,
                 forms: Any = None) -> None:
        import threading

        import zmq

        self._observe = observe
        self._forms = forms
        self._rank = rank
        self.malformed = 0
        self._stop = threading.Event()
        self._sub = zmq.Context.instance().socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint.connect)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kvbm-trtllm-names-r{rank}")
        self._thread.start()

    def _run(self) -> None:
        import msgpack

        try:
            while not self._stop.is_set():
                if not self._sub.poll(100):
                    continue
                frames = self._sub.recv_multipart()
                try:
                    batch = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
                    events = batch[1]
                    rank = batch[2] if len(batch) > 2 and type(batch[2]) is int else self._rank
                except Exception:  # not msgpack [ts, events, dp_rank]
                    self.malformed += 1
                    continue
                if isinstance(events, list):
                    self._observe(rank, events if self._forms is None
                                  else self._forms(rank, events))
        finally:
            self._sub.close(0)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

"""Dynamo's STREAMING mode served by the consolidated output: the plugin takes the endpoint the
engine YAML names and moves TensorRT-LLM's own publisher to one of its own.

Why it works, read in the stored upstream source:

* Dynamo (``components/src/dynamo/trtllm/workers/llm_worker.py``, stored id 58281061292, and
  ai-dynamo 1.6.1 from PyPI): ``_resolve_streaming_kv_events_config`` reads
  ``kv_cache_config.kv_events_config`` from the engine arguments (the YAML of
  ``--extra-engine-args`` plus ``--override-engine-args``) in Dynamo's own process, as a copy,
  *before* ``get_llm_engine`` builds TensorRT-LLM. After the engine is up it hands that copy to
  ``get_publisher``; ``Publisher.initialize`` (``dynamo/trtllm/publisher.py``, stored id
  58272634303) then creates, per attention-DP rank r, ``KvEventPublisher(endpoint,
  zmq_endpoint=<the YAML's endpoint, rank r: tcp port + r or ipc/inproc + "_dp{r}", a wildcard
  host as 127.0.0.1>, zmq_topic=<the YAML's topic>, dp_rank=r)``: Dynamo's relay onto its event
  plane, under the worker's own id. Nothing TensorRT-LLM does later changes where it connects.
* TensorRT-LLM (``tensorrt_llm/_torch/pyexecutor/py_executor_creator.py`` @000429d5, stored id
  36005802797, and @bab0f2e6, id 1083207948): ``create_py_executor`` takes
  ``kv_cache_config = llm_args.kv_cache_config``, constructs the connector's worker and
  scheduler (the leader) with that same ``llm_args`` and only then builds the KV cache managers
  from ``kv_cache_config`` (``KvCacheCreator.build_managers``). The streaming event manager is
  built in ``KVCacheManagerV2.__init__`` and its ``ZmqEventPublisher`` reads
  ``kv_events_config.endpoint`` when constructed and binds it in ``start()``
  (``_torch/pyexecutor/kv_cache_events.py`` @13599e98c71c, stored id 71400586074).

So the leader's constructor, running before the KV cache manager exists, can replace
``llm_args.kv_cache_config.kv_events_config`` with a copy whose ``endpoint`` is
``DYN_KVBM_KV_EVENTS_TRTLLM_MOVED_ENDPOINT`` (TensorRT-LLM's rank r then binds it by its own
offset rule; the replay endpoint, topic and everything else stay), read TensorRT-LLM's stream
there, and bind its consolidated output where the YAML's endpoint was (rank r at + r, the rule
Dynamo subscribes with), under the YAML's topic. Each rank's leader does this in its own process
(attention DP: one leader per rank) on its own ``llm_args``; the object is replaced, never
mutated, so a shared one (the simulated engine's ranks in one process) is left alone.

Called by the leader's constructor and by ``kvbm-plugin doctor`` (the setting's syntax). Pure
Python, no I/O.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from kvbm_plugin.consolidator_config import (
    OUTPUT_ENDPOINT,
    TOPIC,
    TRTLLM_MOVED_ENDPOINT,
    ConfigError,
    consolidator_enabled,
    env_value,
)
from kvbm_plugin.events.trtllm_publisher import (
    _WILDCARDS,
    FIELD,
    TrtllmPublisher,
    offset_endpoint,
    read_trtllm_publisher,
)


def load_moved_endpoint(env: Mapping[str, str] | None = None) -> str | None:
    """``DYN_KVBM_KV_EVENTS_TRTLLM_MOVED_ENDPOINT`` (None when unset), checked by TensorRT-LLM's
    own endpoint rules; ConfigError names the variable and its value."""
    import os

    env = os.environ if env is None else env
    value = env_value(env, TRTLLM_MOVED_ENDPOINT)
    if value is None:
        return None
    try:
        offset_endpoint(value.strip(), 1)
    except ConfigError as exc:
        why = str(exc).split(": ", 1)[-1]
        raise ConfigError(f"{TRTLLM_MOVED_ENDPOINT}={value!r}: {why}") from None
    return value.strip()


def _with_endpoint(config: Any, endpoint: str) -> Any:
    """A copy of TensorRT-LLM's ``KVEventsConfig`` (a pydantic model, a dataclass or the YAML's
    mapping) with ``endpoint`` replaced."""
    if isinstance(config, Mapping):
        return {**config, "endpoint": endpoint}
    if hasattr(config, "model_copy"):  # pydantic v2 (TensorRT-LLM's StrictBaseModel)
        return config.model_copy(update={"endpoint": endpoint})
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.replace(config, endpoint=endpoint)
    moved = copy.copy(config)
    moved.endpoint = endpoint
    return moved


def _overlap(moved: str, other: str, ranks: int) -> int | None:
    """The first rank of ``other`` (tcp, rank r at port + r) whose port one of ``moved``'s
    ``ranks`` ranks also binds on a host both reach (the same, or either a wildcard)."""
    if not (moved.startswith("tcp://") and other.startswith("tcp://")):
        return None
    host_a, _, port_a = moved[len("tcp://"):].rpartition(":")
    host_b, _, port_b = other[len("tcp://"):].rpartition(":")
    if host_a != host_b and host_a not in _WILDCARDS and host_b not in _WILDCARDS:
        return None
    first = int(port_b)
    hit = set(range(int(port_a), int(port_a) + ranks)) & set(range(first, first + ranks))
    return min(hit) - first if hit else None


def take_yaml_endpoint(llm_args: Any, env: Mapping[str, str], attention_dp: bool = False,
                       dp_size: int = 1
                       ) -> tuple[TrtllmPublisher | None, Mapping[str, str], str | None]:
    """TensorRT-LLM's publisher as this leader will read it, the settings the leader then
    loads its consolidator from, and a start-up line (None when nothing is moved).

    Without ``DYN_KVBM_KV_EVENTS_TRTLLM_MOVED_ENDPOINT``: ``(read_trtllm_publisher(llm_args), env,
    None)``. With it: TensorRT-LLM's publisher is moved there in ``llm_args`` and the returned
    settings put the consolidated output at the YAML's endpoint under the YAML's topic.
    ConfigError (naming the variable) where that cannot work: no streaming publisher to move,
    an ipc/inproc YAML endpoint under attention DP (the plugin's rank 0 output would be at the
    path + ``_dp0``, where Dynamo's rank 0 is the path as given),
    the consolidator off, the output placed by ``DYN_KVBM_KV_EVENTS_OUTPUT_ENDPOINT`` too, a
    topic Dynamo's filter would drop, or the moved endpoint equal to one the YAML names."""
    moved = load_moved_endpoint(env)
    engine_pub = read_trtllm_publisher(llm_args)
    if moved is None:
        return engine_pub, env, None
    where = f"{TRTLLM_MOVED_ENDPOINT}={moved!r}"
    if engine_pub is None or not engine_pub.streams:
        raise ConfigError(f"{where}: {FIELD} does not enable TensorRT-LLM's zmq publisher, so "
                          "there is no endpoint to take over (set enable_kv_cache_events: true)")
    if not consolidator_enabled(env):
        raise ConfigError(f"{where} needs the consolidator: its output is what takes the "
                          f"endpoint {engine_pub.endpoint!r}")
    if env_value(env, OUTPUT_ENDPOINT) is not None:
        raise ConfigError(f"{where} places the consolidated output at {FIELD}.endpoint="
                          f"{engine_pub.endpoint!r}; unset {OUTPUT_ENDPOINT}="
                          f"{env_value(env, OUTPUT_ENDPOINT)!r}")
    if attention_dp and not engine_pub.endpoint.startswith("tcp://"):
        raise ConfigError(f"{where}: under attention DP the consolidated output of rank 0 binds "
                          f"{engine_pub.endpoint!r} + '_dp0' (the plugin's per-rank rule) while "
                          f"Dynamo subscribes to {engine_pub.endpoint!r}: give {FIELD}.endpoint a "
                          "tcp:// endpoint")
    if moved in (engine_pub.endpoint, engine_pub.replay_endpoint):
        raise ConfigError(f"{where} is an endpoint {FIELD} already names")
    ranks = dp_size if attention_dp else 1  # rank r binds every endpoint's base + r
    for name, other, whose in (("endpoint", engine_pub.endpoint, "Dynamo's rank"),
                               ("replay_endpoint", engine_pub.replay_endpoint,
                                f"{FIELD}.replay_endpoint of rank")):
        rank = _overlap(moved, other, ranks) if other else None
        if rank is not None:
            raise ConfigError(f"{where}: with {ranks} attention-DP ranks (each at the base port "
                              f"+ its rank) TensorRT-LLM's moved publisher would bind a port "
                              f"of {FIELD}.{name}={other!r}, {whose} {rank}'s; move it at "
                              f"least {ranks} ports away")
    topic = (env.get(TOPIC) or "").strip() or None  # set by the operator, not the default
    if topic is not None and not topic.startswith(engine_pub.topic):
        raise ConfigError(f"{TOPIC}={topic!r} does not start with {FIELD}.topic="
                          f"{engine_pub.topic!r}, the prefix Dynamo subscribes with ({where})")
    kv_cache_config = llm_args["kv_cache_config"] if isinstance(llm_args, Mapping) \
        else llm_args.kv_cache_config
    original = kv_cache_config["kv_events_config"] if isinstance(kv_cache_config, Mapping) \
        else kv_cache_config.kv_events_config
    replaced = _with_endpoint(original, moved)
    if isinstance(kv_cache_config, Mapping):
        kv_cache_config["kv_events_config"] = replaced  # type: ignore[index]
    else:
        kv_cache_config.kv_events_config = replaced
    settings = {**env, OUTPUT_ENDPOINT: engine_pub.endpoint}
    if topic is None:
        settings[TOPIC] = engine_pub.topic
    line = (f"kvbm_plugin: Dynamo STREAMING mode: TensorRT-LLM's own publisher moved from "
            f"{engine_pub.endpoint!r} to {moved!r} ({where}); the consolidated output binds "
            f"{engine_pub.endpoint!r} (attention-DP rank r: + r), where Dynamo's relay subscribes")
    return read_trtllm_publisher(llm_args), settings, line

"""How every publisher queues, buffers, frames and guards its batches (``DYN_KVBM_KV_EVENTS_*``
publisher variables, ``DYN_KVBM_ZMQ_*``, ``DYN_KVBM_LORA_NAMES``), read and validated.

Called by :func:`kvbm_plugin.consolidator_config.load_consolidator_config` (CLI start-up, the
leader's constructor on rank 0), by the sockets' guards (``load_max_peers``, ``load_allowlist``:
connector metadata, shared-tier announcements) and by ``kvbm-plugin doctor``, on the calling
thread; ``load_events_source`` by the leader's constructor and ``doctor``. Standard library only
(the publisher name is checked against the entry points by name, nothing is imported).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from kvbm_plugin.settings.values import ConfigError, parse_int
from kvbm_plugin.settings.variables import (
    BUFFER_BYTES,
    BUFFER_STEPS,
    ENV_VARS_BY_NAME,
    EVENTS_SOURCE,
    HWM,
    LORA_NAMES,
    MAX_QUEUE_SIZE,
    OUTPUT_REPLAY_ROLLED,
    PUBLISHER,
    PUBLISHERS_GROUP,
    SALT_FORM,
    TOPIC,
    WINDOW_SIZE,
    ZMQ_ALLOW,
    ZMQ_MAX_PEERS,
    env_value,
)


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

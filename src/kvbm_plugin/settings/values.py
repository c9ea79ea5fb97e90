"""The values a setting can take, parsed: switches, numbers, ports and ZMQ endpoints.

Called by the settings modules (:mod:`kvbm_plugin.settings.publisher`,
:mod:`kvbm_plugin.settings.tiers`, :mod:`kvbm_plugin.settings.runtime`,
:mod:`kvbm_plugin.settings.shared`, :mod:`kvbm_plugin.consolidator_config`, the last two
re-exporting these names) on whatever thread reads the settings: CLI start-up, the
leader's and the worker's constructors. The standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal


class ConfigError(ValueError):
    """A setting has a value the plugin cannot use. The message names the variable and value."""


# The words a switch accepts, and the endpoint schemes ZMQ binds (shared_settings reads them too).
TRUE_WORDS = frozenset({"1", "true", "on", "yes"})
FALSE_WORDS = frozenset({"0", "false", "off", "no"})
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


def parse_bool(name: str, value: str) -> bool:
    """Parse a switch: 1/true/on/yes or 0/false/off/no, case-insensitive, trimmed."""
    text = value.strip().lower()
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS:
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean; use one of 1/true/on/yes or "
                      "0/false/off/no")


def parse_int(name: str, value: str, *, minimum: int, maximum: int | None = None) -> int:
    """Parse an integer in [minimum, maximum] or raise ConfigError naming the variable."""
    text = value.strip()
    try:
        number = int(text, 10)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None
    if number < minimum or (maximum is not None and number > maximum):
        bound = f"{minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        raise ConfigError(f"{name}={value!r} is out of range ({bound})")
    return number


def parse_float(name: str, value: str, *, minimum: float = 0.0) -> float:
    """Parse a non-negative number (e.g. a size in GiB) or raise ConfigError."""
    try:
        number = float(value.strip())
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number") from None
    if not number >= minimum or number == float("inf"):
        raise ConfigError(f"{name}={value!r} must be a finite number >= {minimum}")
    return number


def parse_port(name: str, value: str) -> int:
    return parse_int(name, value, minimum=1, maximum=65535)


@dataclass(frozen=True)
class Endpoint:
    """A ZMQ endpoint family: a base from which each rank's bind and connect addresses derive.

    tcp: rank r uses ``port + r``; ipc/inproc: rank r uses ``address + "_dp{r}"``. A tcp socket
    binds the interface its endpoint names (``bind_host``), so ``tcp://127.0.0.1:P`` listens on
    loopback only; ``*`` (also written ``0.0.0.0`` or ``::``) is every interface. The streams
    carry prompts' token ids and the replay sockets answer anyone who connects: nothing binds
    every interface unless the endpoint says ``*``.
    """

    scheme: Literal["tcp", "ipc", "inproc"]
    address: str = ""  # ipc path or inproc name
    host: str = "127.0.0.1"  # tcp: where connectors connect
    port: int = 0  # tcp base port
    source: str = ""  # variable the endpoint came from, for error messages
    bind_host: str = ""  # tcp: the interface to bind ("*" = every one); "" = ``host``

    def for_rank(self, rank: int) -> Endpoint:
        if self.scheme == "tcp":
            port = self.port + rank
            if port > 65535:
                raise ConfigError(f"{self.source}: port {self.port} + rank {rank} = {port} "
                                  "exceeds 65535")
            return Endpoint("tcp", host=self.host, port=port, source=self.source,
                            bind_host=self.bind_host)
        return Endpoint(self.scheme, address=f"{self.address}_dp{rank}", source=self.source)

    @property
    def bind(self) -> str:
        if self.scheme == "tcp":
            return f"tcp://{_url_host(self.bind_host or self.host)}:{self.port}"
        return f"{self.scheme}://{self.address}"

    @property
    def connect(self) -> str:
        if self.scheme == "tcp":
            return f"tcp://{_url_host(self.host)}:{self.port}"
        return f"{self.scheme}://{self.address}"

    @property
    def every_interface(self) -> bool:
        """Whether the socket listens on every interface (tcp ``*``), not one host."""
        return self.scheme == "tcp" and self.bind_host == "*"

    @property
    def key(self) -> tuple[str, str | int]:
        """What two endpoints must not share: a tcp port, or an ipc/inproc address."""
        return (self.scheme, self.port if self.scheme == "tcp" else self.address)


_EVERY_INTERFACE: Final = frozenset({"*", "0.0.0.0", "::", "[::]"})


def _url_host(host: str) -> str:
    """``host`` as it stands in a tcp URL: an IPv6 literal in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def parse_endpoint(name: str, value: str, *, default_host: str) -> Endpoint:
    """Parse ``tcp://host:port``, ``ipc://path``, ``inproc://name`` or a bare port number.

    The scheme is decided by prefix only, so ``tcp://ipc-host:5557`` is tcp. A bare port binds
    and connects ``default_host``; ``tcp://*:port`` binds every interface and connects
    ``default_host``; ``tcp://host:port`` binds and connects ``host``.
    """
    text = value.strip()
    if text.isdigit():
        return Endpoint("tcp", host=default_host, port=parse_port(name, text), source=name,
                        bind_host=default_host)
    if text.startswith("tcp://"):
        rest = text[len("tcp://"):]
        host, sep, port_text = rest.rpartition(":")
        if not sep or not host:
            raise ConfigError(f"{name}={value!r}: a tcp endpoint needs host:port")
        if not port_text.isdigit():
            raise ConfigError(f"{name}={value!r}: tcp endpoint has no numeric port "
                              f"({port_text!r})")
        try:
            port = parse_port(name, port_text)
        except ConfigError:  # named with the whole endpoint, not the port alone
            raise ConfigError(f"{name}={value!r}: port {port_text} is out of range "
                              "(1..65535)") from None
        if host in _EVERY_INTERFACE:
            return Endpoint("tcp", host=default_host, port=port, source=name, bind_host="*")
        host = host.strip("[]")
        return Endpoint("tcp", host=host, port=port, source=name, bind_host=host)
    for scheme in ("ipc", "inproc"):
        prefix = f"{scheme}://"
        if text.startswith(prefix):
            address = text[len(prefix):]
            if not address:
                raise ConfigError(f"{name}={value!r}: empty {scheme} address")
            return Endpoint(scheme, address=address, source=name)  # type: ignore[arg-type]
    raise ConfigError(f"{name}={value!r}: expected a port number or an endpoint starting with "
                      + ", ".join(ENDPOINT_SCHEMES))

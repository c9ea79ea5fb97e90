"""A private ``redis-server`` for tests, the demo and benchmarks: on a unix socket in its own
directory (``unix_address``) and a free loopback TCP port (``address``), persisting nothing.

Usage (the caller's thread)::

    with RedisServer(tmp_path, maxmemory="8mb", policy="allkeys-lru") as server:
        settings = SharedSettings(store="redis", model_key="m", address=server.unix_address)

Debian's ``redis-server`` package (7.0 here) provides the binary. ``--save ""`` and
``--appendonly no`` keep it from writing anything; readiness is a PING answered on the socket.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Sequence

from kvbm_plugin.testing.local_server import LocalServer, ServerError, free_port

__all__ = ["INSTALL_HINT", "RedisServer", "ServerError", "server_binary"]

INSTALL_HINT = "apt-get install -y redis-server (Debian), and pip install '.[redis]'"


def server_binary() -> str:
    """Path of ``redis-server``; raises ServerError naming the package."""
    found = shutil.which("redis-server") or next(
        (p for p in ("/usr/bin/redis-server", "/usr/sbin/redis-server") if os.access(p, os.X_OK)),
        None)
    if found is None:
        raise ServerError(f"no redis-server binary: {INSTALL_HINT}")
    return found


class RedisServer(LocalServer):
    """One ``redis-server`` (``maxmemory`` and ``policy``: eviction knobs for fault tests;
    ``tcp=False``: the unix socket only, ``--port 0``)."""

    kind = "redis-server"

    def __init__(self, directory: str | os.PathLike[str], *, host: str = "127.0.0.1",
                 tcp: bool = True, maxmemory: str | None = None, policy: str | None = None,
                 extra_args: Sequence[str] = (), ready_timeout_s: float = 20.0) -> None:
        super().__init__(directory, ready_timeout_s)
        self.host = host
        self.tcp = tcp
        self.maxmemory = maxmemory
        self.policy = policy
        self.extra_args = tuple(extra_args)
        self.binary = server_binary()
        self.port = 0
        self.socket_path = str(self.directory / "redis.sock")

    @property
    def address(self) -> str:
        """The TCP URL (``DYN_KVBM_SHARED_ADDRESS``)."""
        if not self.tcp:
            raise ServerError("this redis-server listens on its unix socket only")
        return f"redis://{self.host}:{self.port}/0"

    @property
    def unix_address(self) -> str:
        """The unix-socket URL (``DYN_KVBM_SHARED_ADDRESS``)."""
        return f"unix://{self.socket_path}"

    def _pick_ports(self) -> None:
        self.port = free_port(self.host) if self.tcp else 0

    def _command(self) -> list[str]:
        command = [self.binary, "--port", str(self.port), "--bind", self.host,
                   "--unixsocket", self.socket_path, "--unixsocketperm", "700",
                   "--save", "", "--appendonly", "no", "--dir", str(self.directory)]
        if self.maxmemory is not None:
            command += ["--maxmemory", self.maxmemory]
        if self.policy is not None:
            command += ["--maxmemory-policy", self.policy]
        return command + list(self.extra_args)

    def _ready(self) -> bool:
        try:
            return self.command("PING") == "+PONG"
        except OSError:
            return False

    def command(self, *args: str, timeout_s: float = 1.0) -> str:
        """One inline command on the unix socket; its first reply line (``+PONG``, ``:3``)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout_s)
            conn.connect(self.socket_path)
            conn.sendall((" ".join(args) + "\r\n").encode())
            data = b""
            while not data.endswith(b"\r\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
        return data.split(b"\r\n", 1)[0].decode("utf-8", "replace")

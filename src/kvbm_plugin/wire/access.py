"""An IP allowlist for the tcp sockets this process binds, through ZMQ's ZAP.

``DYN_KVBM_ZMQ_ALLOW`` (:func:`kvbm_plugin.consolidator_config.load_allowlist`) names the
addresses that may connect to the GPU-tier publishers and their replay ROUTERs, the
consolidated output and its replay, and the shared-tier announce endpoint. With a list, each
such socket gets a ZAP domain, and a ZAP handler (pyzmq's
:class:`zmq.auth.thread.ThreadAuthenticator`, one thread per ZMQ context) answers each new
connection's handshake: an address on the list is admitted, any other is refused before a
single message of it is read (libzmq ``src/null_mechanism.cpp``: with a ZAP domain the NULL
handshake waits for the handler's "200"). Without a list nothing changes (no domain, no
thread): whoever reaches the bind address may connect, as before.

Who calls what: the thread that creates a socket calls :meth:`Allowlist.start` (once per
context, before the socket binds), :meth:`Allowlist.configure` on the socket before it binds,
and :meth:`Allowlist.stop` after closing the sockets and before terminating the context (the
handler's own socket would keep ``term`` waiting). Not thread-safe.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import zmq

logger = logging.getLogger(__name__)

ZAP_DOMAIN = b"kvbm"


class Allowlist:
    """Admits only ``addresses`` (IP addresses, as the peer's socket reports them) to the
    sockets it configures; an empty list admits everyone and starts nothing."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self.addresses = tuple(addresses)
        self._auth: Any = None  # zmq.auth.thread.ThreadAuthenticator while started

    def start(self, context: zmq.Context, owned: bool) -> None:
        """Start the ZAP handler on ``context`` (a no-op without a list, or when started).
        ``owned``: the caller made ``context`` and terminates it itself; a shared one (the
        process-wide instance, used for inproc, which ZAP does not cover) gets no handler."""
        if not self.addresses or self._auth is not None or not owned:
            return
        from zmq.auth.thread import ThreadAuthenticator  # only with a list

        auth = ThreadAuthenticator(context, log=logging.getLogger("kvbm_plugin.zap"))
        auth.start()
        auth.allow(*self.addresses)
        self._auth = auth

    def configure(self, sock: zmq.Socket) -> None:
        """Put ``sock`` under the handler (before it binds); a no-op without a handler."""
        if self._auth is not None:
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)

    def stop(self) -> None:
        """Stop the handler (after the sockets it guards are closed); idempotent."""
        auth, self._auth = self._auth, None
        if auth is not None:
            auth.stop()

"""Announcements between leaders: "this engine wrote these blocks to the shared store".

Each leader's :class:`~.agent.SharedAgent` thread owns one :class:`Announcer`: an XPUB socket
bound at this leader's announce endpoint (:func:`announce_endpoint`) and a SUB socket connected
to every peer's (``DYN_KVBM_SHARED_PEERS``). A message is one batch of
:class:`~.directory.SharedBlock` the sender confirmed in the store; a receiver never trusts it
(its agent confirms every block with ``exists()`` before it is tracked) and never forwards it,
so there are no loops, and a leader that starts late learns only what is announced after its
SUB joined (plus its own writes).

Wire format (msgpack, one frame): ``["kvbm-shared", 1, sender, seq, blocks]``: ``sender`` a
random u64 naming the sending announcer (a leader ignores its own), ``seq`` its message count
from 0 (a jump is counted as ``lost``), each block ``[digest, parent_digest, event_hash,
parent_event_hash, token_ids, lora_id, extra_keys]`` (digests as msgpack bin, None as nil).
Every field is checked on receipt (:func:`decode`); a bad message is counted, logged
rate-limited and skipped, never raised on the receiving thread.

The sockets are made, used and closed by the thread that calls :meth:`Announcer.open` (the
agent's); only :meth:`Announcer.stats` may be called from another thread.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Final

import msgpack
import zmq

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin._util.saferepr import saferepr
from kvbm_plugin.tiers.shared.directory import SharedBlock, check_block
from kvbm_plugin.wire.access import Allowlist
from kvbm_plugin.wire.guard import SubscriptionGuard

if TYPE_CHECKING:
    from kvbm_plugin.shared_settings import SharedSettings

__all__ = ["AnnouncementError", "Announcer", "announce_endpoint", "decode", "encode"]

logger = logging.getLogger(__name__)

MAGIC: Final = "kvbm-shared"
VERSION: Final = 1
ANNOUNCE_PORT_OFFSET: Final = 2000  # default port: DYN_KVBM_LEADER_ZMQ_PUB_PORT + this + dp
MAX_MESSAGE_BYTES: Final = 16 << 20  # a larger message is refused by the SUB (ZMQ_MAXMSGSIZE)
BLOCKS_PER_MESSAGE: Final = 256
MAX_TOKENS: Final = 1 << 16  # per block
_MAX_SENDERS: Final = 4096  # per-sender seq bookkeeping (forgotten beyond, counted)


class AnnouncementError(ValueError):
    """A message that is not a well-formed announcement (the text names the field)."""


def announce_endpoint(settings: SharedSettings, env: Mapping[str, str] | None,
                      dp_rank: int) -> str:
    """The endpoint the leader of ``dp_rank`` binds its announcements on.

    ``DYN_KVBM_SHARED_ANNOUNCE_ENDPOINT`` when set (rank r: tcp port + r, ipc/inproc path +
    ``_dp{r}``, as every per-rank endpoint of the project), else
    ``tcp://DYN_KVBM_LEADER_ZMQ_HOST:(DYN_KVBM_LEADER_ZMQ_PUB_PORT + 2000 + dp_rank)``.
    Raises ConfigError naming the variable for an unusable value. Peers connect to what this
    returns (for ``tcp://*:P``: this host's name and port P + r)."""
    env = os.environ if env is None else env
    if dp_rank < 0:
        raise ValueError(f"dp_rank {dp_rank!r} must be >= 0")
    host = (env.get(cc.LEADER_ZMQ_HOST) or "127.0.0.1").strip()
    if not host or any(c in host for c in "/ ") or host.isdigit():
        raise cc.ConfigError(f"{cc.LEADER_ZMQ_HOST}={env.get(cc.LEADER_ZMQ_HOST)!r} is not a "
                             "host name")
    if settings.announce_endpoint:
        endpoint = cc.parse_endpoint(cc.SHARED_ANNOUNCE_ENDPOINT, settings.announce_endpoint,
                                     default_host=host)
        return endpoint.for_rank(dp_rank).bind
    port_text = env.get(cc.LEADER_ZMQ_PUB_PORT) or cc.ENV_VARS_BY_NAME[
        cc.LEADER_ZMQ_PUB_PORT].default or ""
    leader_port = cc.parse_port(cc.LEADER_ZMQ_PUB_PORT, port_text)
    port = leader_port + ANNOUNCE_PORT_OFFSET + dp_rank
    if port > 65535:
        raise cc.ConfigError(f"{cc.LEADER_ZMQ_PUB_PORT}={leader_port}: the shared-tier "
                             f"announce port {leader_port} + {ANNOUNCE_PORT_OFFSET} + dp rank "
                             f"{dp_rank} exceeds 65535; set {cc.SHARED_ANNOUNCE_ENDPOINT}")
    return cc.Endpoint("tcp", host=host, port=port, source=cc.LEADER_ZMQ_PUB_PORT,
                       bind_host=host).bind


def encode(sender: int, seq: int, blocks: Sequence[SharedBlock]) -> bytes:
    """One announcement message."""
    return msgpack.packb([MAGIC, VERSION, sender, seq, [
        [b.digest, b.parent_digest, b.event_hash, b.parent_event_hash, list(b.token_ids),
         b.lora_id, b.extra_keys] for b in blocks]], use_bin_type=True)


def decode(payload: bytes) -> tuple[int, int, list[SharedBlock]]:
    """``(sender, seq, blocks)`` of one message; AnnouncementError naming what is wrong."""
    if len(payload) > MAX_MESSAGE_BYTES:
        raise AnnouncementError(f"message of {len(payload)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        message = msgpack.unpackb(payload, raw=False, use_list=False, strict_map_key=True)
    except Exception as exc:  # any malformed msgpack (ExtraData, FormatError, ValueError ...)
        raise AnnouncementError(f"not msgpack: {type(exc).__name__}: "
                                f"{saferepr(str(exc))}") from None
    if not isinstance(message, tuple) or len(message) != 5:
        raise AnnouncementError(f"message {saferepr(message)} is not a 5-item array")
    magic, version, sender, seq, blocks = message
    if magic != MAGIC:
        raise AnnouncementError(f"magic {saferepr(magic)} is not {MAGIC!r}")
    if version != VERSION:
        raise AnnouncementError(f"version {saferepr(version)} is not {VERSION}")
    for name, value in (("sender", sender), ("seq", seq)):
        if type(value) is not int or not 0 <= value < 1 << 64:
            raise AnnouncementError(f"{name} {saferepr(value)} is not a u64")
    if not isinstance(blocks, tuple):
        raise AnnouncementError(f"blocks {saferepr(blocks)} is not an array")
    out = []
    for i, raw in enumerate(blocks):
        if not isinstance(raw, tuple) or len(raw) != 7:
            raise AnnouncementError(f"block {i}: {saferepr(raw)} is not a 7-item array")
        if isinstance(raw[4], tuple) and len(raw[4]) > MAX_TOKENS:
            raise AnnouncementError(f"block {i}: token_ids has {len(raw[4])} items "
                                    f"(> {MAX_TOKENS})")
        try:
            out.append(check_block(SharedBlock(*raw)))
        except ValueError as exc:
            raise AnnouncementError(f"block {i}: {exc}") from None
    return sender, seq, out


class Announcer:
    """This leader's announcement sockets (see the module docstring).

    ``endpoint``: where the XPUB binds (None: this leader announces nothing); ``peers``: the
    other leaders' endpoints the SUB connects to. Nothing is opened until :meth:`open`.
    """

    def __init__(self, endpoint: str | None, peers: Sequence[str], *,
                 context: zmq.Context | None = None, sender: int | None = None,
                 allow: Sequence[str] | None = None, max_peers: int | None = None) -> None:
        self.endpoint = endpoint
        self.peers = tuple(peers)
        self.sender = int.from_bytes(os.urandom(8), "little") if sender is None else sender
        self._context = context
        self._own_context = False
        self.pub: zmq.Socket | None = None
        self.sub: zmq.Socket | None = None
        self._seq = 0
        self._next_seq: dict[int, int] = {}  # sender -> the seq expected next
        self._log = RateLimitedLog(logger)
        # Peers' subscriptions: only b"" can match a topic-less message; others are bounded
        # (wire/guard.py), as are the connections (DYN_KVBM_ZMQ_MAX_PEERS unless
        # ``max_peers`` is given). Who may connect: DYN_KVBM_ZMQ_ALLOW unless ``allow`` is.
        self._guard = SubscriptionGuard(
            "Announcer", b"", max_peers=cc.load_max_peers() if max_peers is None else max_peers)
        self._allowlist = Allowlist(cc.load_allowlist() if allow is None else allow)
        self.last_bad: str | None = None  # why the last bad message was refused
        self._n = dict.fromkeys(("announced", "announce_messages", "announce_dropped",
                                 "heard_messages", "heard", "bad_announcements", "lost",
                                 "own_ignored", "subscriptions"), 0)

    def open(self) -> None:
        """Bind and connect (on the thread that will use the sockets). Raises ZMQError for an
        endpoint that cannot be bound or connected (the caller names it)."""
        if self._context is None:
            self._context = zmq.Context()
            self._own_context = True
        try:
            if self.endpoint is not None:
                self._allowlist.start(self._context, self._own_context)
                pub = self.pub = self._context.socket(zmq.XPUB)
                pub.setsockopt(zmq.LINGER, 0)
                pub.setsockopt(zmq.SNDHWM, 1024)
                # Manual subscriptions (every peer's is seen, only b"" applied), bounded.
                self._guard.configure(pub)
                self._allowlist.configure(pub)
                pub.bind(self.endpoint)
            if self.peers:
                sub = self.sub = self._context.socket(zmq.SUB)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.RCVHWM, 4096)
                sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                for peer in self.peers:
                    sub.connect(peer)
        except Exception:
            self.close()
            raise

    def sockets(self) -> list[zmq.Socket]:
        """The sockets to poll for input (the SUB's announcements, the XPUB's subscriptions)."""
        guarded = self._guard.sockets if self.pub is not None else []
        return [s for s in (self.sub, self.pub, *guarded) if s is not None]

    def publish(self, blocks: Sequence[SharedBlock]) -> None:
        """Announce ``blocks`` (in messages of :data:`BLOCKS_PER_MESSAGE`). Never blocks: a
        message a slow peer has no room for is dropped by ZMQ for that peer (the peer counts
        the gap in its ``lost``); one no peer can take is counted here."""
        if self.pub is None or not blocks:
            return
        for start in range(0, len(blocks), BLOCKS_PER_MESSAGE):
            chunk = blocks[start:start + BLOCKS_PER_MESSAGE]
            payload = encode(self.sender, self._seq, chunk)
            self._seq += 1
            try:
                self.pub.send(payload, zmq.NOBLOCK)
            except zmq.Again:
                self._n["announce_dropped"] += len(chunk)
                continue
            self._n["announce_messages"] += 1
            self._n["announced"] += len(chunk)

    def receive(self, limit: int = 64) -> list[SharedBlock]:
        """The blocks of up to ``limit`` messages waiting on the SUB (never blocks); also reads
        the XPUB's subscriptions. Bad messages are counted and skipped."""
        self._read_subscriptions()
        if self.sub is None:
            return []
        out: list[SharedBlock] = []
        for _ in range(limit):
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            try:
                if len(frames) != 1:
                    raise AnnouncementError(f"{len(frames)} frames, expected 1")
                sender, seq, blocks = decode(frames[0])
            except AnnouncementError as exc:
                self._bad(str(exc))
                continue
            if sender == self.sender:
                self._n["own_ignored"] += 1
                continue
            self._n["heard_messages"] += 1
            self._n["heard"] += len(blocks)
            self._note_seq(sender, seq)
            out.extend(blocks)
        return out

    def stats(self) -> dict[str, int]:
        return {**self._n, **self._guard.stats()}

    def close(self) -> None:
        """Close the sockets (and the context it made); idempotent."""
        if self.pub is not None:
            self._guard.close()  # its connection monitor, before the XPUB
        for sock in (self.pub, self.sub):
            if sock is not None:
                sock.close(linger=0)
        self.pub = self.sub = None
        self._allowlist.stop()
        if self._own_context and self._context is not None:
            self._context.term()
            self._context = None
            self._own_context = False

    # ---- internals -------------------------------------------------------------------

    def _read_subscriptions(self) -> None:
        if self.pub is None:
            return
        applied = self._guard.applied
        self._guard.service(self.pub)  # bounded per call; the agent's next turn reads on
        joined = self._guard.applied - applied
        if joined:  # a peer's SUB joined (its filter is in place now)
            self._n["subscriptions"] += joined
            logger.info("kvbm_plugin: %d peer subscription(s) to the shared-tier "
                        "announcements on %s", joined, self.endpoint)

    def _note_seq(self, sender: int, seq: int) -> None:
        expected = self._next_seq.get(sender)
        if expected is not None and seq > expected:
            self._n["lost"] += seq - expected
            self._log.log(logging.WARNING, "lost", "kvbm_plugin: %d shared-tier announcement "
                          "message(s) from peer %016x were lost (its blocks are not loadable "
                          "here until it writes them again)", seq - expected, sender)
        if expected is None and len(self._next_seq) >= _MAX_SENDERS:
            self._next_seq.clear()
        self._next_seq[sender] = seq + 1

    def _bad(self, why: str) -> None:
        self._n["bad_announcements"] += 1
        self.last_bad = why
        self._log.log(logging.WARNING, "bad", "kvbm_plugin: bad shared-tier announcement "
                      "ignored: %s", why)


"""Announcements between leaders: "this engine wrote these blocks to the shared store".

Each leader's :class:`~.agent.SharedAgent` thread owns one :class:`Announcer`: an XPUB socket
bound at this leader's announce endpoint (:func:`announce_endpoint`) and a SUB socket connected
to every peer's (``DYN_KVBM_SHARED_PEERS``). A message is one batch of
:class:`~.block.SharedBlock` the sender confirmed in the store; a receiver never trusts it
(its agent confirms every block with ``exists()`` before it is tracked) and never forwards it,
so there are no loops, and a leader that starts late learns only what is announced after its
SUB joined (plus its own writes).

**Wire format** (one frame): a 32-byte HMAC-SHA256 tag, then the msgpack body ``["kvbm-shared",
2, sender, seq, time_ms, blocks]``. The tag is over the body, keyed by the deployment's secret
(``DYN_KVBM_SHARED_ANNOUNCE_SECRET_FILE``, the same on every engine): a frame whose tag does not
match is dropped before its body is parsed. ``sender`` is a random u64 naming the sending
announcer (a leader ignores its own), ``seq`` its message count from 0 (a jump is counted as
``lost``; a seq at or below one already heard is a replay, dropped), ``time_ms`` the sender's
wall clock (a message more than :data:`REPLAY_WINDOW_S` off this host's clock is dropped, so a
recorded message cannot be replayed to a leader that has not heard its sender yet). Each block
is ``[digest, parent_digest, event_hash, parent_event_hash, token_ids, lora_id, extra_keys,
mm]`` (digests as msgpack bin, None as nil; ``mm`` the multimodal part of the reuse scope).

**Nothing announced is believed that the receiver can recompute.** Every field is checked
(:func:`decode`), then each block's digest is recomputed from its tokens, its parent digest
and the reuse scope its announced cache salt (``extra_keys``), LoRA id and ``mm`` make
(:func:`block_scope`, the scope string the leader keys blocks by,
``wire.identity.request_scope``), and its token count must be this engine's block size: a
block whose metadata does not hash to its digest is dropped (``forged``) before it is queued,
so it can never make this leader advertise tokens it cannot load, nor take the place of the
honest announcement of the same object. (The event hashes a block is advertised under are
TensorRT-LLM's and cannot be recomputed here, nor can the digests of the multimodal items a
block overlaps, in its ``extra_keys`` before the salt; they are believed from a peer that
holds the secret.) The object's presence on every rank is then checked by the agent (``exists()``).

**Bounds** (whatever a peer or an outsider sends): a frame over :data:`MAX_MESSAGE_BYTES` is
refused by ZMQ before it is read (``ZMQ_MAXMSGSIZE``: the connection is dropped and made again,
counted as ``peer_disconnects``); at most :data:`RCVHWM` messages wait per peer connection
(so at most RCVHWM x MAX_MESSAGE_BYTES = 16 MiB each); a message of more than
:data:`BLOCKS_PER_MESSAGE` blocks is refused; each authenticated sender may announce
``DYN_KVBM_SHARED_ANNOUNCE_RATE`` blocks per second (twice that in a burst; more are dropped,
counted as ``rate_limited``); and one :meth:`Announcer.receive` reads for at most its time
budget (:data:`HEAR_BUDGET_S` by default), at most :data:`MESSAGES_PER_TURN` announcements and
:data:`SUBSCRIPTIONS_PER_TURN` subscription frames, whatever is still waiting: the agent's
turns, and so its lease renewals, go on during a flood. A bad message is counted, logged
rate-limited and skipped, never raised on the receiving thread.

The sockets are made, used and closed by the thread that calls :meth:`Announcer.open` (the
agent's); only :meth:`Announcer.stats` may be called from another thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Final, NamedTuple

import msgpack
import zmq

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin._util.saferepr import saferepr
from kvbm_plugin.tiers.shared.block import SharedBlock, check_block
from kvbm_plugin.tiers.shared.keys import content_digest
from kvbm_plugin.wire.access import Allowlist
from kvbm_plugin.wire.guard import SubscriptionGuard
from kvbm_plugin.wire.identity import SALT_TAG, is_mm_digest, salt_extra_key, scope_string
from kvbm_plugin.wire.reconnect import keep_alive

if TYPE_CHECKING:
    from kvbm_plugin.settings.shared import SharedSettings

__all__ = ["Announcement", "AnnouncementError", "Announcer", "Unauthenticated",
           "announce_endpoint", "block_scope", "decode", "encode", "mm_of_scope"]

logger = logging.getLogger(__name__)

MAGIC: Final = "kvbm-shared"
VERSION: Final = 3  # 3: the block digests of content_keys.chain_digest
ANNOUNCE_PORT_OFFSET: Final = 2000  # default port: DYN_KVBM_LEADER_ZMQ_PUB_PORT + this + dp
# A larger frame is refused by the SUB (ZMQ_MAXMSGSIZE). 256 blocks of 128 tokens take about
# 200 KiB; a sender splits a message that would be larger (publish()).
MAX_MESSAGE_BYTES: Final = 256 << 10
RCVHWM: Final = 64  # messages waiting per peer connection: <= 16 MiB each
BLOCKS_PER_MESSAGE: Final = 256  # sent and accepted, at most
MAX_TOKENS: Final = 1 << 16  # per block (before the block size is known)
TAG_BYTES: Final = 32  # HMAC-SHA256
REPLAY_WINDOW_S: Final = 60.0  # a message's time may differ this much from this host's clock
HEAR_BUDGET_S: Final = 0.02  # reading time of one receive(), at most (checked between frames)
MESSAGES_PER_TURN: Final = 64
SUBSCRIPTIONS_PER_TURN: Final = 4096
_MAX_SENDERS: Final = 4096  # per-sender seq and rate bookkeeping (forgotten beyond)


class AnnouncementError(ValueError):
    """A message that is not a well-formed announcement (the text names the field)."""


class Unauthenticated(AnnouncementError):
    """A frame whose tag does not match the body under this engine's secret."""


class Announcement(NamedTuple):
    """One decoded message: ``mms[i]`` is the multimodal scope part of ``blocks[i]``."""

    sender: int
    seq: int
    time_ms: int
    blocks: list[SharedBlock]
    mms: list[str | None]


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


def mm_of_scope(scope: str | None) -> str | None:
    """The multimodal part of a reuse scope string (``wire.identity.scope_string``), or None."""
    if scope:
        for part in scope.split(","):
            if part.startswith("mm:"):
                return part[3:]
    return None


# The multimodal digests one block's extra_keys may carry (the items overlapping it).
MAX_MM_KEYS: Final = 64


def block_scope(block: SharedBlock, mm: str | None) -> str | None:
    """The reuse scope a block's digest is keyed under, from what it is advertised with (its
    cache salt item in ``extra_keys``, its LoRA id) and ``mm``; ValueError when ``extra_keys``
    is not a form this plugin writes (``wire.identity.scope_extra_keys``: None, or up to
    :data:`MAX_MM_KEYS` multimodal digests as 64 lowercase hex digits, only with ``mm``, then
    at most one salt item). The digests are believed from a peer that holds the secret, as its
    event hashes are: they are not part of the scope a digest is keyed under."""
    extra = block.extra_keys
    salt: int | None = None
    if extra is not None:
        n_mm = 0
        while n_mm < len(extra) and is_mm_digest(extra[n_mm]):
            n_mm += 1
        if n_mm and mm is None:
            raise ValueError(f"extra_keys {saferepr(extra)} carries multimodal digests, but "
                             "the block's scope has no multimodal part")
        if n_mm > MAX_MM_KEYS:
            raise ValueError(f"extra_keys carries {n_mm} multimodal digests, more than "
                             f"{MAX_MM_KEYS}")
        rest = extra[n_mm:]
        item = rest[0] if len(rest) == 1 else None
        if not rest and n_mm:
            item = None
        elif not isinstance(item, str) or not item.startswith(SALT_TAG):
            raise ValueError(f"extra_keys {saferepr(extra)} is not None, or multimodal "
                             f"digests then at most one {SALT_TAG!r} item")
        if item is not None:
            try:
                salt = int(item[len(SALT_TAG):], 16)
            except ValueError:
                raise ValueError(f"extra_keys {saferepr(extra)}: not a hex salt") from None
            if salt_extra_key(salt) != item:
                raise ValueError(f"extra_keys {saferepr(extra)}: not a canonical salt")
    lora = block.lora_id
    if lora is not None and lora < 0:
        raise ValueError(f"lora_id {lora} is negative")
    return scope_string(salt, lora, mm)


def _tag(secret: bytes, body: bytes) -> bytes:
    return hmac.new(secret, body, hashlib.sha256).digest()


def encode(secret: bytes, sender: int, seq: int, blocks: Sequence[SharedBlock],
           mms: Sequence[str | None] | None = None, *, time_ms: int | None = None) -> bytes:
    """One announcement frame, signed with ``secret`` (``mms``: each block's multimodal scope
    part, None for all; ``time_ms``: now by default)."""
    if time_ms is None:
        time_ms = int(time.time() * 1000)
    if mms is None:
        mms = [None] * len(blocks)
    body = msgpack.packb([MAGIC, VERSION, sender, seq, time_ms, [
        [b.digest, b.parent_digest, b.event_hash, b.parent_event_hash, list(b.token_ids),
         b.lora_id, b.extra_keys, mm] for b, mm in zip(blocks, mms, strict=True)]],
        use_bin_type=True)
    return _tag(secret, body) + body


def decode(payload: bytes, secret: bytes) -> Announcement:
    """One frame, authenticated with ``secret`` and checked field by field; Unauthenticated
    (a subclass of AnnouncementError) when the tag does not match, AnnouncementError naming
    what is wrong otherwise. The digests are not checked here (:meth:`Announcer.receive`)."""
    if len(payload) > MAX_MESSAGE_BYTES:
        raise AnnouncementError(f"message of {len(payload)} bytes exceeds {MAX_MESSAGE_BYTES}")
    tag, body = payload[:TAG_BYTES], payload[TAG_BYTES:]
    if len(tag) < TAG_BYTES or not hmac.compare_digest(tag, _tag(secret, body)):
        raise Unauthenticated(f"a frame of {len(payload)} bytes failed authentication")
    try:
        message = msgpack.unpackb(body, raw=False, use_list=False, strict_map_key=True)
    except Exception as exc:  # any malformed msgpack (ExtraData, FormatError, ValueError ...)
        raise AnnouncementError(f"not msgpack: {type(exc).__name__}: "
                                f"{saferepr(str(exc))}") from None
    if not isinstance(message, tuple) or len(message) != 6:
        raise AnnouncementError(f"message {saferepr(message)} is not a 6-item array")
    magic, version, sender, seq, time_ms, blocks = message
    if magic != MAGIC:
        raise AnnouncementError(f"magic {saferepr(magic)} is not {MAGIC!r}")
    if version != VERSION:
        raise AnnouncementError(f"version {saferepr(version)} is not {VERSION}")
    for name, value in (("sender", sender), ("seq", seq), ("time_ms", time_ms)):
        if type(value) is not int or not 0 <= value < 1 << 64:
            raise AnnouncementError(f"{name} {saferepr(value)} is not a u64")
    if not isinstance(blocks, tuple):
        raise AnnouncementError(f"blocks {saferepr(blocks)} is not an array")
    if len(blocks) > BLOCKS_PER_MESSAGE:
        raise AnnouncementError(f"{len(blocks)} blocks in one message (> "
                                f"{BLOCKS_PER_MESSAGE})")
    out, mms = [], []
    for i, raw in enumerate(blocks):
        if not isinstance(raw, tuple) or len(raw) != 8:
            raise AnnouncementError(f"block {i}: {saferepr(raw)} is not an 8-item array")
        if isinstance(raw[4], tuple) and len(raw[4]) > MAX_TOKENS:
            raise AnnouncementError(f"block {i}: token_ids has {len(raw[4])} items "
                                    f"(> {MAX_TOKENS})")
        mm = raw[7]
        if mm is not None and (not isinstance(mm, str) or not 0 < len(mm) <= 64
                               or "," in mm):
            raise AnnouncementError(f"block {i}: mm {saferepr(mm)} is not None or a digest")
        try:
            out.append(check_block(SharedBlock(*raw[:7])))
        except ValueError as exc:
            raise AnnouncementError(f"block {i}: {exc}") from None
        mms.append(mm)
    return Announcement(sender, seq, time_ms, out, mms)


class Announcer:
    """This leader's announcement sockets (see the module docstring).

    ``endpoint``: where the XPUB binds (None: this leader announces nothing); ``peers``: the
    other leaders' endpoints the SUB connects to; ``secret``: the deployment's announcement
    secret (required when either is given); ``tokens_per_block``: this engine's block size
    (an announced block of another size is refused; None: not checked); ``rate``: blocks per
    second one sender may announce; ``wall_clock``: seconds since the epoch (tests).
    Nothing is opened until :meth:`open`.
    """

    def __init__(self, endpoint: str | None, peers: Sequence[str], *,
                 secret: bytes | None = None, tokens_per_block: int | None = None,
                 rate: float = 20000.0, context: zmq.Context | None = None,
                 sender: int | None = None,
                 wall_clock: Callable[[], float] = time.time,
                 allow: Sequence[str] | None = None, max_peers: int | None = None) -> None:
        if secret is None and (endpoint is not None or peers):
            raise ValueError("Announcer: announcements need a secret "
                             f"({cc.SHARED_ANNOUNCE_SECRET_FILE})")
        if not rate > 0:
            raise ValueError(f"Announcer rate {rate!r} must be > 0 blocks per second")
        self.endpoint = endpoint
        self.peers = tuple(peers)
        self.sender = int.from_bytes(os.urandom(8), "little") if sender is None else sender
        self._secret = secret or b""
        self._block_tokens = tokens_per_block
        self._rate = float(rate)
        self._burst = max(2 * self._rate, float(BLOCKS_PER_MESSAGE))
        self._wall = wall_clock
        self._context = context
        self._own_context = False
        self.pub: zmq.Socket | None = None
        self.sub: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._seq = 0
        self._next_seq: dict[int, int] = {}  # sender -> the seq expected next
        self._bucket: dict[int, tuple[float, float]] = {}  # sender -> (blocks, at)
        self._log = RateLimitedLog(logger)
        # Peers' subscriptions: only b"" can match a topic-less message; others are bounded
        # (wire/guard.py), as are the connections (DYN_KVBM_ZMQ_MAX_PEERS unless
        # ``max_peers`` is given). Who may connect: DYN_KVBM_ZMQ_ALLOW unless ``allow`` is.
        self._guard = SubscriptionGuard(
            "Announcer", b"", max_peers=cc.load_max_peers() if max_peers is None else max_peers)
        self._allowlist = Allowlist(cc.load_allowlist() if allow is None else allow)
        self.last_bad: str | None = None  # why the last bad message was refused
        # Whether the last receive() stopped at a bound with frames still waiting (a flood,
        # or a burst): the agent then pauses a little before its next turn.
        self.saturated = False
        self._n = dict.fromkeys(("announced", "announce_messages", "announce_dropped",
                                 "announce_too_large", "heard_messages", "heard",
                                 "bad_announcements", "unauthenticated", "replayed", "stale",
                                 "forged", "rate_limited", "lost", "own_ignored",
                                 "subscriptions", "subscription_frames", "peer_disconnects",
                                 "hear_budget_spent"), 0)

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
                keep_alive(pub)  # an engine gone silent is dropped, not kept towards the cap
                # Manual subscriptions (every peer's is seen, only b"" applied), bounded.
                self._guard.configure(pub)
                self._allowlist.configure(pub)
                pub.bind(self.endpoint)
            if self.peers:
                sub = self.sub = self._context.socket(zmq.SUB)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.RCVHWM, RCVHWM)
                sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                keep_alive(sub)  # an engine gone silent: its connection made again
                # A frame over MAXMSGSIZE drops the connection inside ZMQ: counted from here.
                self._monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                for peer in self.peers:
                    sub.connect(peer)
        except Exception:
            self.close()
            raise

    def sockets(self) -> list[zmq.Socket | int]:
        """The sockets to poll for input (the SUB's announcements, the XPUB's subscriptions,
        the SUB's disconnections, the XPUB's connection events: a wake-up fd)."""
        guarded = self._guard.sockets if self.pub is not None else []
        return [s for s in (self.sub, self.pub, self._monitor) if s is not None] + guarded

    def publish(self, blocks: Sequence[SharedBlock],
                mms: Sequence[str | None] | None = None) -> None:
        """Announce ``blocks`` (``mms``: their multimodal scope parts) in messages of at most
        :data:`BLOCKS_PER_MESSAGE` blocks and :data:`MAX_MESSAGE_BYTES`. Never blocks: a
        message a slow peer has no room for is dropped by ZMQ for that peer (the peer counts
        the gap in its ``lost``); one no peer can take is counted here."""
        if self.pub is None or not blocks:
            return
        if mms is None:
            mms = [None] * len(blocks)
        todo = [(start, min(start + BLOCKS_PER_MESSAGE, len(blocks)))
                for start in range(0, len(blocks), BLOCKS_PER_MESSAGE)]
        todo.reverse()
        while todo:
            start, end = todo.pop()
            payload = encode(self._secret, self.sender, self._seq, blocks[start:end],
                             mms[start:end])
            if len(payload) > MAX_MESSAGE_BYTES:
                if end - start == 1:  # a block of ~25k tokens: no peer would take it
                    self._n["announce_too_large"] += 1
                    continue
                middle = (start + end) // 2
                todo += [(middle, end), (start, middle)]
                continue
            self._seq += 1
            try:
                self.pub.send(payload, zmq.NOBLOCK)
            except zmq.Again:
                self._n["announce_dropped"] += end - start
                continue
            self._n["announce_messages"] += 1
            self._n["announced"] += end - start

    def receive(self, budget_s: float = HEAR_BUDGET_S) -> list[SharedBlock]:
        """The checked blocks of the announcements waiting on the SUB (never blocks); also
        reads the XPUB's subscriptions. Reads for at most ``budget_s`` (checked between
        frames), :data:`MESSAGES_PER_TURN` messages and :data:`SUBSCRIPTIONS_PER_TURN`
        subscription frames: what is left waits in ZMQ for the next call. Bad messages and
        blocks are counted and skipped."""
        deadline = time.monotonic() + budget_s
        self.saturated = not self._read_subscriptions(deadline)
        self._read_monitor()
        if self.sub is None:
            return []
        out: list[SharedBlock] = []
        for _ in range(MESSAGES_PER_TURN):
            if time.monotonic() >= deadline:
                self._n["hear_budget_spent"] += 1
                self.saturated = True
                break
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            try:
                if len(frames) != 1:
                    raise AnnouncementError(f"{len(frames)} frames, expected 1")
                message = decode(frames[0], self._secret)
            except Unauthenticated as exc:
                self._unauthenticated(str(exc))
                continue
            except AnnouncementError as exc:
                self._bad(str(exc))
                continue
            if message.sender == self.sender:
                self._n["own_ignored"] += 1
                continue
            if self._fresh(message) and self._within_rate(message):
                self._n["heard_messages"] += 1
                self._n["heard"] += len(message.blocks)
                out.extend(self._verified(message))
        else:
            self.saturated = True
        return out

    def stats(self) -> dict[str, int]:
        return {**self._n, **self._guard.stats()}

    def close(self) -> None:
        """Close the sockets (and the context it made); idempotent."""
        if self._monitor is not None:
            if self.sub is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self.sub.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
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

    def _read_subscriptions(self, deadline: float) -> bool:
        """Subscription frames of the XPUB: anyone who reaches the endpoint can send them as
        fast as they like, so at most SUBSCRIPTIONS_PER_TURN, until ``deadline``. Whether
        every waiting frame was read."""
        if self.pub is None:
            return True
        if time.monotonic() >= deadline:
            self._n["hear_budget_spent"] += 1
            return False
        guard = self._guard
        applied, read = guard.applied, guard.applied + guard.refused + guard.unsubscribed
        more = guard.service(self.pub)  # bounded per call; the agent's next turn reads on
        self._n["subscription_frames"] += (guard.applied + guard.refused + guard.unsubscribed
                                           - read)
        joined = guard.applied - applied
        if joined:  # a peer's SUB joined (its filter is in place now)
            self._n["subscriptions"] += joined
            self._log.log(logging.INFO, "subscribed", "kvbm_plugin: %d peer subscription(s) "
                          "to the shared-tier announcements on %s", joined, self.endpoint)
        return not more

    def _read_monitor(self) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        for _ in range(64):
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._n["peer_disconnects"] += 1
            endpoint = frames[-1].decode("utf-8", "replace") if frames else ""
            self._log.log(logging.WARNING, "disconnect", "kvbm_plugin: a shared-tier peer's "
                          "connection (%s) dropped: it went away, or sent a message over "
                          "%d bytes (refused)", saferepr(endpoint[:200]), MAX_MESSAGE_BYTES)
            if endpoint in self.peers and self.sub is not None:
                # ZMQ gives up a connection that broke the protocol (a frame over
                # MAXMSGSIZE) for good: connect again, so that a peer is never lost.
                with contextlib.suppress(zmq.ZMQError):
                    self.sub.disconnect(endpoint)
                with contextlib.suppress(zmq.ZMQError):
                    self.sub.connect(endpoint)

    def _fresh(self, message: Announcement) -> bool:
        """Not a replay: its time within REPLAY_WINDOW_S of this host's, its seq above every
        one heard from its sender (a jump counted as lost)."""
        skew = message.time_ms / 1000 - self._wall()
        if abs(skew) > REPLAY_WINDOW_S:
            self._n["stale"] += 1
            self._log.log(logging.WARNING, "stale", "kvbm_plugin: a shared-tier announcement "
                          "from peer %016x dropped: its time is %.0f s off this host's (a "
                          "replay, or the hosts' clocks differ by more than %g s)",
                          message.sender, skew, REPLAY_WINDOW_S)
            return False
        sender, seq = message.sender, message.seq
        expected = self._next_seq.get(sender)
        if expected is not None and seq < expected:
            self._n["replayed"] += 1
            self._log.log(logging.WARNING, "replayed", "kvbm_plugin: a replayed shared-tier "
                          "announcement (peer %016x, seq %d, expected %d+) dropped", sender,
                          seq, expected)
            return False
        if expected is not None and seq > expected:
            self._n["lost"] += seq - expected
            self._log.log(logging.WARNING, "lost", "kvbm_plugin: %d shared-tier announcement "
                          "message(s) from peer %016x were lost (its blocks are not loadable "
                          "here until it writes them again)", seq - expected, sender)
        if expected is None and len(self._next_seq) >= _MAX_SENDERS:
            self._next_seq.clear()
            self._bucket.clear()
        self._next_seq[sender] = seq + 1
        return True

    def _within_rate(self, message: Announcement) -> bool:
        """The sender's token bucket (``rate`` blocks per second, ``burst`` at most) has
        room for the message's blocks; else it is dropped, counted."""
        now = time.monotonic()
        level, at = self._bucket.get(message.sender, (self._burst, now))
        level = min(self._burst, level + (now - at) * self._rate)
        count = len(message.blocks)
        if count > level:
            self._bucket[message.sender] = (level, now)
            self._n["rate_limited"] += count
            self._log.log(logging.WARNING, "rate", "kvbm_plugin: peer %016x announces more "
                          "than %s=%g blocks per second: %d dropped", message.sender,
                          cc.SHARED_ANNOUNCE_RATE, self._rate, count)
            return False
        self._bucket[message.sender] = (level - count, now)
        return True

    def _verified(self, message: Announcement) -> list[SharedBlock]:
        """The blocks whose digest their announced tokens, parent and scope hash to (and of
        this engine's block size); the others are counted as forged and dropped."""
        out = []
        width = self._block_tokens
        for block, mm in zip(message.blocks, message.mms, strict=True):
            why = None
            if width is not None and len(block.token_ids) != width:
                why = f"{len(block.token_ids)} tokens, this engine's blocks have {width}"
            else:
                try:
                    scope = block_scope(block, mm)
                except ValueError as exc:
                    why = str(exc)
                else:
                    if content_digest(block.parent_digest, block.token_ids,
                                      scope) != block.digest:
                        why = "its tokens, parent and scope do not hash to its digest"
            if why is None:
                out.append(block)
                continue
            self._n["forged"] += 1
            self._log.log(logging.WARNING, "forged", "kvbm_plugin: shared-tier block %s "
                          "announced by peer %016x dropped: %s", block.digest.hex(),
                          message.sender, why)
        return out

    def _unauthenticated(self, why: str) -> None:
        self._n["unauthenticated"] += 1
        self.last_bad = why
        self._log.log(logging.WARNING, "unauthenticated", "kvbm_plugin: a shared-tier "
                      "announcement failed authentication and was dropped (%s; is %s the same "
                      "secret on every engine?)", why, cc.SHARED_ANNOUNCE_SECRET_FILE)

    def _bad(self, why: str) -> None:
        self._n["bad_announcements"] += 1
        self.last_bad = why
        self._log.log(logging.WARNING, "bad", "kvbm_plugin: bad shared-tier announcement "
                      "ignored: %s", why)

"""What the leader builds from its configuration: the event path it publishes through.

:func:`assemble_event_path` is called once, by ``KvbmConnectorLeader.__init__`` on rank 0 (a
thread-pool thread, concurrently with the worker's constructor), after the leader read and
validated the DYN_KVBM_* settings; it waits on nothing. It builds this rank's GPU-tier
publisher and the event sink in front of it, the in-process consolidator when enabled
(started), and picks the target of the leader's tier events (the consolidator, a
:class:`TierEventPublisher` on the rank's publisher, or one the caller passes). The leader owns
the parts afterwards: it flushes them each iteration and shuts them down at teardown. Never
imports torch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.consolidator_config import EVENTS_ENDPOINT, TRTLLM_ZMQ_PORT, ConsolidatorConfig
from kvbm_plugin.wire.events import BlockRemoved, BlockStored

if TYPE_CHECKING:
    from kvbm_plugin.consolidator.service import KvEventConsolidator
    from kvbm_plugin.event_sink import KvEventSink

logger = logging.getLogger(__name__)

__all__ = ["EventPath", "TierEventPublisher", "assemble_event_path"]


class TierEventPublisher:
    """Tier events without a consolidator: the same register_* API as ``KvEventConsolidator``,
    published as wire events with medium CPU/DISK on the rank's publisher.

    Called by the leader on the executor thread; ``flush`` publishes one batch (never blocks).
    """

    def __init__(self, publisher: Any, block_size: int, data_parallel_rank: int) -> None:
        self._publisher = publisher
        self._block_size = block_size
        self._dp_rank = data_parallel_rank
        self._events: list[dict[str, Any]] = []
        self.lost_batches = 0  # batches the publisher refused or raised on (leader stats)
        self._log = RateLimitedLog(logger)

    def register_store(self, tier: str, dp_rank: int, block_hash: int, parent_hash: int | None,
                       token_ids: Sequence[int], block_size: int, *, lora_id: int | None = None,
                       extra_keys: tuple[Any, ...] | None = None) -> None:
        self.register_stores(tier, dp_rank, [(block_hash, parent_hash, list(token_ids),
                                              lora_id, extra_keys)], block_size)

    def register_stores(self, tier: str, dp_rank: int,
                        stores: Sequence[tuple[int, int | None, list[int], int | None, Any]],
                        block_size: int) -> None:
        """:meth:`register_store` of each ``(hash, parent hash, token ids, lora id, extra
        keys)``, in order (the consolidator's batch form)."""
        append = self._events.append
        for block_hash, parent_hash, tokens, lora_id, extra_keys in stores:
            append(BlockStored([block_hash], parent_hash, tokens, block_size, lora_id=lora_id,
                               medium=tier,
                               extra_keys=None if extra_keys is None else [extra_keys]).to_wire())

    def register_remove(self, tier: str, dp_rank: int, block_hashes: Sequence[int]) -> None:
        self._events.append(BlockRemoved(list(block_hashes), medium=tier).to_wire())

    def register_clear(self, tier: str, dp_rank: int) -> None:
        # AllBlocksCleared carries no medium, so a tier reset is spelled as removals upstream.
        return None

    def flush(self) -> bool:
        if not self._events:
            return True
        events, self._events = self._events, []
        try:
            ok = bool(self._publisher.publish(events, self._dp_rank))
        except Exception as exc:  # executor thread: a transport plugin must not break it
            ok = False
            self._log.log(logging.ERROR, "publish-error", "TierEventPublisher: %s.publish "
                          "raised %s: %s; %d tier events lost", type(self._publisher).__name__,
                          type(exc).__name__, exc, len(events))
        if not ok:
            self.lost_batches += 1
        return ok


@dataclass
class EventPath:
    """The parts :func:`assemble_event_path` built; the leader owns them from then on."""

    # owns this rank's GPU-tier publisher (under attention DP, rank 0's owns every rank's);
    # None on an attention-DP rank other than 0, whose GPU-tier events rank 0 publishes
    event_sink: KvEventSink | None
    consolidator: KvEventConsolidator | None  # started; None when not enabled
    tier_events: Any  # the register_store/remove/clear target of the leader's tiers
    name_reader: Any = None  # TrtllmNameReader: TRT-LLM's stream read for names (no consolidator)


def assemble_event_path(config: ConsolidatorConfig, *, consolidate: bool, dp_rank: int,
                        block_size: int, tier_events: Any = None, own_gpu_stream: bool = True,
                        engine_observer: Any = None, engine_topic: str = "",
                        dp_size: int = 1, engine_forms: Any = None) -> EventPath:
    """Build the leader's event path from its validated ``config``: this rank's GPU-tier
    publisher (``config.publisher`` by name; a NullEventPublisher, said once, when no endpoint
    is configured) and the prefix-closed event sink in front of it; when ``consolidate``, the
    consolidator, started, to which the sink hands this rank's GPU-tier batches by direct call
    (``KvEventSink.hand_over``, ``KvEventConsolidator.take_gpu_batch``) while the publisher
    still sends them for readers outside the process. ``tier_events``: where the tiers' events
    go when given (the simulated engine's recorder); otherwise the consolidator, or a
    :class:`TierEventPublisher` on the rank's publisher.

    ``own_gpu_stream`` False: TensorRT-LLM publishes the GPU tier itself (its streaming
    publisher); with the consolidator on, this rank binds no publisher at all (the consolidator
    reads ``config.gpu_streams``, and ``engine_observer`` sees each of their batches, see
    ``KvEventConsolidator``), without it the rank's publisher carries the tiers' events only
    and a :class:`~kvbm_plugin.events.trtllm_publisher.TrtllmNameReader` (topic
    ``engine_topic``) hands TensorRT-LLM's batches to ``engine_observer``. ``engine_forms``
    (a :class:`~kvbm_plugin.consolidator.engine_forms.EngineForms`) normalises each of those
    batches first, on the consolidator's ingest thread or the reader's.

    Attention DP (``dp_size`` > 1): TensorRT-LLM's C++ KV cache manager gathers every rank's
    events onto rank 0, each tagged ``attention_dp_rank`` (``kvCacheEventManager.cpp``,
    ``exchangeAttentionDpThread``: ranks other than 0 serialise and clear their queue every
    ``attention_dp_events_gather_period_ms``). So rank 0's sink publishes every rank's batches,
    each on that rank's endpoint (``publish_endpoint(r)``: base + r) with its dp rank, and the
    other ranks' leaders build no GPU-tier publisher and never read their queue (a second
    reader would race the gather). Each rank's consolidator is its own
    (``config.for_dp_rank``): it subscribes to its rank's stream only.

    What it started is shut down again when a later step raises, so a failure leaves nothing
    running behind.
    """
    from kvbm_plugin.event_sink import KvEventSink
    from kvbm_plugin.wire.publisher import NullEventPublisher, create_publisher

    # The other ranks' GPU-tier publishers (rank 0 builds them) fill a {dp_rank} in the topic
    # with their own rank: for_dp_rank fills it with this rank's.
    rank_settings = config.publisher
    if dp_size > 1:
        config = config.for_dp_rank(dp_rank)
        if dp_rank != 0:
            return _other_dp_rank_path(config, consolidate, tier_events, engine_observer,
                                       engine_forms)
    if not own_gpu_stream and consolidate:
        publisher = NullEventPublisher(config.publisher)  # the sink never publishes here
    elif config.gpu_events is not None:
        publisher = create_publisher(config.publisher, config.publish_endpoint(dp_rank),
                                     config.replay_endpoint(dp_rank), dp_rank)
    elif consolidate:
        # The consolidator takes this rank's batches by direct call; without an endpoint
        # only readers outside the process go without the rank's GPU-tier stream.
        logger.info("kvbm_plugin: no GPU-tier endpoint configured (%s / %s): the rank's "
                    "GPU-tier stream is not published outside the process; the consolidated "
                    "output carries the GPU tier", TRTLLM_ZMQ_PORT, EVENTS_ENDPOINT)
        publisher = NullEventPublisher(config.publisher)
    else:
        # The consolidator is off: say once that nothing is published, rather than stay silent.
        logger.warning("kvbm_plugin: no KV-event endpoint configured (%s / %s): %s are "
                       "counted but not published", TRTLLM_ZMQ_PORT, EVENTS_ENDPOINT,
                       "GPU-tier and offload-tier events" if own_gpu_stream
                       else "offload-tier events")
        publisher = NullEventPublisher(config.publisher)
    sink: KvEventSink | None = None
    consolidator: KvEventConsolidator | None = None
    reader: Any = None
    others: dict[int, Any] = {}
    try:
        if own_gpu_stream and config.gpu_events is not None:
            for rank in range(1, dp_size):  # attention DP: rank 0 publishes every rank
                others[rank] = create_publisher(rank_settings, config.publish_endpoint(rank),
                                                config.replay_endpoint(rank), rank)
        sink = KvEventSink(publisher, block_size=block_size,
                           window_size=config.publisher.window_size,
                           data_parallel_rank=dp_rank, prefix_closed=True,
                           rank_publishers=others or None)
        if consolidate:
            from kvbm_plugin.consolidator.service import KvEventConsolidator

            # This rank's GPU-tier batches are made here: the sink hands them to the
            # consolidator as they are (no socket between them); they still go out on the
            # rank's publisher for other readers.
            direct = (dp_rank,) if own_gpu_stream else ()
            consolidator = KvEventConsolidator(config, engine_observer=engine_observer,
                                               direct_ranks=direct)
            consolidator.engine_forms = engine_forms
            consolidator.start()
            if direct:
                sink.hand_over(dp_rank, consolidator.take_gpu_batch)
            if tier_events is None:
                tier_events = consolidator
        elif tier_events is None:
            tier_events = TierEventPublisher(publisher, block_size, dp_rank)
        if not consolidate and engine_observer is not None and config.gpu_streams:
            from kvbm_plugin.events.trtllm_publisher import TrtllmNameReader

            rank, stream, _ = config.gpu_streams[0]
            reader = TrtllmNameReader(stream, engine_topic, engine_observer, rank,
                                      forms=engine_forms)
    except BaseException:
        if consolidator is not None:
            consolidator.shutdown()
        if sink is not None:
            sink.flush()
            sink.shutdown()
        else:
            for own in (publisher, *others.values()):
                own.shutdown()
        raise
    return EventPath(sink, consolidator, tier_events, reader)


def _other_dp_rank_path(config: ConsolidatorConfig, consolidate: bool,
                        tier_events: Any, engine_observer: Any = None,
                        engine_forms: Any = None) -> EventPath:
    """An attention-DP rank other than 0: no GPU-tier publisher (rank 0 publishes this rank's
    GPU-tier stream, see :func:`assemble_event_path`), its own consolidator. Its tier events
    have no stream of their own without a consolidator, so that is refused."""
    from kvbm_plugin.consolidator_config import ENABLE_CONSOLIDATOR, ConfigError

    if not consolidate and tier_events is None:
        raise ConfigError(
            f"attention DP rank {config.stream_ranks()[0]}: {ENABLE_CONSOLIDATOR} is off, but "
            "this rank's offload-tier events then have no stream (rank 0 publishes every "
            f"rank's GPU-tier stream); turn {ENABLE_CONSOLIDATOR} on (each rank's consolidated "
            "output carries its tiers and GPU blocks)")
    consolidator = None
    if consolidate:
        from kvbm_plugin.consolidator.service import KvEventConsolidator

        consolidator = KvEventConsolidator(config, engine_observer=engine_observer)
        consolidator.engine_forms = engine_forms
        consolidator.start()
        if tier_events is None:
            tier_events = consolidator
    return EventPath(None, consolidator, tier_events)

"""``kvbm-plugin demo --attention-dp N``: the demo's run under attention DP.

Each of the N ranks is its own process with its own executor, leader, worker, tiers and
consolidator (``kvbm_plugin.testing.adp``); rank 0 publishes every rank's GPU-tier stream
(TensorRT-LLM gathers the events there), each rank's consolidator publishes its own output.
The demo plays a KV-aware router (as NVIDIA Dynamo's does under attention DP): one router view
fed by every rank's consolidated output, the dp ranks kept apart, each request sent to the
rank the view says caches most of its prompt (ties: the least loaded), and its answer for that
rank compared with what that rank reused. Called by :func:`kvbm_plugin.cli.demo.run_demo`
on the CLI's thread.
"""

from __future__ import annotations

import time
from typing import Any

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.routers.router_view import RouterView, TreeSubscriber
from kvbm_plugin.testing.chat_workload import RouterProbe
from kvbm_plugin.wire.events import to_signed_int64


class AdpRouterProbe(RouterProbe):
    """The router's side under attention DP: settle every rank's streams, then query the
    shared view for one rank. ``subscribers[r]`` reads rank r's consolidated output."""

    def __init__(self, engine: Any, subscribers: list[TreeSubscriber],
                 settle_timeout: float = 10.0) -> None:
        super().__init__(engine, subscribers[0], settle_timeout=settle_timeout,
                         poll=self._poll_all)
        self.subscribers = subscribers
        self._routed: dict[int, int] = {}  # dp rank -> requests routed there
        # Requests whose rank's GPU pool held less of the prompt than the view said the rank
        # caches: the tiers were expected to serve the rest.
        self.tier_opportunities = 0

    def _poll_all(self, timeout_ms: int) -> None:
        for i, subscriber in enumerate(self.subscribers):
            subscriber.poll(timeout_ms if i == 0 else 0)

    def _upstream_done(self) -> bool:
        engine = self.engine
        if not engine.gathered():
            return False
        sink = engine.leader.event_sink
        for r in range(engine.size):
            cons = engine.call(r, "consolidator_stats")
            if cons["messages_received"] + cons["replayed_batches"] < \
                    sink.rank_batches_published(r):
                return False  # a batch rank 0 published for rank r is on its way
            if not engine.call(r, "consolidator_idle", 0):
                return False
        return True

    def caught_up(self) -> bool:
        if not self._upstream_done():
            return False
        return all(s.next_seq == self.engine.call(r, "consolidator_stats")["batches_out"]
                   for r, s in enumerate(self.subscribers))

    def settle(self) -> bool:
        """Every rank's copies in flight done, rank 0 publishing what was gathered, every
        rank's tier changes published; then wait for the view (see RouterProbe.settle)."""
        engine = self.engine
        deadline = time.monotonic() + self.settle_timeout
        while not all(engine.call(r, "workers_idle") for r in range(engine.size)) \
                and time.monotonic() < deadline:
            self._poll(1)
        while not engine.gathered() and time.monotonic() < deadline:
            self._poll(1)  # the exchange threads run every few ms
        for r in reversed(range(engine.size)):  # rank 0 last: it publishes the gathered events
            engine.call(r, "publish_now")
        self.settles += 1
        return self._wait_caught_up(deadline)

    def _batches(self) -> int:
        return sum(s.stats.batches for s in self.subscribers)

    def route(self, prompt: list[int], salt: str | None = None) -> int:
        """The rank whose caches hold most of the prompt (ties: fewest routed so far)."""
        best = max(range(self.engine.size), key=lambda r: (
            self.predict(prompt, salt, r), -self._routed.get(r, 0), -r))
        self._routed[best] = self._routed.get(best, 0) + 1
        if self.predict(prompt, salt, best) > self._gpu_prefix(prompt, salt, best):
            self.tier_opportunities += 1
        return best

    def _gpu_prefix(self, prompt: list[int], salt: str | None, rank: int) -> int:
        """Tokens of ``prompt``'s leading full blocks in ``rank``'s GPU pool now."""
        from kvbm_plugin.testing.fake_trtllm import trtllm_block_hash

        bs = self.view.block_size
        gpu = self.engine.call(rank, "resident_blocks")["GPU"][rank]
        parent = None
        for i in range(len(prompt) // bs):
            parent = trtllm_block_hash(parent, prompt[i * bs:(i + 1) * bs], salt)
            if parent not in gpu:
                return i * bs
        return len(prompt) // bs * bs


def subscribers_for(config: cc.ConsolidatorConfig, size: int, view: RouterView
                    ) -> list[TreeSubscriber]:
    """One subscriber per rank's consolidated output, all feeding ``view``."""
    out = []
    for r in range(size):
        ranked = config.for_dp_rank(r)
        out.append(TreeSubscriber(
            ranked.output.connect,
            None if ranked.output_replay is None else ranked.output_replay.connect,
            start_seq=0, view=view))
    return out


def tier_reuse_check(args: Any, engine: Any, probe: AdpRouterProbe, Check: Any  # noqa: N803
                     ) -> Any:
    """The tiers stored blocks, and served some wherever the router counted on them (a
    KV-aware router keeps a session on a rank whose GPU still holds it, so an eviction alone
    is no reason to expect tier hits)."""
    name = "prefixes reused from tiers"
    if "none" in args.tiers.split(","):
        return Check(name, True, "not exercised (--tiers none)")
    stats = engine.stats()
    reused = stats.host_hit_tokens + stats.disk_hit_tokens
    saved = sum(engine.call(r, "leader_stats")["saves_committed"] for r in range(engine.size))
    ok = saved > 0 and (probe.tier_opportunities == 0 or reused > 0)
    return Check(name, ok, f"host {stats.host_hit_tokens} + disk {stats.disk_hit_tokens} "
                           f"tokens; {probe.tier_opportunities} requests routed to a rank whose "
                           f"tiers held more of the prompt than its GPU; {saved} blocks saved")


def settle_and_check(engine: Any, subscribers: list[TreeSubscriber], args: Any,
                     probe: AdpRouterProbe, Check: Any  # noqa: N803 (the demo's check type)
                     ) -> tuple[list[Any], list[tuple[str, str]]]:
    """The last events out, every rank's view against its truth; (checks, summary)."""
    probe.settle()
    truth = engine.resident_blocks()
    if args.mode == "dedup":
        expected = {(r, to_signed_int64(h)) for per_rank in truth.values()
                    for r, hashes in per_rank.items() for h in hashes}
    else:
        expected = {(r, to_signed_int64(h), medium) for medium, per_rank in truth.items()
                    for r, hashes in per_rank.items() for h in hashes}

    def view() -> set:
        return set().union(*(s.held if args.mode == "dedup" else s.held_with_medium
                             for s in subscribers))

    deadline = time.monotonic() + args.settle_timeout
    while view() != expected and time.monotonic() < deadline:
        probe.settle()  # bounded by its own settle timeout
    stats = engine.stats()
    sink = engine.leader.event_sink.stats()
    gaps = sum(s.stats.gaps for s in subscribers)
    lost = sink["batches_lost"] + sum(
        engine.call(r, "consolidator_stats")["output_lost"] + s.stats.missing_batches
        + s.stats.history_missing for r, s in enumerate(subscribers))
    bad = [sum(getattr(s.stats, k) for s in subscribers)
           for k in ("duplicate_stores", "unknown_removes", "orphan_stores")]
    reads = [engine.call(r, "queue_reads") for r in range(1, engine.size)]
    failed = sum(engine.call(r, "leader_stats").get(k, 0) for r in range(engine.size)
                 for k in ("saves_failed", "demotes_failed", "loads_failed"))
    prompt = max(1, stats.prompt_tokens)
    per_rank = ", ".join(f"dp {r}: GPU {len(truth['GPU'][r])} host {len(truth['CPU'][r])} "
                         f"disk {len(truth['DISK'][r])}" for r in range(engine.size))
    summary = [
        ("requests", f"{stats.requests_finished} finished / {stats.requests_submitted} "
                     f"submitted, attention DP {engine.size} ranks (rank processes), "
                     f"{'plain' if args.no_overlap else 'overlap'} scheduler"),
        ("hit rate GPU / host / disk", f"{stats.gpu_hit_tokens / prompt:.1%} / "
                                       f"{stats.host_hit_tokens / prompt:.1%} / "
                                       f"{stats.disk_hit_tokens / prompt:.1%}"),
        ("GPU-tier events (rank 0 publishes every rank)",
         f"{sink['blocks_stored']} blocks stored, {sink['blocks_removed']} removed"),
        ("subscriber view", f"{len(view())} blocks held; truth {len(expected)} ({per_rank})"),
    ]
    checks = [
        Check("every request finished", stats.requests_finished == stats.requests_submitted,
              f"{stats.requests_finished}/{stats.requests_submitted}"),
        Check("onboarded KV bytes exact", stats.kv_mismatches == 0,
              f"{stats.kv_mismatches} mismatching blocks"),
        Check("no gaps, no losses", gaps == 0 and lost == 0, f"{gaps} gaps, {lost} lost"),
        Check("no duplicate STORE, no unknown REMOVE, parents first", not any(bad),
              f"{bad[0]} duplicate, {bad[1]} unknown, {bad[2]} orphan"),
        Check("subscriber view == every rank's tiers' true contents", view() == expected,
              f"missing {len(expected - view())}, extra {len(view() - expected)}"),
        Check("no reader races the gather (ranks other than 0 never read their queue)",
              not any(reads), f"reads per rank 1..: {reads}"),
        Check("no save, demotion or load broken on any rank", failed == 0, f"{failed}"),
    ]
    return checks, summary

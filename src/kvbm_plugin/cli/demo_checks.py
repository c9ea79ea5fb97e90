"""``kvbm-plugin demo``'s end-of-run checks: what must hold for the run to pass.

:func:`settle_and_check` waits until the subscriber has every event and compares its view with
what the GPU pool and tiers really hold; :func:`router_report` grades the router view against
the engine's reuse; :func:`failure_check` counts what must never happen (a broken transfer, an
ERROR logged, a dead thread, seen by :class:`ErrorWatch`); :func:`tier_reuse_check` asks the
tiers to have served evicted prefixes when :class:`FollowUps` saw the chance. Called by
:func:`kvbm_plugin.cli.demo.run_demo` on the CLI's main thread, once the workload has been
driven (``failure_check`` after the engine's shutdown); ``Check`` is handed to the other demos
(``demo_adp``, ``demo_engines``, ``demo_windows``) for their own checks.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvbm_plugin.cli.demo_report import format_bytes
from kvbm_plugin.wire.events import to_signed_int64


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


class ErrorWatch(logging.Handler):
    """Counts what the run must not produce: ERROR records of any ``kvbm_plugin`` logger and
    exceptions that escaped a thread (``threading.excepthook``); keeps the first few lines."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.errors = 0
        self.thread_exceptions = 0
        self.first: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.errors += 1
        self._keep(f"{record.name}: {record.getMessage()}")

    def _keep(self, line: str) -> None:
        if len(self.first) < 3:
            self.first.append(line[:200])

    @contextmanager
    def watching(self) -> Iterator[ErrorWatch]:
        plugin_logger = logging.getLogger("kvbm_plugin")
        previous_hook = threading.excepthook

        def hook(args: threading.ExceptHookArgs) -> None:
            self.thread_exceptions += 1
            self._keep(f"thread {args.thread.name if args.thread else '?'}: "
                       f"{args.exc_type.__name__}: {args.exc_value}")
            previous_hook(args)

        plugin_logger.addHandler(self)
        threading.excepthook = hook
        try:
            yield self
        finally:
            threading.excepthook = previous_hook
            plugin_logger.removeHandler(self)


def failure_check(engine, watch: ErrorWatch) -> Check:  # noqa: ANN001
    """Nothing failed on the way: no transfer job or op failed on any rank, the leader failed
    no save, demotion or load, nothing logged an ERROR and no thread died. (The demo injects no
    faults, so any of these is a bug even when the stream still came out right.)"""
    workers = [w.stats() for w in engine.workers]
    leader = engine.leader.stats()
    jobs = sum(w.get("jobs_failed", 0) for w in workers)
    ops = sum(w["ops_failed"] for w in workers)
    leader_failed = sum(leader.get(k, 0) for k in ("saves_failed", "demotes_failed",
                                                   "loads_failed"))
    ok = jobs == ops == leader_failed == watch.errors == watch.thread_exceptions == 0
    # Worded so that a clean run's output holds neither "ERROR" nor "failed": an operator (or
    # a script) grepping the demo's output for those words finds only real trouble.
    detail = (f"transfer jobs broken {jobs}, ops broken {ops}, saves/demotions/loads broken "
              f"{leader_failed}, error-level log lines {watch.errors}, thread exceptions "
              f"{watch.thread_exceptions}")
    if watch.first:
        detail += "; first: " + " | ".join(watch.first)
    return Check("clean run (no broken transfer, no error logged, no thread died)", ok, detail)


# The router-accuracy target: the share of prompt tokens on which the strict router view and the
# engine's reuse agree.
ROUTER_AGREEMENT_TARGET = 0.99


def router_report(result, probe) -> tuple[list[Check], list[tuple[str, str]]]:  # noqa: ANN001
    """Router accuracy and the rules the strict router view had to apply."""
    view = probe.view
    counts = view.counts
    tally = result.tally
    rules = [line.strip() for line in view.summary_lines() if line.startswith(("rule", "  "))]
    trees = ", ".join(f"{medium} {n}" for (_, _, medium), n in sorted(view.blocks().items()))
    summary = [
        ("router view (strict)", f"{sum(view.blocks().values())} blocks held ({trees or 'none'})"
                                 f"; {'; '.join(rules)}"),
        ("router accuracy", tally.describe()),
    ]
    if probe.settle_timeouts or probe.settle_stalls:
        summary.append(("router settles given up", f"{probe.settle_timeouts} timed out, "
                        f"{probe.settle_stalls} on a lost batch, of {probe.settles}"))
    checks = [
        Check("router rule warnings 0", counts.warnings == 0,
              f"{counts.warnings} ({'; '.join(rules)})"),
        Check(f"router agrees with engine reuse on >= {ROUTER_AGREEMENT_TARGET:.0%} of prompt "
              "tokens", tally.agreement >= ROUTER_AGREEMENT_TARGET,
              f"{tally.agreement:.2%} over {tally.requests} requests"),
    ]
    return checks, summary


def settle_and_check(engine, subscriber, args: argparse.Namespace,  # noqa: ANN001, ANN202
                      workload: FollowUps):
    """Flush the last GPU events, wait until the subscriber has everything, then compare.

    The subscriber connects while the engine is already up, and a PUB socket drops what it
    sends before the subscription has reached it (which takes the I/O threads an unbounded
    time on a loaded machine). It starts at seq 0, so it fetches what it missed from the
    replay socket, as a router that joins late would: that catch-up is the join, not a gap
    (``stats.gaps`` counts only holes after it); history the replay no longer held fails the
    run like a lost batch.

    The truth is read once the engine is idle (:meth:`SimulatedEngine.idle`: every transfer
    terminal and applied by the leader); an engine still busy at ``--settle-timeout`` fails the
    check. ``drive`` returns when every request has its answer, while the leader may still have
    operations in flight. A host-to-disk demotion is one: its block left the host tier at
    eviction and joins the disk tier when its report is applied, so a block the GPU pool
    evicted in the last iteration is in no tier meanwhile (the stream says REMOVE), then STORE
    once the idle keeper applies the report. Tiers read in between lacked a block the view got
    a moment later (seen as 1-6 "extra" blocks at a 10 ms keeper period).

    The GPU truth is the pool as TensorRT-LLM's flushed events describe it: a request that
    ``get_finished`` released in the last pass stored its blocks after that pass's flush, and
    nobody can read them before the engine's next pass (the summary says how many)."""
    deadline = time.monotonic() + args.settle_timeout
    while not engine.idle() and time.monotonic() < deadline:
        subscriber.poll(1)  # waits on the socket (and drains it), not a sleep
    quiet = engine.idle()
    engine.leader.flush_events()  # events of the last iteration (TRT-LLM: next iteration)
    consolidator = engine.leader.consolidator
    truth = engine.resident_blocks()
    if args.mode == "dedup":
        expected = {(0, to_signed_int64(h)) for per_rank in truth.values() for h in per_rank[0]}
    else:
        expected = {(0, to_signed_int64(h), medium) for medium, per_rank in truth.items()
                    for h in per_rank[0]}

    def view() -> set:
        return subscriber.held if args.mode == "dedup" else subscriber.held_with_medium

    while time.monotonic() < deadline:
        consolidator.wait_idle(0.2)
        subscriber.poll(20)
        published = consolidator.stats()["batches_out"]
        if subscriber.next_seq == published and view() == expected:
            break
    subscriber.poll(50)
    stats = engine.stats()
    sink = engine.leader.event_sink.stats()
    cons = consolidator.stats()
    sub = subscriber.stats
    blocks_in = cons["store_blocks_in"] + cons["remove_blocks_in"]
    blocks_out = cons["store_blocks_out"] + cons["remove_blocks_out"]
    prompt = max(1, stats.prompt_tokens)
    lost = (sink["publisher_lost_batches"] + cons["output_lost"] + sub.missing_batches
            + sub.history_missing)
    summary = [
        ("requests", f"{stats.requests_finished} finished / {stats.requests_submitted} "
                     f"submitted, {stats.iterations} engine iterations, TP={args.tp}"
                     f"{' (rank processes)' if args.processes else ''}, "
                     f"{'plain' if args.no_overlap else 'overlap'} scheduler"
                     + (f", base model and {args.adapters} LoRA adapters" if args.adapters
                        else "")),
        ("prefill tokens", f"{stats.prompt_tokens} in prompts: {stats.computed_prefill_tokens} "
                           f"computed, {prompt - stats.computed_prefill_tokens} reused"),
        ("hit rate GPU", f"{stats.gpu_hit_tokens / prompt:.1%} ({stats.gpu_hit_tokens} tokens)"),
        ("hit rate host", f"{stats.host_hit_tokens / prompt:.1%} ({stats.host_hit_tokens} "
                          "tokens)"),
        ("hit rate disk", f"{stats.disk_hit_tokens / prompt:.1%} ({stats.disk_hit_tokens} "
                          "tokens)"),
        ("bytes offloaded", format_bytes(stats.bytes_offloaded) + " (all ranks)"),
        ("bytes onboarded", format_bytes(stats.bytes_onboarded) + " (all ranks)"),
        ("GPU-tier events, dp rank 0", f"{sink['blocks_stored']} blocks stored, "
                                       f"{sink['blocks_removed']} removed, "
                                       f"{sink['publisher_batches_published']} batches"),
        ("tier events", f"{cons['registrations']} host/disk store/remove registrations"),
        ("consolidated events", f"{cons['store_blocks_out']} block stores, "
                                f"{cons['remove_blocks_out']} block removes, "
                                f"{cons['batches_out']} batches"),
        ("suppressed by dedup", f"{blocks_in - blocks_out} of {blocks_in} block events"),
        ("gaps / losses", f"{sub.gaps} gaps, {lost} batches lost"
                          + (f" (joined late: {sub.replayed_batches} batches replayed)"
                             if sub.replayed_batches and not sub.gaps else "")),
        ("subscriber view", f"{len(view())} blocks held; truth {len(expected)} "
                            f"(GPU {len(truth['GPU'][0])}, host {len(truth['CPU'][0])}, "
                            f"disk {len(truth['DISK'][0])})" + unflushed_note(engine)),
    ]
    checks = [
        Check("every request finished", stats.requests_finished == stats.requests_submitted,
              f"{stats.requests_finished}/{stats.requests_submitted}"),
        Check("onboarded KV bytes exact", stats.kv_mismatches == 0,
              f"{stats.kv_mismatches} mismatching blocks"),
        tier_reuse_check(args, stats, workload),
        Check("no gaps, no losses", sub.gaps == 0 and lost == 0,
              f"{sub.gaps} gaps, {lost} lost"),
        Check("no duplicate STORE, no unknown REMOVE, parents first",
              sub.duplicate_stores == 0 and sub.unknown_removes == 0 and sub.orphan_stores == 0,
              f"{sub.duplicate_stores} duplicate, {sub.unknown_removes} unknown, "
              f"{sub.orphan_stores} orphan"),
        Check("subscriber view == tiers' true contents", quiet and view() == expected,
              f"missing {len(expected - view())}, extra {len(view() - expected)}"
              + ("" if quiet else " (transfers still in flight after --settle-timeout "
                 f"{args.settle_timeout:g} s)")),
    ]
    return checks, summary


def unflushed_note(engine) -> str:  # noqa: ANN001
    """What the GPU pool holds beyond TensorRT-LLM's flushed events (the truth above): blocks
    a request's release stored after the last pass's flush, readable at its next pass."""
    stored, removed = engine.unflushed_gpu_blocks()
    if not stored and not removed:
        return ""
    return (f"; the GPU pool differs by {len(stored)} stored and {len(removed)} removed "
            "blocks that TensorRT-LLM flushes at its next pass")


def tier_reuse_check(args: argparse.Namespace, stats, workload: FollowUps) -> Check:  # noqa: ANN001
    """Tiers must serve evicted prefixes when the run gave them the chance: a session's later
    turn handed out after the GPU pool had evicted a block. (A run of first turns only, e.g.
    ``--requests`` up to ``--sessions``, re-sends no history: nothing to serve.)"""
    name = "prefixes reused from tiers"
    reused = stats.host_hit_tokens + stats.disk_hit_tokens
    detail = f"host {stats.host_hit_tokens} + disk {stats.disk_hit_tokens} tokens"
    if "none" in args.tiers.split(","):
        return Check(name, True, "not exercised (--tiers none)")
    if workload.after_eviction == 0:
        return Check(name, True, "not exercised (no later turn came after the GPU pool "
                                 f"evicted a block); {detail}")
    return Check(name, reused > 0, f"{detail} ({workload.after_eviction} later turns after "
                                   "a GPU eviction)")


class FollowUps:
    """The demo's workload, counting the requests that continue a session (a later turn,
    re-sending its history) handed out after the GPU pool first evicted a block: only those
    can find a prefix in a tier that the GPU no longer holds. Same interface as the workload
    it wraps (:func:`kvbm_plugin.testing.chat_workload.drive` calls it)."""

    def __init__(self, workload) -> None:  # noqa: ANN001
        self._workload = workload
        self._sessions: set[int] = set()
        self.engine = None  # set by run_demo once the engine is up
        self.after_eviction = 0

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._workload, name)

    def next_request(self):  # noqa: ANN201
        request = self._workload.next_request()
        if request is None:
            return None
        if request.session in self._sessions and self._evicted():
            self.after_eviction += 1
        self._sessions.add(request.session)
        return request

    def _evicted(self) -> bool:
        sink = self.engine.leader.event_sink if self.engine is not None else None
        return sink is not None and sink.stats()["blocks_removed"] > 0

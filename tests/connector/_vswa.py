"""Helpers of the sliding-window model's tests (test_layer_groups*.py): a strict router view
fed by the leader's tier registrations, the chat workload, and the engine's invariants."""

from __future__ import annotations

import time
from typing import Any

from _engines import prompt

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.routers.router_view import RouterView
from kvbm_plugin.testing.vswa_engine import VswaEngine
from kvbm_plugin.wire.events import BlockRemoved, BlockStored

BS = 4
WINDOW = 16  # tokens: 4 blocks
OFF = {cc.EVENTS_SOURCE: "off"}  # no GPU tier: device pages are never reused here


class ViewRecorder:
    """The leader's tier registrations applied to a strict router view as they happen."""

    def __init__(self, worker: str) -> None:
        self.view = RouterView(BS)
        self.worker = worker

    def register_store(self, tier, dp_rank, block_hash, parent_hash, token_ids, block_size,
                       **scope: Any) -> None:
        extra = [list(scope["extra_keys"])] if "extra_keys" in scope else None
        self.view.apply_event(BlockStored([block_hash], parent_hash, list(token_ids),
                                          block_size, medium=tier, extra_keys=extra),
                              self.worker, dp_rank)

    def register_remove(self, tier, dp_rank, block_hashes) -> None:
        self.view.apply_event(BlockRemoved(list(block_hashes), medium=tier), self.worker,
                              dp_rank)

    def register_clear(self, tier, dp_rank) -> None:
        return None


def _chats(seed: int) -> list[list[int]]:
    """Three conversations of three turns; each turn resends the conversation so far (the
    sequences grow past the sliding window), plus one long prompt whose start left the
    window before it could be saved (never servable: some group lacks those blocks)."""
    return [prompt(seed * 10 + c, 9) for c in range(3)] + [prompt(seed * 10 + 9, 11 * BS + 1)]


def settle(engine: VswaEngine, timeout: float = 20.0) -> None:
    """Every rank's copies done and reported, the leader's view of them applied (what a
    router and the next match then both see)."""
    deadline = time.monotonic() + timeout
    leader = engine.leader
    assert leader is not None
    while True:  # demotions included (no request waits for them)
        leader.publish_now()
        if all(r.worker.idle() for r in engine.ranks) and leader.stats()["ops_inflight"] == 0:
            return
        assert time.monotonic() < deadline, "copies still in flight"
        time.sleep(0.005)


def _drive(engine: VswaEngine, route: Any, seed: int = 1, turns: int = 3
           ) -> tuple[int, int, int]:
    """Runs the chats; returns (prompt tokens, tokens the router and the engine disagreed
    on, tokens the engine loaded). ``route(tokens)``: the router's answer for a prompt."""
    convs = _chats(seed)
    total = disagreed = loaded = 0
    history: dict[int, list[int]] = {}
    for turn in range(turns):
        for c, first in enumerate(convs):
            tokens = history.get(c, []) + (first if turn == 0 else prompt(seed * 97 + c * 7
                                                                          + turn, 9))
            settle(engine)
            servable = (len(tokens) - 1) // BS * BS  # a prompt leaves one token to compute
            predicted = min(route(tokens), servable)
            req = engine.submit(tokens, 3)
            engine.run_until_idle()
            got = engine.loaded_tokens(req)
            total += len(tokens)
            disagreed += abs(predicted - got)
            loaded += got
            history[c] = engine._reqs[req].tokens[:-1]  # noqa: SLF001 (the reply, as a chat)
    return total, disagreed, loaded


def _check_engine(engine: VswaEngine) -> None:
    stats = engine.stats
    assert stats.kv_mismatches == 0 and stats.pages_checked > 0, stats
    assert stats.dead_page_touches == 0 and stats.window_violations == 0, stats
    assert stats.sliding_saves > 0 and stats.full_saves >= stats.sliding_saves, stats
    leader = engine.leader.stats()
    assert leader["window_skips"] > 0 and leader["saves_failed"] == 0, leader

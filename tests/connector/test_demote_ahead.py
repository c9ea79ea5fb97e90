"""A host tier in front of a disk tier: its next victims copied to disk ahead of their
eviction by the leader's keeper (``OffloadTiers.demote_ahead``), withdrawn when the engine
idles, paused after a failed demotion; driven by the simulated TRT-LLM engine."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

from _engines import flush_gpu, prompt, tiers


def test_a_full_host_tiers_victims_go_to_disk_ahead_of_their_eviction(make_engine,
                                                                       monkeypatch) -> None:
    """In front of a disk tier, the leader's keeper copies a full host tier's next victims to
    disk ahead of need (they stay in host) and evicts from host only what the disk holds; a
    demotion no metadata took is withdrawn when the engine idles, its block still in host. The
    keeper's steps are called here in turn, as its applies call them (its own calls of them
    do nothing, and it makes no idle tick: it only applies the workers' reports)."""
    from kvbm_plugin.leader import offload_tiers

    monkeypatch.setattr(offload_tiers, "EVICT_AHEAD_MIN_CAPACITY", 1)
    monkeypatch.setattr(offload_tiers, "EVICT_AHEAD_SLOTS", 2)
    monkeypatch.setattr(offload_tiers, "EVICT_AHEAD_STEP", 64)
    tiers_cls = offload_tiers.OffloadTiers
    evict_ahead, demote_ahead = tiers_cls.evict_ahead, tiers_cls.demote_ahead
    monkeypatch.setattr(tiers_cls, "evict_ahead", lambda self: 0)
    monkeypatch.setattr(tiers_cls, "demote_ahead", lambda self: 0)
    engine = make_engine(num_gpu_blocks=16, env=tiers(host=8, disk=64))
    leader = engine.leader
    leader._keeper.period_s = 3600.0
    a = prompt(2, 33)  # 8 full blocks + 1 token: the host tier full
    engine.submit(a, 1)
    engine.run_until_idle()
    t = leader._tiers
    with leader._lock:
        chain = {e.key for e in t.host.resident_entries()}
        assert len(chain) == 8 and len(t.disk) == 0
        assert evict_ahead(t) == 0  # the disk holds none of the host tier's victims
        assert demote_ahead(t) == 8  # the leaf's demotion copies its ancestors too
        assert {e.key for e in t.host.resident_entries()} == chain and len(t.disk) == 8
        ops = set(leader._ops)
        assert len(ops) == 8
        leader._idle_tick()  # the engine idles: no metadata takes them
        assert t.pending_demotes == [] and len(t.disk) == 0 and not set(leader._ops) & ops
        assert {e.key for e in t.host.resident_entries()} == chain
        assert leader.stats()["demotes_withdrawn"] == 8
        assert demote_ahead(t) == 8  # and again, for the metadata below to take
    engine.submit(prompt(3, 9), 1)  # two blocks to save: the host tier evicts two
    engine.run_until_idle()
    stats = leader.stats()
    assert stats["demotes_scheduled"] == 16 and stats["demotes_committed"] == 8
    with leader._lock:
        assert {e.key for e in t.disk.resident_entries()} == chain
        assert len(chain & {e.key for e in t.host.resident_entries()}) == 6
        assert evict_ahead(t) == 2  # victims the disk holds: a REMOVE each, no demotion
        assert len(chain & {e.key for e in t.host.resident_entries()}) == 4
    assert leader.stats()["demotes_scheduled"] == 16
    flush_gpu(engine, 3)
    again = engine.submit(a, 1)
    engine.run_until_idle()
    r = engine.result(again)
    assert r.host_hit_tokens + r.disk_hit_tokens == 32 and r.disk_hit_tokens > 0
    assert r.kv_mismatches == 0  # the bytes copied ahead are the block's



def test_a_failing_disk_pauses_the_demotions_made_ahead(make_engine, monkeypatch) -> None:
    """After a demotion fails (the disk cannot be written), the keeper stops copying the host
    tier's victims to disk ahead of need for a while: they stay in host, so each apply would
    hand the failing disk the same victims again. It resumes once the pause is over; a
    failure after it doubles the next pause, a committed demotion restores the first."""
    from kvbm_plugin.leader import offload_tiers

    monkeypatch.setattr(offload_tiers, "EVICT_AHEAD_MIN_CAPACITY", 1)
    monkeypatch.setattr(offload_tiers, "EVICT_AHEAD_SLOTS", 2)
    monkeypatch.setattr(offload_tiers, "EVICT_AHEAD_STEP", 64)
    monkeypatch.setattr(offload_tiers, "DEMOTE_AHEAD_PAUSE_S", 3600.0)
    monkeypatch.setattr(offload_tiers, "DEMOTE_AHEAD_PAUSE_MAX_S", 1e9)
    tiers_cls = offload_tiers.OffloadTiers
    demote_ahead = tiers_cls.demote_ahead
    monkeypatch.setattr(tiers_cls, "evict_ahead", lambda self: 0)  # (called in turn below)
    monkeypatch.setattr(tiers_cls, "demote_ahead", lambda self: 0)
    engine = make_engine(num_gpu_blocks=16, env=tiers(host=8, disk=64))
    leader = engine.leader
    leader._keeper.period_s = 3600.0
    engine.submit(prompt(2, 33), 1)  # the host tier full
    engine.run_until_idle()
    t = leader._tiers
    rank_dir = Path(t.disk_dir) / "rank0"
    shutil.rmtree(rank_dir, ignore_errors=True)  # (made at its first write)
    rank_dir.write_bytes(b"not a directory")  # every write of rank 0 fails, root's too

    seeds = itertools.count(3)

    def demote_round() -> int:
        """The keeper's demotions ahead, then a request whose metadata takes them."""
        with leader._lock:
            made = demote_ahead(t)
        engine.submit(prompt(next(seeds), 9), 1)
        engine.run_until_idle()
        return made

    assert demote_round() == 8
    assert leader.stats()["demotes_failed"] >= 8
    with leader._lock:
        assert demote_ahead(t) == 0 and leader.stats()["demotes_ahead_paused"] == 1
        assert demote_ahead(t) == 0 and leader.stats()["demotes_ahead_paused"] == 1
        t._demote_pause_until = 0.0  # the pause is over
    failed = leader.stats()["demotes_failed"]
    assert demote_round() > 0  # resumed, and failing again
    assert leader.stats()["demotes_failed"] > failed
    with leader._lock:
        assert demote_ahead(t) == 0 and leader.stats()["demotes_ahead_paused"] == 2
        assert t._demote_pause_s == 4 * 3600.0  # the next one twice this one
        t._demote_pause_until = 0.0
    rank_dir.unlink()
    rank_dir.mkdir()  # the disk works again
    assert demote_round() > 0
    assert leader.stats()["demotes_committed"] > 0
    with leader._lock:
        demote_ahead(t)
        assert t._demote_pause_s == 3600.0  # back to the first length

"""The demo runs end to end and its checks can fail."""

from __future__ import annotations

import pytest

from kvbm_plugin import demo

SMALL = ["--sessions", "6", "--turns", "3", "--system-tokens", "64", "--gpu-blocks", "24",
         "--host-blocks", "16", "--disk-blocks", "64", "--no-progress"]


def test_demo_passes_and_reports_every_tier(capsys) -> None:
    assert demo.main_demo(SMALL) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out
    assert "[FAIL]" not in out
    for line in ("hit rate GPU", "hit rate host", "hit rate disk", "bytes offloaded",
                 "suppressed by dedup", "gaps / losses", "subscriber view"):
        assert line in out
    assert "0 gaps, 0 batches lost" in out


def test_demo_passthrough_mode(capsys) -> None:
    assert demo.main_demo([*SMALL, "--mode", "passthrough"]) == 0
    assert "suppressed by dedup         0 of" in capsys.readouterr().out


def test_demo_fails_when_the_subscriber_view_is_wrong(monkeypatch, capsys) -> None:
    from kvbm_plugin.testing.engine import SimulatedEngine

    true_contents = SimulatedEngine.resident_blocks

    def with_a_block_nobody_announced(self: SimulatedEngine) -> dict:
        truth = true_contents(self)
        truth["CPU"][0] = set(truth["CPU"][0]) | {12345}
        return truth

    monkeypatch.setattr(SimulatedEngine, "resident_blocks", with_a_block_nobody_announced)
    assert demo.main_demo([*SMALL, "--settle-timeout", "1"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] subscriber view == tiers' true contents: missing 1, extra 0" in out


def test_demo_rejects_bad_options() -> None:
    with pytest.raises(SystemExit, match="--sessions must be >= 1"):
        demo.main_demo(["--sessions", "0"])
    with pytest.raises(SystemExit, match="unknown tier"):
        demo.main_demo(["--tiers", "tape", "--no-progress"])


def test_demo_fails_when_tiers_serve_nothing(monkeypatch, capsys) -> None:
    from kvbm_plugin.connector_leader import KvbmConnectorLeader

    monkeypatch.setattr(KvbmConnectorLeader, "get_num_new_matched_tokens",
                        lambda self, request, num_computed_tokens: (0, False))
    assert demo.main_demo(SMALL) == 1
    assert "[FAIL] prefixes reused from tiers: host 0 + disk 0 tokens" in capsys.readouterr().out


def test_tier_reuse_check_is_not_applied_when_nothing_was_evicted(capsys) -> None:
    assert demo.main_demo(["--sessions", "2", "--turns", "1", "--no-progress"]) == 0
    assert "not exercised" in capsys.readouterr().out

"""The demo runs end to end and its checks can fail."""

from __future__ import annotations

import pytest

from kvbm_plugin import demo
from kvbm_plugin.subscribe import StreamSubscriber

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
    original = StreamSubscriber.apply
    dropped: list[int] = []

    def lossy_apply(self: StreamSubscriber, batch) -> None:  # noqa: ANN001
        if batch.seq == 3 and not dropped:
            dropped.append(batch.seq)
            batch.events = []  # a router that lost one batch's events
        original(self, batch)

    monkeypatch.setattr(StreamSubscriber, "apply", lossy_apply)
    assert demo.main_demo([*SMALL, "--timeout", "60"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] subscriber view == tiers' true contents" in out


def test_demo_rejects_bad_options() -> None:
    with pytest.raises(SystemExit, match="--sessions must be >= 1"):
        demo.main_demo(["--sessions", "0"])
    with pytest.raises(SystemExit, match="unknown tier"):
        demo.main_demo(["--tiers", "tape", "--no-progress"])

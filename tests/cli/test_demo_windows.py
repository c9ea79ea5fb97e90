"""``kvbm-plugin demo --windows FULL,SLIDING``: the demo on a sliding-window model passes its
checks, and its checks fail when a layer group's bytes come back wrong."""

from __future__ import annotations

import pytest

from kvbm_plugin.cli import demo
from kvbm_plugin.cli.main import UsageError

SMALL = ["--windows", "4096,64", "--sessions", "4", "--turns", "3", "--system-tokens", "48",
         "--gpu-blocks", "48", "--host-blocks", "24", "--disk-blocks", "64", "--no-progress"]


def test_the_demo_runs_a_sliding_window_model(capsys) -> None:
    assert demo.main_demo(SMALL) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and "[FAIL]" not in out
    assert "windows 4096 (full) and 64 (sliding)" in out
    assert "onboarded KV bytes exact in every layer group" in out


def test_the_demo_fails_when_a_groups_bytes_come_back_wrong(monkeypatch, capsys) -> None:
    from kvbm_plugin.worker import layer_group_copies

    real = layer_group_copies.GroupPages.load_pairs

    def shifted(self, pages, slot):  # noqa: ANN001
        return [(dst, src.roll(1)) for dst, src in real(self, pages, slot)]

    monkeypatch.setattr(layer_group_copies.GroupPages, "load_pairs", shifted)
    assert demo.main_demo(SMALL) == 1
    assert "[FAIL] onboarded KV bytes exact in every layer group" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["512", "512,512", "4096,x", "4096,8", "1,2,3"])
def test_bad_windows_are_one_clear_error(value: str) -> None:
    with pytest.raises(UsageError, match=f"--windows {value}: expected two different"):
        demo.main_demo(["--windows", value, "--no-progress"])


def test_windows_on_cuda_without_cuda_is_one_clear_error(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match="--device cuda: CUDA is not available"):
        demo.main_demo(["--windows", "4096,512", "--device", "cuda", "--no-progress"])


def test_windows_refuse_what_they_do_not_run_with() -> None:
    with pytest.raises(UsageError, match="--windows runs one engine"):
        demo.main_demo(["--windows", "4096,512", "--attention-dp", "2", "--no-progress"])

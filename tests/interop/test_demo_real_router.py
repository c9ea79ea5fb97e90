"""``kvbm-plugin demo --real-router``: NVIDIA Dynamo's own indexer asked beside the view."""

from __future__ import annotations

import pytest

from kvbm_plugin.cli import demo
from kvbm_plugin.routers import dynamo_indexer

SMALL = ["--sessions", "4", "--turns", "3", "--system-tokens", "32", "--user-tokens", "16",
         "--gen-tokens", "4", "--layers", "1", "--block-size", "4", "--gpu-blocks", "24",
         "--host-blocks", "16", "--disk-blocks", "48", "--tp", "1", "--no-progress"]


def test_without_the_indexer_the_option_says_why_and_exits_2(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kvbm_plugin.cli import main as cli

    monkeypatch.setattr(dynamo_indexer, "unavailable", lambda: "not installed (test)")
    assert cli.main(["demo", *SMALL, "--real-router"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvbm-plugin demo: --real-router: NVIDIA Dynamo's indexer cannot run here: "
                   "not installed (test)"]


@pytest.mark.parametrize("mode", [
    [], ["--duration", "3", "--tenants", "2", "--max-context", "96"],
    # README's settings for Dynamo (passthrough), tenants on the base model and two adapters,
    # each request asked by its salt string and its adapter's name
    ["--requests", "40", "--tenants", "2", "--max-context", "96", "--adapters", "2",
     "--mode", "passthrough"]])
def test_the_real_indexer_agrees_with_the_engine(capsys: pytest.CaptureFixture[str],
                                                 mode: list[str]) -> None:
    reason = dynamo_indexer.unavailable()
    if reason is not None:
        pytest.skip(reason)
    assert demo.main_demo([*SMALL, *mode, "--real-router"]) == 0
    out = capsys.readouterr().out
    assert "[PASS] Dynamo indexer warnings 0: 0" in out
    assert "[PASS] Dynamo indexer agrees with engine reuse on >= 99% of prompt tokens" in out
    assert "[PASS] router rule warnings 0" in out


class _Asked:
    """An indexer stand-in that holds one tenant under its id's hex only (a broken
    spelling) and records how it is asked."""

    def __init__(self, hex_name: str) -> None:
        self.hex_name, self.asked = hex_name, []

    def held(self) -> dict:
        return {}

    def cached_tokens(self, prompt: list[int], cache_salt: str | None = None,
                      lora_name: str | None = None) -> int:
        self.asked.append(cache_salt)
        return len(prompt) if cache_salt == self.hex_name else 0


def test_the_demo_asks_dynamo_with_the_salt_as_a_client_sends_it() -> None:
    # The demo's agreement check must fail when the output spells a tenant by anything
    # other than what a client sends: asked both ways, a hex spelling passed it.
    from kvbm_plugin.wire.identity import cache_salt_id, salt_namespace

    hex_name = salt_namespace(cache_salt_id("tenant-a"))
    client = _Asked(hex_name)
    ask = dynamo_indexer.ask_like_the_view(client, lambda: 0, settle_s=0.0)  # type: ignore[arg-type]
    assert ask([1, 2, 3, 4], "tenant-a") == 0 and client.asked == ["tenant-a"]
    by_id = _Asked(hex_name)
    ask = dynamo_indexer.ask_like_the_view(by_id, lambda: 0, settle_s=0.0,  # type: ignore[arg-type]
                                           salt_form="id")
    assert ask([1, 2, 3, 4], "tenant-a") == 4 and by_id.asked == [hex_name]

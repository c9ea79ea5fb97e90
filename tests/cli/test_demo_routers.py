"""``kvbm-plugin demo --real-router llm-d`` and ``--adapters``: the demo's multi-tenant workload
with salts and adapters, configured as README says for llm-d, each request asked as a client
asks (its salt string, its adapter's name) of the model of llm-d's indexer and scorer."""

from __future__ import annotations

import pytest

from kvbm_plugin.cli import demo, demo_routers
from kvbm_plugin.testing.chat_workload import SteadyChat, TurnWaves

SMALL = ["--sessions", "6", "--turns", "3", "--system-tokens", "32", "--user-tokens", "16",
         "--gen-tokens", "4", "--layers", "1", "--block-size", "4", "--gpu-blocks", "24",
         "--host-blocks", "16", "--disk-blocks", "48", "--tp", "1", "--no-progress"]
STEADY = ["--requests", "48", "--tenants", "2", "--max-context", "96", "--adapters", "2"]


def test_llm_d_agrees_with_the_engine_on_tenants_and_adapters(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main_demo([*SMALL, *STEADY, "--real-router", "llm-d"]) == 0
    out = capsys.readouterr().out
    assert "base model and 2 LoRA adapters" in out
    assert "[PASS] llm-d parse errors 0, stores skipped for an unknown parent 0" in out
    assert "[PASS] llm-d agrees with engine reuse on >= 99% of prompt tokens" in out
    assert "held cpu" in out  # passthrough: llm-d weighs the host tier as such


def test_the_llm_d_check_fails_when_adapters_go_out_unnamed(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Without DYN_KVBM_LORA_NAMES the stream names adapters lora-<id>, which no request
    # uses: llm-d credits adapter requests nothing, and the demo's check must say so.
    real_env = demo_routers.router_env

    def unnamed(args):  # noqa: ANN001, ANN202
        env = real_env(args)
        env.pop(demo.cc.LORA_NAMES, None)
        return env

    monkeypatch.setattr(demo_routers, "router_env", unnamed)
    assert demo.main_demo([*SMALL, *STEADY, "--real-router", "llm-d"]) == 1
    assert "[FAIL] llm-d agrees with engine reuse" in capsys.readouterr().out


def test_adapters_cycle_per_tenant_in_waves_and_are_drawn_per_session_in_a_steady_chat() -> None:
    waves = TurnWaves(sessions=6, turns=1, system_tokens=4, user_tokens=2, gen_tokens=1, seed=0,
                      salts=("a", "b"), adapters=2)
    scopes = []
    while (request := waves.next_request()) is not None:
        scopes.append((request.salt, request.lora))
    assert scopes == [("a", None), ("b", None), ("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    chat = SteadyChat(tenants=2, sessions=32, max_turns=2, system_tokens=4, user_tokens=2,
                      gen_tokens=1, max_context=64, seed=0, adapters=2)
    seen = set()
    while (request := chat.next_request()) is not None:
        seen.add(request.lora)
    assert seen == {None, 0, 1}
    plain = SteadyChat(tenants=2, sessions=8, max_turns=2, system_tokens=4, user_tokens=2,
                       gen_tokens=1, max_context=64, seed=0)
    assert all(plain.next_request().lora is None for _ in range(8))


@pytest.mark.parametrize("argv, message", [
    (["--adapters", "-1"], "--adapters must be >= 0, got -1"),
    (["--adapters", "1", "--attention-dp", "2"], "--adapters 1 runs on the one-engine demo"),
])
def test_bad_adapter_options_are_one_line(argv: list[str], message: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from kvbm_plugin.cli import main as cli

    assert cli.main(["demo", *SMALL, *argv]) == 2
    assert message in capsys.readouterr().err

"""Chat workloads and the router-accuracy tally."""

from __future__ import annotations

from kvbm_plugin.testing.chat_workload import AccuracyTally, SteadyChat, TurnWaves


def test_tally_splits_agreement_over_and_under_estimates() -> None:
    tally = AccuracyTally()
    tally.add(100, predicted=64, gpu=32, host=32, disk=0)  # exact
    tally.add(100, predicted=64, gpu=32, host=0, disk=0)  # router said 32 too many
    tally.add(100, predicted=16, gpu=32, host=16, disk=16, late=48)  # 48 too few, all late
    tally.add(10, predicted=16, gpu=0, host=0, disk=0)  # an answer beyond the prompt is capped
    assert tally.requests == 4 and tally.prompt_tokens == 310
    assert tally.over_tokens == 32 + 10 and tally.over_requests == 2
    assert tally.under_tokens == 48 and tally.under_requests == 1
    assert tally.under_gpu_tokens == 16 and tally.under_tier_tokens == 32
    assert tally.under_late_tokens == 48
    assert tally.agree_tokens == 310 - 42 - 48
    assert abs(tally.agreement - 220 / 310) < 1e-12
    assert "70.97% of 310 prompt tokens agree" in tally.describe()


def test_empty_tally_agrees() -> None:
    assert AccuracyTally().agreement == 1.0


def test_turn_waves_release_a_turn_when_the_previous_finished() -> None:
    waves = TurnWaves(sessions=3, turns=2, system_tokens=8, user_tokens=4, gen_tokens=2,
                      seed=1, salts=("a", "b"))
    first = [waves.next_request() for _ in range(3)]
    assert [r.salt for r in first if r is not None] == ["a", "b", "a"]
    assert waves.next_request() is None and not waves.exhausted()
    assert all(r is not None and r.prompt[:8] == first[0].prompt[:8] for r in first)
    for r in first[:2]:
        assert r is not None
        waves.finished(r, r.prompt + [7, 7])
    assert waves.next_request() is None  # one of the wave still running
    assert first[2] is not None
    waves.finished(first[2], first[2].prompt + [9, 9])
    second = [waves.next_request() for _ in range(3)]
    assert second[2] is not None and second[2].prompt[:len(first[2].prompt) + 2] == \
        first[2].prompt + [9, 9]
    assert waves.exhausted()


def test_steady_chat_sessions_come_and_go_within_their_limits() -> None:
    chat = SteadyChat(tenants=3, sessions=4, max_turns=3, system_tokens=8, user_tokens=6,
                      gen_tokens=2, max_context=40, seed=3)
    systems = set()
    for _ in range(200):
        request = chat.next_request()
        assert request is not None and len(request.prompt) + request.gen_tokens <= 40
        systems.add((tuple(request.prompt[:8]), request.salt))
        chat.finished(request, request.prompt + [1, 2])
    assert chat.sessions_started > 4 + 200 // 3  # sessions end (turn limit) and are replaced
    assert len(systems) == 3  # every tenant's system prompt is used, always with its salt
    assert not chat.exhausted()


def test_turn_waves_know_their_longest_request() -> None:
    waves = TurnWaves(sessions=2, turns=3, system_tokens=8, user_tokens=4, gen_tokens=2, seed=5)
    longest = 0
    while not waves.exhausted():
        batch = [waves.next_request() for _ in range(2)]
        for r in batch:
            assert r is not None
            longest = max(longest, len(r.prompt) + r.gen_tokens)
            waves.finished(r, r.prompt + [0] * r.gen_tokens)
    assert waves.longest_request() == longest

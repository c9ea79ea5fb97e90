"""saferepr: bounded, never-raising repr for wire data in log lines."""

from __future__ import annotations

import msgpack

from kvbm_plugin._util.saferepr import saferepr


def test_deep_nesting_huge_ints_and_long_values_are_bounded() -> None:
    nested: list = []
    for _ in range(5000):
        nested = [nested]
    assert saferepr(nested) == "[[[[[...]]]]]"
    assert saferepr(10**5000) == "<int of 16610 bits>"
    assert len(saferepr(b"x" * 10**6)) < 120
    assert len(saferepr({"k": list(range(10**5)), "s": "y" * 10**5})) <= 203
    assert saferepr(msgpack.Timestamp(1, 2)) == "Timestamp(seconds=1, nanoseconds=2)"
    cyclic: dict = {}
    cyclic["a"] = cyclic
    assert len(saferepr(cyclic)) < 80


def test_a_raising_repr_and_the_limit() -> None:
    class Broken:
        def __repr__(self) -> str:
            raise RuntimeError("no")

    assert "Broken" in saferepr(Broken())
    assert saferepr("abcdef", limit=3) == "'ab..."

"""``_util.bounded.EvictionOrder.put``: the one insert-and-evict every capped naming map uses."""

from __future__ import annotations

from kvbm_plugin._util.bounded import EvictionOrder


def test_put_evicts_the_oldest_past_the_cap_and_a_known_key_keeps_its_place() -> None:
    d: dict[int, str] = {}
    order = EvictionOrder()
    assert not order.put(d, 1, "a", 2) and not order.put(d, 2, "b", 2)
    assert not order.put(d, 1, "A", 2)  # updated in place: still the oldest, not kept twice
    assert len(order) == 2
    assert order.put(d, 3, "c", 2)  # past the cap: the oldest (1) goes
    assert d == {2: "b", 3: "c"}
    del d[2]  # deleted by its owner: skipped when met
    assert not order.put(d, 4, "d", 2)
    assert order.put(d, 5, "e", 2) and d == {4: "d", 5: "e"}

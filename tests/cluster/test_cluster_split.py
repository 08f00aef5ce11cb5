"""The safe split of a slot count while Redis is down (kilolined/cluster/split.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kilolined.cluster.split import alive, share


def test_floor_each_remainder_to_lowest_ids() -> None:
    assert [share(5, me, {"a", "b", "c"} - {me}) for me in ("a", "b", "c")] == [2, 2, 1]
    assert [share(2, me, {"a", "b", "c"} - {me}) for me in ("a", "b", "c")] == [1, 1, 0]  # "c" queues
    assert share(3, "solo", []) == 3


@given(st.integers(0, 50), st.sets(st.text(min_size=1, max_size=4), min_size=1, max_size=8))
def test_shares_add_up_to_n_never_more(n: int, ids: set[str]) -> None:
    assert sum(share(n, me, ids - {me}) for me in ids) == n


def test_alive_is_seen_within_the_window() -> None:
    assert alive([("b", 1.0), ("c", 31.0), ("b", 40.0)], 30) == ["b"]

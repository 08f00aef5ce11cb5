"""The safe split of a slot count while Redis is unreachable: pure arithmetic, no I/O."""

from __future__ import annotations

from collections.abc import Iterable

from kilolined.scheduling.share import share_of


def alive(peers: Iterable[tuple[str, float]], window_sec: float) -> list[str]:
    """Ids of the other gateways seen within ``window_sec`` (peers: (id, seconds since seen))."""
    return sorted({pid for pid, age in peers if age <= window_sec})


def share(n: int, me: str, others: Iterable[str]) -> int:
    """This gateway's part of ``n``: ⌊n / k⌋ each, the remainder to the lowest gateway ids."""
    return share_of(me, others).slots(n)

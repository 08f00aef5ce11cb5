"""This gateway's part of every slot count: all of it, or its safe share while Redis is down.

An overlay the scheduler reads where it reads a slot count (``Scheduler.caps``, whose limits ``can_take`` checks),
never a rewrite of the configs: a route or node made or reloaded meanwhile (an ad-hoc target, a
reload) is cut like the others, and the full counts are simply the configs again once Redis is
back (docs/CLUSTER.md). Pure arithmetic, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Share:
    """``part`` 0: nothing starts; else ⌊n / k⌋ of every count n, the remainder to the lowest
    ``rank``s (this gateway's place among the k by gateway id); a capacity splits evenly."""

    part: int = 1
    rank: int = 0
    k: int = 1

    def slots(self, n: int) -> int:
        return self.part * (n // self.k + (1 if self.rank < n % self.k else 0))

    def capacity(self, full: float) -> float:
        return self.part * full / self.k


#: a gateway alone, or one whose Redis answers: every slot count as configured
WHOLE = Share()


def share_of(me: str, others: Iterable[str], part: int = 1) -> Share:
    """The share of ``me`` among itself and ``others`` (ids of the gateways seen alive)."""
    ids = sorted({me, *others})
    return Share(part, ids.index(me), len(ids))

"""Coarse deadlines for many leases at once: one timer per 50 ms tick, not one per request.

``asyncio.timeout`` costs a timer handle, a context manager and a reschedule per request (~8 µs,
a tenth of a request's whole cost in the gateway). Deadlines of the same tick share a bucket and
one loop timer; an entry that ends before its tick (the common case) is just a set removal.
A deadline fires at most one tick late — the upstream client's deadlines have the same precision.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from typing import Protocol

TICK_SEC = 0.05


class Expirable(Protocol):
    def expire(self) -> None: ...


class Deadlines:
    def __init__(self, tick: float = TICK_SEC):
        self._tick = tick
        self._buckets: dict[int, set[Expirable]] = {}
        self._keys: list[int] = []  # heap of bucket keys
        self._timer: asyncio.TimerHandle | None = None
        self._timer_key: int | None = None

    def add(self, item: Expirable, when: float) -> int:
        """Call ``item.expire()`` at loop time ``when`` (rounded up to the tick); returns the key
        to ``discard`` it with."""
        key = math.ceil(when / self._tick)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = set()
            heapq.heappush(self._keys, key)
        bucket.add(item)
        if self._timer_key is None or key < self._timer_key:
            self._schedule(key)
        return key

    def discard(self, item: Expirable, key: int) -> None:
        bucket = self._buckets.get(key)
        if bucket is not None:
            bucket.discard(item)

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())

    def _schedule(self, key: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_key = key
        self._timer = asyncio.get_running_loop().call_at(key * self._tick, self._fire)

    def _fire(self) -> None:
        self._timer = self._timer_key = None
        now_key = math.floor(asyncio.get_running_loop().time() / self._tick + 1e-9)
        due: list[Expirable] = []
        while self._keys and self._keys[0] <= now_key:
            due.extend(self._buckets.pop(heapq.heappop(self._keys), ()))
        while self._keys and not self._buckets.get(self._keys[0]):
            self._buckets.pop(heapq.heappop(self._keys), None)  # emptied before their tick
        if self._keys:
            self._schedule(self._keys[0])
        for item in due:
            item.expire()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timer_key = None
        self._buckets.clear()
        self._keys.clear()

"""Coarse deadlines for many items at once: one loop timer per 50 ms tick, not one per item.

A uvloop ``call_at`` costs a libuv timer per handle (~2 µs), ``asyncio.timeout`` a handle, a
context manager and a reschedule (~8 µs) — per request, on the hot path. Deadlines of the same
tick share a bucket and one loop timer; an item that ends before its tick (the common case) is
just a set removal. A deadline fires at most one tick late, never early.

One implementation for every user: the lease scopes' ``request_timeout_sec`` (kilolined/scheduling/lease.py,
one ``Deadlines`` per Runtime) and the upstream exchanges' deadlines (kilolined/wire/upstream.py, one
per node pool).
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
        self.tick = tick
        self.buckets: dict[int, set[Expirable]] = {}
        self._order: list[int] = []  # heap of bucket keys (may hold emptied ones: skipped)
        self.timer: asyncio.TimerHandle | None = None
        self._timer_key = 0

    def add(self, item: Expirable, when: float) -> int:
        """Call ``item.expire()`` at loop time ``when`` (rounded up to the tick); returns the key
        to ``discard`` it with."""
        key = math.ceil(when / self.tick)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = set()
            heapq.heappush(self._order, key)
            if self.timer is None or key < self._timer_key:
                self._schedule(key)
        bucket.add(item)
        return key

    def discard(self, item: Expirable, key: int) -> None:
        bucket = self.buckets.get(key)
        if bucket is not None:
            bucket.discard(item)
            if not bucket:
                del self.buckets[key]

    def __len__(self) -> int:
        return sum(len(b) for b in self.buckets.values())

    def _schedule(self, key: int) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self._timer_key = key
        self.timer = asyncio.get_running_loop().call_at(key * self.tick, self._fire)

    def _fire(self) -> None:
        self.timer = None
        now_key = (asyncio.get_running_loop().time() + 0.001) / self.tick  # libuv timers: 1 ms resolution
        due: list[Expirable] = []
        while self._order and self._order[0] <= now_key:
            due.extend(self.buckets.pop(heapq.heappop(self._order), ()))
        while self._order and self._order[0] not in self.buckets:
            heapq.heappop(self._order)  # emptied before its tick: forget it
        if self._order:
            self._schedule(self._order[0])
        for item in due:
            item.expire()

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = None
        self.buckets.clear()
        self._order.clear()

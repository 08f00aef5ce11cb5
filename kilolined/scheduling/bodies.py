"""The request bodies held in memory while their requests wait (docs/CONFIG.md, ``server.
max_queued_body_mb`` and ``max_queued_body_mb_per_key``).

Pure bookkeeping, no I/O. A waiting request keeps its whole body (it is sent when a slot frees,
and again on a re-queue), so the queue limits that count requests (``max_queue_depth``,
``max_queued_per_key``) do not bound memory: one key with many ad-hoc targets (a queue each) and
large bodies parks gigabytes. These bounds count bytes, for one key across every route and for
the whole gateway, as Envoy's overload manager refuses new work past a memory threshold: a
request that would have to wait beyond them is refused (per key 429 ``queue_full``, in total 503
``queue_full``); one that finds a free slot never waits, so it is never refused by them.

A ticket counts from the moment it waits until it leaves the queue (leased, failed, cancelled),
once however often both are called (``held``), and again when a failed node puts it back.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

MB = 1024 * 1024


class Ticket(Protocol):
    """What of a ticket (queue.Ticket) the count reads and marks."""

    key: str
    body: int  # bytes of its request's body
    body_held: bool  # counted here now


class WaitingBodies:
    """Bytes of the bodies of waiting requests, per key and in total, against their bounds."""

    __slots__ = ("by_key", "per_key_limit", "total", "total_limit")

    def __init__(self, total_limit: float | None = None, per_key_limit: float | None = None):
        self.total = 0
        self.by_key: Counter[str] = Counter()
        self.total_limit, self.per_key_limit = total_limit, per_key_limit

    def configure(self, total_mb: float, per_key_mb: float) -> None:
        """New bounds (a reload): what waits already stays; they apply to what comes next."""
        self.total_limit, self.per_key_limit = total_mb * MB, per_key_mb * MB

    def refusal(self, key: str, size: int) -> tuple[int, str] | None:
        """(status, why) when a body of ``size`` bytes of ``key`` may not wait; None when it may.
        A body alone larger than a bound still waits when nothing else is held there (the bound
        is on memory parked, and max_body_mb already caps one body)."""
        if not size:
            return None
        held = self.by_key.get(key, 0)
        if self.per_key_limit is not None and held and held + size > self.per_key_limit:
            return 429, (f"key already has {held / MB:.1f} MB of request bodies waiting "
                         f"(server.max_queued_body_mb_per_key: {self.per_key_limit / MB:g})")
        if self.total_limit is not None and self.total and self.total + size > self.total_limit:
            return 503, (f"the gateway already holds {self.total / MB:.1f} MB of waiting request bodies "
                         f"(server.max_queued_body_mb: {self.total_limit / MB:g})")
        return None

    def hold(self, t: Ticket) -> None:
        if t.body and not t.body_held:
            t.body_held = True
            self.total += t.body
            self.by_key[t.key] += t.body

    def release(self, t: Ticket) -> None:
        if t.body_held:
            t.body_held = False
            self.total -= t.body
            left = self.by_key[t.key] - t.body
            if left > 0:
                self.by_key[t.key] = left
            else:
                del self.by_key[t.key]

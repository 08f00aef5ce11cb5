"""Rolling request statistics for the dashboard: outcome counts, p50/p95 of wait and duration,
and GPU seconds used (for the cost panel). Bounded memory: the last N samples per route.

The percentiles describe GPU work only: requests that were admitted, leased a slot and ran on a
node. A route's other answers (unqueued status polls and file fetches, 401s, 429s, queue
timeouts) are counted apart with their own duration percentiles: mixed in, a few thousand 2 ms
polls would put the p95 of 2-second renders at 2 ms.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    i = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return round(s[i], 3)


def machines(urls: Iterable[str]) -> int:
    """How many rented machines the nodes run on: one per URL host. Two servers on one machine
    (ComfyUI on :8188, TTS on :5002) are two nodes but one card, and are billed once."""
    return len({(urlsplit(u).hostname or u).lower() for u in urls})


class RouteStats:
    def __init__(self, keep: int):
        self.outcomes: Counter[str] = Counter()  # every answer on the route, work or not
        self.work = 0  # requests that leased a slot and ran on a node
        self.other = 0  # the rest: unqueued paths, refusals, requests that never left the queue
        self.waits: deque[float] = deque(maxlen=keep)  # work only
        self.durations: deque[float] = deque(maxlen=keep)  # work only
        self.other_durations: deque[float] = deque(maxlen=keep)


class Stats:
    def __init__(self, keep: int = 500):
        self.keep = keep
        self.routes: dict[str, RouteStats] = {}
        self.gpu_seconds = 0.0

    def record(self, route: str, outcome: str, queue_wait: float | None, duration: float | None,
               *, ran: bool) -> None:
        """One finished request. ``ran``: it was leased a slot and sent to a node (GPU work)."""
        rs = self.routes.get(route)
        if rs is None:
            rs = self.routes[route] = RouteStats(self.keep)
        rs.outcomes[outcome] += 1
        if not ran:
            rs.other += 1
            if duration is not None:
                rs.other_durations.append(duration)
            return
        rs.work += 1
        if queue_wait is not None:
            rs.waits.append(queue_wait)
        if duration is not None:
            rs.durations.append(duration)

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, rs in self.routes.items():
            w, d, o = list(rs.waits), list(rs.durations), list(rs.other_durations)
            out[name] = {
                "outcomes": dict(rs.outcomes),
                "work_requests": rs.work,
                "queue_wait_p50": percentile(w, 0.5), "queue_wait_p95": percentile(w, 0.95),
                "duration_p50": percentile(d, 0.5), "duration_p95": percentile(d, 0.95),
                "other_requests": rs.other,
                "other_duration_p50": percentile(o, 0.5), "other_duration_p95": percentile(o, 0.95),
            }
        return {"routes": out, "gpu_seconds": round(self.gpu_seconds, 3)}

"""The dashboard's chart history, kept by the gateway: a bounded ring of per-route series.

A page opened after a burst must still show it, so the series the chart plots are sampled
here, not in the page. Time is cut into buckets of ``step_sec``; a bucket keeps the peak of each
series over the observations that fell in it (a burst shorter than a step still shows), and
only the last ``span_sec`` of buckets are kept. Pure logic: the clock is injected.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Bucket = tuple[int, tuple[int, ...]]  # (bucket number, one value per series)


class History:
    def __init__(self, series: Sequence[str], *, span_sec: float = 600, step_sec: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        if step_sec <= 0 or span_sec < step_sec:
            raise ValueError("need 0 < step_sec <= span_sec")
        self.series = tuple(series)
        self.step_sec = step_sec
        self.size = math.floor(span_sec / step_sec)  # buckets kept per route
        self.clock = clock
        self._rings: dict[str, deque[Bucket]] = {}

    def _bucket(self) -> int:
        return math.floor(self.clock() / self.step_sec)

    def record(self, values: Mapping[str, Sequence[int]]) -> None:
        """One observation of every route (values in ``series`` order). A route missing from
        ``values`` is gone from the config: its ring goes too, so memory follows the config."""
        b = self._bucket()
        for gone in self._rings.keys() - values.keys():
            del self._rings[gone]
        for route, vals in values.items():
            if len(vals) != len(self.series):
                raise ValueError(f"route {route}: {len(vals)} values for {len(self.series)} series")
            ring = self._rings.get(route)
            if ring is None:
                ring = self._rings[route] = deque(maxlen=self.size)
            if ring and ring[-1][0] == b:
                ring[-1] = (b, tuple(max(old, new) for old, new in zip(ring[-1][1], vals, strict=True)))
            else:
                ring.append((b, tuple(vals)))
            # maxlen bounds the count; this bounds the age when observations had gaps.
            while ring[0][0] <= b - self.size:
                ring.popleft()

    def snapshot(self) -> dict[str, Any]:
        """Per route, one array per series, oldest bucket first and the current one last; a
        bucket with no observation (the sampler was held up) is None."""
        now = self._bucket()
        first = now - self.size + 1
        routes: dict[str, dict[str, list[int | None]]] = {}
        for route, ring in self._rings.items():
            kept = [(b, v) for b, v in ring if b >= first]
            if not kept:
                continue
            start = kept[0][0]
            cols: list[list[int | None]] = [[None] * (now - start + 1) for _ in self.series]
            for b, v in kept:
                for col, x in zip(cols, v, strict=True):
                    col[b - start] = x
            routes[route] = dict(zip(self.series, cols, strict=True))
        return {"step_sec": self.step_sec, "span_sec": self.size * self.step_sec, "routes": routes}

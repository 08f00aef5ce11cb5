"""A small in-memory pub/sub of state changes, for /admin/events and the dashboard's feed."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any


class Feed:
    def __init__(self, keep: int = 200, max_pending: int = 500):
        self.recent: deque[dict[str, Any]] = deque(maxlen=keep)
        self._subs: set[asyncio.Queue[dict[str, Any]]] = set()
        self._max_pending = max_pending
        self._seq = 0

    def publish(self, kind: str, **data: Any) -> dict[str, Any]:
        self._seq += 1
        ev = {"id": self._seq, "kind": kind, "ts": time.time(), **data}
        self.recent.append(ev)
        for q in list(self._subs):
            if q.qsize() >= self._max_pending:
                # A stuck dashboard must not grow memory without bound: it loses old events.
                try:
                    q.get_nowait()
                except asyncio.QueueEmpty:
                    pass
            q.put_nowait(ev)
        return ev

    def subscribe(self) -> asyncio.Queue[dict[str, Any]]:
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._subs.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[dict[str, Any]]) -> None:
        self._subs.discard(q)

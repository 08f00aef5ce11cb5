"""Ending background tasks at shutdown.

One cancel is not always enough: on Python 3.11 ``asyncio.wait_for`` (redis-py wraps each
command in one) drops a cancel that arrives in the step its inner call completes, and the loop
around it goes on. So a stop cancels again until the task has ended, within a bound, and says
so instead of hanging when a task never ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("kilolined")

RETRY_SEC = 0.1  # how long one cancel is given before the next
BOUND_SEC = 10.0  # a task still running after this is left (and logged): shutdown goes on


async def cancel_until_done(*tasks: asyncio.Future[Any] | None, bound_sec: float = BOUND_SEC) -> None:
    """Cancel ``tasks`` (None skipped) until every one has ended, at most ``bound_sec``."""
    await cancel_all([t for t in tasks if t is not None], bound_sec=bound_sec)


async def cancel_all(tasks: Iterable[asyncio.Future[Any]], bound_sec: float = BOUND_SEC) -> None:
    """As ``cancel_until_done``, for a collection (copied first: a done callback may shrink it)."""
    tasks = list(tasks)
    loop = asyncio.get_running_loop()
    end = loop.time() + bound_sec
    while pending := [t for t in tasks if not t.done()]:
        if loop.time() >= end:
            log.error("✗ %d task(s) did not end %gs after being cancelled: left running", len(pending), bound_sec)
            return
        for t in pending:
            t.cancel()
        await asyncio.wait(pending, timeout=RETRY_SEC)
    # Collect their outcomes, so none is reported as "never retrieved".
    await asyncio.gather(*tasks, return_exceptions=True)

"""The active health check of one node: GET url+path every interval, with its own timeout.

It runs on the node's pooled session but never takes a route slot, and it is jittered so that
many nodes configured alike do not all probe in the same millisecond.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import aiohttp

from kilolined.nodes import NodeState


async def probe(session: aiohttp.ClientSession, ns: NodeState) -> tuple[bool, float | None, str | None]:
    hc = ns.health_cfg
    assert hc is not None
    t0 = time.perf_counter()
    try:
        async with session.get(
            ns.cfg.url + hc.path,
            headers=ns.cfg.headers,
            timeout=aiohttp.ClientTimeout(total=hc.timeout_sec),
            allow_redirects=False,
        ) as r:
            await r.read()
            ms = (time.perf_counter() - t0) * 1000
            if r.status in hc.expect_status:
                return True, ms, None
            return False, ms, f"health check {r.status}"
    except TimeoutError:
        return False, None, f"health check timed out after {hc.timeout_sec:g}s"
    except aiohttp.ClientConnectorError:
        return False, None, "connection refused (spot interrupted?)"
    except (aiohttp.ClientError, OSError) as e:
        return False, None, f"health check failed: {type(e).__name__}"


async def health_loop(session: Callable[[str], aiohttp.ClientSession], ns: NodeState, clock: Callable[[], float],
                      on_events: Callable[[NodeState, list[str]], None], *,
                      active: Callable[[], bool] = lambda: True) -> None:
    hc = ns.health_cfg
    assert hc is not None
    # First probe soon (a node that is down at start should be known quickly), then jittered.
    await asyncio.sleep(random.uniform(0, min(hc.interval_sec, 0.5)))
    while True:
        # Cluster mode: only the leader probes; the others apply what it publishes.
        if active():
            ok, ms, err = await probe(session(ns.name), ns)
            if ns.retired:
                return
            on_events(ns, ns.record_check(ok, clock(), ms, err))
        await asyncio.sleep(hc.interval_sec * random.uniform(0.9, 1.1))

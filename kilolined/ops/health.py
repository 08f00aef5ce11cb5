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
import orjson

from kilolined.core.config import DISCOVER
from kilolined.scheduling.affinity import reported_start, restarted
from kilolined.scheduling.models import WARM_PATHS, model_ids, running_models
from kilolined.scheduling.nodes import NodeState

MODELS_TIMEOUT_SEC = 2.0  # a node without a health check: how long its model lists may take


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
            raw = await r.read()
            ms = (time.perf_counter() - t0) * 1000
            if r.status in hc.expect_status:
                _note_start(ns, raw)
                return True, ms, None
            return False, ms, f"health check {r.status}"
    except TimeoutError:
        return False, None, f"health check timed out after {hc.timeout_sec:g}s"
    except aiohttp.ClientConnectorError:
        return False, None, "connection refused (spot interrupted?)"
    except (aiohttp.ClientError, OSError) as e:
        return False, None, f"health check failed: {type(e).__name__}"


def _note_start(ns: NodeState, raw: bytes) -> None:
    """A health answer that tells the process's uptime or start time: a new start means a
    restarted process, whose caches are empty (the scheduler then empties its prefix index)."""
    if not raw.startswith(b"{") or len(raw) > 64 * 1024:
        return
    try:
        seen = reported_start(orjson.loads(raw), time.time())
    except orjson.JSONDecodeError:
        return
    if seen is not None and restarted(ns.started, seen):
        ns.saw_start(seen)


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
        else:
            ok = ns.healthy
        # Every gateway reads the models itself: which are warm follows its own dispatches too.
        if ok and ns.cfg.models is not None:
            await refresh_models(session(ns.name), ns, hc.timeout_sec)
        await asyncio.sleep(hc.interval_sec * random.uniform(0.9, 1.1))


# --- multi-model nodes (docs/CONFIG.md#multi-model-nodes) -------------------------------------------


async def _get_json(session: aiohttp.ClientSession, ns: NodeState, path: str,
                    timeout: float) -> tuple[bool, object]:
    """(the node answered at all, its JSON or None)."""
    try:
        async with session.get(ns.cfg.url + path, headers=ns.cfg.headers, allow_redirects=False,
                               timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            raw = await r.read()
            if r.status != 200:
                return True, None
            return True, orjson.loads(raw)
    except orjson.JSONDecodeError:
        return True, None
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False, None


async def refresh_models(session: aiohttp.ClientSession, ns: NodeState, timeout: float = MODELS_TIMEOUT_SEC) -> None:
    """Ask a multi-model node what it serves (``models: discover``: its ``GET /v1/models``) and
    which models it holds loaded (llama-swap ``GET /running``, Ollama ``GET /api/ps``). Runs at
    start and after every passing health check; never takes a slot. A node that answers neither
    warm endpoint is not asked again: the gateway's own record of its dispatches is all there is."""
    state = ns.models
    if ns.cfg.models == DISCOVER:
        _, doc = await _get_json(session, ns, "/v1/models", timeout)
        ids = model_ids(doc)
        if ids is not None:
            state.observe_served(ids)
    paths = WARM_PATHS if state.warm_paths is None else state.warm_paths
    since = state.dispatches
    answered = False
    for path in paths:
        reached, doc = await _get_json(session, ns, path, timeout)
        answered = answered or reached
        running = running_models(doc)
        if running is not None:
            state.warm_paths = (path,)
            state.observe_warm(running, since)
            return
    if answered and state.warm_paths is None:
        state.warm_paths = ()

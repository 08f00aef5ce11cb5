"""``kilolined check --probe``: connect to every node of a config once, as its health check would
(``GET health.path``, else ``GET /``, with the node's headers and timeout), and say what happened."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import orjson
from yarl import URL

from kilolined.core.config import Config, NodeConfig

DEFAULT_TIMEOUT_SEC = 5.0


@dataclass(frozen=True, slots=True)
class Probe:
    node: str
    target: str  # scheme://host:port/path, without credentials
    reachable: bool
    status: int | None
    expected: bool  # the status is one the health check accepts (any status when there is none)
    ms: float
    error: str | None = None

    def line(self) -> str:
        if not self.reachable:
            return f"node {self.node}: unreachable: {self.error} ({self.target}, {self.ms:.0f} ms)"
        verdict = "ok" if self.expected else "unexpected status"
        return f"node {self.node}: reachable, HTTP {self.status} {verdict} ({self.target}, {self.ms:.0f} ms)"


def _target(nc: NodeConfig) -> tuple[str, str, float]:
    path = nc.health.path if nc.health else "/"
    timeout = nc.health.timeout_sec if nc.health else DEFAULT_TIMEOUT_SEC
    shown = str(URL(nc.url + path).with_user(None))  # never print a password from the URL
    return nc.url + path, shown, timeout


async def probe_node(session: aiohttp.ClientSession, name: str, nc: NodeConfig,
                     clock: Callable[[], float] = time.perf_counter) -> Probe:
    url, shown, timeout = _target(nc)
    t0 = clock()
    try:
        async with session.get(url, headers=nc.headers, timeout=aiohttp.ClientTimeout(total=timeout),
                               allow_redirects=False) as r:
            await r.read()
            ok = r.status in nc.health.expect_status if nc.health else True
            return Probe(name, shown, True, r.status, ok, (clock() - t0) * 1000)
    except TimeoutError:
        return Probe(name, shown, False, None, False, (clock() - t0) * 1000, f"no answer within {timeout:g}s")
    except aiohttp.ClientConnectorError as e:
        err = e.os_error
        reason = os.strerror(err.errno).lower() if err is not None and err.errno else type(err).__name__
        return Probe(name, shown, False, None, False, (clock() - t0) * 1000, f"cannot connect ({reason})")
    except (aiohttp.ClientError, OSError) as e:
        return Probe(name, shown, False, None, False, (clock() - t0) * 1000, type(e).__name__)


async def probe_all(cfg: Config) -> list[Probe]:
    """Every node at once (one slow node does not hold up the others), in config order."""
    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(probe_node(session, n, nc) for n, nc in cfg.nodes.items())))


def gateway_slots(cfg: Config, node: str) -> dict[str, int]:
    """The slots each openai route gives ``node`` (its ``max_concurrency``), by route."""
    return {r: rc.max_concurrency for r, rc in cfg.routes.items()
            if rc.kind == "openai" and (node in rc.nodes or node in rc.standby)}


def slots_warning(cfg: Config, node: str, total_slots: object) -> str | None:
    """A warning when the gateway may send ``node`` more requests at once than the server has
    slots (llama.cpp ``GET /props`` ``total_slots``): the rest would queue inside the server,
    where the gateway cannot see or reorder them."""
    if isinstance(total_slots, bool) or not isinstance(total_slots, int) or total_slots <= 0:
        return None
    by_route = gateway_slots(cfg, node)
    nc = cfg.nodes[node]
    given = sum(by_route.values())
    if nc.max_concurrency is not None:
        given = min(given, nc.max_concurrency)
    if given <= total_slots:
        return None
    routes = ", ".join(f"{r}: {n}" for r, n in by_route.items())
    return (f"warning: node {node}: the gateway may send it {given} requests at once ({routes}) but the server "
            f"has {total_slots} slots (GET /props total_slots): the rest would queue inside the server, unseen; "
            f"lower max_concurrency or start it with more slots (llama-server -np)")


async def props_slots(session: aiohttp.ClientSession, nc: NodeConfig) -> object:
    """llama.cpp's ``total_slots`` from ``GET /props``; None when the node answers no such thing."""
    _, _, timeout = _target(nc)
    try:
        async with session.get(nc.url + "/props", headers=nc.headers, allow_redirects=False,
                               timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                return None
            doc = orjson.loads(await r.read())
    except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError):
        return None
    return doc.get("total_slots") if isinstance(doc, dict) else None


async def slot_warnings(cfg: Config) -> list[str]:
    """``check --probe``'s slot check, for every node of an openai route (docs/BACKENDS.md)."""
    names = [n for n in cfg.nodes if gateway_slots(cfg, n)]
    async with aiohttp.ClientSession() as session:
        slots = await asyncio.gather(*(props_slots(session, cfg.nodes[n]) for n in names))
    return [w for n, s in zip(names, slots, strict=True) if (w := slots_warning(cfg, n, s)) is not None]

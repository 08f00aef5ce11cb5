"""``kilolined check --probe``: connect to every node of a config once, as its health check would
(``GET health.path``, else ``GET /``, with the node's headers and timeout), and say what happened."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from yarl import URL

from kilolined.config import Config, NodeConfig

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

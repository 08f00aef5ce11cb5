"""Shared fixtures: real fake GPUs and a real gateway, all on loopback sockets."""

from __future__ import annotations

import asyncio
import copy
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from kilolined.core.config import parse_config
from kilolined.edge.server import Server
from kilolined.fakegpu import FakeGPU

# Fixtures more than one test module uses live in helper modules, never in a test module: no test
# imports another (tests/test_architecture.py).
pytest_plugins = ["affinity_llamas", "browser_page", "fakegpu_util", "fleet_market", "fleet_vast", "install_run",
                  "slow_fleet", "upstream_peer"]

ADMIN_KEY = "kl_admin_test_key_000000000000000"
KEYS = {"alice": "kl_alice_key_0000000000000000000000", "bob": "kl_bob_key_00000000000000000000000000",
        "carol": "kl_carol_key_000000000000000000000000"}


def sha(k: str) -> str:
    return hashlib.sha256(k.encode()).hexdigest()


def auth(who: str = "alice") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def base_config(nodes: dict[str, str], **route_over: Any) -> dict[str, Any]:
    """One route 'gen' at /gen over the given nodes (name -> url); first node primary, rest standby."""
    names = list(nodes)
    route = {"path": "/gen", "nodes": names[:1], "standby": names[1:], "max_concurrency": 2,
             "queue_timeout_sec": 30, "request_timeout_sec": 30}
    route.update(route_over)
    return {
        "server": {"listen": "127.0.0.1:0", "heartbeat_sec": 1, "shutdown_grace_sec": 5},
        "admin": {"key_sha256": sha(ADMIN_KEY), "public_metrics": False},
        "keys": {k: {"key_sha256": sha(v), "routes": ["*"]} for k, v in KEYS.items()},
        "nodes": {n: {"url": u} for n, u in nodes.items()},
        "routes": {"gen": route},
    }


class Gateway:
    def __init__(self, server: Server, path: Path):
        self.server = server
        self.path = path

    @property
    def rt(self):
        return self.server.rt

    @property
    def jobs(self):
        return self.server.gateway.jobs

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    def write_config(self, cfg: dict[str, Any]) -> None:
        cfg = copy.deepcopy(cfg)
        cfg["server"]["listen"] = self.rt.cfg.server.listen
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(cfg))
        tmp.replace(self.path)


@pytest.fixture
async def fakegpus() -> AsyncIterator[Callable[..., Awaitable[FakeGPU]]]:
    made: list[FakeGPU] = []

    async def make(kind: str = "generic", **kw: Any) -> FakeGPU:
        kw.setdefault("steps", 5)
        kw.setdefault("step_ms", 20)
        kw.setdefault("crash_sec", 0.5)
        g = FakeGPU(kind, **kw)
        await g.start()
        made.append(g)
        return g

    yield make
    for g in made:
        await g.stop()


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Gateway]]]:
    made: list[Server] = []

    async def make(cfg: dict[str, Any], watch: bool = False) -> Gateway:
        path = tmp_path / "kiloline.yaml"
        text = yaml.safe_dump(cfg)
        path.write_text(text)
        parsed = parse_config(text, env={})
        srv = Server(parsed, hashlib.sha256(text.encode()).hexdigest(), str(path), watch=watch)
        await srv.start()
        made.append(srv)
        # Serve the rest of the tests on the port we actually got.
        cfg["server"]["listen"] = f"127.0.0.1:{srv.port}"
        path.write_text(yaml.safe_dump(cfg))
        srv.rt.version = hashlib.sha256(path.read_bytes()).hexdigest()
        srv.rt.cfg = parse_config(path.read_text(), env={})
        return Gateway(srv, path)

    yield make
    for srv in made:
        await srv.shutdown()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        yield s


async def wait_until(pred: Callable[[], bool | Awaitable[bool]], timeout: float = 10, step: float = 0.02) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        r = pred()
        if asyncio.iscoroutine(r):
            r = await r
        if r:
            return
        if loop.time() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(step)

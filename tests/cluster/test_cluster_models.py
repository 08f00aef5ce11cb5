"""Cluster mode and multi-model nodes: only a node that serves the request's model is granted it,
whichever gateway asked (the ticket's node set travels to Redis), and a model no node serves is
404 at admission there too (real redis-server, two gateway processes)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import ADMIN, auth

from kilolined.fakegpu import FakeGPU

from .harness import GatewayProc, RedisServer, make_gateways, start_all, until


@pytest.fixture
async def boxes() -> AsyncIterator[tuple[FakeGPU, FakeGPU]]:
    x = FakeGPU("openai", models=["a"], steps=2, step_ms=20)
    y = FakeGPU("openai", models=["b"], steps=2, step_ms=20)
    await x.start()
    await y.start()
    yield x, y
    await x.stop()
    await y.stop()


def two_boxes(procs: list[GatewayProc], x: FakeGPU, y: FakeGPU) -> None:
    for g in procs:
        g.cfg["nodes"] = {"x": {"url": x.url, "models": ["a"]}, "y": {"url": y.url, "models": ["b"]}}
        g.cfg["routes"] = {"llm": {"path": "/v1", "kind": "openai", "nodes": ["x", "y"], "max_concurrency": 2,
                                   "queue_timeout_sec": 60, "request_timeout_sec": 30}}


async def chat(s: aiohttp.ClientSession, gw: GatewayProc, model: str) -> tuple[int, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with s.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
        return r.status, await r.json()


async def test_only_a_node_serving_the_model_is_granted_it(redis_server: RedisServer, gateways: list[GatewayProc],
                                                           boxes: tuple[FakeGPU, FakeGPU], tmp_path: Path) -> None:
    x, y = boxes
    gateways += make_gateways(2, tmp_path, redis_server.url, x.url)
    two_boxes(gateways, x, y)
    await start_all(gateways)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        # Twenty at once for "b" over both gateways: x is idle and least loaded, but serves only "a".
        got = await asyncio.gather(*(chat(s, gateways[i % 2], "b") for i in range(20)))
        assert [st for st, _ in got] == [200] * 20, got
        assert x.backend.asked == [] and y.backend.asked == ["b"] * 20  # type: ignore[attr-defined]
        assert y.stats["max_concurrent"] <= 2
        status, body = await chat(s, gateways[1], "zeta")
        assert status == 404 and body["error"]["type"] == "model_not_found" and "'zeta'" in body["error"]["message"]


async def warm_of(s: aiohttp.ClientSession, gw: GatewayProc, node: str) -> list[str] | None:
    async with s.get(gw.url + "/admin/state", headers=ADMIN) as r:
        st = await r.json()
    return st["nodes"][node]["warm"]


async def test_a_node_where_the_model_is_warm_is_preferred_across_gateways(
        redis_server: RedisServer, gateways: list[GatewayProc], tmp_path: Path) -> None:
    """Both nodes serve a and b; x holds a, y holds b (their /running says so). Requests for b,
    through either gateway, go to y: no swap on x."""
    x = FakeGPU("openai", models=["a", "b"], swap_ms=50, steps=2, step_ms=10)
    y = FakeGPU("openai", models=["b", "a"], swap_ms=50, steps=2, step_ms=10)
    await x.start()
    await y.start()
    try:
        gateways += make_gateways(2, tmp_path, redis_server.url, x.url)
        two_boxes(gateways, x, y)
        for g in gateways:
            g.cfg["nodes"]["x"]["models"] = g.cfg["nodes"]["y"]["models"] = ["a", "b"]
        await start_all(gateways)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            for g in gateways:
                await until(lambda g=g: _warm_known(s, g), "warm sets read from /running")
            for i in range(6):
                status, _ = await chat(s, gateways[i % 2], "b")
                assert status == 200
        assert x.backend.asked == [] and y.backend.asked == ["b"] * 6  # type: ignore[attr-defined]
        assert x.stats["swaps"] == 0 and y.stats["swaps"] == 0
    finally:
        await x.stop()
        await y.stop()


async def _warm_known(s: aiohttp.ClientSession, gw: GatewayProc) -> bool:
    return await warm_of(s, gw, "x") == ["a"] and await warm_of(s, gw, "y") == ["b"]

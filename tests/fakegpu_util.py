"""Helpers shared by the tests of the simulated GPU (tests/test_fakegpu*.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from kilolined.fakegpu import FakeGPU

MakeGPU = Callable[..., Awaitable[FakeGPU]]


@pytest.fixture
async def make_gpu() -> AsyncIterator[MakeGPU]:
    made: list[FakeGPU] = []

    async def make(kind: str = "generic", **kw: Any) -> FakeGPU:
        kw.setdefault("steps", 5)
        kw.setdefault("step_ms", 10)
        kw.setdefault("crash_sec", 0.4)
        gpu = FakeGPU(kind, **kw)
        await gpu.start()
        made.append(gpu)
        return gpu

    yield make
    for gpu in made:
        await gpu.stop()


async def eventually(pred: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def sse_data(resp: aiohttp.ClientResponse) -> list[str]:
    """The `data:` payloads of an event stream, in order."""
    out = []
    async for line in resp.content:
        text = line.decode().strip()
        if text.startswith("data: "):
            out.append(text[len("data: "):])
    return out


async def refused(url: str) -> bool:
    """True when a fresh connection is refused (the fake's process is 'dead')."""
    async with aiohttp.ClientSession() as fresh:
        try:
            async with fresh.get(url + "/_fake/stats"):
                return False
        except aiohttp.ClientConnectorError:
            return True

"""Helpers shared by the tests of the fake providers (tests/test_fakegpu_provider*.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import aiohttp

from kilolined.fakegpu.provider import FakeProvider

CARD = {"steps": 2, "step_ms": 5, "crash_sec": 0.2}


async def answers(url: str) -> bool:
    """Whether anything listens at `url` (a card that is down refuses the connection)."""
    try:
        async with aiohttp.ClientSession() as s, s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status < 500
    except (TimeoutError, aiohttp.ClientError):
        return False


async def fake_state(market: FakeProvider) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(f"{market.url}/_fake/instances") as r:
        assert r.status == 200
        return dict(await r.json())


async def fail(market: FakeProvider, plan: dict[str, Any]) -> None:
    async with aiohttp.ClientSession() as s, s.post(f"{market.url}/_fake/fail", json=plan) as r:
        assert r.status == 200


async def reclaim(market: FakeProvider, instance_id: str | int) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(f"{market.url}/_fake/reclaim/{instance_id}") as r:
        assert r.status == 200
        return dict(await r.json())


def start_cli_provider(provider: str, *args: str) -> tuple[subprocess.Popen[str], str]:
    """`kilolined fakegpu --provider ... --port 0` in a process of its own, and its URL."""
    proc = subprocess.Popen([sys.executable, "-m", "kilolined", "fakegpu", "--provider", provider, "--port", "0",
                             *args], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    prefix = f"fakegpu provider {provider} listening on "
    seen = []
    for line in proc.stderr:  # until its "listening" line; a warning may come first
        if line.startswith(prefix):
            return proc, line[len(prefix):].strip()
        seen.append(line)
    proc.kill()
    raise AssertionError(f"it exited without listening: {''.join(seen)!r}")


async def in_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """The official clients are synchronous (requests): they run in a thread while the fake
    serves on this loop."""
    return await asyncio.to_thread(fn, *args, **kwargs)

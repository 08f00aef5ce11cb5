"""Shutdown ends every background loop even when a loop swallows a cancel (kilolined/wire/tasks.py).

On Python 3.11, ``asyncio.wait_for`` (redis-py wraps each command in one) drops a cancel that
arrives in the step its inner call completes, and the loop around it goes on. A stop that
cancels once and then waits would hang the gateway's shutdown; each stop cancels until its
tasks have ended.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio as aioredis
import yaml

from kilolined.cluster.leader import LeaderLease, Leadership
from kilolined.cluster.nodes import NodeSync
from kilolined.cluster.view import ClusterView
from kilolined.core.config import ClusterConfig, parse_config
from kilolined.ops.runtime import Runtime
from kilolined.wire.tasks import cancel_all, cancel_until_done

STOP_BOUND_SEC = 30  # far beyond what a stop takes: reaching it means the stop hung


async def stubborn(swallow: int, ended: list[str]) -> None:
    """A loop that goes on after its first ``swallow`` cancels, as one around wait_for does."""
    left = swallow
    try:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if left == 0:
                    raise
                left -= 1
    finally:
        ended.append("ended")


async def stops(stop: Awaitable[None], loop: asyncio.Task[None]) -> bool:
    """Whether ``stop`` ends by itself; if it hangs, the loop is cancelled once more (its
    swallowing is spent) so that the test ends either way."""
    stopping = asyncio.ensure_future(stop)
    done, _ = await asyncio.wait({stopping}, timeout=STOP_BOUND_SEC)
    if not done:
        loop.cancel()
        await asyncio.gather(stopping, return_exceptions=True)
    return bool(done)


def runtime() -> Runtime:
    return Runtime(parse_config(yaml.safe_dump({
        "keys": {"k": {"key_sha256": hashlib.sha256(b"k").hexdigest()}},
        "nodes": {"a": {"url": "http://127.0.0.1:9"}},
        "routes": {"r": {"path": "/r", "nodes": ["a"], "max_concurrency": 1}},
    })), "v1")


async def test_cancel_until_done_outlasts_swallowed_cancels() -> None:
    ended: list[str] = []
    tasks = [asyncio.create_task(stubborn(n, ended)) for n in (0, 1, 3)]
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_all(tasks), STOP_BOUND_SEC)
    assert all(t.done() for t in tasks) and ended == ["ended"] * 3
    await cancel_until_done(None)  # nothing to end


async def test_a_task_that_never_ends_is_left_after_the_bound(caplog: pytest.LogCaptureFixture) -> None:
    release = asyncio.Event()

    async def deaf() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue

    t = asyncio.create_task(deaf())
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="kilolined"):
        await asyncio.wait_for(cancel_until_done(t, bound_sec=0.3), STOP_BOUND_SEC)
    assert not t.done() and "did not end" in caplog.text  # shutdown goes on, and says why
    release.set()
    t.cancel()
    await asyncio.gather(t, return_exceptions=True)


async def test_runtime_stop_ends_a_loop_that_swallows_a_cancel() -> None:
    rt = runtime()
    ended: list[str] = []
    t = rt.spawn(stubborn(1, ended))
    await asyncio.sleep(0)
    assert await stops(rt.stop(), t), "Runtime.stop hung"
    assert t.done() and ended == ["ended"]


def leader_lease(redis: aioredis.Redis) -> tuple[LeaderLease, Callable[[asyncio.Task[None]], None]]:
    cfg = ClusterConfig(redis_url="redis://127.0.0.1:9/0", lease_ttl_sec=3)
    lease = LeaderLease(redis, cfg, "gw#1", ClusterView("gw"), Leadership("gw", 3), clock=lambda: 0.0,
                        alert=lambda *a: None)

    def plant(t: asyncio.Task[None]) -> None:
        lease._task = t

    return lease, plant


def node_sync(redis: aioredis.Redis) -> tuple[NodeSync, Callable[[asyncio.Task[None]], None]]:
    sync = NodeSync(redis, "kl:", "gw#1", dict, clock=lambda: 0.0, redis_up=lambda: False, leader=lambda: False,
                    on_applied=lambda ns, events: None, sweep_sec=1.0)

    def plant(t: asyncio.Task[None]) -> None:
        sync._tasks.add(t)

    return sync, plant


Part = Callable[[aioredis.Redis], tuple["LeaderLease | NodeSync", Callable[[asyncio.Task[None]], None]]]


@pytest.mark.parametrize("make", [leader_lease, node_sync], ids=["leader", "node_sync"])
async def test_a_cluster_part_stops_when_its_loop_swallows_a_cancel(make: Part) -> None:
    redis = aioredis.Redis(host="127.0.0.1", port=9)  # never reached: the parts' loops are replaced
    try:
        part, plant = make(redis)
        ended: list[str] = []
        t = asyncio.create_task(stubborn(1, ended))
        plant(t)
        await asyncio.sleep(0)
        assert await stops(part.stop(), t), "stop hung"
        assert t.done() and ended == ["ended"]
    finally:
        await redis.aclose()

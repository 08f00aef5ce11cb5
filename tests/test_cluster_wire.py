"""The lease scripts' own Redis connection (kilolined/cluster/wire.py), on a real redis-server.

A freed slot is handed on by the answer of the release script, so that script must be on its
way to Redis when ``release`` returns, not one task and a pool checkout later; and the one
pipelined connection must keep every answer with its call through a lost script cache, and end
every call on it when Redis stops answering.
"""

from __future__ import annotations

import asyncio
import time

import redis
import redis.asyncio as aioredis
from cluster_harness import RedisServer, redis_server, until
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from test_lease_cluster import cluster_runtime

from kilolined.cluster.wire import Wire
from kilolined.scheduling.queue import LEASED, WAITING

__all__ = ["redis_server"]  # fixtures

ECHO = "return {ARGV[1], KEYS[1]}"


def _poll_blocking(check: redis.Redis, key: str, field: str, want: bytes, timeout: float = 10) -> bytes | None:
    """Reads ``key``'s ``field`` from a second client until it is ``want``, without letting the
    event loop run (nothing this gateway has not written yet can reach Redis meanwhile)."""
    end = time.monotonic() + timeout
    got = None
    while time.monotonic() < end:
        got = check.hget(key, field)
        if got == want:
            return got
        time.sleep(0.01)
    return got


async def test_a_release_reaches_redis_before_the_loop_turns_and_its_answer_grants_the_next(
        redis_server: RedisServer) -> None:
    async with cluster_runtime(redis_server, 1) as (rt, leases):
        now = rt.clock()
        first = await leases.settle(leases.admit("r", "k", 0, now))
        second = await leases.settle(leases.admit("r", "k", 0, now))
        assert first.state == LEASED and first.lease is not None
        assert second.state == WAITING
        tid = leases.tid_of(second)
        assert tid is not None
        check = redis.Redis.from_url(redis_server.url)
        try:
            leases.release(first.lease, rt.clock(), service_time=0.01)
            # One loop turn (uvloop writes what a turn wrote at its end), then the loop is held:
            # the script that frees the slot must have left with the release itself, not in a
            # task that takes a pooled connection turns later. In Redis it has leased the slot
            # to the waiting ticket (in the cluster's order).
            await asyncio.sleep(0)
            state = _poll_blocking(check, f"{leases.prefix}t:{tid}", "state", b"l")
            assert state == b"l", f"the release was not sent in its own turn (ticket state {state!r})"
        finally:
            check.close()

        async def resumed() -> bool:
            return second.state == LEASED

        await until(resumed, "the release's answer leases the waiting ticket here")
        assert second.lease is not None
        leases.release(second.lease, rt.clock(), service_time=0.01)

        async def none_held() -> bool:
            return int((await leases.redis.hget(leases.prefix + "nin", "a")) or 0) == 0

        await until(none_held, "the last lease given back in Redis")


async def test_calls_keep_their_answers_when_redis_forgets_its_scripts(redis_server: RedisServer) -> None:
    r = aioredis.Redis.from_url(redis_server.url)
    wire = Wire(r.connection_pool, timeout=5)
    try:
        assert await wire.evalsha(ECHO, ["k0"], ["warm"]) == [b"warm", b"k0"]
        await r.script_flush()
        # Pipelined: the first ones meet NOSCRIPT and go again with the source, after the others.
        futs = [wire.evalsha(ECHO, [f"k{i}"], [str(i)]) for i in range(5)]
        assert await asyncio.gather(*futs) == [[str(i).encode(), f"k{i}".encode()] for i in range(5)]
        assert await wire.command("PING") == b"PONG"
    finally:
        wire.close()
        await r.aclose()


async def test_a_redis_that_stops_answering_fails_every_call_then_the_next_connects_again(
        redis_server: RedisServer) -> None:
    r = aioredis.Redis.from_url(redis_server.url)
    wire = Wire(r.connection_pool, timeout=0.5)
    try:
        assert await wire.command("PING") == b"PONG"
        redis_server.freeze()
        try:
            futs = [wire.evalsha(ECHO, ["k"], [str(i)]) for i in range(3)]
            outs = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 20)
        finally:
            redis_server.thaw()
        assert all(isinstance(o, RedisTimeoutError) for o in outs), outs

        async def answers() -> bool:
            try:
                return bool(await wire.evalsha(ECHO, ["k"], ["back"]) == [b"back", b"k"])
            except RedisError:
                return False

        await until(answers, "a call after the timeout connects again")
    finally:
        wire.close()
        await r.aclose()


async def test_a_closed_wire_refuses_calls(redis_server: RedisServer) -> None:
    r = aioredis.Redis.from_url(redis_server.url)
    wire = Wire(r.connection_pool, timeout=5)
    assert await wire.command("PING") == b"PONG"
    wire.close()
    try:
        fut = wire.command("PING")
        assert isinstance(fut.exception(), RedisError)
    finally:
        await r.aclose()

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
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kilolined.cluster.leases import WAITED_SEC
from kilolined.cluster.wire import Wire
from kilolined.scheduling.queue import LEASED, WAITING

from .harness import RedisServer, cluster_runtime, until

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


async def _beat_tids(r: aioredis.Redis, sha: str) -> list[int]:
    """How many ticket ids each BEAT in Redis' slow log carried (its arguments past the fixed seven)."""
    out = []
    for entry in await r.execute_command("SLOWLOG", "GET", -1, NEVER_DECODE=True):
        args = entry[3]
        if args[0].upper() == b"EVALSHA" and args[1].decode() == sha:
            # EVALSHA sha numkeys epoch, then 7 ARGV; past 32 arguments the log says how many more
            more = args[-1].startswith(b"... (") and args[-1].endswith(b"more arguments)")
            extra = int(args[-1].split(b" ")[1].lstrip(b"(")) + 1 if more else 0
            out.append(len(args) - 11 + extra - (1 if more else 0))
    return out


async def test_the_heartbeat_does_not_reread_every_waiting_ticket_while_the_grant_channel_holds(
        redis_server: RedisServer) -> None:
    import hashlib

    from kilolined.cluster import scripts

    sha = hashlib.sha1(scripts.BEAT.encode()).hexdigest()
    async with cluster_runtime(redis_server, 1) as (rt, leases):
        now = rt.clock()
        first = await leases.settle(leases.admit("r", "k", 0, now))
        waiting = [await leases.settle(leases.admit("r", "k", 0, now)) for _ in range(40)]
        assert first.lease is not None and all(t.state == WAITING for t in waiting)
        r = leases.redis
        # Past WAITED_SEC: from here each of them is one a sweep would re-read.
        await asyncio.sleep(WAITED_SEC + 0.2)
        await r.config_set("slowlog-max-len", 10000)
        await r.slowlog_reset()
        await r.config_set("slowlog-log-slower-than", 0)
        try:
            async def a_light_beat() -> bool:
                # Once one sweep has followed the subscription, the beats carry no ticket.
                return 0 in await _beat_tids(r, sha)

            await until(a_light_beat, "a heartbeat that does not re-read the 40 waiting tickets")
        finally:
            await r.config_set("slowlog-log-slower-than", 10000)
        for t in waiting:
            leases.cancel(t)
        leases.release(first.lease, rt.clock(), service_time=0.01)


async def test_a_grant_published_while_the_channel_was_down_is_found_by_the_sweep(
        redis_server: RedisServer) -> None:
    from kilolined.cluster import scripts

    async with cluster_runtime(redis_server, 1) as (rt, leases):
        now = rt.clock()
        first = await leases.settle(leases.admit("r", "k", 0, now))
        second = await leases.settle(leases.admit("r", "k", 0, now))
        assert first.lease is not None and second.state == WAITING
        lid = leases._lid[first.lease]
        r = leases.redis

        async def subscribed() -> bool:
            return leases._sub_at is not None

        await until(subscribed, "the grant channel subscribed")
        # The channel drops; another gateway's script frees the slot and grants our waiting
        # ticket: its message goes nowhere.
        assert int(await r.execute_command("CLIENT", "KILL", "TYPE", "pubsub")) >= 1
        res = await r.evalsha(hashlib_sha(scripts.RELEASE), 1, leases._epoch, leases.prefix, "another#gw", lid)
        assert res == []

        async def leased() -> bool:
            return second.state == LEASED

        await until(leased, "the sweep after the channel came back finds the grant")
        assert second.lease is not None
        leases.release(second.lease, rt.clock(), service_time=0.01)
        leases.release(first.lease, rt.clock(), service_time=0.01)

        async def none_held() -> bool:
            return int((await r.hget(leases.prefix + "nin", "a")) or 0) == 0

        await until(none_held, "nothing left counted in Redis")


def hashlib_sha(src: str) -> str:
    import hashlib

    return hashlib.sha1(src.encode()).hexdigest()

"""The lease property of tests/test_lease.py on the second lease store: ``ClusterLeases`` on a
real redis-server, lost and restored at random points of the run.

The same requests (succeed, fail, hang, raise, cancel) run through ``LeaseScope`` on an
in-process Runtime whose leases live in Redis, while Redis is killed and started again empty
(no persistence) or frozen (SIGSTOP) for a while. Besides the property itself (every request
ends as its behaviour says, never more than N on the node, nothing runs twice, every move in
the scope's table), nothing may stay counted in Redis once everything has ended: a slot counted
there for a request that is gone would be lost to every gateway.
"""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lease_props import BEHAVIOURS, Quiet, config, every_slot_comes_back, inflight

from kilolined.cluster.leases import ClusterLeases
from kilolined.scheduling.lease import LeaseScope
from kilolined.scheduling.queue import WAITING, Lease
from kilolined.wire.proxy import UpstreamFailed

from .harness import RedisServer, cluster_runtime, until

#: (what happens to Redis, seconds after the previous fault, seconds it lasts)
Fault = tuple[str, float, float]
FAULTS = st.lists(st.tuples(st.sampled_from(("restart", "freeze")), st.floats(0, 1.0), st.floats(0.05, 2.5)),
                  max_size=2)


async def disturb(redis: RedisServer, faults: list[Fault]) -> None:
    """Lose Redis and give it back, as drawn; Redis runs, unfrozen, when this ends (or fails)."""
    frozen = False
    try:
        for kind, after, lasts in faults:
            await asyncio.sleep(after)
            if kind == "restart":
                redis.kill()
                await asyncio.sleep(lasts)
                await asyncio.to_thread(redis.start)  # empty: no persistence
            else:
                redis.freeze()
                frozen = True
                await asyncio.sleep(lasts)
                redis.thaw()
                frozen = False
    finally:
        if frozen:
            redis.thaw()
        if not redis.running:
            redis.start()


async def nothing_counted(leases: ClusterLeases) -> bool:
    """Redis counts no lease on any node and no request waiting on the route."""
    r, p = leases.redis, leases.prefix
    on_nodes = await r.hgetall(p + "nin")
    on_route = await r.hgetall(p + "in:r")
    waiting = await r.get(p + "n:r")
    return (all(int(v) == 0 for v in [*on_nodes.values(), *on_route.values()])
            and int(waiting or 0) == 0)


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(BEHAVIOURS), min_size=1, max_size=12), st.integers(1, 3), FAULTS)
def test_every_slot_comes_back_with_redis_lost_and_restored(redis_server: RedisServer, behaviours: list[str],
                                                             slots: int, faults: list[Fault]) -> None:
    async def scenario() -> None:
        async with cluster_runtime(redis_server, slots) as (rt, leases):
            # With Redis lost, requests wait (or go on alone on this gateway's share) and still end.
            await every_slot_comes_back(rt, behaviours, slots, meanwhile=disturb(redis_server, faults), within=60)

            async def settled() -> bool:
                # Releases reach Redis in the background; one lost with Redis is given back there
                # once the heartbeat has found it again.
                if not leases.view.redis_up:
                    return False
                return await nothing_counted(leases)

            await until(settled, f"Redis still counts leases or waiting requests ({faults})", timeout=20)
            assert inflight(rt) == 0

    asyncio.run(scenario())


async def test_stop_ends_a_loop_whose_cancel_a_redis_command_swallowed(redis_server: RedisServer) -> None:
    """A loop of the store cancelled while redis-py sends a command (Python 3.11: its wait_for
    returns the command's answer and drops the cancel) goes on: stop must still end it."""
    async with cluster_runtime(redis_server, 1) as (_rt, leases):
        async def beats() -> None:  # the shape of the store's loops: Redis calls, round and round
            while True:
                await leases.redis.ping()

        leases._spawn(beats())
        await asyncio.sleep(0)  # it is in the middle of a send now
        await asyncio.wait_for(leases.stop(), 10)
        assert not leases._tasks


async def test_a_request_admitted_again_while_its_nodes_are_barred_is_granted_once_the_bar_lifts(
        redis_server: RedisServer) -> None:
    """A request lost by both its nodes (connection reset) waits for them: neither may have it
    back for ``breaker.open_sec`` (nothing probes them), as in the local scheduler. Redis restarts
    empty meanwhile, and the request is admitted there again with that bar. When the bar lifts
    here, it must lift in Redis too: the request goes back to a node, not on waiting to its
    queue_timeout."""
    cfg = config(slots=1, retries=2)
    for node in cfg["nodes"].values():
        node["breaker"]["open_sec"] = 2
    cfg["routes"]["r"]["queue_timeout_sec"] = 8
    async with cluster_runtime(redis_server, 1, cfg) as (rt, _leases):
        ticket = await rt.settle(rt.admit("r", "k", 0))
        tried: list[str] = []

        async def attempt(lease: Lease) -> str:
            tried.append(lease.node)
            if len(tried) <= 2:
                raise UpstreamFailed("connection reset")
            return "answer"

        async def restart_redis_while_barred() -> None:
            async def barred_on_both() -> bool:
                return ticket.requeues == 2 and ticket.state == WAITING
            await until(barred_on_both, "the request was not re-queued from both nodes")
            redis_server.kill()
            await asyncio.to_thread(redis_server.start)  # empty: no persistence

        async with LeaseScope(rt, ticket, Quiet(), "k") as scope:
            answer, _ = await asyncio.gather(scope.acquire(attempt), restart_redis_while_barred())
            scope.ok = True
        assert answer == "answer"
        assert tried[:2] == ["a", "b"] and len(tried) == 3, tried

"""A grant that reaches a gateway Redis has not counted alive for a TTL waits for its heartbeat.

A gateway frozen (SIGSTOP, a stalled VM) past ``lease_ttl_sec`` is reaped; the grants Redis
published for its waiting requests meanwhile wait in its socket, and their slots, in doubt, may
be freed (the node shows them free) and granted to another gateway. When it wakes it reads those
grants before its heartbeat tells it it was reaped: run then, they would run beside the requests
that took their slots since (the node ran N + 1 under chaos_cluster). So a grant that arrives
when Redis last counted the gateway alive a TTL ago or more starts only once a heartbeat says it
still is (and is dropped if it was reaped). ClusterLeases on a real redis-server, its clock moved
on by a TTL where a freeze would have moved it.
"""

from __future__ import annotations

import asyncio
import hashlib

from kilolined.scheduling.queue import WAITING

from .harness import RedisServer, cluster_runtime

TTL = 30.0  # no heartbeat of its own during the test: the test beats when it means to


async def test_a_grant_after_a_ttl_unseen_waits_for_the_heartbeat(redis_server: RedisServer) -> None:
    cfg = {
        "keys": {"k": {"key_sha256": hashlib.sha256(b"k").hexdigest()}},
        "nodes": {"a": {"url": "http://127.0.0.1:9"}},
        "routes": {"r": {"path": "/r", "nodes": ["a"], "max_concurrency": 1, "queue_timeout_sec": 300}},
    }
    frozen_for = [0.0]
    async with cluster_runtime(redis_server, 1, cfg, ttl=TTL, ahead=lambda: frozen_for[0]) as (_rt, leases):
        first = await leases.settle(leases.admit("r", "k", 0, leases.clock()))
        second = await leases.settle(leases.admit("r", "k", 0, leases.clock()))
        assert first.lease is not None and second.state == WAITING
        frozen_for[0] = TTL  # Redis last counted it alive a TTL ago
        leases.release(first.lease, leases.clock(), None)  # its answer grants the slot to `second`
        await asyncio.sleep(0.5)
        assert second.state == WAITING and second.lease is None
        await leases._beat()  # still counted alive: the grant holds
        assert second.lease is not None and second.lease.node == "a"

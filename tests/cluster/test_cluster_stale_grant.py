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
import os

import yaml

from kilolined.cluster.leases import ClusterLeases
from kilolined.core.config import parse_config
from kilolined.ops.runtime import Runtime, Wiring
from kilolined.scheduling.queue import WAITING

from .harness import RedisServer

TTL = 30.0  # no heartbeat of its own during the test: the test beats when it means to


async def test_a_grant_after_a_ttl_unseen_waits_for_the_heartbeat(redis_server: RedisServer) -> None:
    cfg = {
        "keys": {"k": {"key_sha256": hashlib.sha256(b"k").hexdigest()}},
        "nodes": {"a": {"url": "http://127.0.0.1:9"}},
        "routes": {"r": {"path": "/r", "nodes": ["a"], "max_concurrency": 1, "queue_timeout_sec": 300}},
        "cluster": {"redis_url": redis_server.url, "gateway_id": "gw", "lease_ttl_sec": TTL,
                    "key_prefix": f"stale-{os.urandom(4).hex()}:"},
    }
    frozen_for = [0.0]
    made: list[ClusterLeases] = []

    def wire(rt: Runtime) -> Wiring:
        assert rt.cfg.cluster is not None
        made.append(ClusterLeases(rt.scheduler, rt.cfg.cluster, "gw", clock=lambda: rt.clock() + frozen_for[0],
                                  version=lambda: rt.version, alert=rt.notify))
        return Wiring(leases=made[0], settle=made[0].settle, cluster=made[0].view)

    rt = Runtime(parse_config(yaml.safe_dump(cfg)), "test", wire=wire)
    leases = made[0]
    await rt.start()
    try:
        await leases.start()
        try:
            first = await leases.settle(leases.admit("r", "k", 0, leases.clock()))
            second = await leases.settle(leases.admit("r", "k", 0, leases.clock()))
            assert first.lease is not None and second.state == WAITING
            frozen_for[0] = TTL  # Redis last counted it alive a TTL ago
            leases.release(first.lease, leases.clock(), None)  # its answer grants the slot to `second`
            await asyncio.sleep(0.5)
            assert second.state == WAITING and second.lease is None
            await leases._beat()  # still counted alive: the grant holds
            assert second.lease is not None and second.lease.node == "a"
        finally:
            await asyncio.wait_for(leases.stop(), 10)
    finally:
        await asyncio.wait_for(rt.stop(), 10)

"""A waiting request's plan (its candidate nodes and their ranks, kilolined/scheduling/rules.py) is
written into Redis when it is admitted; a reload that changes its route's nodes writes it again at
the next heartbeat, so a node added by the reload takes the requests already waiting, in cluster
mode as on one gateway (docs/CLUSTER.md)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import yaml
from cluster_harness import RedisServer, redis_server, until

from kilolined.cluster.leases import ClusterLeases
from kilolined.core.config import parse_config
from kilolined.ops.runtime import Runtime
from kilolined.scheduling.queue import LEASED

__all__ = ["redis_server"]  # fixtures


def config(nodes: list[str], cluster: dict[str, Any]) -> str:
    return yaml.safe_dump({
        "keys": {"k": {"key_sha256": "0" * 64}},
        "nodes": {n: {"url": f"http://127.0.0.1:{9 + i}"} for i, n in enumerate("abc")},
        "routes": {"r": {"path": "/r", "nodes": nodes, "max_concurrency": 1, "queue_timeout_sec": 30}},
        "cluster": cluster,
    })


async def test_a_node_added_by_a_reload_takes_the_requests_already_waiting(redis_server: RedisServer) -> None:
    cluster = {"redis_url": redis_server.url, "gateway_id": "g", "lease_ttl_sec": 1.0,
               "key_prefix": f"replan-{os.urandom(4).hex()}:"}
    rt = Runtime(parse_config(config(["a"], cluster)), "v1")
    assert rt.cfg.cluster is not None
    leases = ClusterLeases(rt.scheduler, rt.cfg.cluster, "g", clock=rt.clock, version=lambda: rt.version,
                           alert=rt.notify)
    rt.leases, rt.settle, rt.cluster = leases, leases.settle, leases.view
    await rt.start()
    try:
        await leases.start()
        try:
            first = await leases.settle(leases.admit("r", "k", 0, rt.clock()))
            waiting = await leases.settle(leases.admit("r", "k", 0, rt.clock()))
            assert first.state == LEASED and first.lease is not None and first.lease.node == "a"
            assert waiting.state != LEASED  # a's one slot is taken
            rt.apply(parse_config(config(["a", "c"], cluster)), "v2")
            leases.commit(rt.cfg)

            async def leased() -> bool:
                return waiting.state == LEASED

            await until(leased, "the waiting request never went to the node the reload added", 5)
            assert waiting.lease is not None and waiting.lease.node == "c"
        finally:
            await asyncio.wait_for(leases.stop(), 10)
    finally:
        await asyncio.wait_for(rt.stop(), 10)

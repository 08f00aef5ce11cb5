"""A waiting request's plan (its candidate nodes and their ranks, kilolined/scheduling/rules.py) is
written into Redis when it is admitted; a reload that changes its route's nodes writes it again at
the next heartbeat, so a node added by the reload takes the requests already waiting, in cluster
mode as on one gateway (docs/CLUSTER.md)."""

from __future__ import annotations

from typing import Any

import yaml

from kilolined.core.config import parse_config
from kilolined.scheduling.queue import LEASED

from .harness import RedisServer, cluster_runtime, until


def config(nodes: list[str]) -> dict[str, Any]:
    return {
        "keys": {"k": {"key_sha256": "0" * 64}},
        "nodes": {n: {"url": f"http://127.0.0.1:{9 + i}"} for i, n in enumerate("abc")},
        "routes": {"r": {"path": "/r", "nodes": nodes, "max_concurrency": 1, "queue_timeout_sec": 30}},
    }


async def test_a_node_added_by_a_reload_takes_the_requests_already_waiting(redis_server: RedisServer) -> None:
    cfg = config(["a"])
    async with cluster_runtime(redis_server, 1, cfg) as (rt, leases):
        first = await leases.settle(leases.admit("r", "k", 0, rt.clock()))
        waiting = await leases.settle(leases.admit("r", "k", 0, rt.clock()))
        assert first.state == LEASED and first.lease is not None and first.lease.node == "a"
        assert waiting.state != LEASED  # a's one slot is taken
        reloaded = {**config(["a", "c"]), "cluster": cfg["cluster"]}  # the same cluster section
        rt.apply(parse_config(yaml.safe_dump(reloaded)), "v2")
        leases.commit(rt.cfg)  # (as a Component: the Runtime commits those it was wired with)

        async def leased() -> bool:
            return waiting.state == LEASED

        await until(leased, "the waiting request never went to the node the reload added", 5)
        assert waiting.lease is not None and waiting.lease.node == "c"

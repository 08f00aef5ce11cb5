"""Two gateways of one cluster in front of fake ComfyUI nodes, for the ComfyUI cluster tests."""

from __future__ import annotations

from typing import Any

from conftest import base_config

from .harness import RedisServer

PREFIX = "kl-cl:"


async def two_gateways(redis: RedisServer, gateway: Any, nodes: dict[str, Any], **route: Any) -> list[Any]:
    """Two gateways of one cluster, each with every node (``route``: the route's settings)."""
    made = []
    for gid in ("gw0", "gw1"):
        cfg = base_config({n: f.url for n, f in nodes.items()}, kind="comfyui", **{"max_concurrency": 1, **route})
        cfg["routes"]["gen"].update(nodes=list(nodes), standby=[])
        cfg["cluster"] = {"redis_url": redis.url, "gateway_id": gid, "lease_ttl_sec": 2, "key_prefix": PREFIX}
        made.append(await gateway(cfg))
    return made

"""A generic route measures speed per request (its size unknown), so one client's heavy requests
must not look like a slow node (SPEC §14): each key's requests are compared only with the same
key's on the other nodes. A real gateway over three simulated GPUs, over loopback."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from conftest import auth, base_config

SLOW = {"samples": 4, "evaluations": 2, "min_gap_ms": 1}
BREAKER = {"consecutive_failures": 3, "open_sec": 60, "slow_start_sec": 0}
LIGHT = {"steps": 2, "step_ms": 10}
HEAVY = {"steps": 2, "step_ms": 100}  # ten times longer, on healthy nodes


async def send(http: aiohttp.ClientSession, url: str, who: str, body: dict[str, Any], n: int,
               session: str | None, seen: list[tuple[str, int, str]]) -> None:
    headers = {**auth(who), **({"X-Session-Id": session} if session else {})}
    for _ in range(n):
        async with http.post(url + "/gen/generate", json=body, headers=headers) as r:
            await r.read()
            seen.append((who, r.status, r.headers.get("X-KiloLine-Node", "")))


async def test_a_client_pinning_heavier_requests_to_a_node_gets_it_no_eject(fakegpus, gateway, http) -> None:
    gpus = [await fakegpus() for _ in range(3)]
    cfg = base_config({n: g.url for n, g in zip("abc", gpus, strict=True)}, max_concurrency=2,
                      affinity="session")
    cfg["routes"]["gen"].update(nodes=["a", "b", "c"], standby=[])
    for n in "abc":
        cfg["nodes"][n].update(slow=SLOW, breaker=BREAKER)
    gw = await gateway(cfg)
    seen: list[tuple[str, int, str]] = []
    # alice's light requests spread over the nodes (no session); bob's heavy ones all go to the
    # one node his session maps to, which then serves heavier requests than the others
    await asyncio.gather(*[send(http, gw.url, "alice", LIGHT, 30, None, seen) for _ in range(2)],
                         send(http, gw.url, "bob", HEAVY, 12, "bob-pins-a-node", seen))
    assert {s for _, s, _ in seen} == {200}
    assert len({node for who, _, node in seen if who == "bob"}) == 1
    nodes = gw.rt.scheduler.nodes
    assert [n for n in "abc" if nodes[n].slowed or nodes[n].slow_state != "ok"] == []
    assert all(ns.breaker == "closed" for ns in nodes.values())
    # judged all the same: alice's series have peers on every node
    assert all(gw.rt.speed.view(n) is not None for n in "abc")

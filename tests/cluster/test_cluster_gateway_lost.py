"""A dead gateway's slots come back fast (docs/CLUSTER.md "What happens when something fails").

A gateway killed with every slot of the node held by its async jobs: its leases are in doubt,
and come back as soon as the node shows them free — vLLM through its own /metrics — or, on a
node that can tell nothing, when the gateway restarts (same gateway_id, a new process: its
connections closed with the old one). Its jobs are carried on by the others and complete; only
its share stays reserved, as for any lost gateway, until it comes back or is forgotten.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import ADMIN, auth
from fakes import FakeTelegram, FakeWebhookReceiver

from kilolined.cluster.leases import ClusterLeases
from kilolined.core.config import ClusterConfig
from kilolined.fakegpu import FakeGPU
from kilolined.scheduling.queue import Scheduler

from .harness import GatewayProc, RedisServer, make_gateways, start_all, until

N = 4
TTL = 1.5
JOBS = 12
TOKEN = "123:abc"
ASYNC = {"X-KiloLine-Mode": "async"}


async def submit(s: aiohttp.ClientSession, gw: GatewayProc, kind: str, hook: str) -> str:
    if kind == "openai":
        url, body = gw.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    else:
        url, body = gw.url + "/gen/generate", {"steps": 10, "step_ms": 100}
    async with s.post(url, json=body, headers={**auth(), **ASYNC, "X-KiloLine-Callback": hook}) as r:
        assert r.status == 202, await r.text()
        return str((await r.json())["job_id"])


async def job_status(s: aiohttp.ClientSession, gw: GatewayProc, jid: str) -> str:
    async with s.get(f"{gw.url}/v1/jobs/{jid}", headers=auth()) as r:
        return str((await r.json())["status"]) if r.status == 200 else f"http {r.status}"


@pytest.mark.parametrize(("server", "restart"), [("vllm", False), ("generic", True)])
async def test_a_killed_gateways_jobs_complete_through_the_others(
        redis_server: RedisServer, gateways: list[GatewayProc], tmp_path: Path, server: str, restart: bool) -> None:
    kind = "openai" if server == "vllm" else "generic"
    options: dict[str, Any] = {"server": "vllm"} if server == "vllm" else {}
    gpu = FakeGPU(kind, vram_gb=1000, job_vram_gb=1, steps=10, step_ms=100, crash_sec=0.4, **options)
    await gpu.start()
    tg = FakeTelegram(token=TOKEN)
    await tg.__aenter__()
    hooks = FakeWebhookReceiver()
    await hooks.__aenter__()
    try:
        # request_timeout_sec is far off: only the node (or the restart) can give the slots back in time.
        route: dict[str, Any] = {"kind": kind, "max_concurrency": N, "request_timeout_sec": 600, "retry_on_failover": 1}
        if kind == "openai":
            route["path"] = "/v1"
        gateways += make_gateways(3, tmp_path, redis_server.url, gpu.url, ttl=TTL, **route)
        for g in gateways:
            g.cfg["notify"] = {"telegram": {"bot_token": TOKEN, "chat_id": "-1001", "api_base": tg.url},
                               "group_sec": 0.1, "min_interval_sec": 0}
            g.cfg["jobs"] = {"webhook_allow_private": True, "webhook_backoff_sec": [0.2, 0.2]}
        await start_all(gateways)
        dead, alive = gateways[2], gateways[0]
        async with aiohttp.ClientSession() as s:
            jobs = [await submit(s, dead, kind, hooks.url()) for _ in range(JOBS)]
            await until(lambda: _running(gpu, N), "the jobs never filled the node")
            dead.kill9()  # while it holds every slot, with the rest of its jobs queued
            if restart:
                dead.start()
                await dead.ready()
            for jid in jobs:
                await until(lambda jid=jid: _status_in(s, alive, jid, {"completed"}), f"job {jid} never completed", 60)
            await until(lambda: _delivered(hooks, len(jobs)), "a webhook never came", 30)
            sent = sorted(d["json"]["job_id"] for d in hooks.deliveries if d["json"])
            assert sent == sorted(jobs), sent  # each job's webhook once, whichever gateway ended it
            if not restart:
                # Killed for good: its share (1 of 4) stays reserved, loudly, until an operator forgets it.
                lost = (await alive.state())["cluster"]["lost"]
                assert [(g["id"], g["reserved"]["routes"]) for g in lost] == [("gw2", {"gen": 1})], lost
                async with s.post(alive.url + "/admin/cluster/forget/gw2", headers=ADMIN) as r:
                    assert r.status == 200, await r.text()
                async with s.post(alive.url + "/admin/cluster/forget/gw2", headers=ADMIN) as r:
                    assert r.status == 404  # nothing left to forget
                async with s.post(alive.url + "/admin/cluster/forget/gw1", headers=ADMIN) as r:
                    assert r.status == 409  # alive: it holds only what it runs
                assert (await alive.state())["cluster"]["lost"] == []
                # The leader said so once, naming it and what its reservation held.
                said = [m["text"] for m in tg.messages if "gateway gw2 lost" in m["text"]]
                assert len(said) == 1 and "gen 1/node" in said[0] and "forget/gw2" in said[0], tg.messages
        assert gpu.stats["max_concurrent"] <= N, gpu.stats
    finally:
        await hooks.__aexit__(None, None, None)
        await tg.__aexit__(None, None, None)
        await gpu.stop()


async def _delivered(hooks: FakeWebhookReceiver, n: int) -> bool:
    return len([d for d in hooks.deliveries if d["json"]]) >= n


async def _running(gpu: FakeGPU, n: int) -> bool:
    return bool(gpu.stats["running"] >= n)


async def _status_in(s: aiohttp.ClientSession, gw: GatewayProc, jid: str, want: set[str]) -> bool:
    return await job_status(s, gw, jid) in want


async def test_a_loss_seen_before_this_gateway_is_the_voice_is_said_when_it_becomes_it() -> None:
    # The lost gateway was the leader: the others see it lost before its leader lease has passed
    # on, and none of them may speak yet. The one that becomes the voice says it then, once.
    said: list[str] = []
    voice = [False]
    leases = ClusterLeases(Scheduler(), ClusterConfig(redis_url="redis://127.0.0.1:1/0", gateway_id="gw0"), "gw0",
                           clock=lambda: 0.0, version=lambda: "v", alert=lambda event, text, node: said.append(text),
                           speaks=lambda event: voice[0])
    lost = ["gw2", "12000", '{"r": {"gen": 1}}']
    leases._gone(lost)
    assert said == [] and [g.id for g in leases.view.lost] == ["gw2"]
    voice[0] = True
    leases._gone(lost)
    leases._gone(lost)
    assert len(said) == 1 and "gateway gw2 lost" in said[0] and "gen 1/node" in said[0], said

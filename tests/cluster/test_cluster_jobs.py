"""Jobs anywhere (docs/CLUSTER.md#jobs): an sse/async job submitted on one gateway is served,
cancelled and — when its gateway dies — carried on by another. Real redis-server, real gateway
processes, a fake GPU, a local webhook receiver."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from comfy_client import PNG_SIGNATURE
from comfy_client import graph as comfy_graph
from conftest import auth
from fakes import FakeWebhookReceiver

from kilolined.fakegpu import FakeGPU

from .harness import GatewayProc, RedisServer, forget, make_gateways, start_all

ASYNC = {"X-KiloLine-Mode": "async"}


@pytest.fixture
async def receiver() -> AsyncIterator[FakeWebhookReceiver]:
    async with FakeWebhookReceiver() as r:
        yield r


async def submit(s: aiohttp.ClientSession, gw: GatewayProc, who: str = "alice", headers: dict[str, str] | None = None,
                 **body: Any) -> dict[str, Any]:
    async with s.post(gw.url + "/gen/generate", json=body, headers={**auth(who), **ASYNC, **(headers or {})}) as r:
        assert r.status == 202, await r.text()
        return await r.json()


async def status(s: aiohttp.ClientSession, gw: GatewayProc, job_id: str, who: str = "alice") -> tuple[int, Any]:
    async with s.get(f"{gw.url}/v1/jobs/{job_id}", headers=auth(who)) as r:
        return r.status, await r.json()


async def until_status(s: aiohttp.ClientSession, gw: GatewayProc, job_id: str, want: set[str],
                       timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st, body = await status(s, gw, job_id)
        if st == 200 and body["status"] in want:
            return body
        assert time.monotonic() < deadline, (st, body)
        await asyncio.sleep(0.05)


def parse_sse(text: str) -> list[tuple[int, str, dict[str, Any]]]:
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in fields:
            out.append((int(fields["id"]), fields["event"], orjson.loads(fields["data"])))
    return out


async def events(s: aiohttp.ClientSession, gw: GatewayProc, job_id: str, after: int = 0) -> list[Any]:
    async with s.get(f"{gw.url}/v1/jobs/{job_id}/events", headers={**auth(), "Last-Event-ID": str(after)},
                     timeout=aiohttp.ClientTimeout(total=60)) as r:
        assert r.status == 200, await r.text()
        return parse_sse(await r.text())


def gw_url(gw: GatewayProc, url: str) -> str:
    return url if url.startswith("http") else gw.url + url


async def test_a_job_taken_on_a_is_served_by_b(redis_server: RedisServer, gateways: list[GatewayProc],
                                               gpu: FakeGPU, tmp_path: Path) -> None:
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url)
    await start_all(gateways)
    a, b = gateways
    async with aiohttp.ClientSession() as s:
        job = await submit(s, a, steps=10, step_ms=100, echo="hello")
        jid = job["job_id"]
        # While it runs on A, B follows it live from the start.
        follow = asyncio.create_task(events(s, b, jid))
        st, body = await status(s, b, jid)
        assert st == 200 and body["job_id"] == jid and body["status"] in ("queued", "running")
        # Another key may not see it on B either; its token may.
        assert (await status(s, b, jid, "bob"))[0] == 404
        async with s.get(gw_url(b, job["events_url"]), headers={"Last-Event-ID": "1"}) as r:
            assert r.status == 200
        live = await follow
        done = await until_status(s, b, jid, {"completed"})
        assert done["node"] == "gpu" and done["http_status"] == 200
        async with s.get(f"{b.url}/v1/jobs/{jid}/result", headers=auth()) as r:
            assert r.status == 200
            assert (await r.json())["echo"] == "hello"
        # Without a key: its token on B, as on A; a wrong one is a 404.
        async with s.get(gw_url(b, job["result_url"])) as r:
            assert r.status == 200 and (await r.json())["echo"] == "hello"
        async with s.get(gw_url(b, job["result_url"]).split("?")[0] + "?token=nope") as r:
            assert r.status == 404
        # The replay on B from Last-Event-ID: every later event, ids without a gap, then the end.
        replay = await events(s, b, jid, after=1)
    names = [name for _, name, _ in live]
    assert names[0] == "queued" and "dispatched" in names and names[-1] == "output_ready", names
    assert [i for i, _, _ in live] == list(range(1, len(live) + 1))
    assert replay == live[1:]


async def test_delete_on_b_cancels_the_job_running_on_a(redis_server: RedisServer, gateways: list[GatewayProc],
                                                        gpu: FakeGPU, tmp_path: Path) -> None:
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, max_concurrency=1)
    await start_all(gateways)
    a, b = gateways
    async with aiohttp.ClientSession() as s:
        jid = (await submit(s, a, steps=300, step_ms=100))["job_id"]  # 30 s unless cancelled
        await until_status(s, b, jid, {"running"})
        async with s.delete(f"{b.url}/v1/jobs/{jid}", headers=auth()) as r:
            assert r.status == 200
            assert (await r.json())["status"] == "cancelled"
        assert (await status(s, a, jid))[1]["status"] == "cancelled"
        # The one slot is free again: a request on B is served long before the cancelled one's 30 s.
        async with s.post(b.url + "/gen/generate", json={}, headers=auth(),
                          timeout=aiohttp.ClientTimeout(total=10)) as r:
            assert r.status == 200
        ev = await events(s, b, jid)
    assert ev[-1][1] == "failed" and ev[-1][2]["status"] == "cancelled"


async def test_delete_of_a_queued_job_gives_its_place_back(redis_server: RedisServer, gateways: list[GatewayProc],
                                                           gpu: FakeGPU, tmp_path: Path) -> None:
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, max_concurrency=1)
    await start_all(gateways)
    a, b = gateways
    r = redis_server.client()
    async with aiohttp.ClientSession() as s:
        first = (await submit(s, a, steps=300, step_ms=100))["job_id"]
        await until_status(s, b, first, {"running"})
        queued = [(await submit(s, a))["job_id"] for _ in range(2)]
        assert int(await r.get("kl-test:n:gen") or 0) == 2
        # One deleted on the gateway that holds it, one through the other gateway.
        for gw, jid in zip((a, b), queued, strict=True):
            async with s.delete(f"{gw.url}/v1/jobs/{jid}", headers=auth()) as resp:
                assert resp.status == 200 and (await resp.json())["status"] == "cancelled"
        deadline = time.monotonic() + 5
        while int(await r.get("kl-test:n:gen") or 0) != 0:
            assert time.monotonic() < deadline, "a cancelled job still waits in the cluster's queue"
            await asyncio.sleep(0.05)
        async with s.delete(f"{b.url}/v1/jobs/{first}", headers=auth()) as resp:
            assert resp.status == 200
    await r.aclose()


async def test_kill9_of_the_gateway_running_a_job(redis_server: RedisServer, gateways: list[GatewayProc],
                                                  gpu: FakeGPU, receiver: FakeWebhookReceiver,
                                                  tmp_path: Path) -> None:
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, retry_on_failover=1)
    for g in gateways:
        g.cfg["jobs"] = {"webhook_allow_private": True, "webhook_backoff_sec": [0.2, 0.2]}
    await start_all(gateways)
    a, b = gateways
    async with aiohttp.ClientSession() as s:
        jid = (await submit(s, a, headers={"X-KiloLine-Callback": receiver.url()}, steps=30, step_ms=100,
                            echo="again"))["job_id"]
        await until_status(s, b, jid, {"running"})
        a.kill9()
        await forget(b, "gw0")  # gone for good: its share and its slot on a node that cannot tell come back
        done = await until_status(s, b, jid, {"completed", "failed"})
        assert done["status"] == "completed", done
        async with s.get(f"{b.url}/v1/jobs/{jid}/result", headers=auth()) as r:
            assert r.status == 200 and (await r.json())["echo"] == "again"
        ev = await events(s, b, jid)
        await asyncio.sleep(1.0)  # a second webhook, were one to be sent, would arrive by now
    rerouted = [d for _, name, d in ev if name == "rerouted"]
    assert rerouted == [{"from_node": "gpu", "to_node": "gpu", "reason": "gateway_lost"}], ev
    assert [i for i, _, _ in ev] == list(range(1, len(ev) + 1))  # one log, no gap, across both gateways
    hooks = [d["json"] for d in receiver.deliveries if d["json"] and d["json"]["job_id"] == jid]
    assert len(hooks) == 1 and hooks[0]["type"] == "job.completed", receiver.deliveries


async def test_a_running_job_whose_gateway_died_goes_back_to_the_head(
        redis_server: RedisServer, gateways: list[GatewayProc], gpu: FakeGPU, tmp_path: Path) -> None:
    """Re-queued after its gateway's loss as after a node failure: before the jobs still waiting."""
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, max_concurrency=1, retry_on_failover=1)
    await start_all(gateways)
    a, b = gateways
    async with aiohttp.ClientSession() as s:
        cut = (await submit(s, a, steps=10, step_ms=100))["job_id"]
        await until_status(s, b, cut, {"running"})
        waiting = [(await submit(s, b, steps=10, step_ms=100))["job_id"] for _ in range(3)]
        a.kill9()
        await forget(b, "gw0")
        ended = {}
        for jid in [cut, *waiting]:
            ended[jid] = (await until_status(s, b, jid, {"completed", "failed"}, timeout=60))["finished_at"]
    assert all(st for st in ended.values())
    # The slot the dead gateway held may go to the first waiting job in the moment it is freed;
    # the cut job is at the head after that, before the two others.
    order = sorted(ended, key=lambda j: ended[j])
    assert order.index(cut) <= 1, (order.index(cut), order)


async def test_a_job_cut_by_a_clean_stop_is_carried_on(redis_server: RedisServer, gateways: list[GatewayProc],
                                                       gpu: FakeGPU, receiver: FakeWebhookReceiver,
                                                       tmp_path: Path) -> None:
    # SIGTERM: the job outlasts shutdown_grace_sec (2 s), so the stopping gateway cuts it; it is
    # still the cluster's, and the other gateway runs it again and sends its one webhook.
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, retry_on_failover=1)
    for g in gateways:
        g.cfg["jobs"] = {"webhook_allow_private": True, "webhook_backoff_sec": [0.2, 0.2]}
    await start_all(gateways)
    a, b = gateways
    async with aiohttp.ClientSession() as s:
        jid = (await submit(s, a, headers={"X-KiloLine-Callback": receiver.url()}, steps=40, step_ms=100))["job_id"]
        await until_status(s, b, jid, {"running"})
        await asyncio.get_running_loop().run_in_executor(None, a.stop)
        done = await until_status(s, b, jid, {"completed", "failed", "cancelled"})
        ev = await events(s, b, jid)
        await asyncio.sleep(1.0)
    assert done["status"] == "completed", done
    assert [d["reason"] for _, name, d in ev if name == "rerouted"] == ["gateway_lost"]
    hooks = [d["json"] for d in receiver.deliveries if (d["json"] or {}).get("job_id") == jid]
    assert [h["type"] for h in hooks] == ["job.completed"], hooks


async def test_queued_jobs_of_a_dead_gateway_keep_their_place(redis_server: RedisServer,
                                                              gateways: list[GatewayProc], gpu: FakeGPU,
                                                              receiver: FakeWebhookReceiver, tmp_path: Path) -> None:
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, max_concurrency=1, strategy="fifo")
    for g in gateways:
        g.cfg["jobs"] = {"webhook_allow_private": True, "webhook_backoff_sec": [0.2, 0.2]}
    await start_all(gateways)
    a, b = gateways
    hook = {"X-KiloLine-Callback": receiver.url()}
    async with aiohttp.ClientSession() as s:
        # It holds the one slot for 8 s: longer than the kill and the reaping of A (lease_ttl_sec 2).
        first = (await submit(s, b, steps=80, step_ms=100))["job_id"]
        await until_status(s, b, first, {"running"})
        mine = [(await submit(s, a, headers=hook, steps=1, step_ms=10))["job_id"] for _ in range(4)]  # wait, on A
        later = (await submit(s, b, steps=1, step_ms=10))["job_id"]  # waits behind them, on B
        await until_status(s, b, mine[-1], {"queued"})
        a.kill9()
        await forget(b, "gw0")  # its share (the one slot) is reserved until then
        j_mine = [await until_status(s, b, jid, {"completed"}) for jid in mine]
        j_later = await until_status(s, b, later, {"completed"})
        ev = await events(s, b, mine[0])
        await asyncio.sleep(1.0)  # a second webhook, were one to be sent, would arrive by now
    starts = [j["started_at"] for j in j_mine]
    assert starts == sorted(starts) and starts[-1] < j_later["started_at"]  # in their order, ahead of B's
    assert "rerouted" not in [name for _, name, _ in ev]  # they never ran: they only changed hands
    sent = sorted(d["json"]["job_id"] for d in receiver.deliveries if d["json"])
    assert sent == sorted(mine), sent  # each webhook once, by the gateway that carried the job on


async def test_results_in_redis_stay_within_max_results_mb(redis_server: RedisServer, gateways: list[GatewayProc],
                                                           gpu: FakeGPU, tmp_path: Path) -> None:
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url)
    for g in gateways:
        g.cfg["jobs"] = {"max_results_mb": 0.00012}  # 125 bytes: room for two results of ~56, not three
    await start_all(gateways)
    a, b = gateways
    async with aiohttp.ClientSession() as s:
        jids = []
        for i in range(3):
            jids.append((await submit(s, a if i % 2 else b, steps=1, step_ms=1))["job_id"])
            await until_status(s, a, jids[-1], {"completed"})
        got = []
        for jid, gw in zip(jids, (a, b, a), strict=True):  # each asked where it did not run
            async with s.get(f"{gw.url}/v1/jobs/{jid}/result", headers=auth()) as r:
                got.append(r.status)
    assert got == [404, 200, 200]  # the oldest result made room, cluster-wide


async def test_redis_restarted_empty_forgets_only_what_no_gateway_holds(
        redis_server: RedisServer, gateways: list[GatewayProc], gpu: FakeGPU, tmp_path: Path) -> None:
    gateways += make_gateways(3, tmp_path, redis_server.url, gpu.url)
    await start_all(gateways)
    a, b, c = gateways
    async with aiohttp.ClientSession() as s:
        done_a = (await submit(s, a))["job_id"]
        gone_c = (await submit(s, c))["job_id"]
        for jid in (done_a, gone_c):
            await until_status(s, b, jid, {"completed"})
        c.kill9()  # its job was held by Redis alone from now on
        running = (await submit(s, a, steps=40, step_ms=100, echo="through"))["job_id"]
        await until_status(s, b, running, {"running"})
        redis_server.kill()
        await redis_is(a, "down")
        # Degraded: a job goes on on the gateway that took it, as on one gateway.
        alone = (await submit(s, a))["job_id"]
        await until_status(s, a, alone, {"completed"})
        redis_server.start()
        await redis_is(a, "up")
        await redis_is(b, "up")
        # What Redis alone held is gone: 404 everywhere.
        for path in ("", "/result", "/events"):
            async with s.get(f"{b.url}/v1/jobs/{gone_c}{path}", headers=auth()) as r:
                assert r.status == 404, path
                assert (await r.json())["error"]["type"] == "not_found"
        # What a live gateway holds is written again: the cluster's once more.
        for jid in (done_a, alone):
            await until_status(s, b, jid, {"completed"})
        await until_status(s, b, running, {"completed"})
        async with s.get(f"{b.url}/v1/jobs/{running}/result", headers=auth()) as r:
            assert r.status == 200 and (await r.json())["echo"] == "through"
        ev = await events(s, b, running)
        # A new job is the cluster's again (the scripts the empty Redis forgot are loaded anew).
        fresh = (await submit(s, a))["job_id"]
        await until_status(s, b, fresh, {"completed"})
    assert [i for i, _, _ in ev] == list(range(1, len(ev) + 1)) and ev[-1][1] == "output_ready"


async def redis_is(gw: GatewayProc, state: str) -> None:
    deadline = time.monotonic() + 20
    while (await gw.state())["cluster"]["redis"] != state:
        assert time.monotonic() < deadline, f"{gw.url} never saw Redis {state}"
        await asyncio.sleep(0.1)


async def test_a_paused_gateway_that_comes_back_sends_no_second_webhook(
        redis_server: RedisServer, gateways: list[GatewayProc], gpu: FakeGPU, receiver: FakeWebhookReceiver,
        tmp_path: Path) -> None:
    # SIGSTOP, not kill: A's heartbeat lapses, B carries the job on and finishes it; then A wakes
    # up, its own run is stopped (lease lost) — and the webhook still goes out once. A generic
    # node cannot show its slot free: A's slot stays in doubt until its request_timeout_sec, and
    # A's share (2 of 4) stays reserved while it is frozen; B carries the job on in its own share.
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, retry_on_failover=1, request_timeout_sec=6,
                              max_concurrency=4)
    for g in gateways:
        g.cfg["jobs"] = {"webhook_allow_private": True, "webhook_backoff_sec": [0.2, 0.2]}
    await start_all(gateways)
    a, b = gateways
    assert a.proc is not None
    async with aiohttp.ClientSession() as s:
        jid = (await submit(s, a, headers={"X-KiloLine-Callback": receiver.url()}, steps=30, step_ms=100))["job_id"]
        await until_status(s, b, jid, {"running"})
        a.proc.send_signal(signal.SIGSTOP)
        try:
            done = await until_status(s, b, jid, {"completed"})
            assert done["status"] == "completed"
            deadline = time.monotonic() + 10
            while not [d for d in receiver.deliveries if (d["json"] or {}).get("job_id") == jid]:
                assert time.monotonic() < deadline, "B never sent the webhook"
                await asyncio.sleep(0.05)
        finally:
            a.proc.send_signal(signal.SIGCONT)
        await until_status(s, a, jid, {"completed"})  # A's own run ended too, on A
        await asyncio.sleep(1.0)
    hooks = [d for d in receiver.deliveries if (d["json"] or {}).get("job_id") == jid]
    assert len(hooks) == 1, hooks


async def test_a_comfyui_jobs_files_are_served_by_another_gateway(redis_server: RedisServer,
                                                                  gateways: list[GatewayProc],
                                                                  tmp_path: Path) -> None:
    """files/{n} of a ComfyUI job taken and run on A, fetched through B (it streams /view from
    the node that rendered it, as A would)."""
    fake = FakeGPU("comfyui", steps=2, step_ms=10)
    await fake.start()
    try:
        gateways += make_gateways(2, tmp_path, redis_server.url, fake.url, kind="comfyui")
        await start_all(gateways)
        a, b = gateways
        async with aiohttp.ClientSession() as s:
            async with s.post(a.url + "/gen/prompt", json={"prompt": comfy_graph(3)},
                              headers={**auth(), **ASYNC}) as r:
                assert r.status == 202, await r.text()
                jid = (await r.json())["job_id"]
            await until_status(s, b, jid, {"completed"})
            async with s.get(f"{b.url}/v1/jobs/{jid}/result", headers=auth()) as r:
                assert r.status == 200
                image = (await r.json())["outputs"]["9"]["images"][0]
            async with s.get(b.url + image["url"]) as r:  # the file token alone is enough
                assert r.status == 200, await r.text()
                via_b = await r.read()
            params = {k: image[k] for k in ("filename", "subfolder", "type")}
            async with s.get(fake.url + "/view", params=params) as r:
                direct = await r.read()
        assert via_b == direct and via_b.startswith(PNG_SIGNATURE)
    finally:
        await fake.stop()

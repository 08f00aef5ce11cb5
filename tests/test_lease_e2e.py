"""The lease's deadline over real sockets: whatever holds a slot, request_timeout_sec frees it.

- a client that opens a large response and never reads it (the relay is blocked writing);
- a ComfyUI prompt in sync mode that is still running on the node at the deadline: it is
  interrupted on the node before its slot is given back, so the node never runs two.
"""

from __future__ import annotations

import asyncio
import socket

import aiohttp
from aiohttp import web
from comfy_client import graph
from conftest import KEYS, auth, base_config, wait_until


async def big_node() -> tuple[web.AppRunner, str]:
    """A node that streams 64 MiB per request: far more than the socket buffers hold."""

    async def gen(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        chunk = b"x" * (1024 * 1024)
        for _ in range(64):
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", gen)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def test_a_client_that_never_reads_holds_its_slot_no_longer_than_the_timeout(gateway, http) -> None:
    runner, url = await big_node()
    try:
        cfg = base_config({"a": url}, max_concurrency=1, request_timeout_sec=1.5)
        gw = await gateway(cfg)
        host, port = gw.url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(f"GET /gen/big HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS['alice']}\r\n\r\n".encode())
        try:
            await wait_until(lambda: gw.rt.scheduler.node_inflight.get("a", 0) == 1, timeout=5)
            # The client reads nothing: at the deadline the slot is back, the node not blamed.
            await wait_until(lambda: gw.rt.scheduler.node_inflight.get("a", 0) == 0, timeout=6)
            assert gw.rt.scheduler.nodes["a"].last_error is None
            async with http.get(gw.url + "/gen/next", headers=auth("bob")) as r:
                assert r.status == 200
                assert len(await r.read()) == 64 * 1024 * 1024
        finally:
            sock.close()
    finally:
        await runner.cleanup()


async def test_a_sync_prompt_past_the_timeout_is_interrupted_before_its_slot_is_freed(fakegpus, gateway, http) -> None:
    fake = await fakegpus("comfyui", steps=200, step_ms=50)  # 10 s of work
    cfg = base_config({"c": fake.url}, kind="comfyui", max_concurrency=1, request_timeout_sec=1)
    gw = await gateway(cfg)
    async with http.post(gw.url + "/gen/prompt", json={"prompt": graph(steps=200)}, headers=auth()) as r:
        assert r.status == 200, await r.text()
        assert "prompt_id" in await r.json()
    await wait_until(lambda: fake.stats["running"] == 1)
    # The second prompt waits for the slot; it may only reach the node once the first stopped.
    second = asyncio.ensure_future(http.post(gw.url + "/gen/prompt", json={"prompt": graph(steps=3)},
                                             headers=auth("bob")))
    await wait_until(lambda: gw.rt.scheduler.node_inflight.get("c", 0) == 0 or fake.stats["interrupts"] > 0,
                     timeout=8)
    r2: aiohttp.ClientResponse = await second
    assert r2.status == 200
    r2.release()
    await wait_until(lambda: fake.stats["interrupts"] >= 1, timeout=8)
    await wait_until(lambda: fake.stats["running"] == 0, timeout=8)
    assert fake.stats["max_concurrent"] == 1

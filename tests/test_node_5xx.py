"""What a node's 5xx does (docs/API.md "Re-queue"), in every client mode and on every adapter: a 502 or 503 means
the node did no work and the request is re-queued to another node; a 500 or 504 may come after the
work ran, so it reaches the client as the node sent it and is never re-sent. Every one of them
counts toward the node's breaker. Real fake GPUs, a real gateway, real sockets."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from conftest import ADMIN, auth, base_config, wait_until

KINDS = {
    # kind: (path on the route, a body the fake GPU of that kind takes)
    "generic": ("/gen/generate", {"steps": 1, "step_ms": 1}),
    "openai": ("/gen/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                            "max_tokens": 2}),
    "comfyui": ("/gen/prompt", {"prompt": {
        "3": {"class_type": "KSampler", "inputs": {"seed": 1, "steps": 1}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": "x"}}}}),
}


async def two_nodes(fakegpus: Any, gateway: Any, kind: str, status: int, **breaker: Any) -> tuple[Any, Any, Any]:
    """Primary ``a`` answering ``status`` to every job, healthy standby ``b``."""
    a = await fakegpus(kind, steps=1, step_ms=1)
    b = await fakegpus(kind, steps=1, step_ms=1)
    a.set_control(fail_status=status)
    cfg = base_config({"a": a.url, "b": b.url}, kind=kind, max_concurrency=1)
    cfg["nodes"]["a"]["breaker"] = {"consecutive_failures": 3, "open_sec": 30, **breaker}
    return a, b, await gateway(cfg)


async def run(http: aiohttp.ClientSession, url: str, kind: str, mode: str) -> tuple[int, str | None]:
    """One request in ``mode``; the HTTP status the client ends up with and the node that gave it."""
    path, body = KINDS[kind]
    if mode == "sync":
        async with http.post(url + path, json=body, headers=auth()) as r:
            await r.read()
            return r.status, r.headers.get("X-KiloLine-Node")
    if mode == "sse":
        async with http.post(url + path, json=body, headers={**auth(), "X-KiloLine-Mode": "sse"}) as r:
            assert r.status == 200
            node, last = None, None
            async for raw in r.content:
                line = raw.decode().strip()
                if line.startswith("data:"):
                    data = json.loads(line[5:])
                    node = data.get("node", node)
                    last = data
            assert last is not None and last.get("status") in ("completed", "failed"), last
            return last["http_status"], node
    async with http.post(url + path, json=body, headers={**auth(), "X-KiloLine-Mode": "async"}) as r:
        assert r.status == 202
        job_id = (await r.json())["job_id"]
    job: dict[str, Any] = {}

    async def ended() -> bool:
        nonlocal job
        async with http.get(f"{url}/v1/jobs/{job_id}", headers=auth()) as r:
            job = await r.json()
        return job["status"] in ("completed", "failed")

    await wait_until(ended)
    return job["http_status"], job["node"]


async def breaker(http: aiohttp.ClientSession, url: str, node: str) -> str:
    async with http.get(url + "/admin/state", headers=ADMIN) as r:
        return str((await r.json())["nodes"][node]["breaker"])


MODES = ("sync", "sse", "async")


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("status", [500, 504])
async def test_500_and_504_reach_the_client_and_are_never_sent_again(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession, kind: str, mode: str, status: int) -> None:
    a, b, gw = await two_nodes(fakegpus, gateway, kind, status)
    got, node = await run(http, gw.url, kind, mode)
    assert (got, node) == (status, "a")  # the node's own status; a job ends failed with it
    assert a.stats["rejected"] == 1  # sent once: the work may have run
    assert b.stats["served"] == 0 and not any(r["method"] == "POST" for r in b.requests)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("status", [502, 503])
async def test_502_and_503_are_requeued_to_another_node(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession, kind: str, mode: str, status: int) -> None:
    a, _, gw = await two_nodes(fakegpus, gateway, kind, status)
    assert await run(http, gw.url, kind, mode) == (200, "b")  # the node did no work: another one does it
    assert a.stats["rejected"] == 1


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("status", [500, 501, 504, 507])
async def test_every_5xx_counts_toward_the_breaker(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession,
                                                   kind: str, mode: str, status: int) -> None:
    a, _, gw = await two_nodes(fakegpus, gateway, kind, status, consecutive_failures=2)
    for _ in range(2):
        assert await run(http, gw.url, kind, mode) == (status, "a")
    assert await breaker(http, gw.url, "a") == "open"
    assert a.stats["rejected"] == 2  # one try per request, no re-send
    assert await run(http, gw.url, kind, "sync") == (200, "b")  # the breaker sends the next one elsewhere


async def test_a_504_is_answered_at_once_not_after_the_queue_timeout(fakegpus: Any, gateway: Any,
                                                                   http: aiohttp.ClientSession) -> None:
    """A lone node answering 504: the client gets that 504, not a 503 queue_timeout once the
    re-tries have opened the breaker and the request has waited out the queue."""
    a = await fakegpus("generic", steps=1, step_ms=1)
    a.set_control(fail_status=504)
    cfg = base_config({"a": a.url}, queue_timeout_sec=5)
    cfg["nodes"]["a"]["breaker"] = {"consecutive_failures": 2, "open_sec": 30}
    gw = await gateway(cfg)
    async with asyncio.timeout(4):  # well inside queue_timeout_sec: no waiting it out
        async with http.post(gw.url + "/gen/generate", json={}, headers=auth()) as r:
            body = await r.json()
            assert r.status == 504 and r.headers["X-KiloLine-Node"] == "a", body
    assert "simulated failure" in json.dumps(body)  # the node's own body
    assert a.stats["rejected"] == 1 and await breaker(http, gw.url, "a") == "closed"


@pytest.mark.parametrize("status", [500, 504])
async def test_an_openai_stream_request_gets_the_nodes_own_answer(fakegpus: Any, gateway: Any,
                                                                  http: aiohttp.ClientSession, status: int) -> None:
    a, b, gw = await two_nodes(fakegpus, gateway, "openai", status)
    path, body = KINDS["openai"]
    async with http.post(gw.url + path, json={**body, "stream": True}, headers=auth()) as r:
        await r.read()
        assert (r.status, r.headers["X-KiloLine-Node"]) == (status, "a")
    assert a.stats["rejected"] == 1 and b.stats["served"] == 0

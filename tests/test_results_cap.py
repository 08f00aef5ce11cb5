"""jobs.max_results_mb counts results while they are still being read, not only finished ones
(docs/SECURITY.md): the bytes held, finished plus in flight, never exceed the cap, and every
ending (completed, failed, cancelled, the node dying mid-body) gives its reservation back.

The node is a tiny aiohttp server in the test: it streams a chunked answer (no Content-Length, so
the gateway learns the size only as bytes arrive), holds the rest behind a gate the test opens,
and can die mid-body. The fake GPU's /blob (with a Content-Length) covers the up-front refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from conftest import auth, base_config, wait_until
from fakes import _FakeServer
from jobs_client import job_status

from kilolined.fakegpu import FakeGPU

KIB = 1024
CAP_MB = 1
CAP = CAP_MB * 1024 * 1024
ASYNC = {"X-KiloLine-Mode": "async"}


class GatedNode(_FakeServer):
    """``GET /big?first=N&rest=M&gate=G[&die=1]``: N bytes at once, then — once gate G opens — M
    more and the end (or, with die, the connection dropped)."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: dict[str, asyncio.Event] = {}
        self.waiting = 0  # requests whose first part is sent and that wait at their gate
        self.app.router.add_get("/big", self.big)

    def gate(self, name: str) -> asyncio.Event:
        return self.gates.setdefault(name, asyncio.Event())

    async def big(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        first, rest = int(q["first"]), int(q.get("rest", "0"))
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(0, first, 64 * KIB):
            await resp.write(b"a" * min(64 * KIB, first - i))
        self.waiting += 1
        try:
            await self.gate(q["gate"]).wait()
        finally:
            self.waiting -= 1
        if q.get("die") and request.transport is not None:
            request.transport.abort()  # a spot GPU vanishing mid-body
            return resp
        for i in range(0, rest, 64 * KIB):
            await resp.write(b"b" * min(64 * KIB, rest - i))
        await resp.write_eof()
        return resp


class Sampler:
    """The store's counters, sampled on the event loop while jobs run."""

    def __init__(self, jobs: Any) -> None:
        self.jobs = jobs
        self.max_accounted = 0
        self.max_reading = 0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(0.002)

    def sample(self) -> None:
        self.max_accounted = max(self.max_accounted, self.jobs.result_bytes + self.jobs.reading_bytes)
        self.max_reading = max(self.max_reading, self.jobs.reading_bytes)

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.sample()


@pytest.fixture
async def node() -> AsyncIterator[GatedNode]:
    async with GatedNode() as n:
        yield n
        for g in n.gates.values():
            g.set()  # no handler left waiting at teardown


async def submit(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url, headers={**auth(), **ASYNC}) as r:
        assert r.status == 202, await r.text()
        return str((await r.json())["job_id"])


def cap_cfg(url: str, slots: int = 8) -> dict[str, Any]:
    cfg = base_config({"n": url}, max_concurrency=slots, retry_on_failover=0)
    cfg["jobs"] = {"max_results_mb": CAP_MB}
    return cfg


async def result_of(http: aiohttp.ClientSession, gw: Any, job_id: str) -> tuple[int, bytes]:
    async with http.get(f"{gw.url}/v1/jobs/{job_id}/result", headers=auth()) as r:
        return r.status, await r.read()


async def test_results_being_read_count_against_the_cap(node: GatedNode, gateway: Any,
                                                        http: aiohttp.ClientSession) -> None:
    gw = await gateway(cap_cfg(node.base_url))
    sampler = Sampler(gw.jobs)
    try:
        big = f"{gw.url}/gen/big?first={300 * KIB}&rest={100 * KIB}&gate=g"
        ids = [await submit(http, big) for _ in range(4)]
        # Three reads of 300 KiB fit in 1 MiB; the fourth would not, and fails while the others wait.
        await wait_until(lambda: sum(gw.jobs.jobs[i].status == "failed" for i in ids) == 1, timeout=20)
        await wait_until(lambda: node.waiting == 4 and gw.jobs.reading_bytes == 3 * 300 * KIB, timeout=20)
        failed = next(i for i in ids if gw.jobs.jobs[i].status == "failed")
        view = await job_status(http, gw, failed)
        assert view["http_status"] == 502 and view["error"]["type"] == "upstream_error"
        assert "max_results_mb" in view["error"]["message"]
        running = [i for i in ids if i != failed]
        # A client DELETE mid-body gives its reservation back.
        async with http.delete(f"{gw.url}/v1/jobs/{running[0]}", headers=auth()) as r:
            assert r.status == 200 and (await r.json())["status"] == "cancelled"
        await wait_until(lambda: gw.jobs.reading_bytes == 2 * 300 * KIB, timeout=20)
        node.gate("g").set()
        await wait_until(lambda: all(gw.jobs.jobs[i].status == "completed" for i in running[1:]), timeout=20)
    finally:
        await sampler.stop()
    assert sampler.max_reading >= 3 * 300 * KIB  # the sampler saw the reads in flight
    assert sampler.max_accounted <= CAP
    # After every job ended, only finished results are accounted, and they are whole.
    assert gw.jobs.reading_bytes == 0
    assert gw.jobs.result_bytes == 2 * 400 * KIB
    for i in running[1:]:
        status, body = await result_of(http, gw, i)
        assert status == 200 and body == b"a" * (300 * KIB) + b"b" * (100 * KIB)


async def test_a_read_evicts_the_oldest_finished_result_and_a_dying_node_releases(
        node: GatedNode, gateway: Any, http: aiohttp.ClientSession) -> None:
    gw = await gateway(cap_cfg(node.base_url))
    sampler = Sampler(gw.jobs)
    try:
        node.gate("open").set()
        first = await submit(http, f"{gw.url}/gen/big?first={400 * KIB}&gate=open")
        await wait_until(lambda: gw.jobs.jobs[first].status == "completed", timeout=20)
        assert gw.jobs.result_bytes == 400 * KIB
        kept = await submit(http, f"{gw.url}/gen/big?first={300 * KIB}&rest={100 * KIB}&gate=g")
        dies = await submit(http, f"{gw.url}/gen/big?first={300 * KIB}&gate=g&die=1")
        await wait_until(lambda: node.waiting == 2 and gw.jobs.reading_bytes == 600 * KIB, timeout=20)
        assert (await result_of(http, gw, first))[0] == 200  # 400 + 600 KiB: still fits
        late = await submit(http, f"{gw.url}/gen/big?first={300 * KIB}&rest={100 * KIB}&gate=h")
        # The third read needs room: the oldest finished result goes, the reads in flight stay.
        await wait_until(lambda: node.waiting == 3 and gw.jobs.reading_bytes == 900 * KIB, timeout=20)
        assert (await result_of(http, gw, first))[0] == 404
        assert gw.jobs.result_bytes == 0
        node.gate("g").set()  # `dies` loses its node mid-body; `kept` completes
        await wait_until(lambda: gw.jobs.jobs[dies].status == "failed"
                         and gw.jobs.jobs[kept].status == "completed", timeout=20)
        node.gate("h").set()
        await wait_until(lambda: gw.jobs.jobs[late].status == "completed", timeout=20)
    finally:
        await sampler.stop()
    assert sampler.max_accounted <= CAP
    assert gw.jobs.reading_bytes == 0
    assert gw.jobs.result_bytes == 2 * 400 * KIB
    assert (await job_status(http, gw, dies))["error"]["type"] == "upstream_error"


async def test_a_declared_length_that_cannot_fit_fails_before_its_bytes_arrive(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    gpu: FakeGPU = await fakegpus("generic")
    gw = await gateway(cap_cfg(gpu.url))
    job = await submit(http, f"{gw.url}/gen/blob?bytes={CAP + 1}")
    await wait_until(lambda: gw.jobs.jobs[job].status == "failed", timeout=20)
    view = await job_status(http, gw, job)
    assert view["http_status"] == 502 and f"result of {CAP + 1} bytes" in view["error"]["message"]
    assert gw.jobs.reading_bytes == 0 and gw.jobs.result_bytes == 0
    ok = await submit(http, f"{gw.url}/gen/blob?bytes={CAP}")  # exactly the cap fits
    await wait_until(lambda: gw.jobs.jobs[ok].status == "completed", timeout=20)
    assert gw.jobs.result_bytes == CAP and gw.jobs.reading_bytes == 0

"""The access log, as an operator reads it (docs/CONFIG.md `server.access_log`): every line names the
method and the path (never the query: job URLs carry their token there), and a job's line tells the
time it waited for its node, whatever its mode."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import aiohttp
import pytest
from conftest import auth, base_config, wait_until
from jobs_client import SSEReader, job_status

SECRET_QUERY = "token=QRY-SECRET-0123456789"


def access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kilolined.access"]


def wait_ms(line: str) -> int:
    m = re.search(r" wait=(\d+)ms ", line)
    assert m is not None, line
    return int(m.group(1))


async def busy_then_jobs(http: aiohttp.ClientSession, gw: Any) -> tuple[dict[str, Any], str]:
    """The one slot held by a sync request while an sse job and an async job queue behind it;
    returns the async job's 202 body and the sse job's id, both jobs completed."""
    slow = {"steps": 6, "step_ms": 50}
    url = gw.url + "/gen/generate?" + SECRET_QUERY
    first = asyncio.ensure_future(http.post(url, json=slow, headers=auth()))
    await wait_until(lambda: gw.rt.scheduler.node_inflight.get("a", 0) == 1)
    async with http.post(url, json={}, headers={**auth(), "X-KiloLine-Mode": "async"}) as r:
        assert r.status == 202
        queued = await r.json()
    async with http.post(url, json={}, headers={**auth(), "X-KiloLine-Mode": "sse"}) as r:
        assert r.status == 200
        sse_job = r.headers["X-KiloLine-Job"]
        await SSEReader(r).rest(timeout=30)
    async with await first as r:
        assert r.status == 200
    return queued, sse_job


@pytest.mark.parametrize("json_log", [False, True])
async def test_lines_name_method_and_path_and_a_job_s_wait(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession,
                                                           caplog: pytest.LogCaptureFixture, json_log: bool) -> None:
    caplog.set_level(logging.INFO, logger="kilolined.access")
    gpu = await fakegpus()
    gw = await gateway(base_config({"a": gpu.url}, max_concurrency=1))
    gw.server.gateway.log_json = json_log
    queued, sse_job = await busy_then_jobs(http, gw)
    await wait_until(lambda: len(access_lines(caplog)) == 4)  # sync, async 202, sse, the async job's end
    lines = access_lines(caplog)
    assert not any("QRY-SECRET" in ln for ln in lines)  # the query is never logged
    recs = [json.loads(ln) for ln in lines] if json_log else []
    if json_log:
        assert all((r["method"], r["path"]) == ("POST", "/gen/generate") for r in recs), recs
        by_mode = {(r["mode"], r["status"]): r for r in recs}
        assert by_mode[("async", 202)]["queue_wait_ms"] is None  # not known at the 202
        sse_wait, async_wait = by_mode[("sse", 200)]["queue_wait_ms"], by_mode[("async", 200)]["queue_wait_ms"]
        assert by_mode[("async", 200)]["job"] == "completed"
        assert by_mode[("async", 200)]["request_id"] == by_mode[("async", 202)]["request_id"]
    else:
        assert all(" POST /gen/generate alice gen " in ln for ln in lines), lines
        (accepted,) = [ln for ln in lines if " async 202 " in ln]
        assert " wait=- " in accepted
        (ended,) = [ln for ln in lines if " async 200 " in ln]
        assert ended.endswith(" job=completed") and ended.split()[0] == accepted.split()[0]
        sse_wait = wait_ms(next(ln for ln in lines if " sse 200 " in ln))
        async_wait = wait_ms(ended)
    # Each job's line says the wait the job measured (both waited for the slow request).
    for job_id, logged in ((queued["job_id"], async_wait), (sse_job, sse_wait)):
        assert (await job_status(http, gw, job_id))["status"] == "completed"
        waited = gw.jobs.finished[job_id].queue_wait
        assert waited > 0 and logged == int(waited * 1000), (logged, waited)

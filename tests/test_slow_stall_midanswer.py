"""A stream that stalls after its first bytes (tokens came, then silence for ``slow.stall_sec``).

What reached the client decides what happens:
- sync: the node's bytes were relayed as they came, so nothing can be replayed: with
  ``continue_streams: false`` the stream ends with the error (OpenAI's shape) and the node's
  breaker opens (on, it goes on on another node: test_continuation.py);
- sse and async jobs: the client gets only gateway events (``step_progress`` counts chunks, never
  their bytes) and the result at the end: the job is re-queued to another node (``rerouted``,
  reason "stalled"), which continues the answer, and completes there.
In every mode the stalled node is out at once and no slot or result reservation is left behind.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from comfy_client import inflight
from conftest import auth, base_config, wait_until

MESSAGES = [{"role": "user", "content": "say something please"}]
BREAKER = {"consecutive_failures": 3, "open_sec": 60, "slow_start_sec": 0}
BODY = {"model": "fake-llm", "messages": MESSAGES, "stream": True, "max_tokens": 50}


async def setup(fakegpus: Any, gateway: Any, **route: Any) -> tuple[Any, Any, Any]:
    # 50 tokens of 100 ms: the answer streams for 5 s unless the node freezes first
    stuck = await fakegpus("openai", step_ms=100)
    fine = await fakegpus("openai", step_ms=20)
    cfg = base_config({"s": stuck.url, "f": fine.url}, kind="openai", path="/v1", max_concurrency=1, **route)
    for n in ("s", "f"):
        cfg["nodes"][n].update(slow={"stall_sec": 0.5}, breaker=BREAKER)
    return stuck, fine, await gateway(cfg)  # s is the primary, f its standby


def freeze(node: Any) -> None:
    """The node goes silent mid-answer: its next piece comes 60 s later (a frozen GPU)."""
    node.set_control(drip_ms=60_000)


async def sse_events(r: aiohttp.ClientResponse, stuck: Any) -> list[tuple[str, dict[str, Any]]]:
    """The job's events; the node freezes once the first tokens reached the gateway."""
    events: list[tuple[str, dict[str, Any]]] = []
    name = "message"
    async for raw in r.content:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            events.append((name, orjson.loads(line[5:])))
            if name == "step_progress" and stuck.knobs.drip_ms == 0:
                freeze(stuck)
    return events


@pytest.mark.parametrize("mode", ["sse", "async"])
async def test_a_job_whose_stream_stalls_mid_answer_is_requeued(fakegpus: Any, gateway: Any,
                                                                http: aiohttp.ClientSession, mode: str) -> None:
    stuck, fine, gw = await setup(fakegpus, gateway)
    headers = {**auth(), "X-KiloLine-Mode": mode}
    async with http.post(gw.url + "/v1/chat/completions", json=BODY, headers=headers) as r:
        assert r.status == (200 if mode == "sse" else 202)
        if mode == "sse":
            events = await asyncio.wait_for(sse_events(r, stuck), 30)
            names = [n for n, _ in events]
        else:
            job = gw.jobs.jobs[(await r.json())["job_id"]]
    if mode == "async":
        # tokens arrived from s: the answer had begun when it froze
        await wait_until(lambda: any(name == "step_progress" for _, name, _ in job.events), timeout=20)
        freeze(stuck)
        await wait_until(lambda: job.status in ("completed", "failed"), timeout=30)
        names = [name for _, name, _ in job.events]
        assert job.status == "completed", job.error
        events = [(name, orjson.loads(frame.split(b"data: ", 1)[1])) for _, name, frame in job.events]
    assert "step_progress" in names[: names.index("rerouted")], names  # the answer had begun on s
    rerouted = [d for n, d in events if n == "rerouted"]
    assert rerouted[0]["from_node"] == "s" and rerouted[0]["to_node"] == "f", events
    assert rerouted[0]["reason"].startswith("stalled"), rerouted
    assert names[-1] == "output_ready" and "failed" not in names, names
    done = next(d for n, d in events if n == "output_ready")
    assert done["http_status"] == 200 and done["content_type"].startswith("text/event-stream"), done
    async with http.get(gw.url + done["result_url"]) as r:
        result = await r.read()  # s's words, then f's continuation of them: one stream
    assert result.count(b'"role"') == 1 and result.rstrip().endswith(b"data: [DONE]"), result
    assert fine.stats["served"] == 1
    ns = gw.rt.scheduler.nodes["s"]
    await wait_until(lambda: ns.breaker == "open", timeout=10)
    assert "stalled" in (ns.last_error or "")
    # Nothing leaked: no slot, no result bytes still reserved; the node ran one answer at a time.
    await wait_until(lambda: inflight(gw) == 0, timeout=10)
    assert gw.jobs.reading_bytes == 0 and not gw.jobs.active
    assert stuck.stats["max_concurrent"] <= 1 and fine.stats["max_concurrent"] <= 1


async def test_a_sync_stream_that_stalls_mid_answer_ends_with_the_error(fakegpus: Any, gateway: Any,
                                                           http: aiohttp.ClientSession) -> None:
    stuck, fine, gw = await setup(fakegpus, gateway, continue_streams=False)
    got = bytearray()
    async with http.post(gw.url + "/v1/chat/completions", json=BODY, headers=auth()) as r:
        assert r.status == 200
        async for chunk in r.content.iter_any():
            got += chunk
            if b'"content"' in got and stuck.knobs.drip_ms == 0:
                freeze(stuck)  # the client holds tokens from s now
    # The tokens went out as they came: the stream ends with the error (OpenAI's shape), not f's answer.
    events = [orjson.loads(line[6:]) for line in bytes(got).split(b"\n\n") if line.startswith(b"data: {")]
    assert events[0]["choices"][0]["delta"]["content"] and "error" in events[-1], got
    assert "stalled" in events[-1]["error"]["message"], events[-1]
    assert sum(1 for ev in events if "choices" in ev and ev["choices"][0]["delta"].get("role")) == 1, got
    ns = gw.rt.scheduler.nodes["s"]
    await wait_until(lambda: ns.breaker == "open", timeout=10)
    assert "stalled" in (ns.last_error or "")
    assert fine.stats["served"] == 0  # bytes went out: never replayed
    await wait_until(lambda: inflight(gw) == 0, timeout=10)


@pytest.mark.parametrize("mode", ["sse", "async"])
async def test_a_job_whose_answer_outlives_request_timeout_fails_as_a_timeout(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession, mode: str) -> None:
    # Read under the attempt, a job's answer still ends at request_timeout_sec as a timeout.
    node = await fakegpus("openai", step_ms=100)  # 50 tokens: 5 s of answer
    cfg = base_config({"n": node.url}, kind="openai", path="/v1", max_concurrency=1, request_timeout_sec=1)
    cfg["nodes"]["n"]["slow"] = "off"
    gw = await gateway(cfg)
    async with http.post(gw.url + "/v1/chat/completions", json=BODY,
                         headers={**auth(), "X-KiloLine-Mode": mode}) as r:
        if mode == "sse":
            await r.read()
            job = next(iter(gw.jobs.jobs.values()))
        else:
            job = gw.jobs.jobs[(await r.json())["job_id"]]
    await wait_until(lambda: job.status in ("completed", "failed"), timeout=20)
    assert job.status == "failed" and job.http_status == 504, (job.status, job.http_status, job.error)
    assert job.error is not None and job.error["type"] == "upstream_timeout", job.error
    assert job.error["message"].endswith("did not finish within 1s"), job.error
    await wait_until(lambda: inflight(gw) == 0, timeout=10)
    assert gw.jobs.reading_bytes == 0 and not gw.jobs.active

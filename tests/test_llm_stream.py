"""End to end: OpenAI-compatible streams kept alive through a long queue (SPEC §4.1, §5 openai).

The real ``openai`` Python client talks to the gateway; a raw aiohttp reader looks at the bytes
(the ``: queued position=N est_wait_sec=S`` comments the SDK must ignore).
The route is at ``/v1`` so ``base_url`` is ``gateway + "/v1"``; the prefix is stripped before
forwarding (SPEC §2: /comfy/prompt -> node /prompt), so the node URL carries ``/v1`` itself.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import time
from typing import Any

import openai
import orjson
import pytest
from conftest import ADMIN, KEYS, auth, base_config, wait_until
from openai import AsyncOpenAI
from test_sse_jobs import SSEReader

WORDS = ["The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", "."]
MESSAGES = [{"role": "user", "content": "say something please"}]  # 3 prompt tokens for the fake
QUEUED = re.compile(r"^queued position=(\d+) est_wait_sec=(\S+)$")


def llm_cfg(fake: Any, **route: Any) -> dict[str, Any]:
    route.setdefault("max_concurrency", 1)
    cfg = base_config({"o": fake.url + "/v1"}, kind="openai", path="/v1", **route)
    cfg["server"]["heartbeat_sec"] = 0.3
    return cfg


def client(gw: Any, who: str = "alice") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS[who], max_retries=0, timeout=30)


async def hold_the_queue(http, gw, fake, n: int, tokens: int) -> list[asyncio.Task[int]]:
    """``n`` plain (non-stream) completions of ``tokens`` tokens each, first one running."""

    async def one() -> int:
        body = {"model": "m", "messages": MESSAGES, "max_tokens": tokens}
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth("bob")) as r:
            await r.read()
            return r.status

    tasks: list[asyncio.Task[int]] = []
    for i in range(n):
        tasks.append(asyncio.create_task(one()))
        if i == 0:
            await wait_until(lambda: fake.stats["running"] == 1)
        else:
            await wait_until(lambda i=i: gw.rt.state()["routes"]["gen"]["queue_depth"] == i)
    return tasks


async def metric(http, gw, line_prefix: str) -> float | None:
    async with http.get(gw.url + "/metrics", headers=ADMIN) as r:
        assert r.status == 200
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.split()[-1])
    return None


# ----------------------------------------------------------------------------------------------


async def test_openai_client_streams_through_a_long_queue(fakegpus, gateway, http) -> None:
    fake = await fakegpus("openai", step_ms=150)
    gw = await gateway(llm_cfg(fake, expected_duration_sec=1))
    ahead = await hold_the_queue(http, gw, fake, 2, tokens=5)  # ~1.5 s of queue

    c = client(gw)
    started = time.monotonic()
    stream = await c.chat.completions.create(model="fake-llm", messages=MESSAGES, stream=True, max_tokens=6,
                                             stream_options={"include_usage": True})
    assert time.monotonic() - started < 1.0, "the 200 must come at once, not after the queue"
    chunks = [ch async for ch in stream]
    assert await asyncio.gather(*ahead) == [200, 200]

    content = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert content == WORDS[:6]
    assert len({ch.id for ch in chunks}) == 1
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finish == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 6, 9)
    await c.close()


async def test_raw_stream_shows_queue_comments_then_chunks_then_done(fakegpus, gateway, http) -> None:
    fake = await fakegpus("openai", step_ms=150)
    gw = await gateway(llm_cfg(fake, expected_duration_sec=1))
    ahead = await hold_the_queue(http, gw, fake, 2, tokens=5)

    body = {"model": "fake-llm", "messages": MESSAGES, "stream": True, "max_tokens": 4}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert r.headers["Cache-Control"] == "no-cache"
        assert r.headers["X-Accel-Buffering"] == "no"
        reader = SSEReader(r)
        events = await reader.rest(timeout=30)
    await asyncio.gather(*ahead)

    queued = [(at, QUEUED.match(text)) for at, text in reader.comments if text.startswith("queued")]
    assert all(m for _, m in queued), reader.comments
    assert len(queued) >= 3, reader.comments  # ~1.5 s of waiting at one comment per 0.3 s
    positions = [int(m.group(1)) for _, m in queued if m]
    assert positions[0] == 2 and positions[-1] == 1 and positions == sorted(positions, reverse=True), positions
    for _, m in queued:
        assert m is not None and float(m.group(2)) >= 0  # a number, not None/null
    gaps = [b[0] - a[0] for a, b in zip(queued, queued[1:], strict=False)]
    assert statistics.median(gaps) < 1.0, gaps  # about every heartbeat_sec (0.3 s)

    first_data = next(i for i, line in enumerate(reader.lines) if line.startswith("data:"))
    last_comment = max(i for i, line in enumerate(reader.lines) if line.startswith(": queued"))
    assert last_comment < first_data  # every queue comment comes before the first chunk
    assert events[-1].data == "[DONE]"
    chunks = [orjson.loads(e.data) for e in events[:-1]]
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
    assert text == "".join(WORDS[:4])
    assert reader.eof


async def test_queue_timeout_ends_the_stream_with_an_error_the_sdk_raises(fakegpus, gateway, http) -> None:
    fake = await fakegpus("openai", step_ms=100)
    gw = await gateway(llm_cfg(fake, queue_timeout_sec=0.8))
    ahead = await hold_the_queue(http, gw, fake, 1, tokens=25)  # 2.5 s: longer than the queue timeout

    body = {"model": "fake-llm", "messages": MESSAGES, "stream": True}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
        assert r.status == 200
        reader = SSEReader(r)
        events = await reader.rest(timeout=15)
    assert any(text.startswith("queued position=1") for _, text in reader.comments), reader.comments
    assert [e.data for e in events][-1] == "[DONE]"
    assert len(events) == 2, events
    err = orjson.loads(events[0].data)["error"]
    assert {"message", "type", "code"} <= set(err)
    assert err["type"] == "queue_timeout" and err["message"]
    assert err["code"] is None or isinstance(err["code"], str)

    c = client(gw)
    stream = await c.chat.completions.create(model="fake-llm", messages=MESSAGES, stream=True)
    with pytest.raises(openai.APIError) as info:
        async for _ in stream:
            pass
    assert "queue" in str(info.value).lower() or "queue" in str(info.value.body).lower()
    await c.close()
    assert await asyncio.gather(*ahead) == [200]
    # the timed-out requests never reached the node
    assert len([q for q in fake.requests if q["path"] == "/v1/chat/completions"]) == 1


async def test_non_stream_completion_models_and_token_metrics(fakegpus, gateway, http) -> None:
    fake = await fakegpus("openai", step_ms=20)
    gw = await gateway(llm_cfg(fake))
    c = client(gw)

    models = await c.models.list()
    assert [m.id for m in models.data] == ["fake-llm"]

    done = await c.chat.completions.create(model="fake-llm", messages=MESSAGES, max_tokens=3)
    assert done.object == "chat.completion"
    assert done.choices[0].message.content == "".join(WORDS[:3])
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.total_tokens == 6

    stream = await c.chat.completions.create(model="fake-llm", messages=MESSAGES, stream=True, max_tokens=4,
                                             stream_options={"include_usage": True})
    chunks = [ch async for ch in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 7
    await c.close()

    async def counted() -> bool:
        return await metric(http, gw, 'kiloline_tokens_total{route="gen",key="alice"}') == 6 + 7

    await wait_until(counted, timeout=5, step=0.1)
    assert await metric(http, gw, 'kiloline_tokens_total{route="gen",key="bob"}') is None


async def test_openai_route_sse_job_reports_token_progress(fakegpus, gateway, http) -> None:
    fake = await fakegpus("openai", step_ms=30)
    gw = await gateway(llm_cfg(fake))
    body = {"model": "fake-llm", "messages": MESSAGES, "stream": True, "max_tokens": 4}
    async with http.post(gw.url + "/v1/chat/completions", json=body,
                         headers={**auth(), "X-KiloLine-Mode": "sse"}) as r:
        assert r.status == 200
        events = await SSEReader(r).rest(timeout=15)
    names = [e.event for e in events]
    assert names[0] == "queued" and names[-1] == "output_ready", names
    progress = [e.json for e in events if e.event == "step_progress"]
    assert [p["pct"] for p in progress] == [25, 50, 75, 100]
    assert [p["step"] for p in progress] == [1, 2, 3, 4] and {p["total"] for p in progress} == {4}
    ready = events[-1].json
    assert ready["content_type"].startswith("text/event-stream")
    async with http.get(gw.url + ready["result_url"]) as res:
        assert res.status == 200
        text = await res.text()
    assert text.rstrip().endswith("data: [DONE]")

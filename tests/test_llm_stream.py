"""End to end: OpenAI-compatible streams kept alive through a long queue (SPEC §4.1, §5 openai).

The real ``openai`` Python client talks to the gateway; a raw aiohttp reader looks at the bytes
(the ``: queued position=N est_wait_sec=S`` comments the SDK must ignore).
The route is at ``/v1`` so ``base_url`` is ``gateway + "/v1"``; as in the shipped example the node's
url is the server's root and an openai route at ``/v1`` forwards the whole path (``strip_path``
defaults to false there), which the fake, serving only ``/v1/...`` as vLLM does, insists on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import statistics
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from conftest import KEYS, auth, base_config, wait_until
from jobs_client import SSEReader
from metrics_text import metric
from openai import AsyncOpenAI

from kilolined.ops import views

WORDS = ["The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", "."]
MESSAGES = [{"role": "user", "content": "say something please"}]  # 3 prompt tokens for the fake
QUEUED = re.compile(r"^queued position=(\d+) est_wait_sec=(\S+)$")


def llm_cfg(fake: Any, **route: Any) -> dict[str, Any]:
    route.setdefault("max_concurrency", 1)
    cfg = base_config({"o": fake.url}, kind="openai", path="/v1", **route)
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
            await wait_until(lambda i=i: views.state(gw.rt)["routes"]["gen"]["queue_depth"] == i)
    return tasks


# ----------------------------------------------------------------------------------------------


async def test_openai_client_streams_through_a_long_queue(fakegpus, gateway, http) -> None:
    fake = await fakegpus("openai", step_ms=150)
    gw = await gateway(llm_cfg(fake, expected_duration_sec=1))
    ahead = await hold_the_queue(http, gw, fake, 2, tokens=5)  # ~1.5 s of queue

    c = client(gw)
    stream = await c.chat.completions.create(model="fake-llm", messages=MESSAGES, stream=True, max_tokens=6,
                                             stream_options={"include_usage": True})
    assert not ahead[1].done(), "the 200 must come at once, not after the queue"
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
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(queued)]
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
    assert {"message", "type", "code", "status"} <= set(err) and err["status"] == 503
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

    # an async job on the openai route counts too (3 prompt + 2 completion tokens)
    body = {"model": "fake-llm", "messages": MESSAGES, "max_tokens": 2}
    async with http.post(gw.url + "/v1/chat/completions", json=body,
                         headers={**auth(), "Prefer": "respond-async"}) as r:
        assert r.status == 202
        result_url = (await r.json())["result_url"]

    async def job_done() -> bool:
        async with http.get(gw.url + result_url) as res:
            return res.status == 200

    await wait_until(job_done, timeout=10, step=0.05)

    async def counted() -> bool:
        return await metric(http, gw, "kiloline_tokens_total", route="gen", key="alice") == 6 + 7 + 5

    await wait_until(counted, timeout=5, step=0.1)
    assert await metric(http, gw, "kiloline_tokens_total", route="gen", key="bob") is None


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


async def test_stream_client_gone_while_queued_leaves_the_queue(fakegpus, gateway, http) -> None:
    fake = await fakegpus("openai", step_ms=100)
    gw = await gateway(llm_cfg(fake))
    ahead = await hold_the_queue(http, gw, fake, 1, tokens=15)  # 1.5 s

    body = {"model": "fake-llm", "messages": MESSAGES, "stream": True}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
        assert r.status == 200
        async with asyncio.timeout(5):
            line = await r.content.readline()
            while not line.strip():
                line = await r.content.readline()
        assert line.startswith(b": queued position=1 "), line
        assert views.state(gw.rt)["routes"]["gen"]["queue_depth"] == 1
        r.close()  # the client gives up while waiting
    await wait_until(lambda: views.state(gw.rt)["routes"]["gen"]["queue_depth"] == 0, timeout=3)
    assert await asyncio.gather(*ahead) == [200]
    await asyncio.sleep(0.3)
    # its slot was never taken: the node saw the one request ahead of it, nothing else
    assert len([q for q in fake.requests if q["path"] == "/v1/chat/completions"]) == 1
    assert views.state(gw.rt)["routes"]["gen"]["inflight"] == 0


async def test_stream_client_gone_the_moment_its_lease_arrives_frees_the_slot(fakegpus, gateway, http,
                                                                                monkeypatch) -> None:
    """The race: the waiter gets its lease and the node's answer while the client goes away."""
    import types

    from kilolined.scheduling import lease

    fake = await fakegpus("openai", step_ms=5)
    gw = await gateway(llm_cfg(fake))
    real_wait = asyncio.wait

    async def wait_then_client_gone(fs, timeout=None):  # type: ignore[no-untyped-def]
        await real_wait(fs)  # the lease and the node's headers are in …
        raise ConnectionResetError("client went away")  # … as the next write to the client fails

    monkeypatch.setattr(lease, "asyncio", types.SimpleNamespace(**{**vars(asyncio), "wait": wait_then_client_gone}))
    body = {"model": "fake-llm", "messages": MESSAGES, "stream": True}
    with contextlib.suppress(aiohttp.ClientError):
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
            await r.read()
    await wait_until(lambda: views.state(gw.rt)["routes"]["gen"]["inflight"] == 0, timeout=3)
    assert views.state(gw.rt)["nodes"][next(iter(gw.rt.cfg.nodes))]["inflight"] == 0
    await wait_until(lambda: not any(p.busy for p in gw.rt.pools.values()), timeout=3)


async def test_node_error_after_the_200_is_told_in_openai_shape(fakegpus, gateway, http) -> None:
    fake = await fakegpus("openai", step_ms=20)
    gw = await gateway(llm_cfg(fake))
    fake.set_control(fail_status=500)

    # Dispatched at once: the node's own status reaches the SDK, which raises the right class.
    c = client(gw)
    with pytest.raises(openai.InternalServerError, match="simulated failure"):
        await c.chat.completions.create(model="fake-llm", messages=MESSAGES, stream=True)
    await c.close()

    # Queued first: the 200 went out while it waited, so the failure is told in the stream.
    fake.set_control(fail_status=None)
    ahead = await hold_the_queue(http, gw, fake, 1, tokens=6)
    fake.set_control(fail_status=500)
    body = {"model": "fake-llm", "messages": MESSAGES, "stream": True}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
        assert r.status == 200  # promised while it waited
        events = await SSEReader(r).rest(timeout=10)
    await asyncio.gather(*ahead)
    assert [e.data for e in events][-1] == "[DONE]" and len(events) == 2, events
    err = orjson.loads(events[0].data)["error"]
    assert {"message", "type", "code", "status"} <= set(err) and err["status"] == 500
    assert "simulated failure" in err["message"]  # the node's own message passes through
    assert err["type"] == "server_error"
    # PROTOCOLS §2: normalise every backend's error into the OpenAI shape, "code" a string or
    # null — as the gateway's own stream errors already are (code "queue_timeout" above).
    assert err["code"] is None or isinstance(err["code"], str), err


async def test_node_dying_mid_stream_ends_with_error_then_done(fakegpus, gateway, http) -> None:
    # With continue_streams off; on, the stream goes on on another node (test_continuation.py).
    fake = await fakegpus("openai", step_ms=100)
    gw = await gateway(llm_cfg(fake, continue_streams=False))
    body = {"model": "fake-llm", "messages": MESSAGES, "stream": True, "max_tokens": 30}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
        assert r.status == 200
        reader = SSEReader(r)
        first = await reader.next(10)
        assert first is not None and orjson.loads(first.data)["object"] == "chat.completion.chunk"
        await fake.kill()  # a spot machine vanishing mid-answer
        events = await reader.rest(timeout=10)
    assert events and events[-1].data == "[DONE]", events
    err = orjson.loads(events[-2].data)["error"]
    assert err["type"] and err["message"]
    assert str(fake.port) not in err["message"] and "127.0.0.1" not in err["message"]
    await wait_until(lambda: views.state(gw.rt)["routes"]["gen"]["inflight"] == 0, timeout=3)


async def test_stream_client_gone_mid_answer_aborts_the_node_and_frees_the_slot(fakegpus, gateway, http) -> None:
    fake = await fakegpus("openai", step_ms=100)
    gw = await gateway(llm_cfg(fake))
    body = {"model": "fake-llm", "messages": MESSAGES, "stream": True, "max_tokens": 40}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
        first = await SSEReader(r).next(10)
        assert first is not None and first.data.startswith("{")
        r.close()
    await wait_until(lambda: fake.stats["aborted"] >= 1, timeout=5)
    await wait_until(lambda: views.state(gw.rt)["routes"]["gen"]["inflight"] == 0, timeout=3)
    c = client(gw)
    done = await c.chat.completions.create(model="fake-llm", messages=MESSAGES, max_tokens=1)
    assert done.choices[0].message.content == "The"
    await c.close()


async def test_queue_comment_estimate_is_a_number_or_null_before_any_sample(fakegpus, gateway, http) -> None:
    """No expected_duration_sec and no finished request yet: the estimate is unknown. The sse events
    say ``null`` then (SPEC §3.3 "or null"); the comment must not leak Python's ``None``."""
    fake = await fakegpus("openai", step_ms=100)
    gw = await gateway(llm_cfg(fake))
    ahead = await hold_the_queue(http, gw, fake, 1, tokens=6)
    body = {"model": "fake-llm", "messages": MESSAGES, "stream": True, "max_tokens": 1}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
        reader = SSEReader(r)
        events = await reader.rest(timeout=15)
    await asyncio.gather(*ahead)
    assert events[-1].data == "[DONE]"
    estimates = [m.group(2) for _, text in reader.comments if (m := QUEUED.match(text))]
    assert estimates, reader.comments
    for est in estimates:
        assert est == "null" or re.fullmatch(r"\d+(\.\d+)?", est), reader.comments


async def test_node_silent_before_its_first_byte_gets_waiting_comments_then_a_504_event(fakegpus, gateway,
                                                                                         http) -> None:
    """Dispatched at once to a node that does not answer (a model swap): after heartbeat_sec the
    200 goes out and a ``: waiting for the node`` comment every heartbeat_sec; the deadline then
    ends the stream with the status it would have had."""
    fake = await fakegpus("openai", step_ms=10)
    gw = await gateway(llm_cfg(fake, request_timeout_sec=1.5, retry_on_failover=0))
    fake.set_control(hang=True)
    body = {"model": "fake-llm", "messages": MESSAGES, "stream": True, "max_tokens": 2}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
        assert r.status == 200 and r.headers["X-KiloLine-Node"] == "o"
        reader = SSEReader(r)
        events = await reader.rest(timeout=15)
    waiting = [text for _, text in reader.comments if text == "waiting for the node"]
    assert len(waiting) >= 3, reader.comments  # ~1.5 s at one per 0.3 s
    assert not any(text.startswith("queued") for _, text in reader.comments)
    assert [e.data for e in events][-1] == "[DONE]"
    err = orjson.loads(events[0].data)["error"]
    assert err["status"] == 504 and err["type"] == "upstream_timeout" and err["code"] == "upstream_timeout"

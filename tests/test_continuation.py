"""Streams that survive their node (docs/API.md "Streams that survive their node").

Two simulated GPUs answer greedily (the same words for the same context), so an answer cut after k
words and continued from them is checkable against the uninterrupted one. The first node is
killed after at least ten chunks reached the client; the client's stream must go on on the other
node under the same id, model and created, with no chunk repeated or lost at the seam.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from anthropic import AsyncAnthropic
from comfy_client import ASYNC, SSE, inflight
from conftest import KEYS, auth, base_config, wait_until
from openai import AsyncOpenAI

from kilolined.fakegpu.openai import reply_text
from kilolined.ops import views

STEPS = 30


def chat(max_tokens: int | None = STEPS, usage: bool = True, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, **extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


def config(fakes: dict[str, str], stall_sec: float | None = None, **over: Any) -> dict[str, Any]:
    cfg = base_config(fakes, kind="openai", max_concurrency=1, **over)
    if stall_sec is not None:
        for node in cfg["nodes"].values():
            node["slow"] = {"stall_sec": stall_sec}
    cfg["routes"]["gen"]["nodes"] = list(fakes)  # every node a primary: the continuation has one to go to
    cfg["routes"]["gen"]["standby"] = []
    return cfg


async def two(fakegpus: Any, gateway: Any, **over: Any) -> tuple[Any, dict[str, Any], Any]:
    a = await fakegpus("openai", steps=STEPS, step_ms=25)
    b = await fakegpus("openai", steps=STEPS, step_ms=25)
    fakes = {"a": a, "b": b}
    gw = await gateway(config({n: f.url for n, f in fakes.items()}, **over))
    return gw, fakes, a


class Stream:
    """A client's SSE stream, line by line: its events and its comments."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.comments: list[str] = []
        self.done = False
        self.node = ""

    @property
    def content(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("choices") and (e["choices"][0].get("delta", {}).get("content")
                                                                 or e["choices"][0].get("text"))]

    @property
    def text(self) -> str:
        return "".join(e["choices"][0].get("delta", {}).get("content") or e["choices"][0].get("text") or ""
                       for e in self.content)

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [e for e in self.events if "error" in e]


async def stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any], fakes: dict[str, Any],
                 kill_after: int | None = 10, path: str = "/gen/v1/chat/completions") -> Stream:
    """Read a stream; once ``kill_after`` content chunks arrived, kill the node that serves it."""
    got = Stream()
    killed = False
    async with http.post(url + path, json=body, headers=auth()) as r:
        assert r.status == 200, await r.text()
        got.node = r.headers.get("X-KiloLine-Node", "")
        async for raw in r.content:
            line = raw.decode().rstrip("\r\n")
            if line.startswith(":"):
                got.comments.append(line)
            elif line == "data: [DONE]":
                got.done = True
            elif line.startswith("data:"):
                got.events.append(json.loads(line[5:]))
                if kill_after is not None and not killed and len(got.content) >= kill_after:
                    killed = True
                    await fakes[got.node].kill()
    return got


def max_held(fakes: dict[str, Any]) -> int:
    return max(f.stats["max_concurrent"] for f in fakes.values())


async def test_a_stream_cut_by_its_node_goes_on_on_another(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kilolined.access")
    gw, fakes, _ = await two(fakegpus, gateway)
    got = await stream(http, gw.url, chat(), fakes)
    assert not got.errors, got.errors
    assert got.done
    # The whole answer, as the node would have written it uninterrupted: nothing lost or repeated.
    assert got.text == reply_text(STEPS)
    assert len(got.content) == STEPS
    # One stream to the client: one id, model and created throughout.
    assert {e["id"] for e in got.events} == {got.events[0]["id"]}
    assert {e["model"] for e in got.events} == {"m"}
    assert {e["created"] for e in got.events} == {got.events[0]["created"]}
    other = "b" if got.node == "a" else "a"
    assert f": continued on {other}" in got.comments
    # The role came once, at the start.
    assert sum(1 for e in got.events if e.get("choices") and "role" in e["choices"][0].get("delta", {})) == 1
    # usage: what the client received, summed over the two nodes.
    usage = [e["usage"] for e in got.events if e.get("usage")]
    assert len(usage) == 1 and usage[0]["completion_tokens"] == STEPS
    assert usage[0]["total_tokens"] == usage[0]["prompt_tokens"] + STEPS
    finish = [e["choices"][0]["finish_reason"] for e in got.events if e.get("choices")]
    assert finish[-1] == "length" and finish.count("length") == 1
    assert max_held(fakes) == 1
    # Counted, and shown where an operator looks.
    assert gw.rt.metrics.continuations.labels("gen").value == 1
    assert views.state(gw.rt)["routes"]["gen"]["continuations"] == 1
    await wait_until(lambda: any(r.name == "kilolined.access" for r in caplog.records))
    line = next(r.getMessage() for r in caplog.records if r.name == "kilolined.access")
    assert f" {other} sync 200 " in line and line.endswith(" continued=1"), line
    await wait_until(lambda: inflight(gw) == 0)


def sse_text(body: bytes) -> Stream:
    """A stream's bytes as a client reads them (a job's result)."""
    got = Stream()
    for line in body.decode().split("\n"):
        if line.startswith(":"):
            got.comments.append(line)
        elif line == "data: [DONE]":
            got.done = True
        elif line.startswith("data:"):
            got.events.append(json.loads(line[5:]))
    return got


async def test_an_sse_job_cut_by_its_node_continues_instead_of_starting_over(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    gw, fakes, _ = await two(fakegpus, gateway)
    events: list[tuple[str, dict[str, Any]]] = []
    killed = ""
    async with http.post(gw.url + "/gen/v1/chat/completions", json=chat(usage=False), headers=SSE) as r:
        assert r.status == 200
        name = "message"
        async for raw in r.content:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = json.loads(line[5:])
                events.append((name, data))
                if name == "step_progress" and data["step"] >= 10 and not killed:
                    killed = [d for n, d in events if n == "dispatched"][-1]["node"]
                    await fakes[killed].kill()
                if name in ("failed", "output_ready"):
                    break
    assert killed
    assert events[-1][0] == "output_ready", events[-1]
    rerouted = [d for n, d in events if n == "rerouted"]
    assert len(rerouted) == 1 and rerouted[0]["from_node"] == killed, rerouted
    async with http.get(gw.url + events[-1][1]["result_url"]) as r:
        got = sse_text(await r.read())
    # The whole answer: the words before the cut, then the other node's, nothing twice.
    assert got.text == reply_text(STEPS)
    assert got.done and not got.errors
    assert {e["id"] for e in got.events} == {got.events[0]["id"]}
    assert f": continued on {rerouted[0]['to_node']}" in got.comments
    # The usage chunk the gateway asked for is not the client's.
    assert not [e for e in got.events if e.get("usage")]
    # Progress counts on from the seam: it never goes back.
    steps = [d["step"] for n, d in events if n == "step_progress"]
    assert steps == sorted(steps) and steps[-1] == STEPS, steps
    assert max_held(fakes) == 1
    await wait_until(lambda: inflight(gw) == 0)


async def test_an_async_job_cut_by_its_node_completes_with_the_whole_text(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    gw, fakes, _ = await two(fakegpus, gateway)
    async with http.post(gw.url + "/gen/v1/chat/completions", json=chat(), headers=ASYNC) as r:
        assert r.status == 202
        accepted = await r.json()
    job = gw.jobs.jobs[accepted["job_id"]]

    def steps() -> list[int]:
        return [json.loads(f.split(b"data: ", 1)[1])["step"] for _, n, f in job.events if n == "step_progress"]

    await wait_until(lambda: bool(steps()) and steps()[-1] >= 10)
    killed = job.node
    await fakes[killed].kill()
    await wait_until(lambda: job.status in ("completed", "failed"))
    assert job.status == "completed", job.error
    async with http.get(gw.url + accepted["result_url"]) as r:
        got = sse_text(await r.read())
    assert got.text == reply_text(STEPS) and got.done and not got.errors
    usage = [e["usage"] for e in got.events if e.get("usage")]
    assert len(usage) == 1 and usage[0]["completion_tokens"] == STEPS
    assert job.node != killed and max_held(fakes) == 1


async def test_a_stream_that_stalls_goes_on_on_another_node(fakegpus: Any, gateway: Any,
                                                            http: aiohttp.ClientSession) -> None:
    gw, fakes, _ = await two(fakegpus, gateway, stall_sec=0.4)
    got = Stream()
    frozen = ""
    async with http.post(gw.url + "/gen/v1/chat/completions", json=chat(), headers=auth()) as r:
        async for raw in r.content:
            line = raw.decode().rstrip("\r\n")
            if line.startswith(":"):
                got.comments.append(line)
            elif line.startswith("data: {"):
                got.events.append(json.loads(line[5:]))
                if len(got.content) >= 10 and not frozen:
                    frozen = r.headers["X-KiloLine-Node"]
                    fakes[frozen].set_control(drip_ms=60_000)  # the GPU freezes: silence, no reset
    assert frozen and not got.errors, got.errors
    assert got.text == reply_text(STEPS)
    assert any(c.startswith(": continued on ") for c in got.comments)
    assert max_held(fakes) == 1
    for f in fakes.values():
        f.set_control(drip_ms=0)
    await wait_until(lambda: inflight(gw) == 0)


async def test_continue_streams_off_ends_the_stream_as_before(fakegpus: Any, gateway: Any,
                                                              http: aiohttp.ClientSession) -> None:
    gw, fakes, _ = await two(fakegpus, gateway, continue_streams=False)
    got = await stream(http, gw.url, chat(), fakes)
    assert len(got.errors) == 1 and "mid-response" in got.errors[0]["error"]["message"]
    assert got.done and len(got.content) < STEPS and not got.comments
    assert sum(f.stats["served"] for f in fakes.values()) == 0  # the other node never saw it
    assert gw.rt.metrics.continuations.labels("gen").value == 0
    await wait_until(lambda: inflight(gw) == 0)


async def three(fakegpus: Any, gateway: Any, **over: Any) -> tuple[Any, dict[str, Any]]:
    fakes = {n: await fakegpus("openai", steps=STEPS, step_ms=25) for n in ("a", "b", "c")}
    gw = await gateway(config({n: f.url for n, f in fakes.items()}, **over))
    return gw, fakes


async def kill_each(http: aiohttp.ClientSession, url: str, fakes: dict[str, Any], every: int) -> Stream:
    """A stream whose serving node is killed each time ``every`` more chunks arrived."""
    got = Stream()
    killed: set[str] = set()
    async with http.post(url + "/gen/v1/chat/completions", json=chat(), headers=auth()) as r:
        node = r.headers["X-KiloLine-Node"]
        async for raw in r.content:
            line = raw.decode().rstrip("\r\n")
            if line.startswith(":"):
                got.comments.append(line)
                if line.startswith(": continued on "):
                    node = line.removeprefix(": continued on ")
            elif line == "data: [DONE]":
                got.done = True
            elif line.startswith("data: {"):
                got.events.append(json.loads(line[5:]))
                if len(got.content) % every == 0 and node not in killed:
                    killed.add(node)
                    await fakes[node].kill()
    return got


@pytest.mark.parametrize("retries", [1, 2])
async def test_at_most_retry_on_failover_continuations(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession,
                                                        retries: int) -> None:
    gw, fakes = await three(fakegpus, gateway, retry_on_failover=retries)
    got = await kill_each(http, gw.url, fakes, every=10)
    seams = [c for c in got.comments if c.startswith(": continued on ")]
    assert gw.rt.metrics.continuations.labels("gen").value == len(seams) == retries
    if retries == 1:
        # The second cut finds no retry left: the stream ends with the error, as without continuations.
        assert len(got.errors) == 1 and got.text == reply_text(20)
    else:
        assert not got.errors and got.text == reply_text(STEPS)
        assert {e["id"] for e in got.events} == {got.events[0]["id"]}
    assert got.done and max_held(fakes) == 1
    await wait_until(lambda: inflight(gw) == 0)


async def test_the_openai_sdk_reads_one_uninterrupted_stream(fakegpus: Any, gateway: Any) -> None:
    gw, fakes, _ = await two(fakegpus, gateway)
    llm = AsyncOpenAI(base_url=gw.url + "/gen/v1", api_key=KEYS["alice"], max_retries=0, timeout=30)
    chunks = []
    killed = False
    stream = await llm.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                               max_completion_tokens=STEPS, stream=True,
                                               stream_options={"include_usage": True})
    async for chunk in stream:
        chunks.append(chunk)
        if len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 12 and not killed:
            killed = True
            await fakes[next(n for n, f in fakes.items() if f.stats["running"])].kill()
    assert killed
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply_text(STEPS)
    assert {c.id for c in chunks} == {chunks[0].id} and {c.created for c in chunks} == {chunks[0].created}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == STEPS
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert max_held(fakes) == 1


async def test_a_legacy_completion_continues_from_its_prompt(fakegpus: Any, gateway: Any,
                                                             http: aiohttp.ClientSession) -> None:
    gw, fakes, _ = await two(fakegpus, gateway)
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": STEPS, "stream": True}
    got = await stream(http, gw.url, body, fakes, path="/gen/v1/completions")
    assert not got.errors and got.done
    # The fake goes on from the prompt's four words; the continuation's prompt held 4 + k of them.
    assert got.text == reply_text(STEPS, start=4)
    assert {e["id"] for e in got.events} == {got.events[0]["id"]}
    assert any(c.startswith(": continued on ") for c in got.comments)
    assert not [e for e in got.events if e.get("usage")]  # the client did not ask for usage
    assert max_held(fakes) == 1


async def test_the_fake_continues_a_final_assistant_message_as_llama_cpp_does(
        fakegpus: Any, http: aiohttp.ClientSession) -> None:
    # llama.cpp (tools/server/server-common.cpp, server-task.cpp; docs/BACKENDS.md has what the
    # real server answered): with the flag only the new text streams; without it a trailing
    # assistant message is still continued but the first delta repeats it; both flags true is a 400.
    fake = await fakegpus("openai", steps=STEPS)
    said = reply_text(4)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": said}]

    async def first_and_text(**flags: Any) -> tuple[dict[str, Any], str]:
        body = {"model": "m", "messages": messages, "stream": True, "max_tokens": 3, **flags}
        async with http.post(fake.url + "/v1/chat/completions", json=body) as r:
            got = sse_text(await r.read())
        return got.content[0]["choices"][0]["delta"], got.text

    delta, text = await first_and_text(continue_final_message=True, add_generation_prompt=False)
    assert delta == {"role": "assistant", "content": reply_text(1, start=4)} and text == reply_text(3, start=4)
    delta, text = await first_and_text()
    assert delta["content"] == said + reply_text(1, start=4) and text == said + reply_text(3, start=4)
    async with http.post(fake.url + "/v1/chat/completions",
                         json={"model": "m", "messages": messages, "continue_final_message": True}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["message"] == \
            "Cannot set both add_generation_prompt and continue_final_message to true."


async def test_a_node_that_will_not_continue_ends_the_stream_as_before(fakegpus: Any, gateway: Any,
                                                                       http: aiohttp.ClientSession) -> None:
    # The next node answers the continuation with a 400 (a server that refuses
    # continue_final_message): the client's stream ends with the first node's failure.
    gw, fakes, _ = await two(fakegpus, gateway)
    got = Stream()
    async with http.post(gw.url + "/gen/v1/chat/completions", json=chat(), headers=auth()) as r:
        node = r.headers["X-KiloLine-Node"]
        async for raw in r.content:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("data: {"):
                got.events.append(json.loads(line[5:]))
                if len(got.content) == 10 and not got.errors:
                    fakes["b" if node == "a" else "a"].set_control(fail_status=400)
                    await fakes[node].kill()
            elif line == "data: [DONE]":
                got.done = True
    assert got.done and len(got.errors) == 1, got.errors
    assert got.errors[0]["error"]["message"] == f"node {node} failed: node lost (connection dropped mid-response)"
    assert got.text == reply_text(len(got.content)) and len(got.content) < STEPS
    await wait_until(lambda: inflight(gw) == 0)



def checked(cfg: dict[str, Any]) -> dict[str, Any]:
    """Every node health-checked often, and never marked down by the checks within a test."""
    for node in cfg["nodes"].values():
        node["health"] = {"path": "/health", "interval_sec": 0.1, "timeout_sec": 1, "fall": 1000, "rise": 1}
    return cfg


async def _job_cut_after(gw: Any, http: aiohttp.ClientSession, fakes: dict[str, Any], headers: dict[str, str],
                         words: int, after_kill: Callable[[Any], Awaitable[None]] | None = None) -> tuple[Any, str]:
    """An sse or async job whose serving node is killed once ``words`` chunks were generated:
    (the job once it ended, the node killed). ``after_kill(job)`` runs right after the kill."""
    reader: asyncio.Task[bytes] | None = None
    async with http.post(gw.url + "/gen/v1/chat/completions", json=chat(usage=False), headers=headers) as r:
        if headers is ASYNC:
            assert r.status == 202
            await r.read()
        else:
            assert r.status == 200
            reader = asyncio.create_task(r.read())  # the sse client reads on to the end
        await wait_until(lambda: len(gw.jobs.jobs) == 1)
        job = next(iter(gw.jobs.jobs.values()))

        def step() -> int:
            steps = [json.loads(f.split(b"data: ", 1)[1])["step"] for _, n, f in job.events if n == "step_progress"]
            return steps[-1] if steps else 0

        await wait_until(lambda: step() >= words or job.status in ("completed", "failed"))
        killed = job.node
        await fakes[killed].kill()
        if after_kill is not None:
            await after_kill(job)
        await wait_until(lambda: job.status in ("completed", "failed"))
        if reader is not None:
            await reader
    return job, killed


async def _result_text(gw: Any, http: aiohttp.ClientSession, job: Any) -> str:
    async with http.get(gw.url + job.urls()["result_url"]) as r:
        return sse_text(await r.read()).text


@pytest.mark.parametrize(("mode", "restarting"), [("sync", "refusing"), ("sse", "refusing"), ("async", "refusing"),
                                                  ("sse", "loading"), ("async", "seen by a health check")])
async def test_a_node_known_lost_does_not_spend_the_retry_a_continuation_needs(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession, mode: str, restarting: str) -> None:
    # A spot reclaim: node a dies — under a stream, which goes on on b, or idle, which a failed
    # health check saw — and, restarting, refuses connections or answers 503 while it loads; no
    # health check has marked it down yet. The next request is sent there (the least loaded
    # node), then its own node is killed mid-answer. The gateway knew a was lost when it sent the
    # request there: that re-queue is not the request's, and its one retry (the default
    # retry_on_failover) is left for the continuation on c.
    fakes = {n: await fakegpus("openai", steps=STEPS, step_ms=25) for n in ("a", "b", "c")}
    cfg = config({n: f.url for n, f in fakes.items()})
    gw = await gateway(checked(cfg) if restarting == "seen by a health check" else cfg)
    if restarting == "seen by a health check":
        a = gw.rt.scheduler.nodes["a"]
        await fakes["a"].kill()
        await wait_until(lambda: a.lost_at > a.alive_at)
        assert a.healthy
    else:
        first = await stream(http, gw.url, chat(), fakes)
        assert first.node == "a" and not first.errors and first.text == reply_text(STEPS)
    if restarting == "loading":
        fakes["a"].set_control(fail_status=503)
        await fakes["a"].revive()
    if mode == "sync":
        got = await stream(http, gw.url, chat(), fakes)
        assert got.node == "b", got.node  # after a's refusal
        assert not got.errors and got.done, got.errors
        text = got.text
    else:
        job, killed = await _job_cut_after(gw, http, fakes, SSE if mode == "sse" else ASYNC, 10)
        assert killed == "b"
        assert job.status == "completed", job.error
        text = await _result_text(gw, http, job)
    # The whole text: the words b gave before it was killed, then c's continuation of them.
    assert text == reply_text(STEPS)
    assert fakes["c"].stats["served"] >= 1 and max_held(fakes) == 1
    await wait_until(lambda: inflight(gw) == 0)


async def test_a_restarting_node_that_answered_503_is_not_tried_again_before_it_is_back(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    # Node a was lost under a stream and is loading again (503 to requests and to health checks,
    # as llama.cpp answers while it loads its model). A job sent there goes on to b, whose loss
    # mid-answer leaves it no node but a: it waits for a to pass a health check rather than be
    # sent straight back to a's 503, which would spend the retry its continuation needs.
    fakes = {n: await fakegpus("openai", steps=STEPS, step_ms=25) for n in ("a", "b")}
    a = fakes["a"]
    gw = await gateway(checked(config({n: f.url for n, f in fakes.items()})))
    first = await stream(http, gw.url, chat(), fakes)
    assert first.node == "a" and not first.errors
    a.set_control(fail_status=503, health_status=503)
    await a.revive()

    async def loaded(job: Any) -> None:
        # The continuation is re-queued (the second re-queue: a's 503, then b's loss)…
        await wait_until(lambda: job.status == "failed" or job.ticket.requeues >= 2)
        # …and waits, not sent to a: a is back only once a health check passes.
        assert job.status == "queued" and job.ticket.state == "waiting", (job.status, job.error)
        a.set_control(fail_status=None, health_status=200)

    job, killed = await _job_cut_after(gw, http, fakes, SSE, 10, loaded)
    assert killed == "b"
    assert job.status == "completed", job.error
    assert await _result_text(gw, http, job) == reply_text(STEPS)
    assert max_held(fakes) == 1
    await wait_until(lambda: inflight(gw) == 0)


async def test_an_anthropic_messages_stream_cut_by_its_node_goes_on_on_another(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    # The anthropic SDK, through the gateway to /v1/messages on an openai route; the node is killed
    # after ten text deltas. The other node is asked to continue the text so far as a prefilled
    # assistant message, and repeats it in its first delta (as llama-server does): the SDK must read
    # one message, the whole answer, nothing repeated, and the output tokens of both nodes.
    gw, fakes, _ = await two(fakegpus, gateway)
    client = AsyncAnthropic(base_url=gw.url + "/gen", api_key=KEYS["alice"], max_retries=0, timeout=30)
    kinds: list[str] = []
    deltas: list[str] = []
    async with client.messages.stream(model="m", max_tokens=STEPS, messages=[{"role": "user", "content": "hi"}]) as s:
        node = s.response.headers["X-KiloLine-Node"]
        async for ev in s:
            kinds.append(ev.type)
            if ev.type == "content_block_delta" and ev.delta.type == "text_delta":
                deltas.append(ev.delta.text)
                if len(deltas) == 10:
                    await fakes[node].kill()
        final = await s.get_final_message()
    await client.close()
    other = "b" if node == "a" else "a"
    assert fakes[other].stats["served"] >= 1
    assert "".join(deltas) == reply_text(STEPS) and len(deltas) == STEPS
    assert final.content[0].text == reply_text(STEPS)  # type: ignore[union-attr]
    assert (final.usage.output_tokens, final.stop_reason) == (STEPS, "max_tokens")
    # One message, one text block: the continuing node's starts were the client's already.
    assert [k for k in kinds if k not in ("text", "content_block_delta")] == [
        "message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"]
    assert gw.rt.metrics.continuations.labels("gen").value == 1
    assert max_held(fakes) == 1
    await wait_until(lambda: inflight(gw) == 0)


async def test_an_async_anthropic_messages_job_cut_by_its_node_completes_with_the_whole_text(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    gw, fakes, _ = await two(fakegpus, gateway)
    body = {"model": "m", "max_tokens": STEPS, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(gw.url + "/gen/v1/messages", json=body, headers=ASYNC) as r:
        assert r.status == 202
        accepted = await r.json()
    job = gw.jobs.jobs[accepted["job_id"]]

    def steps() -> list[int]:
        return [json.loads(f.split(b"data: ", 1)[1])["step"] for _, n, f in job.events if n == "step_progress"]

    await wait_until(lambda: bool(steps()) and steps()[-1] >= 10)
    killed = job.node
    await fakes[killed].kill()
    await wait_until(lambda: job.status in ("completed", "failed"))
    assert job.status == "completed", job.error
    async with http.get(gw.url + accepted["result_url"]) as r:
        result = (await r.read()).decode()
    data = [json.loads(line[5:]) for line in result.split("\n") if line.startswith("data:")]
    text = "".join(d["delta"]["text"] for d in data if d["type"] == "content_block_delta")
    assert text == reply_text(STEPS)
    assert [d["type"] for d in data].count("message_start") == 1
    assert [d["usage"]["output_tokens"] for d in data if d["type"] == "message_delta"] == [STEPS]
    assert job.node != killed and max_held(fakes) == 1

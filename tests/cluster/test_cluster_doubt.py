"""A reaped slot is in doubt (docs/CLUSTER.md, "What happens when").

A gateway frozen (SIGSTOP) past ``lease_ttl_sec`` is reaped, but its requests still run on the
node. Their slots are granted again only once the node shows them free (ComfyUI's queue,
llama.cpp's ``/slots``) or their ``request_timeout_sec`` has passed; meanwhile the other
gateway's requests wait, so the node never runs more than N. Gateways on a real redis-server
in front of a node that counts what it runs at once.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from comfy_client import graph as comfy_graph
from conftest import auth
from fakes import FakeWebhookReceiver
from prometheus_client.parser import text_string_to_metric_families

from kilolined.cluster.doubt import may_run, probes
from kilolined.core.config import BusyConfig, ConfigError, parse_config
from kilolined.fakegpu import FakeGPU

from .harness import GatewayProc, RedisServer, make_gateways, start_all, until

N = 2
TTL = 2.0
PREFIX = "kl-test:"
SEEDS = itertools.count(1)
Send = Callable[[aiohttp.ClientSession, GatewayProc], Awaitable[int]]


async def comfy_send(s: aiohttp.ClientSession, gw: GatewayProc) -> int:
    # Sync mode answers once the prompt is on the node, and holds the slot until it is done.
    prompt = comfy_graph(30)
    prompt["3"]["inputs"]["seed"] = next(SEEDS)  # another image each time: nothing comes from ComfyUI's cache
    async with s.post(gw.url + "/gen/prompt", json={"prompt": prompt}, headers=auth()) as r:
        await r.read()
        return r.status


async def chat_send(s: aiohttp.ClientSession, gw: GatewayProc) -> int:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30}
    async with s.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
        await r.read()
        return r.status


async def generic_send(s: aiohttp.ClientSession, gw: GatewayProc) -> int:
    async with s.post(gw.url + "/gen/generate", json={}, headers=auth()) as r:
        await r.read()
        return r.status


async def redis_settled(redis_server: RedisServer) -> bool:
    """Nothing in doubt, nothing counted on the node: every slot came back."""
    r = redis_server.client()
    try:
        nodes = await r.smembers(PREFIX + "dn")
        nin = await r.hgetall(PREFIX + "nin")
        return not nodes and all(int(v) == 0 for v in nin.values())
    finally:
        await r.aclose()


async def frozen_round(redis_server: RedisServer, gpu: FakeGPU, frozen: GatewayProc, other: GatewayProc,
                       send: Send) -> None:
    """``frozen`` starts N requests and is frozen past the TTL while they run; ``other`` asks
    for N more. They run once the node is free, never beside the frozen gateway's ones."""
    served = gpu.stats["served"]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        mine = [asyncio.ensure_future(send(s, frozen)) for _ in range(N)]
        await until(lambda: _running(gpu, N), "the frozen gateway's requests never ran")
        assert frozen.proc is not None
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        try:
            await until(lambda: _alone(other), "the frozen gateway was never reaped", timeout=30)
            theirs = [asyncio.ensure_future(send(s, other)) for _ in range(N)]
            # Granted again once the node shows the slots free (or their timeout passed).
            assert await asyncio.wait_for(asyncio.gather(*theirs), 90) == [200] * N
            await until(lambda: _served(gpu, served + N), "the other gateway's requests never ran", 90)
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        await asyncio.wait_for(asyncio.gather(*mine, return_exceptions=True), 60)
    await until(lambda: _idle(gpu), "the node never went idle", 60)
    assert gpu.stats["max_concurrent"] <= N, gpu.stats
    await until(lambda: redis_settled(redis_server), "a slot stayed in doubt or counted", 30)


@pytest.mark.parametrize("kind", ["comfyui", "openai"])
async def test_a_reaped_slot_is_granted_again_only_once_the_node_shows_it_free(
        redis_server: RedisServer, gateways: list[GatewayProc], tmp_path: Path, kind: str) -> None:
    # Each request runs 30 steps of 0.2 s: 6 s, well past the TTL the frozen gateway is reaped after.
    gpu = FakeGPU(kind, vram_gb=1000, job_vram_gb=1, steps=30, step_ms=200, crash_sec=0.4)
    await gpu.start()
    try:
        # request_timeout_sec is far off: only the node can show the slots free in time.
        route: dict[str, Any] = {"kind": kind, "max_concurrency": N, "request_timeout_sec": 600}
        if kind == "openai":
            route["path"] = "/v1"
        gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, ttl=TTL, **route)
        await start_all(gateways)
        send = comfy_send if kind == "comfyui" else chat_send
        rounds = 2 if kind == "comfyui" else 1
        for i in range(rounds):  # each gateway frozen in turn (the leader among them)
            await frozen_round(redis_server, gpu, gateways[i % 2], gateways[(i + 1) % 2], send)
            gpu.reset()
            await until(lambda: _ready(gateways), "a gateway did not come back after its freeze")
    finally:
        await gpu.stop()


async def test_a_reaped_slot_the_node_cannot_show_is_granted_again_after_its_timeout(
        redis_server: RedisServer, gateways: list[GatewayProc], tmp_path: Path) -> None:
    """A generic node shows nothing: the reaped slots wait for request_timeout_sec since their
    grant, when the frozen gateway's requests would have been ended; nothing stays in doubt."""
    gpu = FakeGPU("generic", vram_gb=1000, job_vram_gb=1, steps=30, step_ms=200, crash_sec=0.4)
    await gpu.start()
    try:
        gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, ttl=TTL, max_concurrency=N,
                                  request_timeout_sec=8)
        await start_all(gateways)
        await frozen_round(redis_server, gpu, gateways[0], gateways[1], generic_send)
    finally:
        await gpu.stop()


def _read(kind: str, body: Any, busy: BusyConfig | None = None) -> int | None:
    """What the probes for a route ``kind`` read from a node answering ``body`` at each path."""
    for probe in probes(kind, busy):
        text = body.get(probe.path) if isinstance(body, dict) and probe.path in body else None
        if text is None:
            continue
        raw = text.encode() if isinstance(text, str) else orjson.dumps(text)
        n = probe.read(raw)
        if n is not None:
            return n
    return None


def test_busy_counts_what_each_server_shows() -> None:
    q = {"queue_running": [[1, "a", {}, {}, []]], "queue_pending": [[2, "b", {}, {}, []], [3, "c", {}, {}, []]]}
    assert _read("comfyui", {"/queue": q}) == 3  # a pending prompt runs next: it holds its slot
    assert _read("comfyui", {"/queue": {"queue_running": []}}) is None
    slots = [{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False}, {"id": 2, "is_processing": True}]
    assert _read("openai", {"/slots": slots}) == 2
    assert _read("openai", {"/slots": [{"id": 0, "state": 1}, {"id": 1, "state": 0}]}) == 1  # older llama.cpp
    assert _read("openai", {"/slots": {"error": {"code": 501}}}) is None  # started with --no-slots
    assert _read("openai", {"/slots": [{"id": 0}]}) is None
    assert _read("generic", {"/health": {}}) is None  # a generic node with no busy: cannot tell
    # vLLM (two data-parallel engines), SGLang and TGI: what runs plus what is queued, over every sample.
    vllm = ('# HELP vllm:num_requests_running Number of requests in model execution batches.\n'
            '# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{model_name="m",engine="0"} 2.0\n'
            'vllm:num_requests_running{model_name="m",engine="1"} 1.0\n'
            'vllm:num_requests_waiting{model_name="m",engine="0"} 1.0\n'
            'vllm:num_requests_running_other 9\n')
    assert _read("openai", {"/metrics": vllm}) == 4
    assert _read("openai", {"/metrics": 'sglang:num_running_reqs{model_name="a b}"} 3\nsglang:num_queue_reqs 2\n'}) == 5
    assert _read("generic", {"/metrics": "tgi_queue_size 1\ntgi_batch_current_size 4\n"}) == 5
    assert _read("openai", {"/metrics": "process_cpu_seconds_total 3.0\n"}) is None  # metrics of nothing we know
    # Any other server: nodes.<n>.busy names its number.
    by_json = BusyConfig(path="/load", json_pointer="/engine/active")
    assert _read("generic", {"/load": {"engine": {"active": 3}}}, by_json) == 3
    assert _read("generic", {"/load": {"engine": {"active": ["a", "b"]}}}, by_json) == 2  # an array: its length
    assert _read("generic", {"/load": {"engine": {}}}, by_json) is None
    by_metric = BusyConfig(path="/stats", metric="my_inflight")
    assert _read("generic", {"/stats": 'my_inflight{gpu="0"} 2\nmy_inflight{gpu="1"} 1\n'}, by_metric) == 3


def located_errors(text: str) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        parse_config(text, env={}, source=LOCATED)
    return ei.value.errors


LOCATED = "cfg.yaml"


def test_busy_config_names_one_number() -> None:
    errors = located_errors("nodes:\n  gpu:\n    url: 'http://127.0.0.1:8000'\n    busy:\n      path: /load\n"
                            "routes:\n  gen: {path: /gen, nodes: [gpu]}\n")
    assert errors == [f"{LOCATED}:4: nodes.gpu.busy: give exactly one of json_pointer or metric"], errors
    errors = located_errors("nodes:\n  gpu:\n    url: 'http://127.0.0.1:8000'\n    busy:\n      path: /load\n"
                            "      json_pointer: active\nroutes:\n  gen: {path: /gen, nodes: [gpu]}\n")
    assert errors == [f"{LOCATED}:6: nodes.gpu.busy.json_pointer: a JSON pointer starts with / "
                      "(RFC 6901), e.g. /num_running"], errors


async def test_the_fake_vllm_shows_what_it_runs_as_vllm_does() -> None:
    """The fake LLM node in vLLM's part answers GET /metrics with vLLM's own scheduler gauges: the
    same names, type, help text and labels (vllm/v1/metrics/loggers.py), and no /slots."""
    gpu = FakeGPU("openai", steps=30, step_ms=100, server="vllm")
    await gpu.start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(gpu.url + "/slots") as r:
                assert r.status == 404
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30}
            job = asyncio.ensure_future(s.post(gpu.url + "/v1/chat/completions", json=body))
            await until(lambda: _running(gpu, 1), "the completion never ran")
            async with s.get(gpu.url + "/metrics") as r:
                assert r.headers["Content-Type"].startswith("text/plain")
                text = await r.text()
            (await job).close()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        running = families["vllm:num_requests_running"]
        assert running.type == "gauge" and running.documentation == "Number of requests in model execution batches."
        assert [(x.labels, x.value) for x in running.samples] == [({"model_name": "fake-llm", "engine": "0"}, 1.0)]
        assert families["vllm:num_requests_waiting"].documentation == "Number of requests waiting to be processed."
        assert _read("openai", {"/metrics": text}) == 1
    finally:
        await gpu.stop()


async def test_the_fake_llama_server_shows_its_slots() -> None:
    gpu = FakeGPU("openai", steps=30, step_ms=100, parallel=2)
    await gpu.start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(gpu.url + "/slots") as r:
                idle = await r.json()
            assert [x["is_processing"] for x in idle] == [False, False]
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30}
            job = asyncio.ensure_future(s.post(gpu.url + "/v1/chat/completions", json=body))
            await until(lambda: _running(gpu, 1), "the completion never ran")
            async with s.get(gpu.url + "/slots") as r:
                assert _read("openai", {"/slots": await r.json()}) == 1
            (await job).close()
    finally:
        await gpu.stop()


async def _running(gpu: FakeGPU, n: int) -> bool:
    return bool(gpu.stats["running"] >= n)


async def _served(gpu: FakeGPU, n: int) -> bool:
    return bool(gpu.stats["served"] >= n)


async def _idle(gpu: FakeGPU) -> bool:
    return bool(gpu.stats["running"] == 0)


async def _alone(gw: GatewayProc) -> bool:
    """The other gateway sees no peer: the frozen one was reaped (its leases too)."""
    return not (await gw.state())["cluster"]["peers"]


async def _ready(gws: list[GatewayProc]) -> bool:
    states = await asyncio.gather(*(g.state() for g in gws))
    return all(st["cluster"]["redis"] == "up" and len(st["cluster"]["peers"]) == len(gws) - 1 for st in states)


async def test_a_job_carried_on_from_a_frozen_gateway_runs_to_completion_once(
        redis_server: RedisServer, gateways: list[GatewayProc], tmp_path: Path) -> None:
    """A ComfyUI async job runs on A; A is frozen past the TTL and B carries the job on. B's copy
    waits while A's prompt holds the node (its slot is in doubt); when A wakes it interrupts its
    prompt, the node shows the slot free, B's copy runs: the node never ran both at once, the
    prompt ran to completion once, and the webhook went out once."""
    gpu = FakeGPU("comfyui", vram_gb=1000, job_vram_gb=1, steps=40, step_ms=300, crash_sec=0.4)  # 12 s a prompt
    await gpu.start()
    try:
        async with FakeWebhookReceiver() as receiver:
            gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, ttl=TTL, kind="comfyui",
                                      max_concurrency=1, retry_on_failover=1, request_timeout_sec=600)
            for g in gateways:
                g.cfg["jobs"] = {"webhook_allow_private": True, "webhook_backoff_sec": [0.2, 0.2]}
            await start_all(gateways)
            a, b = gateways
            assert a.proc is not None
            async with aiohttp.ClientSession() as s:
                prompt = comfy_graph(40)
                prompt["3"]["inputs"]["seed"] = next(SEEDS)
                headers = {**auth(), "X-KiloLine-Mode": "async", "X-KiloLine-Callback": receiver.url()}
                async with s.post(a.url + "/gen/prompt", json={"prompt": prompt}, headers=headers) as r:
                    assert r.status == 202, await r.text()
                    jid = (await r.json())["job_id"]
                await until(lambda: _running(gpu, 1), "A's prompt never ran")
                os.kill(a.proc.pid, signal.SIGSTOP)
                try:
                    await until(lambda: _alone(b), "A was never reaped", timeout=30)
                    await until(lambda: _owned_by(redis_server, jid, "gw1#"), "B never carried the job on", 30)
                finally:
                    os.kill(a.proc.pid, signal.SIGCONT)
                try:
                    await until(lambda: _job_is(s, b, jid, {"completed"}), "the carried job never completed", 90)
                except AssertionError:
                    async with s.get(f"{b.url}/v1/jobs/{jid}", headers=auth()) as r:
                        raise AssertionError(await r.text()) from None
                await until(lambda: _hooks(receiver, jid, 1), "no webhook", timeout=30)
                await until(lambda: _idle(gpu), "the node never went idle", 30)
            assert gpu.stats["max_concurrent"] <= 1, gpu.stats  # never both copies at once
            assert gpu.stats["interrupts"] >= 1, gpu.stats  # A stopped its copy when it woke
            assert gpu.stats["served"] == 1, gpu.stats  # to completion once
            hooks = _deliveries(receiver, jid)
            assert len(hooks) == 1 and hooks[0]["json"]["status"] == "completed", hooks  # the job's own ending
    finally:
        await gpu.stop()


async def _job_is(s: aiohttp.ClientSession, gw: GatewayProc, jid: str, want: set[str]) -> bool:
    async with s.get(f"{gw.url}/v1/jobs/{jid}", headers=auth()) as r:
        return r.status == 200 and (await r.json())["status"] in want


async def _owned_by(redis_server: RedisServer, jid: str, inst: str) -> bool:
    r = redis_server.client()
    try:
        return str(await r.hget(f"{PREFIX}j:{jid}", "owner") or "").startswith(inst)
    finally:
        await r.aclose()


def _deliveries(receiver: FakeWebhookReceiver, jid: str) -> list[Any]:
    return [d for d in receiver.deliveries if (d["json"] or {}).get("job_id") == jid]


async def _hooks(receiver: FakeWebhookReceiver, jid: str, n: int) -> bool:
    return len(_deliveries(receiver, jid)) >= n


async def test_a_frozen_gateways_ended_request_frees_its_slot_under_traffic_that_turns_over_within_a_check(
        redis_server: RedisServer, gateways: list[GatewayProc], tmp_path: Path) -> None:
    """A is frozen (SIGSTOP) while its request runs on a node that tells its load (``busy``); the
    node finishes it, but A cannot give its slot back, which is in doubt once A is reaped. B's
    traffic keeps every slot B may use busy with requests far shorter than one check, with more
    waiting: the node's count never falls to what it was asked to run before (``upto``), yet A's
    slot comes back while that load goes on — a lease sent to the node before the check's probe
    and live after it is counted by the node, whatever its age."""
    slots = 8  # 4 a gateway: A's share stays reserved while it is lost, B runs 3 beside A's doubt
    gpu = FakeGPU("generic", vram_gb=1000, job_vram_gb=1, steps=1, step_ms=100, crash_sec=0.4)
    await gpu.start()
    try:
        gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, ttl=TTL, max_concurrency=slots,
                                  request_timeout_sec=600)
        for g in gateways:
            g.cfg["nodes"]["gpu"]["busy"] = {"path": "/_fake/stats", "json_pointer": "/running"}
        await start_all(gateways)
        a, b = gateways
        assert a.proc is not None
        done = asyncio.Event()

        async def short(s: aiohttp.ClientSession) -> list[int]:
            statuses = []
            while not done.is_set():  # 0.1 s each: every slot turns over several times a check
                async with s.post(b.url + "/gen/generate", json={}, headers=auth()) as r:
                    await r.read()
                    statuses.append(r.status)
            return statuses

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            mine = asyncio.ensure_future(s.post(a.url + "/gen/generate", json={"steps": 5}, headers=auth()))
            await until(lambda: _running(gpu, 1), "A's request never ran")
            os.kill(a.proc.pid, signal.SIGSTOP)
            theirs = [asyncio.ensure_future(short(s)) for _ in range(3 * slots)]  # always some waiting
            try:
                await until(lambda: _in_doubt(redis_server, 1), "A's lease was never in doubt", 30)
                await until(lambda: _in_doubt(redis_server, 0), "A's slot stayed in doubt under steady traffic", 30)
                freed_under_load = all(not t.done() for t in theirs)
            finally:
                done.set()
                os.kill(a.proc.pid, signal.SIGCONT)
                statuses = await asyncio.wait_for(asyncio.gather(*theirs), 30)
            await asyncio.gather(mine, return_exceptions=True)
        assert freed_under_load
        assert {st for run in statuses for st in run} == {200}
        assert gpu.stats["max_concurrent"] <= slots, gpu.stats
        await until(lambda: redis_settled(redis_server), "a slot stayed in doubt or counted", 30)
    finally:
        await gpu.stop()


async def _in_doubt(redis_server: RedisServer, n: int) -> bool:
    r = redis_server.client()
    try:
        return int(await r.zcard(PREFIX + "d:gpu")) == n
    finally:
        await r.aclose()


def test_what_may_still_run_counts_only_leases_on_the_node_all_through_the_probe() -> None:
    # Sent before the probe and live after it: on the node all through, so the count holds it.
    assert may_run(4, {"1": True, "2": True, "3": True}, {"1": True, "2": True, "3": True}) == 1
    # Not yet sent (the node may not count it): not subtracted, the bound only grows.
    assert may_run(4, {"1": True, "2": False}, {"1": True, "2": True}) == 3
    # Ended between its mark and the probe (gone after): not subtracted, nor counted by the node.
    assert may_run(2, {"1": True, "2": True}, {"1": True, "9": True}) == 1
    # Granted after the first read: the node may count it, nothing subtracted for it.
    assert may_run(3, {}, {"5": True}) == 3
    assert may_run(1, {"1": True, "2": True}, {"1": True, "2": True}) == 0  # never below none

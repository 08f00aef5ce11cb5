"""A job's webhook is sent once across a partition (docs/CLUSTER.md "Jobs").

A gateway cut off from Redis (its connections reset, or silent: it notices only when its calls
time out) goes on with its job alone, while — once its heartbeat lapsed — another
gateway carries the same job on and sends its webhook when its copy ends. The cut-off gateway's
own copy ends too, while it still cannot reach Redis to ask who owns the job: its webhook waits
until Redis answers, which says another gateway owns it, so it is not sent a second time.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import auth
from fakes import FakeWebhookReceiver

from kilolined.cluster.jobscripts import FINISH, WEBHOOK
from kilolined.fakegpu import FakeGPU

from .harness import GatewayProc, RedisServer, Relay, make_gateways, start_all, until

# The cluster fake GPU as the fake's defaults give it (the tests send their own steps).
pytestmark = pytest.mark.gpu(steps=25, step_ms=200, crash_sec=5)

FINISH_SHA = hashlib.sha1(FINISH.encode()).hexdigest().encode()  # as the gateway calls it: EVALSHA


class SilentRelay(Relay):
    """``sever`` as a black hole: the connections stay open and carry nothing until ``heal``."""

    def __init__(self, target_port: int):
        super().__init__(target_port)
        self.gate = asyncio.Event()
        self.gate.set()

    def sever(self) -> None:
        assert self.gate is not None
        self.gate.clear()

    def heal(self) -> None:
        assert self.gate is not None
        self.gate.set()

    async def stop(self) -> None:
        self.heal()
        Relay.sever(self)
        await super().stop()


@pytest.fixture(params=["reset", "silent"])
async def relay(redis_server: RedisServer, request: pytest.FixtureRequest) -> AsyncIterator[Relay]:
    r = Relay(redis_server.port) if request.param == "reset" else SilentRelay(redis_server.port)
    await r.start()
    yield r
    await r.stop()


async def _async_job(s: aiohttp.ClientSession, gw: GatewayProc, hooks: FakeWebhookReceiver, steps: int,
                     step_ms: int) -> str:
    """An async job through ``gw`` whose webhook goes to ``hooks``; its id."""
    async with s.post(gw.url + "/gen/generate", json={"steps": steps, "step_ms": step_ms},
                      headers={**auth(), "X-KiloLine-Mode": "async", "X-KiloLine-Callback": hooks.url()}) as r:
        assert r.status == 202, await r.text()
        return str((await r.json())["job_id"])


def _sent(hooks: FakeWebhookReceiver, jid: str) -> list[dict[str, Any]]:
    """The deliveries of the job's webhook."""
    return [d for d in hooks.deliveries if (d["json"] or {}).get("job_id") == jid]


async def _status(s: aiohttp.ClientSession, gw: GatewayProc, jid: str) -> str:
    async with s.get(f"{gw.url}/v1/jobs/{jid}", headers=auth()) as r:
        return str((await r.json())["status"]) if r.status == 200 else f"http {r.status}"


async def test_a_job_ended_on_both_sides_of_a_partition_sends_one_webhook(
        redis_server: RedisServer, gpu: FakeGPU, relay: Relay, gateways: list[GatewayProc], tmp_path: Path) -> None:
    async with FakeWebhookReceiver() as hooks:
        gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, ttl=1, max_concurrency=4,
                                  retry_on_failover=1)
        for g in gateways:
            g.cfg["jobs"] = {"webhook_allow_private": True, "webhook_backoff_sec": [0.2, 0.2]}
        cut, other = gateways
        cut.cfg["cluster"]["redis_url"] = relay.url
        await start_all(gateways)
        async with aiohttp.ClientSession() as s:
            jid = await _async_job(s, cut, hooks, steps=25, step_ms=100)
            await until(lambda: _is(s, other, jid, "running"), "the job never ran")
            await asyncio.sleep(1.5)  # it ends a second after the cut: before a silent cut is noticed
            relay.sever()
            # Both copies run to their end: the cut-off one alone, the other one carried on.
            await until(lambda: _served(gpu, 2), "the job was not carried on and ended twice", 30)
            await until(lambda: _delivered(hooks, jid), "the gateway that carried it on sent no webhook")
            await asyncio.sleep(2.5)  # past the cut-off gateway's call timeout (2 s)
            relay.heal()
            await until(lambda: _is(s, cut, jid, "completed"), "the healed gateway never saw the job end")
            await asyncio.sleep(1.5)  # a second webhook, were it sent, arrives by now
        sent = _sent(hooks, jid)
        assert len(sent) == 1, sent


async def _is(s: aiohttp.ClientSession, gw: GatewayProc, jid: str, want: str) -> bool:
    return await _status(s, gw, jid) == want


async def _served(gpu: FakeGPU, n: int) -> bool:
    return int(gpu.stats["served"]) >= n


async def _delivered(hooks: FakeWebhookReceiver, jid: str) -> bool:
    return any((d["json"] or {}).get("job_id") == jid for d in hooks.deliveries)


async def test_a_webhook_claim_asked_again_by_its_gateway_is_still_its_own(redis_server: RedisServer) -> None:
    # A claim whose answer was lost (Redis stalled past the call's timeout, then ran it from the
    # closed connection's buffer) is asked again once Redis answers: it is that gateway's, and the
    # webhook is sent; another gateway's claim still is not.
    r = redis_server.client()
    try:
        async def claim(inst: str) -> int:
            return int(await r.eval(WEBHOOK, 0, "kl-test:", inst, "job1", 60, "http://h/hook", "{}", "msg_job1"))
        assert [await claim("gw0#a"), await claim("gw0#a"), await claim("gw1#b")] == [1, 1, 0]
    finally:
        await r.aclose()


async def test_a_webhook_its_gateway_claimed_and_died_with_is_sent_by_another(
        redis_server: RedisServer, gpu: FakeGPU, gateways: list[GatewayProc], tmp_path: Path) -> None:
    # The receiver refuses the first attempt; the gateway that ended the job waits to try again,
    # and is killed (kill -9) meanwhile: the webhook it claimed is sent by the other gateway.
    async with FakeWebhookReceiver() as hooks:
        hooks.fail_next = 1
        gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, ttl=1)
        for g in gateways:
            g.cfg["jobs"] = {"webhook_allow_private": True, "webhook_backoff_sec": [30],
                             "webhook_timeout_sec": 1}
        await start_all(gateways)
        dead = gateways[0]
        async with aiohttp.ClientSession() as s:
            jid = await _async_job(s, dead, hooks, steps=1, step_ms=10)
            await until(lambda: _attempted(hooks), "the webhook was never tried")
            dead.kill9()
            await until(lambda: _delivered(hooks, jid), "no other gateway sent the webhook", 15)
            await asyncio.sleep(1.0)
        sent = _sent(hooks, jid)
        assert len(sent) == 1, sent
        assert sent[0]["headers"]["webhook-id"] == f"msg_{jid}"  # the same message, for a receiver that dedupes


async def _attempted(hooks: FakeWebhookReceiver) -> bool:
    return bool(hooks.attempts)


async def _delivered_while_cut(redis_server: RedisServer, gpu: FakeGPU, gateways: list[GatewayProc],
                               tmp_path: Path, delay_sec: float, ttl: float, jobs: dict[str, Any],
                               cut_sec: float, then: Callable[[GatewayProc], Awaitable[None]]) -> list[dict[str, Any]]:
    """The gateway that ran a job is cut off from Redis while the receiver takes ``delay_sec`` over
    its webhook, for ``cut_sec`` after the delivery; healed, ``then`` happens to it. The webhook's
    deliveries, every gateway's."""
    relay = Relay(redis_server.port)
    await relay.start()
    try:
        async with FakeWebhookReceiver() as hooks:
            hooks.delay_next, hooks.delay_sec = 1, delay_sec
            gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, ttl=ttl)
            for g in gateways:
                g.cfg["jobs"] = {"webhook_allow_private": True, "webhook_backoff_sec": [0.2], **jobs}
            cut = gateways[0]
            cut.cfg["cluster"]["redis_url"] = relay.url
            await start_all(gateways)
            async with aiohttp.ClientSession() as s:
                jid = await _async_job(s, cut, hooks, steps=1, step_ms=10)
                await until(lambda: _attempted(hooks), "the webhook was never tried")
                relay.sever()  # while the receiver takes its time
                await until(lambda: _delivered(hooks, jid), "the webhook was never delivered")
                await asyncio.sleep(cut_sec)
                relay.heal()
                await asyncio.sleep(2.5)  # a heartbeat or two: what it owes Redis is written
                await then(cut)
            return _sent(hooks, jid)
    finally:
        await relay.stop()


async def test_a_webhook_delivered_while_redis_was_out_of_reach_is_not_sent_again(
        redis_server: RedisServer, gpu: FakeGPU, gateways: list[GatewayProc], tmp_path: Path) -> None:
    # The gateway delivers a webhook while its link to Redis is cut for a moment (shorter than the
    # TTL): that it was delivered reaches Redis once Redis answers again, so when the gateway is
    # killed later, no other gateway sends it a second time.
    async def killed(cut: GatewayProc) -> None:
        cut.kill9()
        await asyncio.sleep(5.0)  # the other gateway finds it lost and takes what it left

    sent = await _delivered_while_cut(redis_server, gpu, gateways, tmp_path, delay_sec=0.8, ttl=3, jobs={},
                                      cut_sec=0.2, then=killed)  # healed before the TTL: never lost
    assert len(sent) == 1, sent


async def test_a_webhook_in_flight_when_its_gateway_is_cut_off_is_not_sent_again(
        redis_server: RedisServer, gpu: FakeGPU, gateways: list[GatewayProc], tmp_path: Path) -> None:
    # Cut off from Redis past the TTL while the receiver takes its time: the gateway is lost to
    # the other one, but its attempt in flight has webhook_timeout_sec to end before the other
    # would send the webhook again — and once back, the gateway says it was delivered.
    async def nothing(cut: GatewayProc) -> None:
        return None

    sent = await _delivered_while_cut(redis_server, gpu, gateways, tmp_path, delay_sec=2.0, ttl=1,
                                      jobs={"webhook_timeout_sec": 5}, cut_sec=1.0,  # lost to the other by then
                                      then=nothing)
    assert len(sent) == 1, sent


def command_end(data: bytes, at: int) -> int:
    """Where the Redis command (a RESP array of bulk strings) that holds byte ``at`` ends."""
    pos = data.rfind(b"*", 0, at)  # EVALSHA <sha>: no '*' between the array's head and the sha
    head = data.index(b"\r\n", pos)
    for _ in range(int(data[pos + 1:head])):
        size = data.index(b"\r\n", head + 2)
        head = size + 2 + int(data[head + 3:size])
    return head + 2


class CutAtTheEnding(Relay):
    """Lets one gateway's traffic with Redis through up to the end of the command that ends its
    job (FINISH), then carries nothing more either way: the gateway as Redis last saw it when a
    kill -9 lands the moment after its job's ending was sent."""

    def __init__(self, target_port: int):
        super().__init__(target_port)
        self.ended = asyncio.Event()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._open |= {writer, up_w}
        try:
            await asyncio.gather(self._pipe(reader, up_w, True), self._pipe(up_r, writer, False))
        finally:
            self._open -= {writer, up_w}

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, to_redis: bool) -> None:
        try:
            while data := await r.read(65536):
                if self.ended.is_set():
                    continue
                if to_redis and FINISH_SHA in data:
                    data = data[:command_end(data, data.index(FINISH_SHA))]
                    self.ended.set()
                w.write(data)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            w.transport.abort()


async def test_a_gateway_killed_right_after_its_job_ended_in_redis_leaves_its_webhook_to_another(
        redis_server: RedisServer, gpu: FakeGPU, gateways: list[GatewayProc], tmp_path: Path) -> None:
    # Redis holds a job's ending only with the claim of its webhook: were the claim a write of its
    # own after the ending (or after it in a batch that may land in part), a kill -9 between the
    # two left a job ended for good and nobody's webhook. Either the ending landed with its claim
    # (the other gateway sends the claimed webhook) or neither did (it carries the job on and
    # sends its own): once.
    relay = CutAtTheEnding(redis_server.port)
    await relay.start()
    try:
        async with FakeWebhookReceiver() as hooks:
            gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, ttl=1)
            for g in gateways:
                g.cfg["jobs"] = {"webhook_allow_private": True, "webhook_backoff_sec": [0.2],
                                 "webhook_timeout_sec": 1}
            dead, other = gateways
            dead.cfg["cluster"]["redis_url"] = relay.url
            await start_all(gateways)
            async with aiohttp.ClientSession() as s:
                jid = await _async_job(s, dead, hooks, steps=2, step_ms=20)
                await asyncio.wait_for(relay.ended.wait(), 10)
                dead.kill9()
                await until(lambda: _delivered(hooks, jid), "nobody sent the webhook of the job", 8)
                assert await _status(s, other, jid) == "completed"
                await asyncio.sleep(1.0)  # a second webhook, were one to be sent, would arrive by now
            sent = _sent(hooks, jid)
            assert len(sent) == 1, sent
            assert sent[0]["headers"]["webhook-id"] == f"msg_{jid}"
    finally:
        await relay.stop()

"""Graceful shutdown (SPEC §10) of a real daemon process: SIGTERM/SIGINT mid-burst, queued async
jobs failed with their webhooks sent, in-flight work finishing within shutdown_grace_sec, and a
second SIGTERM that means "now"."""

from __future__ import annotations

import asyncio
import base64
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import auth, base_config, wait_until
from daemon import Daemon, DaemonFactory, NotifyListener, daemon_factory, fields, socket_dir
from fakes import FakeWebhookReceiver, verify_standard_webhook

SECRET = "whsec_" + base64.b64encode(b"shutdown-test-secret-32-bytes!!!").decode()


@pytest.fixture
async def daemons(tmp_path: Path) -> AsyncIterator[DaemonFactory]:
    async with daemon_factory(tmp_path) as make:
        yield make


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        yield s


async def outcome(http: aiohttp.ClientSession, url: str, **body: Any) -> tuple[int | None, Any]:
    """(status, parsed JSON body), or (None, the exception) when the request failed at the HTTP level."""
    try:
        async with http.post(url + "/gen/generate", json=body, headers=auth()) as r:
            raw = await r.read()
            try:
                data = json.loads(raw)
            except ValueError:
                data = raw
            return r.status, data
    except (aiohttp.ClientError, TimeoutError) as e:
        return None, e


async def route_state(http: aiohttp.ClientSession, d: Daemon) -> dict[str, Any]:
    return (await d.state(http))["routes"]["gen"]


def is_shutting_down(status: int | None, body: Any) -> bool:
    return (status == 503 and isinstance(body, dict)
            and body.get("error", {}).get("type") == "shutting_down")


async def test_sigterm_mid_burst_answers_every_client(
    fakegpus: Any, daemons: DaemonFactory, client: aiohttp.ClientSession
) -> None:
    g = await fakegpus()
    cfg = base_config({"a": g.url}, max_concurrency=1)
    cfg["server"]["shutdown_grace_sec"] = 10
    d = await daemons(cfg)
    tasks = [asyncio.create_task(outcome(client, d.url, steps=5, step_ms=100, echo=i)) for i in range(10)]

    async def all_admitted() -> bool:
        r = await route_state(client, d)
        return r["inflight"] == 1 and r["queue_depth"] == 9

    await wait_until(all_admitted, timeout=15, step=0.05)
    d.signal(signal.SIGTERM)
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    assert await d.wait_exit() == 0

    ok = [b for s, b in results if s == 200]
    refused = [b for s, b in results if is_shutting_down(s, b)]
    others = [(s, b) for s, b in results if s != 200 and not is_shutting_down(s, b)]
    assert not others, f"clients got something else than 200 or 503 shutting_down: {others}"
    assert ok, "the request in flight at SIGTERM did not finish"
    assert refused, "nobody waiting was told 503 shutting_down"
    assert all(b["ok"] is True for b in ok)
    for b in refused:
        assert set(b["error"]) >= {"type", "message", "request_id", "retry_after_sec"}
    st = g.stats
    assert st["served"] == len(ok) and st["aborted"] == 0
    stderr = d.stderr()
    assert "Traceback" not in stderr, stderr


async def test_queued_async_jobs_are_failed_and_their_webhooks_sent_before_exit(
    fakegpus: Any, daemons: DaemonFactory, client: aiohttp.ClientSession
) -> None:
    async with FakeWebhookReceiver() as rx:
        g = await fakegpus()
        cfg = base_config({"a": g.url}, max_concurrency=1)
        cfg["server"]["shutdown_grace_sec"] = 10
        cfg["jobs"] = {"webhook_secret": SECRET, "webhook_allow_private": True, "webhook_backoff_sec": [0.2, 0.2]}
        d = await daemons(cfg)
        # One sync request holds the only slot; three async jobs queue behind it.
        busy = asyncio.create_task(outcome(client, d.url, steps=5, step_ms=100))
        await wait_until(lambda: g.stats["running"] == 1, timeout=15)
        job_ids = []
        for i in range(3):
            headers = {**auth(), "X-KiloLine-Mode": "async", "X-KiloLine-Callback": rx.url(f"/hook/{i}")}
            async with client.post(d.url + "/gen/generate", json={"echo": i}, headers=headers) as r:
                assert r.status == 202, await r.text()
                job_ids.append((await r.json())["job_id"])
        assert (await route_state(client, d))["queue_depth"] == 3

        d.signal(signal.SIGTERM)
        assert await d.wait_exit() == 0
        # Sent before the process exited: no waiting here.
        failed = [x for x in rx.deliveries if x["json"] and x["json"].get("type") == "job.failed"]
        assert sorted(x["json"]["job_id"] for x in failed) == sorted(job_ids), rx.attempts
        for x in failed:
            assert verify_standard_webhook(SECRET, x["headers"], x["body"]), x["headers"]
            assert x["json"]["status"] == "failed"
            assert x["json"]["error"]["type"] == "shutting_down"
        assert not [x for x in rx.deliveries if x["json"] and x["json"].get("type") == "job.completed"]
        status, body = await busy
        assert status == 200 and body["ok"] is True
        assert "Traceback" not in d.stderr()


async def test_sigint_lets_inflight_finish_within_grace(
    fakegpus: Any, daemons: DaemonFactory, client: aiohttp.ClientSession
) -> None:
    g = await fakegpus()
    cfg = base_config({"a": g.url}, max_concurrency=2)
    cfg["server"]["shutdown_grace_sec"] = 10
    d = await daemons(cfg)
    tasks = [asyncio.create_task(outcome(client, d.url, steps=5, step_ms=200)) for _ in range(2)]  # ~1 s each
    await wait_until(lambda: g.stats["running"] == 2, timeout=15)
    d.signal(signal.SIGINT)
    # While in-flight work finishes, nothing new is taken.
    await asyncio.sleep(0.2)
    late_status, late_body = await outcome(client, d.url)
    assert late_status is None or is_shutting_down(late_status, late_body), (late_status, late_body)
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    assert [s for s, _ in results] == [200, 200]
    assert await d.wait_exit() == 0
    assert g.stats["served"] == 2 and g.stats["aborted"] == 0
    assert "Traceback" not in d.stderr()


async def test_grace_expiry_exits_zero_despite_a_hung_request(
    fakegpus: Any, daemons: DaemonFactory, client: aiohttp.ClientSession
) -> None:
    """In-flight work gets shutdown_grace_sec, not more: a hung request must not hold the exit
    past the grace (the unit's TimeoutStopSec is sized on it; systemd would SIGKILL)."""
    g = await fakegpus()
    g.set_control(hang=True)
    grace = 2
    cfg = base_config({"a": g.url}, max_concurrency=1)
    cfg["server"]["shutdown_grace_sec"] = grace
    d = await daemons(cfg)
    hung = asyncio.create_task(outcome(client, d.url))
    await wait_until(lambda: g.stats["hanging"] == 1, timeout=15)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    d.signal(signal.SIGTERM)
    assert await d.wait_exit(timeout=30) == 0
    took = loop.time() - t0
    # Generous slack for a loaded machine, but well under two graces.
    assert took < grace + 3.5, f"exit took {took:.1f}s with shutdown_grace_sec={grace}:\n{d.stderr()}"
    status, _ = await asyncio.wait_for(hung, timeout=10)
    assert status != 200
    assert "Traceback" not in d.stderr()


async def test_second_sigterm_exits_at_once(
    tmp_path: Path, fakegpus: Any, daemons: DaemonFactory, client: aiohttp.ClientSession
) -> None:
    g = await fakegpus()
    g.set_control(hang=True)
    cfg = base_config({"a": g.url}, max_concurrency=1)
    cfg["server"]["shutdown_grace_sec"] = 60
    address = str(socket_dir(tmp_path) / "notify.sock")
    async with NotifyListener(address) as sd:
        d = await daemons(cfg, env={"NOTIFY_SOCKET": address})
        hung = asyncio.create_task(outcome(client, d.url))
        await wait_until(lambda: g.stats["hanging"] == 1, timeout=15)
        d.signal(signal.SIGTERM)
        await sd.wait_for(lambda f: f.get("STOPPING") == "1")
        # The first SIGTERM is waiting out a 60 s grace for the hung request; the second ends it now.
        await asyncio.sleep(0.2)
        assert d.proc is not None and d.proc.returncode is None
        d.signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await d.wait_exit(timeout=15)  # any exit code
        assert loop.time() - t0 < 10
        assert any(fields(m).get("STOPPING") == "1" for m in sd.messages)
    status, _ = await asyncio.wait_for(hung, timeout=10)
    assert status != 200

"""End to end through the real gateway and the fake GPU, over loopback sockets (SPEC §3, §4.1, §4.5, §10)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import hashlib
import json
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import ADMIN, KEYS, auth, base_config, wait_until

from kilolined.ops import views

# --- helpers ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def admin_state(http: aiohttp.ClientSession, gw: Any) -> dict[str, Any]:
    async with http.get(gw.url + "/admin/state", headers=ADMIN) as r:
        assert r.status == 200
        return await r.json()


async def queue_depth(http: aiohttp.ClientSession, gw: Any, route: str = "gen") -> int:
    return (await admin_state(http, gw))["routes"][route]["queue_depth"]


def inflight(gw: Any) -> int:
    return sum(gw.rt.scheduler.node_inflight.values())


def check_error(status: int, headers: Any, body: bytes, want_status: int, want_type: str,
                retry: bool | None = None) -> dict[str, Any]:
    """The JSON error shape of SPEC §4.5; returns the error object."""
    assert status == want_status, body[:500]
    assert headers.get("Content-Type", "").startswith("application/json")
    data = json.loads(body)
    assert set(data) == {"error"}
    err = data["error"]
    assert {"type", "message", "request_id", "retry_after_sec"} <= set(err)
    assert err["type"] == want_type
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["request_id"], str) and err["request_id"]
    assert headers.get("X-Request-Id") == err["request_id"]
    if retry is True:
        ra = headers.get("Retry-After")
        assert ra is not None and ra.isdigit() and int(ra) >= 1, ra
        assert err["retry_after_sec"] == int(ra)
    elif retry is False:
        assert err["retry_after_sec"] is None
    return err


async def call(http: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> tuple[int, Any, bytes]:
    async with http.request(method, url, **kw) as r:
        return r.status, r.headers, await r.read()


async def occupy(http: aiohttp.ClientSession, gw: Any, ms: float = 800, who: str = "alice") -> asyncio.Task[Any]:
    """Start a request that holds a slot for about `ms` and wait until it has the slot."""
    before = inflight(gw)
    task = asyncio.create_task(call(http, "POST", gw.url + "/gen/generate",
                                    json={"steps": 1, "step_ms": ms}, headers=auth(who)))
    await wait_until(lambda: inflight(gw) > before, timeout=5)
    return task


async def raw_request(port: int, data: bytes, read_timeout: float = 5) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        out = b""
        async with asyncio.timeout(read_timeout):
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                out += chunk
                if b"\r\n\r\n" in out:
                    head, _, body = out.partition(b"\r\n\r\n")
                    cl = [ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")]
                    if cl and len(body) >= int(cl[0].split(b":")[1]):
                        break
        return out
    finally:
        writer.close()


def rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


# --- the burst: what the gateway is for ---------------------------------------------------------


async def test_burst_of_50_through_gateway_all_served_without_oom(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=2, step_ms=10)
    gw = await gateway(base_config({"a": g.url}, max_concurrency=2, max_queue_depth=100))

    async def one(i: int) -> tuple[int, Any]:
        async with http.post(gw.url + "/gen/generate", json={"echo": i}, headers=auth()) as r:
            return r.status, await r.json()

    res = await asyncio.gather(*[one(i) for i in range(50)])
    assert [s for s, _ in res] == [200] * 50
    assert sorted(b["echo"] for _, b in res) == list(range(50))  # each got its own answer
    st = g.stats
    assert st["max_concurrent"] <= 2
    assert st["max_concurrent"] == 2  # and it used both slots
    assert st["oom_count"] == 0 and st["served"] == 50
    assert inflight(gw) == 0
    s = await admin_state(http, gw)
    assert s["routes"]["gen"]["queue_depth"] == 0 and s["routes"]["gen"]["inflight"] == 0


async def test_same_burst_straight_at_the_gpu_ooms_it(fakegpus, http) -> None:
    g = await fakegpus(steps=2, step_ms=10, vram_gb=24, job_vram_gb=10, crash_sec=0.3)

    async def one(i: int) -> int | str:
        try:
            async with http.post(g.url + "/generate", json={"echo": i}) as r:
                await r.read()
                return r.status
        except (aiohttp.ClientError, OSError) as e:
            return type(e).__name__

    res = await asyncio.gather(*[one(i) for i in range(50)])
    assert g.stats["oom_count"] > 0
    assert sum(1 for r in res if r != 200) > 0
    assert 500 in res or any(isinstance(r, str) for r in res)


# --- drop policies, timeouts, per-key cap -------------------------------------------------------


@pytest.mark.parametrize(("policy", "status"), [("reject_with_429", 429), ("reject_with_503", 503),
                                                ("drop_oldest", 503)])
async def test_drop_policy_end_to_end(fakegpus, gateway, http, policy: str, status: int) -> None:
    g = await fakegpus(steps=1, step_ms=10)
    gw = await gateway(base_config({"a": g.url}, max_concurrency=1, max_queue_depth=1, drop_policy=policy))
    holder = await occupy(http, gw, ms=700)
    waiting = asyncio.create_task(call(http, "POST", gw.url + "/gen/generate", json={"echo": "old"},
                                       headers=auth()))
    await wait_until(lambda: len(gw.rt.scheduler.routes["gen"].waiting) == 1)
    newcomer = asyncio.create_task(call(http, "POST", gw.url + "/gen/generate", json={"echo": "new"},
                                        headers=auth("bob")))
    if policy == "drop_oldest":
        st, h, body = await asyncio.wait_for(waiting, 5)  # the old one is failed at once
        check_error(st, h, body, 503, "queue_full", retry=True)
        assert not holder.done()
        st2, _, body2 = await newcomer
        assert st2 == 200 and json.loads(body2)["echo"] == "new"
    else:
        st, h, body = await asyncio.wait_for(newcomer, 5)
        assert not holder.done()  # rejected at once, not after waiting
        check_error(st, h, body, status, "queue_full", retry=True)
        st2, _, body2 = await waiting
        assert st2 == 200 and json.loads(body2)["echo"] == "old"
    assert (await holder)[0] == 200
    assert g.stats["max_concurrent"] == 1


async def test_queue_timeout(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=10)
    gw = await gateway(base_config({"a": g.url}, max_concurrency=1, queue_timeout_sec=0.3))
    holder = await occupy(http, gw, ms=1500)
    t0 = time.monotonic()
    st, h, body = await call(http, "POST", gw.url + "/gen/generate", json={}, headers=auth())
    took = time.monotonic() - t0
    check_error(st, h, body, 503, "queue_timeout", retry=True)
    assert 0.25 <= took < 1.2
    assert (await holder)[0] == 200
    assert g.stats["served"] == 1  # the timed-out one never reached the node


async def test_max_queued_per_key(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=10)
    gw = await gateway(base_config({"a": g.url}, max_concurrency=1, max_queued_per_key=1))
    holder = await occupy(http, gw, ms=700)
    a2 = asyncio.create_task(call(http, "POST", gw.url + "/gen/generate", json={}, headers=auth()))
    await wait_until(lambda: len(gw.rt.scheduler.routes["gen"].waiting) == 1)
    st, h, body = await call(http, "POST", gw.url + "/gen/generate", json={}, headers=auth())
    check_error(st, h, body, 429, "queue_full", retry=True)
    b1 = asyncio.create_task(call(http, "POST", gw.url + "/gen/generate", json={}, headers=auth("bob")))
    await wait_until(lambda: len(gw.rt.scheduler.routes["gen"].waiting) == 2)
    s = await admin_state(http, gw)
    assert s["routes"]["gen"]["waiting_by_key"] == {"alice": 1, "bob": 1}
    assert [(await t)[0] for t in (holder, a2, b1)] == [200, 200, 200]


async def test_client_disconnect_while_queued_leaves_the_queue_at_once(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=10)
    gw = await gateway(base_config({"a": g.url}, max_concurrency=1))
    holder = await occupy(http, gw, ms=900)
    body = b'{"echo": "gone"}'
    req = (b"POST /gen/generate?tag=gone HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEYS["alice"].encode()
           + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    _, writer = await asyncio.open_connection("127.0.0.1", gw.server.port)
    writer.write(req)
    await writer.drain()
    await wait_until(lambda: len(gw.rt.scheduler.routes["gen"].waiting) == 1)
    assert await queue_depth(http, gw) == 1
    t0 = time.monotonic()
    writer.transport.abort()

    async def empty() -> bool:
        return await queue_depth(http, gw) == 0

    await wait_until(empty, timeout=2, step=0.01)
    assert time.monotonic() - t0 < 0.5
    assert len(gw.rt.scheduler.routes["gen"].waiting) == 0
    assert (await holder)[0] == 200
    await asyncio.sleep(0.2)
    assert not any("tag=gone" in r["query"] for r in g.requests)
    assert g.stats["served"] == 1
    assert inflight(gw) == 0
    # and the slot it would have taken is free for the next one
    st, _, _ = await call(http, "POST", gw.url + "/gen/generate", json={}, headers=auth())
    assert st == 200


async def test_client_disconnect_in_flight_releases_the_slot(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=10)
    gw = await gateway(base_config({"a": g.url}, max_concurrency=1))
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(gw.url + "/gen/generate", json={"steps": 1, "step_ms": 2000}, headers=auth(),
                             timeout=aiohttp.ClientTimeout(total=0.3)) as r:
            await r.read()
    await wait_until(lambda: inflight(gw) == 0, timeout=3)
    st, _, _ = await call(http, "POST", gw.url + "/gen/generate", json={}, headers=auth())
    assert st == 200


async def test_burst_with_random_disconnects_leaks_no_slot(fakegpus, gateway, http) -> None:
    """Clients that give up while queued or in flight: slots all come back, the cap always holds."""
    import random

    rnd = random.Random(7)
    g = await fakegpus(steps=2, step_ms=20)
    gw = await gateway(base_config({"a": g.url}, max_concurrency=2, max_queue_depth=200))
    who = ["alice", "bob", "carol"]

    async def one(i: int) -> int | str:
        impatient = i % 3 == 0
        timeout = aiohttp.ClientTimeout(total=rnd.uniform(0.02, 0.5) if impatient else 30)
        try:
            async with http.post(gw.url + "/gen/generate", json={"echo": i}, headers=auth(who[i % 3]),
                                 timeout=timeout) as r:
                await r.read()
                return r.status
        except (TimeoutError, aiohttp.ClientError):
            return "gave up" if impatient else "error"

    res = await asyncio.gather(*[one(i) for i in range(60)])
    assert all(r == 200 for i, r in enumerate(res) if i % 3), res
    assert any(r == "gave up" for r in res)
    await wait_until(lambda: inflight(gw) == 0, timeout=3)
    assert len(gw.rt.scheduler.routes["gen"].waiting) == 0
    s = await admin_state(http, gw)
    assert s["routes"]["gen"]["queue_depth"] == 0 and s["routes"]["gen"]["inflight"] == 0
    assert s["nodes"]["a"]["inflight"] == 0
    st = g.stats
    assert st["max_concurrent"] <= 2 and st["oom_count"] == 0
    reached = sum(1 for r in g.requests if r["path"] == "/generate")
    assert res.count(200) <= reached <= 60
    # and the gateway still serves at full speed afterwards
    assert [(await call(http, "POST", gw.url + "/gen/generate", json={}, headers=auth()))[0]
            for _ in range(3)] == [200, 200, 200]


async def test_node_dying_mid_body_cuts_the_client_and_frees_the_slot(fakegpus, gateway, http) -> None:
    g = await fakegpus()
    g.set_control(drip_ms=30)
    gw = await gateway(base_config({"a": g.url}, max_concurrency=1))
    n = 0
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.get(gw.url + f"/gen/blob?bytes={100 * 65536}", headers=auth()) as r:
            assert r.status == 200
            async for chunk in r.content.iter_any():
                n += len(chunk)
                if n >= 3 * 65536 and g.up:
                    await g.kill()
    assert 0 < n < 100 * 65536
    await wait_until(lambda: inflight(gw) == 0, timeout=3)
    assert gw.rt.scheduler.nodes["a"].last_error is not None


# --- streaming: big bodies and SSE --------------------------------------------------------------


async def test_100mb_response_streams_with_flat_memory(fakegpus, gateway, http) -> None:
    g = await fakegpus()
    gw = await gateway(base_config({"a": g.url}, max_concurrency=1))
    size = 100 * 1024 * 1024
    piece = bytes(range(256)) * 256  # the fake's 64 KiB pattern
    want = hashlib.sha256()
    for _ in range(size // len(piece)):
        want.update(piece)
    base = rss_kb()
    peak = base
    done = False

    async def sample() -> None:
        nonlocal peak
        while not done:
            peak = max(peak, rss_kb())
            await asyncio.sleep(0.01)

    sampler = asyncio.create_task(sample())
    got = hashlib.sha256()
    n = 0
    t0 = time.monotonic()
    first: float | None = None
    try:
        async with http.get(gw.url + f"/gen/blob?bytes={size}", headers=auth()) as r:
            assert r.status == 200
            assert r.headers["Content-Type"] == "application/octet-stream"
            async for chunk in r.content.iter_any():
                if first is None:
                    first = time.monotonic() - t0
                got.update(chunk)
                n += len(chunk)
    finally:
        done = True
        await sampler
    total = time.monotonic() - t0
    assert n == size
    assert got.hexdigest() == want.hexdigest()
    growth_mb = (peak - base) / 1024
    assert growth_mb < 50, f"RSS grew {growth_mb:.0f} MB"
    assert first is not None and first < total / 2


async def test_first_byte_arrives_before_the_body_is_complete(fakegpus, gateway, http) -> None:
    g = await fakegpus()
    g.set_control(drip_ms=100)
    gw = await gateway(base_config({"a": g.url}, max_concurrency=1))
    t0 = time.monotonic()
    async with http.get(gw.url + f"/gen/blob?bytes={8 * 65536}", headers=auth()) as r:
        first = None
        n = 0
        async for chunk in r.content.iter_any():
            if first is None:
                first = time.monotonic() - t0
            n += len(chunk)
    total = time.monotonic() - t0
    assert n == 8 * 65536
    assert first is not None and total >= 0.7 and first < total - 0.4


async def test_sse_from_the_node_is_flushed_per_event(fakegpus, gateway, http) -> None:
    g = await fakegpus()
    gw = await gateway(base_config({"a": g.url}, max_concurrency=1))
    t0 = time.monotonic()
    events: list[tuple[float, bytes]] = []
    async with http.post(gw.url + "/gen/generate", json={"stream": True, "steps": 4, "step_ms": 150},
                         headers=auth()) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            if line.startswith(b"data:"):
                events.append((time.monotonic() - t0, line.strip()))
    assert [e for _, e in events][-1] == b"data: [DONE]"
    steps = [json.loads(e[5:]) for _, e in events[:-1]]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    first, last = events[0][0], events[-1][0]
    assert last - first >= 0.3, f"events arrived together: {events}"


# --- auth ---------------------------------------------------------------------------------------


async def test_auth(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    cfg = base_config({"a": g.url})
    cfg["routes"]["other"] = {"path": "/other", "nodes": ["a"]}
    cfg["keys"]["carol"]["routes"] = ["other"]
    gw = await gateway(cfg)
    url = gw.url + "/gen/generate"
    st, h, body = await call(http, "POST", url, json={})
    check_error(st, h, body, 401, "unauthorized")
    assert h["WWW-Authenticate"].startswith("Bearer")
    st, h, body = await call(http, "POST", url, json={}, headers={"Authorization": "Bearer kl_not_a_key"})
    check_error(st, h, body, 401, "unauthorized")
    assert h["WWW-Authenticate"].startswith("Bearer")
    st, h, body = await call(http, "POST", url, json={}, headers={"X-API-Key": "kl_nope"})
    check_error(st, h, body, 401, "unauthorized")
    st, h, body = await call(http, "POST", url, json={}, headers=auth("carol"))
    check_error(st, h, body, 403, "forbidden")
    st, _, _ = await call(http, "POST", gw.url + "/other/generate", json={}, headers=auth("carol"))
    assert st == 200
    st, _, _ = await call(http, "POST", url, json={}, headers={"X-API-Key": KEYS["alice"]})
    assert st == 200
    st, _, _ = await call(http, "POST", url, json={}, headers={"Authorization": "bearer " + KEYS["bob"]})
    assert st == 200
    assert g.stats["served"] == 3  # nothing rejected reached the node


async def test_auth_none_route_takes_anonymous_requests(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    gw = await gateway(base_config({"a": g.url}, auth="none", rate={"per_minute": 60, "burst": 1}))
    st, h, _ = await call(http, "POST", gw.url + "/gen/generate", json={})
    assert st == 200 and h["RateLimit-Limit"] == "1"
    # limits apply per client IP
    st, h, body = await call(http, "POST", gw.url + "/gen/generate", json={})
    check_error(st, h, body, 429, "rate_limited", retry=True)


# --- rate limits and budgets --------------------------------------------------------------------


async def test_rate_limit_headers_and_429(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    gw = await gateway(base_config({"a": g.url}, rate={"per_minute": 60, "burst": 2}))
    url = gw.url + "/gen/generate"
    seen = []
    for _ in range(2):
        st, h, _ = await call(http, "POST", url, json={}, headers=auth())
        assert st == 200
        seen.append((h["RateLimit-Limit"], h["RateLimit-Remaining"], h["RateLimit-Reset"]))
    assert [s[:2] for s in seen] == [("2", "1"), ("2", "0")]
    assert all(s[2].isdigit() and int(s[2]) >= 1 for s in seen)
    st, h, body = await call(http, "POST", url, json={}, headers=auth())
    check_error(st, h, body, 429, "rate_limited", retry=True)
    assert h["RateLimit-Limit"] == "2" and h["RateLimit-Remaining"] == "0" and "RateLimit-Reset" in h
    # another key has its own bucket
    st, h, _ = await call(http, "POST", url, json={}, headers=auth("bob"))
    assert st == 200 and h["RateLimit-Remaining"] == "1"
    assert g.stats["served"] == 3


async def test_key_rate_overrides_route_rate(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    cfg = base_config({"a": g.url}, rate={"per_minute": 60, "burst": 1})
    cfg["keys"]["bob"]["rate"] = {"per_minute": 60, "burst": 3}
    gw = await gateway(cfg)
    codes = [(await call(http, "POST", gw.url + "/gen/generate", json={}, headers=auth("bob")))[0] for _ in range(4)]
    assert codes == [200, 200, 200, 429]


async def test_budget_exhausted_and_survives_restart(fakegpus, gateway, http, tmp_path: Path) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    cfg = base_config({"a": g.url})
    cfg["server"]["state_dir"] = str(tmp_path / "state")
    cfg["keys"]["alice"]["budget"] = {"requests_per_day": 2}
    gw = await gateway(copy.deepcopy(cfg))
    url = gw.url + "/gen/generate"
    assert [(await call(http, "POST", url, json={}, headers=auth()))[0] for _ in range(2)] == [200, 200]
    st, h, body = await call(http, "POST", url, json={}, headers=auth())
    err = check_error(st, h, body, 429, "budget_exhausted", retry=True)
    assert 1 <= err["retry_after_sec"] <= 86400
    st, _, _ = await call(http, "POST", url, json={}, headers=auth("bob"))
    assert st == 200
    await gw.server.shutdown()
    # a new gateway on the same state_dir remembers today's counts
    gw2 = await gateway(copy.deepcopy(cfg))
    st, h, body = await call(http, "POST", gw2.url + "/gen/generate", json={}, headers=auth())
    check_error(st, h, body, 429, "budget_exhausted", retry=True)
    st, _, _ = await call(http, "POST", gw2.url + "/gen/generate", json={}, headers=auth("bob"))
    assert st == 200
    assert g.stats["served"] == 4


# --- header hygiene -----------------------------------------------------------------------------


async def test_upstream_and_response_headers(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    cfg = base_config({"a": g.url})
    cfg["nodes"]["a"]["headers"] = {"X-Node-Token": "node-secret"}
    gw = await gateway(cfg)
    headers = {**auth(), "X-API-Key": "kl_should_not_pass", "X-Request-Id": "req-abc.123",
               "X-KiloLine-Mode": "sync", "X-KiloLine-Anything": "1", "X-Custom": "keep-me"}
    st, h, _ = await call(http, "POST", gw.url + "/gen/generate?x=1&y=2", json={"echo": 1}, headers=headers)
    assert st == 200
    seen = g.requests[-1]
    assert seen["path"] == "/generate" and seen["query"] == "x=1&y=2"
    up = seen["headers"]
    assert up["x-forwarded-for"].split(",")[-1].strip() == "127.0.0.1"
    assert up["x-forwarded-proto"] == "http"
    assert up["x-request-id"] == "req-abc.123"
    assert up["x-node-token"] == "node-secret"
    assert up["x-custom"] == "keep-me"
    assert up["host"] == f"127.0.0.1:{g.port}"
    assert "authorization" not in up and "x-api-key" not in up
    assert not [k for k in up if k.startswith("x-kiloline-")]
    assert not any(KEYS["alice"] in v for v in up.values())
    assert h["X-Request-Id"] == "req-abc.123"
    assert h["X-KiloLine-Node"] == "a"
    assert h["X-KiloLine-Queue-Wait-Ms"].isdigit()
    assert g.url not in json.dumps(dict(h))


@pytest.mark.parametrize("rid", ["has spaces in it", "x" * 300, "<script>", "a\tb", ""])
async def test_insane_request_id_is_replaced(fakegpus, gateway, http, rid: str) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    gw = await gateway(base_config({"a": g.url}))
    st, h, _ = await call(http, "POST", gw.url + "/gen/generate", json={}, headers={**auth(), "X-Request-Id": rid})
    assert st == 200
    new = h["X-Request-Id"]
    assert new and new != rid and len(new) <= 128
    assert g.requests[-1]["headers"]["x-request-id"] == new


async def test_node_authorization_header_replaces_the_clients(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    cfg = base_config({"a": g.url})
    cfg["nodes"]["a"]["headers"] = {"Authorization": "Bearer gpu-token"}
    gw = await gateway(cfg)
    st, _, _ = await call(http, "POST", gw.url + "/gen/generate", json={}, headers=auth())
    assert st == 200
    up = g.requests[-1]["headers"]
    assert up["authorization"] == "Bearer gpu-token"
    assert not any(KEYS["alice"] in v for v in up.values())


async def test_node_headers_replace_client_headers_of_the_same_name(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    cfg = base_config({"a": g.url})
    cfg["nodes"]["a"]["headers"] = {"x-tenant": "from-node", "X-Forwarded-Proto": "https"}
    gw = await gateway(cfg)
    st, _, _ = await call(http, "POST", gw.url + "/gen/generate", json={},
                          headers={**auth(), "X-Tenant": "from-client", "X-Other": "kept"})
    assert st == 200
    raw = g.requests[-1]["headers"]
    assert raw["x-tenant"] == "from-node" and raw["x-other"] == "kept"
    assert raw["x-forwarded-proto"] == "https"  # a node header wins over the gateway's own too


async def test_node_url_credentials_become_basic_auth_not_part_of_host(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    cfg = base_config({"a": g.url.replace("http://", "http://gpu:s3cret@")})
    gw = await gateway(cfg)
    st, _, _ = await call(http, "POST", gw.url + "/gen/generate", json={}, headers=auth())
    assert st == 200
    up = g.requests[-1]["headers"]
    assert up["host"] == f"127.0.0.1:{g.port}"
    assert up["authorization"] == "Basic " + base64.b64encode(b"gpu:s3cret").decode()


async def test_queue_wait_header_reflects_the_wait(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    gw = await gateway(base_config({"a": g.url}, max_concurrency=1))
    holder = await occupy(http, gw, ms=400)
    st, h, _ = await call(http, "POST", gw.url + "/gen/generate", json={}, headers=auth())
    assert st == 200 and int(h["X-KiloLine-Queue-Wait-Ms"]) >= 200
    assert (await holder)[0] == 200


async def test_upstream_status_passes_through(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    gw = await gateway(base_config({"a": g.url}))
    st, _, body = await call(http, "POST", gw.url + "/gen/generate", data=b"not json", headers=auth())
    assert st == 400 and b"not valid JSON" in body  # the node's own 400, unchanged
    st, _, _ = await call(http, "GET", gw.url + "/gen/nothing-here", headers=auth())
    assert st == 404


async def test_longest_prefix_on_a_segment_boundary(fakegpus, gateway, http) -> None:
    a = await fakegpus(steps=1, step_ms=1)
    b = await fakegpus(steps=1, step_ms=1)
    cfg = base_config({"a": a.url})
    cfg["nodes"]["b"] = {"url": b.url}
    cfg["routes"]["v2"] = {"path": "/gen/v2", "nodes": ["b"]}
    gw = await gateway(cfg)
    st, h, _ = await call(http, "GET", gw.url + "/gen/v2/health?x=1", headers=auth())
    assert st == 200 and h["X-KiloLine-Node"] == "b"
    assert (b.requests[-1]["path"], b.requests[-1]["query"]) == ("/health", "x=1")
    st, h, _ = await call(http, "GET", gw.url + "/gen/v2x/health", headers=auth())
    assert h["X-KiloLine-Node"] == "a" and a.requests[-1]["path"] == "/v2x/health"
    st, h, _ = await call(http, "GET", gw.url + "/gen", headers=auth())
    assert h["X-KiloLine-Node"] == "a" and a.requests[-1]["path"] == "/"


async def test_encoded_path_characters_stay_in_the_path(fakegpus, gateway, http) -> None:
    """%3F and %23 in the path are data, not a query or a fragment: the node must see them in its path."""
    from yarl import URL

    g = await fakegpus(steps=1, step_ms=1)
    gw = await gateway(base_config({"a": g.url}))
    for raw, want_path in (("/gen/health%3Fx=1", "/health?x=1"), ("/gen/health%23frag", "/health#frag")):
        async with http.get(URL(gw.url + raw, encoded=True), headers=auth()) as r:
            await r.read()
        seen = g.requests[-1]
        assert (seen["path"], seen["query"]) == (want_path, ""), (raw, seen["path"], seen["query"])


async def test_query_with_kl_mode_keeps_the_rest_verbatim(fakegpus, gateway, http) -> None:
    from urllib.parse import parse_qs

    from yarl import URL

    g = await fakegpus(steps=1, step_ms=1)
    gw = await gateway(base_config({"a": g.url}))
    async with http.get(URL(gw.url + "/gen/health?q=a%26b&kl_mode=sync&r=1", encoded=True), headers=auth()) as r:
        assert r.status == 200
    assert parse_qs(g.requests[-1]["query"]) == {"q": ["a&b"], "r": ["1"]}


async def test_trusted_proxy_x_forwarded_for(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    cfg = base_config({"a": g.url}, auth="none", rate={"per_minute": 60, "burst": 1})
    cfg["server"]["trusted_proxies"] = ["127.0.0.1/32"]
    gw = await gateway(cfg)
    url = gw.url + "/gen/generate"
    st, _, _ = await call(http, "POST", url, json={}, headers={"X-Forwarded-For": "203.0.113.5"})
    assert st == 200
    assert g.requests[-1]["headers"]["x-forwarded-for"] == "203.0.113.5, 127.0.0.1"
    # limits apply per real client IP
    st, _, _ = await call(http, "POST", url, json={}, headers={"X-Forwarded-For": "203.0.113.6"})
    assert st == 200
    st, h, body = await call(http, "POST", url, json={}, headers={"X-Forwarded-For": "203.0.113.5"})
    check_error(st, h, body, 429, "rate_limited", retry=True)


async def test_untrusted_x_forwarded_for_is_not_believed(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    gw = await gateway(base_config({"a": g.url}, auth="none", rate={"per_minute": 60, "burst": 1}))
    url = gw.url + "/gen/generate"
    st, _, _ = await call(http, "POST", url, json={}, headers={"X-Forwarded-For": "203.0.113.5"})
    assert st == 200
    assert g.requests[-1]["headers"]["x-forwarded-for"].split(",")[-1].strip() == "127.0.0.1"
    st, _, _ = await call(http, "POST", url, json={}, headers={"X-Forwarded-For": "203.0.113.6"})
    assert st == 429  # a spoofed header does not buy a fresh bucket


async def test_breaker_trips_on_5xx_and_work_goes_to_standby(fakegpus, gateway, http) -> None:
    a = await fakegpus(steps=1, step_ms=1)
    b = await fakegpus(steps=1, step_ms=1)
    a.set_control(fail_status=500)
    cfg = base_config({"a": a.url, "b": b.url})
    cfg["nodes"]["a"]["breaker"] = {"consecutive_failures": 2, "open_sec": 30}
    gw = await gateway(cfg)
    url = gw.url + "/gen/generate"
    for _ in range(2):
        st, h, _ = await call(http, "POST", url, json={}, headers=auth())
        assert st == 500 and h["X-KiloLine-Node"] == "a"  # the node's own status passes through
    s = await admin_state(http, gw)
    assert s["nodes"]["a"]["breaker"] == "open"
    assert s["routes"]["gen"]["mode"] == "failover"
    st, h, _ = await call(http, "POST", url, json={}, headers=auth())
    assert st == 200 and h["X-KiloLine-Node"] == "b"
    assert a.stats["rejected"] == 2


async def test_health_checks_fail_over_and_back(fakegpus, gateway, http) -> None:
    a = await fakegpus(steps=1, step_ms=1)
    b = await fakegpus(steps=1, step_ms=1)
    cfg = base_config({"a": a.url, "b": b.url})
    cfg["nodes"]["a"]["health"] = {"path": "/health", "interval_sec": 0.05, "timeout_sec": 0.5, "fall": 1, "rise": 1}
    gw = await gateway(cfg)
    url = gw.url + "/gen/generate"
    a.set_control(health_status=503)

    async def health(node: str) -> str:
        return (await admin_state(http, gw))["nodes"][node]["health"]

    async def is_down() -> bool:
        return await health("a") == "down"

    await wait_until(is_down, timeout=3)
    st, h, _ = await call(http, "POST", url, json={}, headers=auth())
    assert st == 200 and h["X-KiloLine-Node"] == "b"
    a.set_control(health_status=200)

    async def is_up() -> bool:
        return await health("a") == "up"

    await wait_until(is_up, timeout=3)
    st, h, _ = await call(http, "POST", url, json={}, headers=auth())
    assert st == 200 and h["X-KiloLine-Node"] == "a"


# --- upstream failures --------------------------------------------------------------------------


async def test_request_timeout_gives_504(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    g.set_control(hang=True)
    gw = await gateway(base_config({"a": g.url}, request_timeout_sec=0.3, retry_on_failover=0))
    t0 = time.monotonic()
    st, h, body = await call(http, "POST", gw.url + "/gen/generate", json={}, headers=auth())
    assert time.monotonic() - t0 < 2
    check_error(st, h, body, 504, "upstream_timeout")
    assert b"127.0.0.1" not in body and str(g.port).encode() not in body
    await wait_until(lambda: inflight(gw) == 0, timeout=2)


async def test_unreachable_node_gives_502_without_its_address(gateway, http) -> None:
    port = free_port()
    gw = await gateway(base_config({"a": f"http://127.0.0.1:{port}"}, retry_on_failover=0))
    st, h, body = await call(http, "POST", gw.url + "/gen/generate", json={}, headers=auth())
    check_error(st, h, body, 502, "upstream_error")
    assert b"127.0.0.1" not in body and f":{port}".encode() not in body
    assert not any(f":{port}" in v or "127.0.0.1" in v for v in h.values())
    assert inflight(gw) == 0


async def test_failover_to_another_node_before_any_byte(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = base_config({"dead": dead}, retry_on_failover=1)
    cfg["nodes"]["live"] = {"url": g.url}
    cfg["routes"]["gen"]["nodes"] = ["dead", "live"]
    gw = await gateway(cfg)
    st, h, _ = await call(http, "POST", gw.url + "/gen/generate", json={}, headers=auth())
    assert st == 200 and h["X-KiloLine-Node"] == "live"


# --- bad input ----------------------------------------------------------------------------------


async def test_unknown_route_is_404_json(gateway, http) -> None:
    gw = await gateway(base_config({"a": f"http://127.0.0.1:{free_port()}"}))
    for path in ("/nope", "/genx/generate", "/"):
        st, h, body = await call(http, "GET", gw.url + path, headers=auth())
        check_error(st, h, body, 404, "not_found")


async def test_huge_content_length_is_413(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    cfg = base_config({"a": g.url})
    cfg["server"]["max_body_mb"] = 1
    gw = await gateway(cfg)
    raw = (b"POST /gen/generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEYS["alice"].encode()
           + b"\r\nContent-Type: application/json\r\nContent-Length: 10737418240\r\n\r\n{}")
    out = await raw_request(gw.server.port, raw)
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert json.loads(body)["error"]["type"] == "payload_too_large"
    # a real body over the limit, without a length up front (chunked)
    async def gen() -> Any:
        for _ in range(40):
            yield b"x" * 65536

    st, h, body = await call(http, "POST", gw.url + "/gen/generate", data=gen(), headers=auth())
    check_error(st, h, body, 413, "payload_too_large")
    assert g.stats["served"] == 0 and not any(r["path"] == "/generate" for r in g.requests)


async def test_bad_mode_is_400(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    gw = await gateway(base_config({"a": g.url}))
    st, h, body = await call(http, "POST", gw.url + "/gen/generate", json={},
                             headers={**auth(), "X-KiloLine-Mode": "turbo"})
    check_error(st, h, body, 400, "bad_request")
    st, h, body = await call(http, "POST", gw.url + "/gen/generate?kl_mode=bogus", json={}, headers=auth())
    check_error(st, h, body, 400, "bad_request")
    st, _, _ = await call(http, "POST", gw.url + "/gen/generate", json={},
                          headers={**auth(), "X-KiloLine-Mode": "SYNC"})
    assert st == 200
    assert g.stats["served"] == 1


async def test_kl_mode_is_not_forwarded(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    gw = await gateway(base_config({"a": g.url}))
    st, _, _ = await call(http, "POST", gw.url + "/gen/generate?a=1&kl_mode=sync&b=2", json={}, headers=auth())
    assert st == 200
    assert g.requests[-1]["query"] == "a=1&b=2"


async def test_garbage_headers_do_not_break_anything(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    gw = await gateway(base_config({"a": g.url}))
    port = gw.server.port
    key = KEYS["alice"].encode()
    get = b"GET /gen/health HTTP/1.1\r\nHost: x\r\n"
    garbage = [
        get + b"Authorization: Bearer " + key + b"\r\nX-Request-Id: \xff\xfe\x80\r\n\r\n",
        b"GET /gen/health HTTP/1.1\r\nHost: x\r\nAuthorization: \xff\xfe\r\n\r\n",
        b"GET /gen/health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer\r\n\r\n",
        b"GET /gen/health HTTP/1.1\r\nHost: x\r\nAuthorization: Basic Zm9vOmJhcg==\r\n\r\n",
        b"GET /gen/health HTTP/1.1\r\nHost: x\r\nX-API-Key: " + b"k" * 5000 + b"\r\n\r\n",
        get + b"Authorization: Bearer " + key + b"\r\nX-KiloLine-Mode: \xc3\xa9\r\n\r\n",
        b"GET /gen/health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key + b"\r\nPrefer: \x01\x02\r\n\r\n",
        b"GET /gen/health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key
        + b"\r\nX-Forwarded-For: not-an-ip, , 999.1.1.1\r\nX-Target-Host: javascript:\r\n\r\n",
        b"GET /gen/%00%ff/../health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key + b"\r\n\r\n",
        b"GET /gen/health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key + b"\r\nContent-Length: -5\r\n\r\n",
        b"POST /gen/generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key
        + b"\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,
        b"GARBAGE\r\n\r\n",
    ]
    for raw in garbage:
        try:
            out = await raw_request(port, raw, read_timeout=3)
        except (ConnectionError, TimeoutError):
            continue
        if out:
            status = int(out.split(b" ", 2)[1])
            assert status < 500, (raw[:80], out[:300])
    st, _, _ = await call(http, "GET", gw.url + "/gen/health", headers=auth())
    assert st == 200
    st, _, _ = await call(http, "GET", gw.url + "/healthz")
    assert st == 200
    assert inflight(gw) == 0


# --- shutdown -----------------------------------------------------------------------------------


async def test_shutdown_fails_waiting_and_finishes_in_flight(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    gw = await gateway(base_config({"a": g.url}, max_concurrency=1))
    holder = await occupy(http, gw, ms=700)
    waiters = [asyncio.create_task(call(http, "POST", gw.url + "/gen/generate", json={}, headers=auth()))
               for _ in range(3)]
    await wait_until(lambda: len(gw.rt.scheduler.routes["gen"].waiting) == 3)
    stopping = asyncio.create_task(gw.server.shutdown())
    for w in waiters:
        st, h, body = await asyncio.wait_for(w, 2)
        check_error(st, h, body, 503, "shutting_down", retry=True)
    assert not holder.done()
    st, _, body = await holder
    assert st == 200 and json.loads(body)["ok"] is True
    await asyncio.wait_for(stopping, 5)
    assert g.stats["served"] == 1
    assert inflight(gw) == 0
    # the listener is closed
    with pytest.raises(aiohttp.ClientError):
        await call(http, "GET", gw.url + "/healthz")


async def test_client_hanging_up_mid_response_is_not_a_node_failure(fakegpus, gateway, http) -> None:
    """aiohttp's ClientConnectionResetError is both a ConnectionResetError and a ClientError: a
    client that leaves mid-body must not count against the node's breaker."""
    g = await fakegpus()
    cfg = base_config({"a": g.url})
    cfg["nodes"]["a"]["breaker"] = {"consecutive_failures": 1, "open_sec": 30}
    gw = await gateway(cfg)
    for i in range(6):
        # Slow and fast nodes: the hang-up lands while the gateway awaits the node or a write.
        g.set_control(drip_ms=20 if i % 2 else 0)
        async with http.get(gw.url + "/gen/blob?bytes=200000000", headers=auth()) as r:
            assert r.status == 200
            await r.content.read(100_000)
            r.close()  # hang up with most of the body still to come
        await wait_until(lambda: views.state(gw.rt)["routes"]["gen"]["inflight"] == 0)
    node = views.state(gw.rt)["nodes"]["a"]
    assert node["breaker"] == "closed" and node["last_error"] is None
    async with http.post(gw.url + "/gen/generate", json={}, headers=auth()) as r:
        assert r.status == 200


async def test_write_to_a_closing_client_is_not_a_node_failure(fakegpus, gateway, http, monkeypatch) -> None:
    """The exact error aiohttp raises when the client's transport is closing while we write."""
    import aiohttp as _aiohttp

    import kilolined.modes.sinks as app_module

    async def closing(*_a: Any, **_k: Any) -> Any:
        raise _aiohttp.ClientConnectionResetError("Cannot write to closing transport")

    g = await fakegpus()
    cfg = base_config({"a": g.url})
    cfg["nodes"]["a"]["breaker"] = {"consecutive_failures": 1, "open_sec": 30}
    gw = await gateway(cfg)
    monkeypatch.setattr(app_module, "stream_back", closing)
    with contextlib.suppress(_aiohttp.ClientError):
        async with http.post(gw.url + "/gen/generate", json={}, headers=auth()) as r:
            await r.read()
    await wait_until(lambda: views.state(gw.rt)["routes"]["gen"]["inflight"] == 0)
    node = views.state(gw.rt)["nodes"]["a"]
    assert node["breaker"] == "closed" and node["last_error"] is None

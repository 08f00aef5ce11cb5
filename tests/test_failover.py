"""Failover end to end (SPEC §3.4, §4.2, §6, §8): a spot GPU dies under a burst and nobody notices
but the operator. Real fake GPUs, a real gateway, real sockets; fake Telegram and Discord."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from conftest import ADMIN, auth, base_config, wait_until
from fakes import FakeDiscord, FakeTelegram
from prometheus_client.parser import text_string_to_metric_families

HEALTH = {"path": "/health", "interval_sec": 0.2, "timeout_sec": 0.5, "fall": 2, "rise": 2}
BREAKER = {"consecutive_failures": 3, "open_sec": 0.5, "max_open_sec": 4, "slow_start_sec": 1}

PRIMARY, PRIMARY_LABEL = "vast-8410", "Vast.ai #8410"
STANDBY, STANDBY_LABEL = "runpod-b2", "RunPod-B2"


# --- helpers -------------------------------------------------------------------------------------


async def admin_state(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/admin/state", headers=ADMIN) as r:
        assert r.status == 200
        return await r.json()


async def readyz(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with http.get(url + "/readyz") as r:
        return r.status, await r.json()


async def metric(http: aiohttp.ClientSession, url: str, sample: str, **labels: str) -> float:
    """One sample of /metrics (read with the admin key); 0 when the series does not exist yet."""
    async with http.get(url + "/metrics", headers=ADMIN) as r:
        assert r.status == 200
        text = await r.text()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def notify_cfg(tg: FakeTelegram, dc: FakeDiscord, **kw: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "telegram": {"bot_token": "T", "chat_id": "1", "api_base": tg.url},
        "discord": {"webhook_url": dc.webhook_url},
        "group_sec": 0.3,
        "min_interval_sec": 60,
    }
    cfg.update(kw)
    return cfg


async def gen(http: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None,
              **headers: str) -> tuple[int, str | None, bytes]:
    async with http.post(url + "/gen/generate", json=body or {}, headers={**auth(), **headers}) as r:
        return r.status, r.headers.get("X-KiloLine-Node"), await r.read()


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    event: str | None = None
    data: list[str] = []
    async for raw in resp.content:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("event:"):
            event = line[len("event:"):].strip()
        elif line.startswith("data:"):
            data.append(line[len("data:"):].strip())
        elif line == "" and event is not None:
            yield event, json.loads("\n".join(data))
            event, data = None, []


def texts(fake: FakeTelegram | FakeDiscord) -> list[str]:
    key = "text" if isinstance(fake, FakeTelegram) else "content"
    return [m[key] for m in fake.messages]


# --- the headline story ----------------------------------------------------------------------------


async def test_primary_dies_mid_burst_standby_takes_over_then_failback(fakegpus, gateway, http):
    async with FakeTelegram() as tg, FakeDiscord() as dc:
        a = await fakegpus(steps=5, step_ms=30)
        b = await fakegpus(steps=5, step_ms=30)
        cfg = base_config({PRIMARY: a.url, STANDBY: b.url}, max_concurrency=2, retry_on_failover=1)
        # open_sec longer than health detection (fall × interval), so the node is already marked
        # down when the breaker first goes half-open: no spurious failback while it is dead.
        breaker = {**BREAKER, "open_sec": 1}
        cfg["nodes"][PRIMARY].update(label=PRIMARY_LABEL, health=HEALTH, breaker=breaker)
        cfg["nodes"][STANDBY].update(label=STANDBY_LABEL, health=HEALTH, breaker=breaker)
        cfg["notify"] = notify_cfg(tg, dc)
        gw = await gateway(cfg)

        async def one(i: int) -> tuple[int, str | None]:
            status, node, _ = await gen(http, gw.url, {"echo": i})
            return status, node

        t0 = time.monotonic()
        tasks = [asyncio.create_task(one(i)) for i in range(30)]
        # Mid-burst: the primary has served some and is working on others.
        await wait_until(lambda: a.stats["served"] >= 6 and a.stats["running"] >= 1, timeout=15, step=0.005)
        await a.kill()
        t_kill = time.monotonic()
        results = await asyncio.gather(*tasks)

        assert [s for s, _ in results] == [200] * 30
        by_node = Counter(n for _, n in results)
        assert set(by_node) <= {PRIMARY, STANDBY}
        assert by_node[STANDBY] >= 1, by_node
        # Everything the client got from the standby was really served there.
        assert b.stats["served"] >= by_node[STANDBY]
        assert b.stats["oom_count"] == 0 and b.stats["max_concurrent"] <= 2
        # The jobs the primary was running when it died were re-queued, not lost.
        killed = a.stats["killed_jobs"]
        assert killed >= 1, a.stats
        failovers = await metric(http, gw.url, "kiloline_failovers_total", route="gen")
        assert failovers >= killed, (failovers, a.stats)
        assert a.stats["served"] + b.stats["served"] >= 30

        # One failover alert per channel, naming the dead node and its label.
        msgs_tg = await tg.wait_for(1, timeout=10)
        msgs_dc = await dc.wait_for(1, timeout=10)
        await wait_until(lambda: any("failing over" in t for t in texts(tg)), timeout=10)
        await wait_until(lambda: any("failing over" in t for t in texts(dc)), timeout=10)
        await asyncio.sleep(0.8)  # anything else of that moment would have gone out by now
        for fake in (tg, dc):
            over = [t for t in texts(fake) if "failing over" in t]
            assert len(over) == 1, texts(fake)
            assert PRIMARY in over[0] and PRIMARY_LABEL in over[0], over[0]
            assert STANDBY in over[0], over[0]
            assert not any("back on primary" in t for t in texts(fake)), texts(fake)
        assert msgs_tg and msgs_dc

        # --- the primary comes back -------------------------------------------------------------
        st = await admin_state(http, gw.url)
        assert st["routes"]["gen"]["mode"] == "failover"
        assert st["nodes"][PRIMARY]["health"] == "down"
        checks_before = a.stats["health_checks"]
        await a.revive()
        t_revive = time.monotonic()

        seen_slots: list[int] = []

        async def back_on_primary() -> bool:
            s = await admin_state(http, gw.url)
            if s["routes"]["gen"]["mode"] == "primary":
                seen_slots.append(s["nodes"][PRIMARY]["slots"])
                return True
            return False

        await wait_until(back_on_primary, timeout=20, step=0.01)
        assert a.stats["health_checks"] - checks_before >= HEALTH["rise"]
        assert t_revive - t_kill > 0 and t_revive - t0 > 0
        # Slow start: the slots ramp from 1 to the configured 2, they do not jump.
        assert seen_slots[0] == 1, seen_slots

        async def slots_full() -> bool:
            s = await admin_state(http, gw.url)
            seen_slots.append(s["nodes"][PRIMARY]["slots"])
            return seen_slots[-1] == 2

        await wait_until(slots_full, timeout=10, step=0.05)
        assert seen_slots == sorted(seen_slots), seen_slots

        # New work goes to the primary again.
        for i in range(3):
            status, node, _ = await gen(http, gw.url, {"echo": i})
            assert (status, node) == (200, PRIMARY)

        # And the operator hears about it.
        await wait_until(lambda: any("back on primary" in t for t in texts(tg)), timeout=10)
        await wait_until(lambda: any("back on primary" in t for t in texts(dc)), timeout=10)
        back = [t for t in texts(tg) if "back on primary" in t]
        assert len(back) == 1 and PRIMARY in back[0], texts(tg)
        assert len([t for t in texts(tg) if "failing over" in t]) == 1


async def test_slow_start_limits_concurrency_on_the_recovered_node(fakegpus, gateway, http):
    """Right after the breaker closes, the node gets 1 job at a time, not its full 2."""
    a = await fakegpus(steps=1, step_ms=1)
    b = await fakegpus(steps=1, step_ms=1)
    cfg = base_config({"a": a.url, "b": b.url}, max_concurrency=2)
    cfg["nodes"]["a"]["breaker"] = {**BREAKER, "open_sec": 0.3, "slow_start_sec": 3}
    gw = await gateway(cfg)
    a.set_control(fail_status=500)
    for _ in range(3):
        assert (await gen(http, gw.url))[0] == 500
    assert (await admin_state(http, gw.url))["nodes"]["a"]["breaker"] == "open"
    a.set_control(fail_status=None)

    async def half_open() -> bool:
        return (await admin_state(http, gw.url))["nodes"]["a"]["breaker"] == "half-open"

    await wait_until(half_open, timeout=10)
    assert (await gen(http, gw.url))[:2] == (200, "a")  # the trial closes the breaker
    st = await admin_state(http, gw.url)
    assert st["nodes"]["a"]["breaker"] == "closed"
    assert st["nodes"]["a"]["slots"] == 1
    assert st["routes"]["gen"]["slots"] == 1
    a.reset()
    # Four concurrent 200 ms jobs inside the 3 s ramp: the node never runs two at once early on,
    # and a merely full primary does not spill onto the standby.
    res = await asyncio.gather(*[gen(http, gw.url, {"steps": 2, "step_ms": 100}) for _ in range(4)])
    assert [(s, n) for s, n, _ in res] == [(200, "a")] * 4
    assert a.stats["max_concurrent"] == 1
    assert b.stats["served"] == 0

    async def ramped() -> bool:
        return (await admin_state(http, gw.url))["nodes"]["a"]["slots"] == 2

    await wait_until(ramped, timeout=10)


async def test_sse_job_sees_rerouted_event_when_its_node_dies(fakegpus, gateway, http):
    a = await fakegpus(steps=10, step_ms=50)
    b = await fakegpus(steps=2, step_ms=10)
    gw = await gateway(base_config({"a": a.url, "b": b.url}))
    events: list[tuple[str, dict[str, Any]]] = []
    async with http.post(gw.url + "/gen/generate", json={}, headers={**auth(), "X-KiloLine-Mode": "sse"}) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for ev, data in sse_events(r):
            events.append((ev, data))
            if ev == "dispatched" and data["node"] == "a":
                await wait_until(lambda: a.stats["running"] == 1, timeout=5)
                await a.kill()
            if ev in ("output_ready", "failed"):
                break
    names = [e for e, _ in events]
    assert "rerouted" in names, events
    rerouted = dict(events)["rerouted"]
    assert rerouted["from_node"] == "a" and rerouted["to_node"] == "b"
    assert isinstance(rerouted["reason"], str) and rerouted["reason"]
    assert "127.0.0.1" not in json.dumps(rerouted)  # never the node's address
    dispatched = [d["node"] for e, d in events if e == "dispatched"]
    assert dispatched == ["a", "b"], events
    assert names.index("rerouted") < len(names) - 1
    assert names[-1] == "output_ready", events
    assert events[-1][1]["status"] == "completed" and events[-1][1]["http_status"] == 200
    assert b.stats["served"] == 1


# --- re-queue on 502/503 -------------------------------------------------------------------------


@pytest.mark.parametrize("status", [502, 503])
async def test_node_5xx_before_any_byte_is_requeued_onto_the_standby(fakegpus, gateway, http, status):
    a = await fakegpus()
    b = await fakegpus()
    gw = await gateway(base_config({"a": a.url, "b": b.url}, retry_on_failover=1))
    a.set_control(fail_status=status)
    code, node, body = await gen(http, gw.url, {"echo": "x"})
    assert (code, node) == (200, "b")
    assert json.loads(body)["echo"] == "x"
    assert a.stats["rejected"] == 1 and b.stats["served"] == 1
    assert await metric(http, gw.url, "kiloline_failovers_total", route="gen") == 1
    st = await admin_state(http, gw.url)
    assert st["routes"]["gen"]["inflight"] == 0 and st["nodes"]["a"]["inflight"] == 0


async def test_node_503_passes_through_when_retry_on_failover_is_zero(fakegpus, gateway, http):
    a = await fakegpus()
    b = await fakegpus()
    gw = await gateway(base_config({"a": a.url, "b": b.url}, retry_on_failover=0))
    a.set_control(fail_status=503)
    code, node, body = await gen(http, gw.url)
    assert (code, node) == (503, "a")
    assert "simulated failure" in body.decode()  # the node's own body, not a gateway error
    assert b.stats["served"] == 0 and len(b.requests) == 0
    st = await admin_state(http, gw.url)
    assert st["routes"]["gen"]["inflight"] == 0 and st["nodes"]["a"]["inflight"] == 0


# --- a node dies mid-response ----------------------------------------------------------------------


async def test_node_dies_while_streaming_no_retry_client_sees_the_cut(fakegpus, gateway, http):
    a = await fakegpus()
    b = await fakegpus()
    gw = await gateway(base_config({"a": a.url, "b": b.url}, retry_on_failover=1))
    lines: list[bytes] = []
    cut = False
    async with http.post(gw.url + "/gen/generate", json={"stream": True, "steps": 20, "step_ms": 50},
                         headers=auth()) as r:
        assert r.status == 200 and r.headers["X-KiloLine-Node"] == "a"
        try:
            async for line in r.content:
                if line.startswith(b"data:"):
                    lines.append(line)
                    if len(lines) == 3:
                        await a.kill()
        except aiohttp.ClientError:
            cut = True
    assert len(lines) >= 3
    assert not any(b"[DONE]" in x for x in lines)
    assert len(lines) < 20
    assert cut, "the client must see the connection end (ClientPayloadError), not a clean EOF"
    # No retry: the standby never saw it.
    assert len(b.requests) == 0 and b.stats["served"] == 0

    async def released() -> bool:
        st = await admin_state(http, gw.url)
        return st["nodes"]["a"]["inflight"] == 0 and st["routes"]["gen"]["inflight"] == 0

    await wait_until(released, timeout=5)
    # The gateway is fine: the next request ends up on the standby.
    assert (await gen(http, gw.url))[:2] == (200, "b")


# --- every node down --------------------------------------------------------------------------------


async def test_all_nodes_down_requests_wait_and_succeed_when_a_node_returns(fakegpus, gateway, http):
    a = await fakegpus()
    b = await fakegpus()
    cfg = base_config({"a": a.url, "b": b.url}, queue_timeout_sec=20)
    for n in ("a", "b"):
        cfg["nodes"][n].update(health=HEALTH, breaker=BREAKER)
    gw = await gateway(cfg)
    await a.kill()
    await b.kill()

    async def route_down() -> bool:
        st = await admin_state(http, gw.url)
        return st["routes"]["gen"]["mode"] == "down"

    await wait_until(route_down, timeout=10)
    status, body = await readyz(http, gw.url)
    assert status == 503 and any("gen" in r for r in body["reasons"]), body
    tasks = [asyncio.create_task(gen(http, gw.url, {"echo": i})) for i in range(3)]

    async def queued() -> bool:
        return (await admin_state(http, gw.url))["routes"]["gen"]["queue_depth"] == 3

    await wait_until(queued, timeout=5)
    await asyncio.sleep(0.3)
    assert not any(t.done() for t in tasks)
    await b.revive()  # the standby comes back first
    results = await asyncio.gather(*tasks)
    assert [(s, n) for s, n, _ in results] == [(200, "b")] * 3
    assert (await readyz(http, gw.url))[0] == 200


async def test_all_nodes_down_queue_timeout_503_with_retry_after(fakegpus, gateway, http):
    a = await fakegpus()
    cfg = base_config({"a": a.url}, queue_timeout_sec=1)
    cfg["nodes"]["a"].update(health=HEALTH, breaker=BREAKER)
    gw = await gateway(cfg)
    await a.kill()

    async def down() -> bool:
        return (await admin_state(http, gw.url))["nodes"]["a"]["health"] == "down"

    await wait_until(down, timeout=10)
    t0 = time.monotonic()
    async with http.post(gw.url + "/gen/generate", json={}, headers=auth()) as r:
        assert r.status == 503
        retry_after = r.headers.get("Retry-After")
        body = await r.json()
    waited = time.monotonic() - t0
    assert body["error"]["type"] == "queue_timeout"
    assert retry_after is not None and int(retry_after) >= 1
    assert waited >= 0.9
    assert "127.0.0.1" not in json.dumps(body)
    assert (await admin_state(http, gw.url))["routes"]["gen"]["queue_depth"] == 0


# --- the OOM story ---------------------------------------------------------------------------------


async def test_oom_story_direct_burst_crashes_the_gpu_gateway_loses_nothing(fakegpus, gateway, http):
    job = {"steps": 5, "step_ms": 40}
    direct = await fakegpus(vram_gb=24, job_vram_gb=10, crash_sec=0.5)

    async def straight() -> int | None:
        try:
            async with http.post(direct.url + "/generate", json=job) as r:
                await r.read()
                return r.status
        except aiohttp.ClientError:
            return None

    straight_res = await asyncio.gather(*[straight() for _ in range(10)])
    assert direct.stats["oom_count"] >= 1
    assert straight_res.count(200) < 10, straight_res

    a = await fakegpus(vram_gb=24, job_vram_gb=10, crash_sec=0.5)
    b = await fakegpus(vram_gb=24, job_vram_gb=10, crash_sec=0.5)
    gw = await gateway(base_config({"a": a.url, "b": b.url}, max_concurrency=2))
    res = await asyncio.gather(*[gen(http, gw.url, job) for _ in range(10)])
    assert [s for s, _, _ in res] == [200] * 10
    for g in (a, b):
        assert g.stats["oom_count"] == 0 and g.stats["max_concurrent"] <= 2
    assert a.stats["served"] + b.stats["served"] == 10


# --- drain / undrain ---------------------------------------------------------------------------------


async def test_drain_sends_new_work_to_standby_inflight_finish_undrain_brings_it_back(fakegpus, gateway, http):
    a = await fakegpus()
    b = await fakegpus()
    gw = await gateway(base_config({"a": a.url, "b": b.url}, max_concurrency=2))
    slow = [asyncio.create_task(gen(http, gw.url, {"steps": 10, "step_ms": 50})) for _ in range(2)]
    await wait_until(lambda: a.stats["running"] == 2, timeout=5)

    async with http.post(gw.url + "/admin/nodes/a/drain") as r:
        assert r.status == 401
    async with http.post(gw.url + "/admin/nodes/nope/drain", headers=ADMIN) as r:
        assert r.status == 404
    async with http.post(gw.url + "/admin/nodes/a/drain", headers=ADMIN) as r:
        assert r.status == 200
        body = await r.json()
    assert body["drained"] is True and body["inflight"] == 2
    st = await admin_state(http, gw.url)
    assert st["nodes"]["a"]["drained"] is True
    assert st["routes"]["gen"]["mode"] == "failover"

    # New work goes to the standby while the drained node finishes what it has.
    for _ in range(3):
        assert (await gen(http, gw.url))[:2] == (200, "b")
    assert [(s, n) for s, n, _ in await asyncio.gather(*slow)] == [(200, "a")] * 2
    assert a.stats["served"] == 2 and a.stats["aborted"] == 0 and a.stats["killed_jobs"] == 0
    assert (await readyz(http, gw.url))[0] == 200  # the standby can take work

    # Drain the standby too: nothing can take work, /readyz says why.
    async with http.post(gw.url + "/admin/nodes/b/drain", headers=ADMIN) as r:
        assert r.status == 200
    status, body = await readyz(http, gw.url)
    assert status == 503
    assert body["reasons"] and any("gen" in reason for reason in body["reasons"]), body
    assert (await admin_state(http, gw.url))["routes"]["gen"]["mode"] == "down"

    async with http.post(gw.url + "/admin/nodes/a/undrain", headers=ADMIN) as r:
        assert r.status == 200
        assert (await r.json())["drained"] is False
    status, body = await readyz(http, gw.url)
    assert status == 200 and body["reasons"] == []
    st = await admin_state(http, gw.url)
    assert st["nodes"]["a"]["drained"] is False and st["routes"]["gen"]["mode"] == "primary"
    for _ in range(3):
        assert (await gen(http, gw.url))[:2] == (200, "a")
    async with http.post(gw.url + "/admin/nodes/b/undrain", headers=ADMIN) as r:
        assert r.status == 200


async def test_drained_waiting_requests_are_not_lost(fakegpus, gateway, http):
    """Draining the only node: new requests wait in the queue, undrain serves them."""
    a = await fakegpus()
    gw = await gateway(base_config({"a": a.url}, queue_timeout_sec=20))
    async with http.post(gw.url + "/admin/nodes/a/drain", headers=ADMIN) as r:
        assert r.status == 200
    tasks = [asyncio.create_task(gen(http, gw.url)) for _ in range(2)]

    async def queued() -> bool:
        return (await admin_state(http, gw.url))["routes"]["gen"]["queue_depth"] == 2

    await wait_until(queued, timeout=5)
    assert len(a.requests) == 0
    async with http.post(gw.url + "/admin/nodes/a/undrain", headers=ADMIN) as r:
        assert r.status == 200
    assert [(s, n) for s, n, _ in await asyncio.gather(*tasks)] == [(200, "a")] * 2


# --- more ways for a node to fail before any byte ----------------------------------------------------


async def test_node_hanging_before_headers_times_out_and_is_requeued(fakegpus, gateway, http):
    a = await fakegpus()
    b = await fakegpus()
    gw = await gateway(base_config({"a": a.url, "b": b.url}, request_timeout_sec=0.5, retry_on_failover=1))
    a.set_control(hang=True)
    t0 = time.monotonic()
    assert (await gen(http, gw.url))[:2] == (200, "b")
    assert time.monotonic() - t0 >= 0.45
    assert await metric(http, gw.url, "kiloline_failovers_total", route="gen") == 1
    await wait_until(lambda: a.stats["hanging"] == 0, timeout=5)  # the gateway hung up on it


async def test_node_hanging_without_retry_gives_504(fakegpus, gateway, http):
    a = await fakegpus()
    b = await fakegpus()
    gw = await gateway(base_config({"a": a.url, "b": b.url}, request_timeout_sec=0.5, retry_on_failover=0))
    a.set_control(hang=True)
    async with http.post(gw.url + "/gen/generate", json={}, headers=auth()) as r:
        assert r.status == 504
        body = await r.json()
    assert body["error"]["type"] == "upstream_timeout"
    assert a.url.split("://")[1] not in json.dumps(body)
    assert b.stats["served"] == 0
    assert (await admin_state(http, gw.url))["routes"]["gen"]["inflight"] == 0


async def test_only_node_unreachable_502_after_retries(fakegpus, gateway, http):
    a = await fakegpus()
    gw = await gateway(base_config({"a": a.url}, retry_on_failover=1))
    await a.kill()
    async with http.post(gw.url + "/gen/generate", json={}, headers=auth()) as r:
        assert r.status == 502
        body = await r.json()
    assert body["error"]["type"] == "upstream_error"
    assert a.url.split("://")[1] not in json.dumps(body)
    st = await admin_state(http, gw.url)
    assert st["routes"]["gen"]["inflight"] == 0 and st["routes"]["gen"]["queue_depth"] == 0


async def test_failback_leaves_work_already_on_the_standby_there(fakegpus, gateway, http):
    a = await fakegpus()
    b = await fakegpus()
    cfg = base_config({"a": a.url, "b": b.url}, max_concurrency=2)
    cfg["nodes"]["a"].update(health=HEALTH, breaker={**BREAKER, "slow_start_sec": 0})
    gw = await gateway(cfg)
    a.set_control(health_status=503)

    async def mode(m: str) -> bool:
        return (await admin_state(http, gw.url))["routes"]["gen"]["mode"] == m

    await wait_until(lambda: mode("failover"), timeout=10)
    long = [asyncio.create_task(gen(http, gw.url, {"steps": 20, "step_ms": 50})) for _ in range(2)]
    await wait_until(lambda: b.stats["running"] == 2, timeout=5)
    a.set_control(health_status=200)
    await wait_until(lambda: mode("primary"), timeout=10)
    assert b.stats["running"] == 2  # not cut, not moved
    assert (await gen(http, gw.url))[:2] == (200, "a")
    assert [(s, n) for s, n, _ in await asyncio.gather(*long)] == [(200, "b")] * 2
    assert b.stats["served"] == 2 and b.stats["aborted"] == 0

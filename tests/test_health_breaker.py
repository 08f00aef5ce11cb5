"""Active health checks and the passive circuit breaker, end to end (SPEC §2 nodes.*.health /
nodes.*.breaker, §3.4, §6 /readyz and /admin/state, §8 log lines)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

import aiohttp
import pytest
from conftest import ADMIN, auth, base_config, wait_until
from prometheus_client.parser import text_string_to_metric_families

HEALTH = {"path": "/health", "interval_sec": 0.2, "timeout_sec": 0.5, "fall": 2, "rise": 2}
BREAKER = {"consecutive_failures": 3, "open_sec": 0.5, "max_open_sec": 4, "slow_start_sec": 1}


# --- helpers -------------------------------------------------------------------------------------


async def admin_state(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/admin/state", headers=ADMIN) as r:
        assert r.status == 200
        return await r.json()


async def node_field(http: aiohttp.ClientSession, url: str, node: str, key: str) -> Any:
    return (await admin_state(http, url))["nodes"][node][key]


async def readyz(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with http.get(url + "/readyz") as r:
        return r.status, await r.json()


async def gauge(http: aiohttp.ClientSession, url: str, sample: str, **labels: str) -> float | None:
    async with http.get(url + "/metrics", headers=ADMIN) as r:
        assert r.status == 200
        text = await r.text()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


async def gen(http: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None) -> tuple[int, str | None]:
    async with http.post(url + "/gen/generate", json=body or {}, headers=auth()) as r:
        await r.read()
        return r.status, r.headers.get("X-KiloLine-Node")


async def wait_field(http: aiohttp.ClientSession, url: str, node: str, key: str, value: Any,
                     timeout: float = 10) -> None:
    async def check() -> bool:
        return await node_field(http, url, node, key) == value

    await wait_until(check, timeout=timeout, step=0.01)


FAST = {"steps": 1, "step_ms": 1}


# --- active health ---------------------------------------------------------------------------------


async def test_health_503_marks_down_after_fall_and_up_after_rise(fakegpus, gateway, http):
    a = await fakegpus()
    cfg = base_config({"a": a.url})
    cfg["nodes"]["a"]["health"] = {**HEALTH, "fall": 3, "rise": 2}
    gw = await gateway(cfg)
    await wait_until(lambda: a.stats["health_checks"] >= 2, timeout=5)
    st = await admin_state(http, gw.url)
    assert st["nodes"]["a"]["health"] == "up"
    assert isinstance(st["nodes"]["a"]["last_check_ms"], (int, float))
    assert await readyz(http, gw.url) == (200, {"status": "ready", "reasons": []})

    a.set_control(health_status=503)
    c0 = a.stats["health_checks"]
    await wait_field(http, gw.url, "a", "health", "down")
    assert a.stats["health_checks"] - c0 >= 3  # not before `fall` failures
    st = await admin_state(http, gw.url)
    assert "503" in (st["nodes"]["a"]["last_error"] or "")
    assert st["routes"]["gen"]["mode"] == "down"
    assert st["routes"]["gen"]["slots"] == 0
    status, body = await readyz(http, gw.url)
    assert status == 503 and body["status"] == "not_ready"
    assert any("gen" in r for r in body["reasons"]), body
    assert await gauge(http, gw.url, "kiloline_node_up", node="a") == 0
    n_requests = len(a.requests)

    a.set_control(health_status=200)
    c1 = a.stats["health_checks"]
    await wait_field(http, gw.url, "a", "health", "up")
    assert a.stats["health_checks"] - c1 >= 2  # not before `rise` successes
    assert (await readyz(http, gw.url))[0] == 200
    assert await gauge(http, gw.url, "kiloline_node_up", node="a") == 1
    assert (await admin_state(http, gw.url))["routes"]["gen"]["mode"] == "primary"
    # Health checks are not traffic: nothing but /health reached the node meanwhile.
    assert all(r["path"] == "/health" for r in a.requests[n_requests:])
    assert await gen(http, gw.url) == (200, "a")


async def test_health_down_primary_with_standby_keeps_ready_and_fails_over(fakegpus, gateway, http):
    a = await fakegpus()
    b = await fakegpus()
    cfg = base_config({"a": a.url, "b": b.url})
    cfg["nodes"]["a"]["health"] = HEALTH
    gw = await gateway(cfg)
    a.set_control(health_status=503)
    await wait_field(http, gw.url, "a", "health", "down")
    st = await admin_state(http, gw.url)
    assert st["routes"]["gen"]["mode"] == "failover"
    assert st["routes"]["gen"]["active_nodes"] == ["b"]
    assert (await readyz(http, gw.url))[0] == 200
    assert await gen(http, gw.url) == (200, "b")
    assert a.stats["served"] == 0
    a.set_control(health_status=200)
    await wait_field(http, gw.url, "a", "health", "up")
    assert await gen(http, gw.url) == (200, "a")


async def test_hanging_health_endpoint_fails_by_timeout(fakegpus, gateway, http):
    a = await fakegpus()
    cfg = base_config({"a": a.url})
    cfg["nodes"]["a"]["health"] = {**HEALTH, "timeout_sec": 0.2}
    gw = await gateway(cfg)
    await wait_until(lambda: a.stats["health_checks"] >= 1, timeout=5)
    t0 = time.monotonic()
    a.set_control(health_hang=True)
    await wait_field(http, gw.url, "a", "health", "down")
    took = time.monotonic() - t0
    assert took >= 2 * 0.2 * 0.9  # fall × timeout at least: it waited for each check to time out
    last_error = await node_field(http, gw.url, "a", "last_error")
    assert "timed out" in last_error, last_error
    assert (await readyz(http, gw.url))[0] == 503
    a.set_control(health_hang=False)
    await wait_field(http, gw.url, "a", "health", "up")
    assert await gen(http, gw.url) == (200, "a")
    # The timed-out probes were abandoned, not left hanging on the node.
    await wait_until(lambda: a.stats["hanging"] == 0, timeout=5)


async def test_dead_node_detected_by_health_before_any_traffic(fakegpus, gateway, http):
    a = await fakegpus()
    b = await fakegpus()
    cfg = base_config({"a": a.url, "b": b.url})
    cfg["nodes"]["a"]["health"] = HEALTH
    gw = await gateway(cfg)
    await a.kill()
    await wait_field(http, gw.url, "a", "health", "down")
    assert "refused" in (await node_field(http, gw.url, "a", "last_error"))
    # No request was ever sent to the dead node, so nothing needed a re-queue.
    assert await gen(http, gw.url) == (200, "b")
    assert (await gauge(http, gw.url, "kiloline_failovers_total", route="gen") or 0) == 0


# --- the passive breaker -----------------------------------------------------------------------------


async def test_breaker_opens_skips_node_single_trial_doubles_then_closes(fakegpus, gateway, http, caplog):
    caplog.set_level(logging.INFO, logger="kilolined")
    p = 1.0
    a = await fakegpus(steps=1, step_ms=1)
    b = await fakegpus(steps=1, step_ms=1)
    cfg = base_config({"a": a.url, "b": b.url}, max_concurrency=2)
    # No health section: only real traffic moves the breaker.
    cfg["nodes"]["a"]["breaker"] = {**BREAKER, "open_sec": p}
    gw = await gateway(cfg)

    # Three 500s in a row trip it; the 500s themselves pass through to the clients.
    a.set_control(fail_status=500)
    for i in range(3):
        assert await gen(http, gw.url, FAST) == (500, "a")
        if i < 2:
            assert await node_field(http, gw.url, "a", "breaker") == "closed"
    st = await admin_state(http, gw.url)
    assert st["nodes"]["a"]["breaker"] == "open"
    assert st["routes"]["gen"]["mode"] == "failover"
    assert await gauge(http, gw.url, "kiloline_breaker_state", node="a") == 2

    # While open: no traffic reaches the node, the standby serves.
    seen = len(a.requests)
    for _ in range(3):
        assert await gen(http, gw.url, FAST) == (200, "b")
    assert len(a.requests) == seen
    assert await node_field(http, gw.url, "a", "breaker") == "open"

    # Half-open: one trial. It fails → open again, for twice as long.
    await wait_field(http, gw.url, "a", "breaker", "half-open", timeout=10)
    assert await gauge(http, gw.url, "kiloline_breaker_state", node="a") == 1
    t_trial = time.monotonic()
    res = await asyncio.gather(*[gen(http, gw.url, FAST) for _ in range(3)])
    assert len(a.requests) == seen + 1, a.requests[seen:]
    assert Counter(res) == Counter({(500, "a"): 1, (200, "b"): 2})
    assert await node_field(http, gw.url, "a", "breaker") == "open"
    await wait_field(http, gw.url, "a", "breaker", "half-open", timeout=15)
    assert time.monotonic() - t_trial >= 2 * p * 0.95
    opens = [r.getMessage() for r in caplog.records if r.name == "kilolined" and "breaker OPEN" in r.getMessage()]
    assert len(opens) == 2, opens
    assert "retry in 1s" in opens[0] and "retry in 2s" in opens[1], opens

    # Half-open again: exactly one trial while it runs (others go to the standby); success closes.
    a.set_control(fail_status=None)
    seen = len(a.requests)
    slow = {"steps": 10, "step_ms": 50}
    res = await asyncio.gather(*[gen(http, gw.url, slow) for _ in range(3)])
    assert len(a.requests) == seen + 1, a.requests[seen:]
    assert Counter(res) == Counter({(200, "a"): 1, (200, "b"): 2})
    st = await admin_state(http, gw.url)
    assert st["nodes"]["a"]["breaker"] == "closed"
    assert st["routes"]["gen"]["mode"] == "primary"
    assert await gauge(http, gw.url, "kiloline_breaker_state", node="a") == 0
    assert await gen(http, gw.url, FAST) == (200, "a")


async def test_breaker_open_without_standby_requests_wait_then_run_as_the_trial(fakegpus, gateway, http):
    a = await fakegpus(steps=1, step_ms=1)
    cfg = base_config({"a": a.url}, max_concurrency=2, queue_timeout_sec=20)
    cfg["nodes"]["a"]["breaker"] = {**BREAKER, "open_sec": 0.5, "slow_start_sec": 0}
    gw = await gateway(cfg)
    a.set_control(fail_status=500)
    for _ in range(3):
        assert await gen(http, gw.url, FAST) == (500, "a")
    assert await node_field(http, gw.url, "a", "breaker") == "open"
    a.set_control(fail_status=None)
    a.reset()
    seen = len(a.requests)
    # Two requests arrive while it is open: they wait in the queue instead of hitting the node.
    tasks = [asyncio.create_task(gen(http, gw.url, {"steps": 4, "step_ms": 50})) for _ in range(2)]

    async def two_waiting() -> bool:
        return (await admin_state(http, gw.url))["routes"]["gen"]["queue_depth"] == 2

    await wait_until(two_waiting, timeout=5, step=0.01)
    assert len(a.requests) == seen
    # Half-open lets exactly one through; the other runs once the trial succeeded (never both at once,
    # although without slow start the closed breaker would allow 2).
    assert [await t for t in tasks] == [(200, "a")] * 2
    assert a.stats["max_concurrent"] == 1
    assert a.stats["served"] == 2
    assert await node_field(http, gw.url, "a", "breaker") == "closed"


async def test_connection_refused_counts_as_failure_and_requeues(fakegpus, gateway, http):
    """A dead node without health checks: failures on real traffic open the breaker; every
    request still succeeds on the standby (re-queued before any byte)."""
    a = await fakegpus()
    b = await fakegpus()
    cfg = base_config({"a": a.url, "b": b.url}, retry_on_failover=1)
    cfg["nodes"]["a"]["breaker"] = {**BREAKER, "open_sec": 2}
    gw = await gateway(cfg)
    await a.kill()
    for _ in range(5):
        assert await gen(http, gw.url) == (200, "b")
    st = await admin_state(http, gw.url)
    assert st["nodes"]["a"]["breaker"] == "open"
    assert "refused" in (st["nodes"]["a"]["last_error"] or "")
    failovers = await gauge(http, gw.url, "kiloline_failovers_total", route="gen")
    assert failovers == 3  # the three that tripped it; after that none was sent to the dead node


# --- log lines -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("node", ["vast-8410"])
async def test_one_log_line_per_state_change_not_per_check(fakegpus, gateway, http, caplog, node):
    caplog.set_level(logging.INFO, logger="kilolined")
    a = await fakegpus(steps=1, step_ms=1)
    b = await fakegpus(steps=1, step_ms=1)
    cfg = base_config({node: a.url, "b": b.url})
    cfg["nodes"][node].update(label="Vast.ai #8410", health=HEALTH, breaker=BREAKER)
    gw = await gateway(cfg)

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "kilolined" and node in r.getMessage()]

    await wait_until(lambda: a.stats["health_checks"] >= 3, timeout=5)
    assert lines() == []  # passing checks are silent

    a.set_control(health_status=503)
    await wait_field(http, gw.url, node, "health", "down")
    c = a.stats["health_checks"]
    await wait_until(lambda: a.stats["health_checks"] >= c + 5, timeout=10)
    down = [x for x in lines() if "DOWN" in x]
    assert len(down) == 1, lines()
    assert down[0].startswith("✗") and "Vast.ai #8410" in down[0] and "503" in down[0]
    n = len(lines())

    a.set_control(health_status=200)
    await wait_field(http, gw.url, node, "health", "up")
    c = a.stats["health_checks"]
    await wait_until(lambda: a.stats["health_checks"] >= c + 5, timeout=10)
    up = [x for x in lines()[n:] if "UP" in x]
    assert len(up) == 1 and up[0].startswith("✓"), lines()[n:]
    n = len(lines())
    await asyncio.sleep(0.6)
    assert len(lines()) == n, lines()[n:]  # steady state: no line per check

    a.set_control(fail_status=500)
    for _ in range(3):
        assert (await gen(http, gw.url, FAST))[0] == 500
    assert await node_field(http, gw.url, node, "breaker") == "open"
    opened = [x for x in lines()[n:] if "OPEN" in x]
    assert len(opened) == 1 and opened[0].startswith("⚡"), lines()[n:]
    assert "3 failures" in opened[0]
    # Each passive failure is one ✗ line of its own; nothing carries the node's address.
    addr = a.url.split("://", 1)[1]
    assert all(addr not in r.getMessage() for r in caplog.records if r.name.startswith("kilolined"))

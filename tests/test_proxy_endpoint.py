"""The seed-compatible /v1/proxy endpoint: X-Target-Host, ad-hoc queues, X-Concurrency-Slot (SPEC §4.6)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from conftest import ADMIN, auth, base_config, wait_until


async def call(http: Any, method: str, url: str, **kw: Any) -> tuple[int, Any, bytes]:
    async with http.request(method, url, **kw) as r:
        return r.status, r.headers, await r.read()


def check_error(st: int, h: Any, body: bytes, status: int, type_: str) -> None:
    assert st == status, body[:300]
    err = json.loads(body)["error"]
    assert err["type"] == type_ and err["message"] and err["request_id"] == h["X-Request-Id"]


def inflight(gw: Any) -> int:
    return sum(gw.rt.scheduler.node_inflight.values())


async def test_configured_node_target_joins_its_route_queue(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=10)
    gw = await gateway(base_config({"a": g.url}, max_concurrency=1))
    # hold gen's only slot
    holder = asyncio.create_task(call(http, "POST", gw.url + "/gen/generate", json={"steps": 1, "step_ms": 600},
                                      headers=auth()))
    await wait_until(lambda: inflight(gw) == 1)
    proxied = asyncio.create_task(call(http, "POST", gw.url + "/v1/proxy/generate?q=1", json={"echo": "via-proxy"},
                                       headers={**auth("bob"), "X-Target-Host": g.url}))
    await wait_until(lambda: len(gw.rt.scheduler.routes["gen"].waiting) == 1)
    async with http.get(gw.url + "/admin/state", headers=ADMIN) as r:
        state = await r.json()
    assert state["routes"]["gen"]["queue_depth"] == 1
    assert state["routes"]["gen"]["waiting_by_key"] == {"bob": 1}
    assert not proxied.done()
    st, h, body = await proxied
    assert st == 200 and json.loads(body)["echo"] == "via-proxy"
    assert h["X-KiloLine-Node"] == "a"
    assert (await holder)[0] == 200
    assert g.stats["max_concurrent"] == 1
    seen = [r for r in g.requests if r["query"] == "q=1"]
    assert len(seen) == 1 and seen[0]["path"] == "/generate"


async def test_trailing_slash_target_and_no_tail(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    gw = await gateway(base_config({"a": g.url}))
    st, _, _ = await call(http, "GET", gw.url + "/v1/proxy/health", headers={**auth(), "X-Target-Host": g.url + "/"})
    assert st == 200
    st, _, _ = await call(http, "GET", gw.url + "/v1/proxy", headers={**auth(), "X-Target-Host": g.url})
    assert st == 404  # the node's own 404 for "/"
    assert g.requests[-1]["path"] == "/"


async def test_adhoc_target_gets_its_own_queue_with_slot_count(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=2, step_ms=40, job_vram_gb=1)  # room for many jobs: the gateway must cap them
    other = await fakegpus(steps=1, step_ms=1)
    cfg = base_config({"a": other.url})
    cfg["keys"]["bob"]["adhoc_targets"] = ["http://127.0.0.1:*"]
    gw = await gateway(cfg)
    headers = {**auth("bob"), "X-Target-Host": g.url, "X-Concurrency-Slot": "3"}

    async def one(i: int) -> tuple[int, Any]:
        async with http.post(gw.url + "/v1/proxy/generate", json={"echo": i}, headers=headers) as r:
            return r.status, await r.json()

    res = await asyncio.gather(*[one(i) for i in range(15)])
    assert [s for s, _ in res] == [200] * 15
    assert sorted(b["echo"] for _, b in res) == list(range(15))
    assert g.stats["max_concurrent"] == 3
    assert g.stats["served"] == 15
    assert other.stats["served"] == 0
    assert inflight(gw) == 0


async def test_adhoc_default_slot_is_one(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=2, step_ms=30, job_vram_gb=1)
    other = await fakegpus()
    cfg = base_config({"a": other.url})
    cfg["keys"]["bob"]["adhoc_targets"] = ["http://127.0.0.1:*"]
    gw = await gateway(cfg)
    res = await asyncio.gather(*[call(http, "POST", gw.url + "/v1/proxy/generate", json={},
                                      headers={**auth("bob"), "X-Target-Host": g.url}) for _ in range(6)])
    assert [r[0] for r in res] == [200] * 6
    assert g.stats["max_concurrent"] == 1


async def test_target_not_allowed_is_403(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    stranger = await fakegpus(steps=1, step_ms=1)
    cfg = base_config({"a": g.url})
    cfg["keys"]["bob"]["adhoc_targets"] = ["http://10.9.9.*"]
    cfg["routes"]["other"] = {"path": "/other", "nodes": ["a"]}
    cfg["keys"]["carol"]["routes"] = ["other"]
    gw = await gateway(cfg)
    url = gw.url + "/v1/proxy/generate"
    # alice has no adhoc_targets at all
    st, h, body = await call(http, "POST", url, json={}, headers={**auth(), "X-Target-Host": stranger.url})
    check_error(st, h, body, 403, "forbidden")
    # bob's glob does not match
    st, h, body = await call(http, "POST", url, json={}, headers={**auth("bob"), "X-Target-Host": stranger.url})
    check_error(st, h, body, 403, "forbidden")
    # a configured node, but picked through a route the key may not use
    st, h, body = await call(http, "POST", url, json={},
                             headers={**auth("carol"), "X-Target-Host": g.url, "X-KiloLine-Route": "gen"})
    check_error(st, h, body, 403, "forbidden")
    # no key
    st, h, body = await call(http, "POST", url, json={}, headers={"X-Target-Host": g.url})
    check_error(st, h, body, 401, "unauthorized")
    assert stranger.stats["served"] == 0 and not stranger.requests
    assert g.stats["served"] == 0


async def test_route_picked_by_header_when_several_own_the_node(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=10)
    cfg = base_config({"a": g.url}, max_concurrency=1)
    cfg["routes"]["other"] = {"path": "/other", "nodes": ["a"], "max_concurrency": 1}
    gw = await gateway(cfg)
    holder = asyncio.create_task(call(http, "POST", gw.url + "/other/generate", json={"steps": 1, "step_ms": 500},
                                      headers=auth()))
    await wait_until(lambda: inflight(gw) == 1)
    t = asyncio.create_task(call(http, "POST", gw.url + "/v1/proxy/generate", json={},
                                 headers={**auth(), "X-Target-Host": g.url, "X-KiloLine-Route": "other"}))
    await wait_until(lambda: len(gw.rt.scheduler.routes["other"].waiting) == 1)
    assert len(gw.rt.scheduler.routes["gen"].waiting) == 0
    assert (await t)[0] == 200 and (await holder)[0] == 200


async def test_control_headers_are_not_forwarded(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1, job_vram_gb=1)
    other = await fakegpus()
    cfg = base_config({"a": other.url})
    cfg["keys"]["bob"]["adhoc_targets"] = ["http://127.0.0.1:*"]
    gw = await gateway(cfg)
    st, _, _ = await call(http, "POST", gw.url + "/v1/proxy/generate?kl_mode=sync&x=1", json={},
                          headers={**auth("bob"), "X-Target-Host": g.url, "X-Concurrency-Slot": "2",
                                   "X-KiloLine-Route": "gen", "X-KiloLine-Whatever": "1", "X-Keep": "yes"})
    assert st == 200
    seen = g.requests[-1]
    up = seen["headers"]
    assert "x-target-host" not in up and "x-concurrency-slot" not in up
    assert not [k for k in up if k.startswith("x-kiloline-")]
    assert "authorization" not in up
    assert up["x-keep"] == "yes"
    assert up["host"] == f"127.0.0.1:{g.port}"
    assert seen["path"] == "/generate" and seen["query"] == "x=1"


@pytest.mark.parametrize("slot", ["abc", "0", "9", "-1", "1.5", ""])
async def test_bad_slot_value_is_400(fakegpus, gateway, http, slot: str) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    other = await fakegpus()
    cfg = base_config({"a": other.url})
    cfg["keys"]["bob"]["adhoc_targets"] = ["http://127.0.0.1:*"]
    gw = await gateway(cfg)
    st, h, body = await call(http, "POST", gw.url + "/v1/proxy/generate", json={},
                             headers={**auth("bob"), "X-Target-Host": g.url, "X-Concurrency-Slot": slot})
    check_error(st, h, body, 400, "bad_request")
    assert g.stats["served"] == 0


@pytest.mark.parametrize("target", ["", "127.0.0.1:80", "ftp://127.0.0.1:21", "http://a b", "http://x/path?q"])
async def test_bad_target_is_rejected(fakegpus, gateway, http, target: str) -> None:
    g = await fakegpus()
    cfg = base_config({"a": g.url})
    cfg["keys"]["bob"]["adhoc_targets"] = ["*"]
    gw = await gateway(cfg)
    headers = {**auth("bob")}
    if target:
        headers["X-Target-Host"] = target
    st, _, body = await call(http, "GET", gw.url + "/v1/proxy/health", headers=headers)
    assert st in (400, 403), body
    assert json.loads(body)["error"]["type"] in ("bad_request", "forbidden")


async def test_query_is_forwarded_verbatim(fakegpus, gateway, http) -> None:
    from urllib.parse import parse_qs

    from yarl import URL

    g = await fakegpus(steps=1, step_ms=1)
    gw = await gateway(base_config({"a": g.url}))
    async with http.get(URL(gw.url + "/v1/proxy/health?q=a%26b%3Dc&r=x%20y", encoded=True),
                        headers={**auth(), "X-Target-Host": g.url}) as r:
        assert r.status == 200
    assert parse_qs(g.requests[-1]["query"]) == {"q": ["a&b=c"], "r": ["x y"]}


async def test_budget_applies_through_the_proxy_endpoint(fakegpus, gateway, http) -> None:
    """SPEC §3: every proxied request goes through rate limit / budget; /v1/proxy is no way around them."""
    g = await fakegpus(steps=1, step_ms=1)
    adhoc = await fakegpus(steps=1, step_ms=1)
    cfg = base_config({"a": g.url})
    cfg["keys"]["alice"]["budget"] = {"requests_per_day": 1}
    cfg["keys"]["alice"]["adhoc_targets"] = ["http://127.0.0.1:*"]
    gw = await gateway(cfg)
    st, _, _ = await call(http, "POST", gw.url + "/gen/generate", json={}, headers=auth())
    assert st == 200
    for target in (g.url, adhoc.url):
        st, h, body = await call(http, "POST", gw.url + "/v1/proxy/generate", json={},
                                 headers={**auth(), "X-Target-Host": target})
        check_error(st, h, body, 429, "budget_exhausted")
    assert g.stats["served"] == 1 and adhoc.stats["served"] == 0


async def test_route_rate_limit_applies_through_the_proxy_endpoint(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1)
    gw = await gateway(base_config({"a": g.url}, rate={"per_minute": 60, "burst": 1}))
    st, h, _ = await call(http, "POST", gw.url + "/gen/generate", json={}, headers=auth())
    assert st == 200 and h["RateLimit-Remaining"] == "0"
    st, h, body = await call(http, "POST", gw.url + "/v1/proxy/generate", json={},
                             headers={**auth(), "X-Target-Host": g.url})
    check_error(st, h, body, 429, "rate_limited")
    assert "RateLimit-Limit" in h and int(h["Retry-After"]) >= 1
    assert g.stats["served"] == 1

"""The self-healing fleet end to end (docs/FLEET.md): the real daemon over loopback against the
fake Vast.ai market (``kilolined fakegpu --provider vastai``, in process), whose instances are
fakegpu cards it starts itself and can reclaim on demand.

Each test is one row of docs/FLEET.md's failure table.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from conftest import ADMIN, auth, base_config, wait_until
from fakes import FakeTelegram
from fleet_market import API_KEY, WAIT, fleet_config, live, pool, serving

from kilolined.core.config import FleetOfferConfig, FleetTemplateConfig
from kilolined.fleet.decide import MAX_BACKOFF_SEC
from kilolined.fleet.vastai import VastAI
from kilolined.ops.reload import reload_from_file


def events(gw: Any, event: str) -> float:
    return float(gw.rt.metrics.fleet_events.labels(event).value)


class Load:
    """Steady requests on a route from a few clients; every answer is kept."""

    def __init__(self, http: aiohttp.ClientSession, url: str, clients: int = 3):
        self.statuses: list[int] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._client(http, url)) for _ in range(clients)]

    async def _client(self, http: aiohttp.ClientSession, url: str) -> None:
        while not self._stop.is_set():
            async with http.post(url, json={}, headers=auth()) as r:
                await r.read()
                self.statuses.append(r.status)

    async def stop(self) -> list[int]:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.statuses


async def test_reclaimed_node_is_replaced_and_no_request_is_lost(fakegpus: Any, gateway: Any, market: Any,
                                                                  http: aiohttp.ClientSession) -> None:
    fp = await market()
    static = await fakegpus()
    gw = await gateway(fleet_config(static.url, fp, {"p": pool()}))
    await wait_until(lambda: len(serving(gw)) == 2, timeout=WAIT)
    load = Load(http, gw.url + "/pool/generate")
    await wait_until(lambda: len(load.statuses) >= 6, timeout=WAIT)
    victim = live(fp)[0]
    async with http.post(f"{fp.url}/_fake/reclaim/{victim.id}") as r:
        assert r.status == 200
    lost_name = f"p-{victim.id}"
    await wait_until(lambda: events(gw, "fleet_node_lost") == 1, timeout=WAIT)
    await wait_until(lambda: len(serving(gw)) == 2 and lost_name not in gw.rt.pool_nodes, timeout=WAIT)
    served_before = len(load.statuses)
    await wait_until(lambda: len(load.statuses) >= served_before + 6, timeout=WAIT)
    statuses = await load.stop()
    assert set(statuses) == {200}, statuses  # nothing lost: the reclaimed node's work was re-queued
    assert len(fp.instances) == 3 and len(live(fp)) == 2  # one replacement, and the lost one destroyed
    assert fp.instances[victim.id].status == "destroyed"
    new = [i for i in live(fp) if i.id not in {victim.id}]
    assert all(i.offer.machine_id != victim.offer.machine_id for i in new)  # not the machine just lost
    assert fp.spend_per_hour() <= 2.0
    assert (events(gw, "fleet_node_rented"), events(gw, "fleet_node_ready")) == (3, 3)
    async with http.get(gw.url + "/admin/state", headers=ADMIN) as r:
        state = await r.json()
    name = next(n for n in gw.rt.pool_nodes)
    node = state["nodes"][name]
    assert node["provider"] == "vast" and node["pool"] == "p" and node["price_per_hour"] > 0
    assert name == f"p-{node['instance_id']}" and node["label"] == f"Vast {node['instance_id']}"
    assert state["fleet"]["pools"]["p"]["serving"] == 2 and state["fleet"]["spend_per_hour"] <= 2.0
    assert "static" in state["nodes"] and state["routes"]["gen"]["nodes"] == ["static"]


async def test_gateway_restarted_mid_rent_rents_no_second_instance(fakegpus: Any, gateway: Any, market: Any) -> None:
    fp = await market(boot_sec=2.0)  # the restart lands while the instances boot
    static = await fakegpus()
    cfg = fleet_config(static.url, fp, {"p": pool()})
    first = await gateway(copy.deepcopy(cfg))
    await wait_until(lambda: len(fp.instances) == 2, timeout=WAIT)
    assert all(i.status == "loading" for i in fp.instances.values())
    await first.server.shutdown()
    second = await gateway(copy.deepcopy(cfg))
    await wait_until(lambda: len(serving(second)) == 2, timeout=WAIT)
    assert len(fp.instances) == 2, "the restarted gateway rented again"
    assert {f"p-{i}" for i in fp.instances} == set(second.rt.pool_nodes)
    assert events(second, "fleet_node_rented") == 0


async def test_provider_down_backs_off_alerts_and_static_nodes_serve(fakegpus: Any, gateway: Any, market: Any,
                                                                     http: aiohttp.ClientSession,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    fp = await market()
    static = await fakegpus()
    tg = await FakeTelegram().start()
    cfg = fleet_config(static.url, fp, {"p": pool(size=1)})
    cfg["notify"] = {"telegram": {"bot_token": "T", "chat_id": "1", "api_base": tg.url}, "group_sec": 0.1,
                     "min_interval_sec": 0}
    gw = await gateway(cfg)
    await wait_until(lambda: len(serving(gw)) == 1, timeout=WAIT)
    async with http.post(f"{fp.url}/_fake/fail", json={"status": 503, "count": None, "op": "search"}) as r:
        assert r.status == 200
    async with http.post(f"{fp.url}/_fake/reclaim/{live(fp)[0].id}") as r:
        assert r.status == 200
    await wait_until(lambda: events(gw, "fleet_rent_failed") >= 3, timeout=WAIT)
    view = gw.rt.fleet_view()
    assert view["pools"]["p"]["failures"] >= 3 and view["pools"]["p"]["serving"] == 0
    # The operator is told, on a real channel: the loss, then the failed rents.
    await wait_until(lambda: any("rent failed" in m["text"] for m in tg.messages), timeout=WAIT)
    assert any("reclaimed by vast" in m["text"] for m in tg.messages)
    assert all(API_KEY not in m["text"] for m in tg.messages)
    for _ in range(3):  # the static route is not touched by the pool's trouble
        async with http.post(gw.url + "/gen/generate", json={}, headers=auth()) as r:
            assert r.status == 200
    assert gw.rt.scheduler.nodes["static"].healthy
    async with http.delete(f"{fp.url}/_fake/fail") as r:
        assert r.status == 200
    await wait_until(lambda: len(serving(gw)) == 1, timeout=WAIT)
    assert gw.rt.fleet_view()["pools"]["p"]["failures"] == 0
    # The key is in no log line, state or metric.
    async with http.get(gw.url + "/admin/state", headers=ADMIN) as r:
        assert API_KEY not in await r.text()
    async with http.get(gw.url + "/metrics", headers=ADMIN) as r:
        text = await r.text()
        assert "kiloline_fleet_spend_per_hour" in text and API_KEY not in text
    assert API_KEY not in caplog.text and "reclaimed by vast" in caplog.text
    assert API_KEY not in repr(gw.rt.cfg) and API_KEY not in str(gw.rt.cfg.model_dump())
    await tg.stop()


async def test_spend_cap_is_never_passed(fakegpus: Any, gateway: Any, market: Any,
                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    fp = await market()
    static = await fakegpus()
    # Bids on the fitting 4090s are 0.25-0.28 $/h: after the first (0.25) a cap of 0.5 leaves 0.25,
    # under every other offer.
    gw = await gateway(fleet_config(static.url, fp, {"p": pool(size=3)}, cap=0.5))
    await wait_until(lambda: events(gw, "fleet_rent_failed") >= 2, timeout=WAIT)
    assert fp.spend_per_hour() <= 0.5
    assert gw.rt.fleet_view()["spend_per_hour"] <= 0.5
    assert len(live(fp)) < 3
    assert "what max_spend_per_hour 0.5 leaves" in caplog.text  # the alert names the cap


async def test_reload_resizes_and_a_removed_pool_destroys_only_its_own(fakegpus: Any, gateway: Any,
                                                                        market: Any) -> None:
    fp = await market()
    static = await fakegpus()
    cfg = fleet_config(static.url, fp, {"p": pool(size=1), "q": pool(size=1, route="other")})
    gw = await gateway(copy.deepcopy(cfg))
    await wait_until(lambda: len(serving(gw, "p")) == 1 and len(serving(gw, "q")) == 1, timeout=WAIT)
    # An instance the gateway did not rent, on the same account.
    vast = VastAI(API_KEY, fp.url)
    try:
        offer_cfg = FleetOfferConfig(gpu_name="RTX 3090", max_dph=1.0)
        offers = await vast.search(offer_cfg, frozenset(), 1.0)
        foreign = await vast.create(offers[0], offer_cfg, FleetTemplateConfig(image="x", port=8080), "mine")
    finally:
        await vast.close()
    q_ids = {i.id for i in live(fp, "kiloline:q")}
    del cfg["fleet"]["pools"]["q"]
    del cfg["routes"]["other"]
    cfg["fleet"]["pools"]["p"]["size"] = 2
    gw.write_config(cfg)
    assert await reload_from_file(gw.rt, "test") == []
    await wait_until(lambda: len(serving(gw, "p")) == 2 and not live(fp, "kiloline:q"), timeout=WAIT)
    assert all(fp.instances[i].status == "destroyed" for i in q_ids)
    assert fp.instances[foreign].status != "destroyed"  # not the gateway's: never touched
    assert gw.rt.scheduler.nodes["static"].healthy and not gw.rt.scheduler.nodes["static"].retired


async def test_runpod_pool_replaces_a_reclaimed_pod(fakegpus: Any, gateway: Any, market: Any,
                                                    http: aiohttp.ClientSession) -> None:
    fp = await market(runpod=True)
    static = await fakegpus()
    cfg = fleet_config(static.url, fp, {"p": pool(size=1)})
    cfg["fleet"]["providers"]["vast"]["kind"] = "runpod"  # the provider entry's name stays "vast"
    gw = await gateway(cfg)
    await wait_until(lambda: len(serving(gw)) == 1, timeout=WAIT)
    first = live(fp)[0]
    async with http.post(f"{fp.url}/_fake/reclaim/{first.id}") as r:
        assert r.status == 200
    await wait_until(lambda: len(serving(gw)) == 1 and f"p-{first.id}" not in gw.rt.pool_nodes, timeout=WAIT)
    async with http.post(gw.url + "/pool/generate", json={}, headers=auth()) as r:
        assert r.status == 200 and r.headers["X-KiloLine-Node"] == next(iter(gw.rt.pool_nodes))
    assert len(fp.instances) == 2 and fp.instances[first.id].status == "destroyed"
    assert events(gw, "fleet_node_lost") == 1


async def test_boot_timeout_destroys_backs_off_and_a_later_rent_serves(fakegpus: Any, gateway: Any, market: Any,
                                                                       http: aiohttp.ClientSession) -> None:
    fp = await market(boot_sec=600.0)  # the first instance never gets healthy in time
    static = await fakegpus()
    p = pool(size=1)
    p["boot_timeout_sec"] = 2
    gw = await gateway(fleet_config(static.url, fp, {"p": p}))
    await wait_until(lambda: len(fp.instances) == 1, timeout=WAIT)
    slow = next(iter(fp.instances))
    await wait_until(lambda: events(gw, "fleet_rent_failed") >= 1, timeout=WAIT)
    async with http.post(f"{fp.url}/_fake/control", json={"boot_sec": 0.2}) as r:
        assert r.status == 200  # later instances boot fast: the pool must fill after its backoff
    await wait_until(lambda: len(serving(gw)) == 1, timeout=WAIT)
    assert fp.instances[slow].status == "destroyed"
    assert f"p-{slow}" not in gw.rt.pool_nodes
    async with http.post(gw.url + "/pool/generate", json={}, headers=auth()) as r:
        assert r.status == 200
    # Nothing orphaned: every instance the market still bills is a node the gateway routes to.
    async with http.get(f"{fp.url}/_fake/instances") as r:
        rows = (await r.json())["instances"]
    assert {f"p-{i['id']}" for i in rows if i["status"] != "destroyed"} == set(gw.rt.pool_nodes)
    assert events(gw, "fleet_node_ready") == 1 and gw.rt.fleet_view()["pools"]["p"]["failures"] == 0


async def test_a_shrink_drains_the_node_before_destroying_it(fakegpus: Any, gateway: Any, market: Any,
                                                             http: aiohttp.ClientSession) -> None:
    fp = await market()
    static = await fakegpus()
    cfg = fleet_config(static.url, fp, {"p": pool(size=2)})
    cfg["routes"]["pool"]["max_concurrency"] = 4
    gw = await gateway(copy.deepcopy(cfg))
    await wait_until(lambda: len(serving(gw)) == 2, timeout=WAIT)
    done: list[tuple[str, float]] = []  # (the node that answered, when)

    async def long_request() -> None:
        body = {"steps": 30, "step_ms": 100}  # ~3 s: the shrink lands while it runs
        async with http.post(gw.url + "/pool/generate", json=body, headers=auth()) as r:
            await r.read()
            assert r.status == 200
            done.append((r.headers["X-KiloLine-Node"], time.time()))

    running = [asyncio.ensure_future(long_request()) for _ in range(4)]
    inflight = gw.rt.scheduler.node_inflight
    await wait_until(lambda: all(inflight.get(n, 0) > 0 for n in gw.rt.pool_nodes), timeout=WAIT)
    started_on = {n: inflight[n] for n in gw.rt.pool_nodes}
    cfg["fleet"]["pools"]["p"]["size"] = 1
    gw.write_config(cfg)
    assert await reload_from_file(gw.rt, "test") == []
    nodes = gw.rt.scheduler.nodes
    await wait_until(lambda: gw.rt.fleet_view().get("draining") == 1 or len(gw.rt.pool_nodes) < 2, timeout=WAIT)
    victim = next(n for n in started_on if n not in gw.rt.pool_nodes or nodes[n].drained)
    survivor = next(n for n in started_on if n != victim)
    phases = {i["node"]: i["phase"] for i in gw.rt.fleet_view()["instances"]}
    assert phases == {victim: "draining", survivor: "serving"}
    async with http.post(gw.url + "/pool/generate", json={}, headers=auth()) as r:
        assert r.status == 200 and r.headers["X-KiloLine-Node"] == survivor  # no new lease on the drained node
    await asyncio.gather(*running)
    # Each request finished where it started: the drained node's work was not re-queued.
    assert {n: sum(1 for d, _ in done if d == n) for n in started_on} == started_on
    await wait_until(lambda: victim not in gw.rt.pool_nodes and len(live(fp)) == 1, timeout=WAIT)
    gone = fp.instances[victim.removeprefix("p-")]
    assert gone.status == "destroyed" and gone.ended_at is not None
    assert gone.ended_at >= max(t for d, t in done if d == victim)  # destroyed after its work ended
    assert serving(gw) == [survivor] and events(gw, "fleet_rent_failed") == 0


async def test_network_loss_and_flapping_rent_and_destroy_nothing(fakegpus: Any, gateway: Any, market: Any,
                                                                  http: aiohttp.ClientSession) -> None:
    fp = await market()
    static = await fakegpus()
    gw = await gateway(fleet_config(static.url, fp, {"p": pool(size=1)}))
    await wait_until(lambda: len(serving(gw)) == 1, timeout=WAIT)
    inst = live(fp)[0]
    name = f"p-{inst.id}"
    tracked = gw.server.fleet.instances[f"vast/{inst.id}"]
    for _ in range(2):  # down twice: a flapping network, the provider saying running each time
        async with http.post(f"{fp.url}/_fake/partition/{inst.id}") as r:
            assert r.status == 200
        await wait_until(lambda: not gw.rt.scheduler.nodes[name].healthy, timeout=WAIT)
        await wait_until(lambda: tracked.provider_running is True, timeout=WAIT)  # the provider was asked
        async with http.post(f"{fp.url}/_fake/heal/{inst.id}") as r:
            assert r.status == 200
        await wait_until(lambda: serving(gw) == [name], timeout=WAIT)
    assert len(fp.instances) == 1 and fp.instances[inst.id].status == "running"
    assert (events(gw, "fleet_node_lost"), events(gw, "fleet_node_rented")) == (0, 1)
    async with http.post(gw.url + "/pool/generate", json={}, headers=auth()) as r:
        assert r.status == 200 and r.headers["X-KiloLine-Node"] == name


async def test_a_429_retry_after_is_waited_out(fakegpus: Any, gateway: Any, market: Any,
                                               http: aiohttp.ClientSession) -> None:
    fp = await market()
    static = await fakegpus()
    async with http.post(f"{fp.url}/_fake/fail", json={"status": 429, "count": 1, "retry_after": 120,
                                                       "op": "search"}) as r:
        assert r.status == 200
    gw = await gateway(fleet_config(static.url, fp, {"p": pool(size=1)}))
    await wait_until(lambda: events(gw, "fleet_rent_failed") == 1, timeout=WAIT)
    view = gw.rt.fleet_view()["pools"]["p"]
    # backoff_base_sec is 0.2 s: only the provider's Retry-After explains a wait this long
    assert view["failures"] == 1 and view["retry_in_sec"] > 60
    assert not fp.instances and events(gw, "fleet_node_rented") == 0


async def test_a_retry_after_past_the_backoff_ceiling_waits_the_ceiling(fakegpus: Any, gateway: Any, market: Any,
                                                                        http: aiohttp.ClientSession) -> None:
    fp = await market()
    static = await fakegpus()
    async with http.post(f"{fp.url}/_fake/fail", json={"status": 429, "count": 1, "retry_after": 1e12,
                                                       "op": "search"}) as r:
        assert r.status == 200
    gw = await gateway(fleet_config(static.url, fp, {"p": pool(size=1)}))
    await wait_until(lambda: events(gw, "fleet_rent_failed") == 1, timeout=WAIT)
    view = gw.rt.fleet_view()["pools"]["p"]
    assert view["failures"] == 1 and 60 < view["retry_in_sec"] <= MAX_BACKOFF_SEC  # an hour, not 31,000 years


async def test_a_shrink_as_an_instance_turns_healthy_destroys_it_without_error(fakegpus: Any, gateway: Any,
                                                                               market: Any) -> None:
    """The tick is driven by hand so that the shrink and the first healthy probe fall in one round."""
    fp = await market(boot_sec=0.3)
    static = await fakegpus()
    cfg = fleet_config(static.url, fp, {"p": pool(size=1)})
    gw = await gateway(copy.deepcopy(cfg))
    fleet = gw.server.fleet
    await wait_until(lambda: bool(fleet.instances), timeout=WAIT)  # rented, booting
    assert fleet._task is not None
    fleet._task.cancel()  # from here on, a round runs only when the test says
    with contextlib.suppress(asyncio.CancelledError):
        await fleet._task
    (t,) = fleet.instances.values()
    assert t.phase == "booting"
    await wait_until(lambda: fp.instances[t.instance_id].status == "running", timeout=WAIT)
    cfg["fleet"]["pools"]["p"]["size"] = 0
    gw.write_config(cfg)
    assert await reload_from_file(gw.rt, "test") == []
    await fleet.tick()  # the probe passes (Ready) in the round that finds it surplus (Destroy)
    assert not fleet.instances and not gw.rt.pool_nodes
    await wait_until(lambda: fp.instances[t.instance_id].status == "destroyed", timeout=WAIT)


async def echoing_provider(key_part: str) -> tuple[web.AppRunner, str]:
    """A provider API that refuses every call and quotes the start of the key it was given, as
    some APIs do ("invalid key 'vast-SECRET-key-0123'")."""

    async def refuse(request: web.Request) -> web.Response:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ")
        return web.json_response({"error": "auth_error", "msg": f"invalid api key '{given[:len(key_part)]}'"},
                                 status=401)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def test_a_provider_echoing_part_of_the_key_gets_it_in_no_log_or_alert(
        fakegpus: Any, gateway: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    part = API_KEY[:20]
    runner, url = await echoing_provider(part)
    tg = await FakeTelegram().start()
    try:
        static = await fakegpus()
        cfg = base_config({"static": static.url})
        cfg["routes"]["pool"] = {"path": "/pool", "nodes": []}
        cfg["fleet"] = {"providers": {"vast": {"kind": "vastai", "api_key": API_KEY, "api_base": url}},
                        "pools": {"p": pool(size=1)}, "max_spend_per_hour": 2.0}
        cfg["notify"] = {"telegram": {"bot_token": "T", "chat_id": "1", "api_base": tg.url}, "group_sec": 0.1,
                         "min_interval_sec": 0}
        gw = await gateway(cfg)
        await wait_until(lambda: any("rent failed" in m["text"] for m in tg.messages), timeout=WAIT)
        said = caplog.text + "".join(m["text"] for m in tg.messages) + str(gw.rt.fleet_view())
        assert "401" in said and "invalid api key" in said  # the provider's words reach the operator…
        for i in range(len(part) - 8 + 1):
            assert part[i:i + 8] not in said  # …without any 8 characters of the key
    finally:
        await tg.stop()
        await runner.cleanup()

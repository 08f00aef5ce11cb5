"""A pool that follows the queue, end to end (docs/FLEET.md "Scaling"): the real daemon over
loopback against the fake Vast.ai market, which stops and resumes instances as Vast does.

At zero a request waits (SSE ``queue_status`` with ``waiting_for_node`` and the pool's measured
boot or resume time) and the fleet rents; an idle instance is stopped, not destroyed, and the next
request resumes it rather than renting; a restart finds the stopped instance again; a spot entry
with no offer falls back to the on-demand entry without waiting out its backoff.
"""

from __future__ import annotations

import copy
from typing import Any

import aiohttp
import orjson
import pytest
from conftest import auth, wait_until
from fleet_vast import SPOT, scaling_config

from kilolined.fakegpu.provider import FakeProvider

WAIT = 30  # generous: a loaded 2-core box


def events(gw: Any, event: str) -> float:
    return float(gw.rt.metrics.fleet_events.labels(event).value)


def statuses(fp: FakeProvider) -> list[str]:
    return [i.status for i in fp.instances.values()]


async def sse_request(http: aiohttp.ClientSession, url: str) -> list[tuple[str, dict[str, Any]]]:
    """One request in sse mode, read to its end: (event, data) pairs."""
    out: list[tuple[str, dict[str, Any]]] = []
    async with http.post(url, json={}, headers={**auth(), "X-KiloLine-Mode": "sse"}) as r:
        assert r.status == 200
        name = "message"
        async for raw in r.content:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                out.append((name, orjson.loads(line[5:])))
    return out


def waiting_for_node(evs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [d for e, d in evs if e == "queue_status" and d["waiting_for_node"]]


async def test_scale_from_zero_stop_when_idle_and_resume_before_renting(
        fakegpus: Any, gateway: Any, vast: FakeProvider, http: aiohttp.ClientSession) -> None:
    static = await fakegpus()
    cfg = scaling_config(static.url, vast)
    gw = await gateway(copy.deepcopy(cfg))
    fleet = gw.server.fleet
    await wait_until(lambda: "vast" in fleet.listed, timeout=WAIT)
    assert vast.instances == {}  # min 0: nothing is rented before a request asks
    # At zero the request waits for a node, told so, and is served once one is rented and healthy.
    first = await sse_request(http, gw.url + "/pool/generate")
    assert [e for e, _ in first][-1] == "output_ready" and first[-1][1]["http_status"] == 200
    assert waiting_for_node(first), first
    assert len(vast.instances) == 1 and events(gw, "fleet_node_rented") == 1
    iid = next(iter(vast.instances))
    # Idle for idle_stop_sec: stopped (its disk kept), off the route, and no longer billed.
    await wait_until(lambda: events(gw, "fleet_node_stopped") == 1, timeout=WAIT)
    assert statuses(vast) == ["stopped"] and not gw.rt.pool_nodes
    view = gw.rt.fleet_view()
    assert [(i["state"], i["billed"]) for i in view["instances"]] == [("stopped", False)]
    assert view["spend_per_hour"] == 0 and vast.spend_per_hour() == 0
    boot = view["pools"]["p"]["measured_boot_sec"]
    assert boot >= vast.boot_sec
    # The next request resumes that instance instead of renting: the same id, one rent in all,
    # and its wait is announced from the pool's measured boot time (nothing resumed yet).
    second = await sse_request(http, gw.url + "/pool/generate")
    assert second[-1][0] == "output_ready"
    told = waiting_for_node(second)
    assert told and told[0]["est_wait_sec"] == pytest.approx(boot, abs=0.1)
    assert list(vast.instances) == [iid] and events(gw, "fleet_node_rented") == 1
    assert events(gw, "fleet_node_resumed") == 1
    await wait_until(lambda: gw.rt.fleet_view()["pools"]["p"]["measured_resume_sec"] is not None, timeout=WAIT)
    # A restart while it is stopped finds it again by its label and resumes it, renting nothing.
    await wait_until(lambda: events(gw, "fleet_node_stopped") == 2, timeout=WAIT)
    await gw.server.shutdown()
    again = await gateway(copy.deepcopy(cfg))
    await wait_until(lambda: "vast" in again.server.fleet.listed, timeout=WAIT)
    assert [i["state"] for i in again.rt.fleet_view()["instances"]] == ["stopped"]
    async with http.post(again.url + "/pool/generate", json={}, headers=auth()) as r:
        assert r.status == 200 and r.headers["X-KiloLine-Node"] == f"p-{iid}"
    assert list(vast.instances) == [iid] and events(again, "fleet_node_rented") == 0
    # Scaling to zero is the pool's choice, not an outage: no route_down was alerted.
    assert not [e for e in again.rt.feed.recent if e["kind"] == "route_down"]
    assert not [e for e in gw.rt.feed.recent if e["kind"] == "route_down"]


async def test_a_spot_entry_with_no_offer_falls_back_to_on_demand_within_one_backoff(
        fakegpus: Any, gateway: Any, vast: FakeProvider, http: aiohttp.ClientSession) -> None:
    static = await fakegpus()
    # No 4090 takes a bid of 0.1 $/h: the spot entry has no offer. Its backoff (600 s) is far
    # longer than this test may wait, so only the next entry, tried at once, can serve.
    cheap_spot = {**SPOT, "max_dph": 0.1}
    on_demand = {**SPOT, "interruptible": False}
    gw = await gateway(scaling_config(static.url, vast, min=1, max=1, backoff_base_sec=600,
                                      offers=[cheap_spot, on_demand]))
    await wait_until(lambda: len(gw.rt.pool_nodes) == 1, timeout=WAIT)
    inst = next(iter(vast.instances.values()))
    assert inst.interruptible is False and inst.price == 0.40  # the on-demand price of the cheapest 4090
    assert events(gw, "fleet_rent_failed") == 1
    async with http.post(gw.url + "/pool/generate", json={}, headers=auth()) as r:
        assert r.status == 200


async def test_an_instance_whose_stop_fails_is_destroyed_not_left_paying(
        fakegpus: Any, gateway: Any, vast: FakeProvider, http: aiohttp.ClientSession) -> None:
    static = await fakegpus()
    vast.boot_sec = 0.3
    gw = await gateway(scaling_config(static.url, vast))
    async with http.post(f"{vast.url}/_fake/fail", json={"status": 500, "count": None, "op": "stop"}) as r:
        assert r.status == 200
    async with http.post(gw.url + "/pool/generate", json={}, headers=auth()) as r:
        assert r.status == 200
    await wait_until(lambda: statuses(vast) == ["destroyed"], timeout=WAIT)
    assert vast.failed_calls["stop"] == 1 and vast.spend_per_hour() == 0
    assert not gw.rt.pool_nodes and gw.rt.fleet_view()["instances"] == []

"""/v1/proxy ad-hoc targets are bounded (docs/SECURITY.md "Ad-hoc targets"): a route only for an
admitted request, idle ones dropped with all they hold, caps per key and in total, and one key's
X-Concurrency-Slot never changes another key's queue."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from conftest import auth, base_config, wait_until


def adhoc_routes(gw: Any) -> list[str]:
    return [n for n in gw.rt.scheduler.routes if n.startswith("adhoc:")]


def adhoc_nodes(gw: Any) -> list[str]:
    return [n for n in gw.rt.scheduler.nodes if n.startswith("adhoc:")]


@contextmanager
def closed_ports(n: int) -> Iterator[list[int]]:
    """Loopback ports nothing listens on, held for the block: bound but never listening, so a
    connect is refused at once and no other test's server can take the port meanwhile (under
    load, a port bound then closed was taken by another worker's fake GPU: a 200 instead of 502)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        yield [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


async def proxy(http: Any, gw: Any, who: str, target: str, slots: int | None = None, **body: Any
                ) -> tuple[int, Any, dict[str, Any]]:
    headers = {**auth(who), "X-Target-Host": target}
    if slots is not None:
        headers["X-Concurrency-Slot"] = str(slots)
    async with http.post(gw.url + "/v1/proxy/generate", json=body, headers=headers) as r:
        return r.status, r.headers, json.loads(await r.read() or b"{}")


def adhoc_config(other_url: str) -> dict[str, Any]:
    cfg = base_config({"a": other_url})
    for k in ("alice", "bob", "carol"):
        cfg["keys"][k]["adhoc_targets"] = ["http://127.0.0.1:*", "http://localhost:*"]
    return cfg


async def in_batches(coros: list[Any], size: int = 50) -> list[Any]:
    out = []
    for i in range(0, len(coros), size):
        out += await asyncio.gather(*coros[i:i + size])
    return out


async def test_refused_targets_make_no_route(fakegpus, gateway, http) -> None:
    other = await fakegpus()
    cfg = adhoc_config(other.url)
    cfg["keys"]["bob"]["rate"] = {"per_minute": 1, "burst": 1}
    gw = await gateway(cfg)
    g = await fakegpus(steps=1, step_ms=1)
    st, _, _ = await proxy(http, gw, "bob", g.url)
    assert st == 200
    res = await in_batches([proxy(http, gw, "bob", f"http://127.0.0.1:{p}") for p in range(20000, 22000)])
    assert {r[0] for r in res} == {429}
    assert {r[2]["error"]["type"] for r in res} == {"rate_limited"}
    # only the admitted request made a route (and its node); 2,000 refusals made nothing
    assert len(adhoc_routes(gw)) == 1 and len(adhoc_nodes(gw)) == 1
    # a malformed or forbidden one neither
    st, _, body = await proxy(http, gw, "alice", "http://127.0.0.1:1/x")
    assert st == 400 and body["error"]["type"] == "bad_request"
    st, _, body = await proxy(http, gw, "alice", g.url, slots=9)
    assert st == 400 and body["error"]["type"] == "bad_request"
    assert len(adhoc_routes(gw)) == 1


async def test_served_targets_stay_bounded_by_the_per_key_cap(fakegpus, gateway, http) -> None:
    other = await fakegpus()
    gw = await gateway(adhoc_config(other.url))
    per_key = gw.rt.adhoc.per_key
    # Batches of per_key: each refused target is re-queued once and waits out its node's recovery
    # before its 502, so the batches run one after another; a batch never exceeds the cap.
    with closed_ports(per_key * 3) as ports:
        res = await in_batches([proxy(http, gw, "carol", f"http://127.0.0.1:{p}") for p in ports],
                               size=per_key)
    # every one was admitted and tried (nothing listens there): 502, none refused by a cap
    assert {r[0] for r in res} == {502}
    assert len(adhoc_routes(gw)) <= per_key
    assert len(adhoc_nodes(gw)) <= per_key
    assert len([n for n in gw.rt.pools if n.startswith("adhoc:")]) <= per_key
    assert gw.rt.adhoc.by_key["carol"] == len(adhoc_routes(gw))


async def test_idle_targets_are_dropped_with_all_they_hold(fakegpus, gateway, http) -> None:
    other = await fakegpus()
    gw = await gateway(adhoc_config(other.url))
    gw.rt.adhoc.idle_sec = 0.3
    g = await fakegpus(steps=5, step_ms=100, job_vram_gb=1)
    # one running and one queued behind it (1 slot): neither route nor node may go while they live
    tasks = [asyncio.create_task(proxy(http, gw, "bob", g.url)) for _ in range(2)]
    await wait_until(lambda: g.stats["served"] + len(g._running) >= 1 and len(adhoc_routes(gw)) == 1)
    name = adhoc_routes(gw)[0]
    node = adhoc_nodes(gw)[0]
    while not all(t.done() for t in tasks):
        assert name in gw.rt.scheduler.routes and node in gw.rt.scheduler.nodes
        await asyncio.sleep(0.02)
    assert [(await t)[0] for t in tasks] == [200, 200]
    assert g.stats["max_concurrent"] == 1
    assert node in gw.rt.pools  # the keep-alive pool to the target, until the target is dropped
    await wait_until(lambda: not adhoc_routes(gw) and not adhoc_nodes(gw))
    assert node not in gw.rt.pools and node not in gw.rt.sessions
    assert len(gw.rt.adhoc) == 0 and not gw.rt.adhoc.by_key
    # and the target works again afterwards, on a new route
    assert (await proxy(http, gw, "bob", g.url))[0] == 200


async def test_caps_refuse_only_when_every_route_is_busy(fakegpus, gateway, http) -> None:
    other = await fakegpus()
    gw = await gateway(adhoc_config(other.url))
    gw.rt.adhoc.per_key, gw.rt.adhoc.total = 2, 3
    g = await fakegpus(steps=4, step_ms=150, job_vram_gb=1)
    t1, t2 = f"http://127.0.0.1:{g.port}", f"http://localhost:{g.port}"
    busy = [asyncio.create_task(proxy(http, gw, "bob", t)) for t in (t1, t2)]
    await wait_until(lambda: len(adhoc_routes(gw)) == 2)
    with closed_ports(2) as ports:
        # bob's own cap: his two routes are busy
        st, h, body = await proxy(http, gw, "bob", f"http://127.0.0.1:{ports[0]}")
        assert st == 429 and body["error"]["type"] == "queue_full" and int(h["Retry-After"]) >= 1
        assert len(adhoc_routes(gw)) == 2
        # alice is not bound by bob's cap; her route, busy, fills the gateway's cap of 3
        busy.append(asyncio.create_task(proxy(http, gw, "alice", t1)))
        await wait_until(lambda: len(adhoc_routes(gw)) == 3)
        st, h, body = await proxy(http, gw, "carol", f"http://127.0.0.1:{ports[1]}")
        assert st == 503 and body["error"]["type"] == "queue_full" and int(h["Retry-After"]) >= 1
        assert [(await t)[0] for t in busy] == [200, 200, 200]
        # once idle, the least recently used route makes room: a new target is taken, the caps hold
        st, _, _ = await proxy(http, gw, "carol", t1)
        assert st == 200
        assert len(adhoc_routes(gw)) == 3
        st, _, _ = await proxy(http, gw, "bob", f"http://127.0.0.1:{g.port}/")
        assert st == 200
        assert gw.rt.adhoc.by_key["bob"] <= 2 and len(adhoc_routes(gw)) <= 3


async def test_one_keys_concurrency_slot_cannot_change_anothers(fakegpus, gateway, http) -> None:
    other = await fakegpus()
    gw = await gateway(adhoc_config(other.url))
    g = await fakegpus(steps=4, step_ms=100, job_vram_gb=1)
    bobs = [asyncio.create_task(proxy(http, gw, "bob", g.url, slots=1)) for _ in range(4)]
    await wait_until(lambda: len(g._running) == 1 and sum(gw.rt.scheduler.depth(gw.rt.scheduler.routes[n])
                                                          for n in adhoc_routes(gw)) == 3)
    # alice asks the same target for 8 slots: her own queue gets 8, bob's keeps 1
    alices = [asyncio.create_task(proxy(http, gw, "alice", g.url, slots=8)) for _ in range(2)]
    res = await asyncio.gather(*bobs, *alices)
    assert [r[0] for r in res] == [200] * 6
    # at most bob's one slot plus alice's two requests ran at once
    assert g.stats["max_concurrent"] <= 3

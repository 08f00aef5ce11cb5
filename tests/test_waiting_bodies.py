"""The bodies of waiting requests are bounded in bytes, per key across every route and in total
(server.max_queued_body_mb_per_key / max_queued_body_mb): past them a request that would wait is
refused (429 / 503 queue_full) instead of parking its body; one with a free slot goes through."""

from __future__ import annotations

import asyncio
from typing import Any

from conftest import auth, base_config, wait_until

from kilolined.ops import views
from kilolined.scheduling.bodies import MB, WaitingBodies
from kilolined.scheduling.queue import Ticket

KIB = 1024
BODY = b'{"pad": "' + b"x" * (300 * KIB) + b'"}'  # 300 KiB


async def test_waiting_bodies_are_bounded_per_key_and_in_total(fakegpus, gateway, http) -> None:
    a, b = await fakegpus(), await fakegpus()
    cfg = base_config({"a": a.url}, max_concurrency=1, max_queued_per_key=100)
    cfg["nodes"]["b"] = {"url": b.url}
    cfg["routes"]["two"] = {**cfg["routes"]["gen"], "path": "/two", "nodes": ["b"], "standby": []}
    # 512 KiB per key, 800 KiB in all: one 300 KiB body waits per key, two in all.
    cfg["server"].update(max_queued_body_mb_per_key=0.5, max_queued_body_mb=800 / 1024)
    gw = await gateway(cfg)
    a.set_control(hang=True)
    b.set_control(hang=True)

    async def post(route: str, who: str) -> tuple[int, Any]:
        async with http.post(f"{gw.url}/{route}/generate", data=BODY,
                             headers={**auth(who), "Content-Type": "application/json"}) as r:
            return r.status, await r.json()

    def depth(route: str) -> int:
        return int(views.state(gw.rt)["routes"][route]["queue_depth"])

    # A free slot: straight through, never counted (both nodes now hold one request each).
    running = [asyncio.create_task(post("gen", "alice")), asyncio.create_task(post("two", "bob"))]
    await wait_until(lambda: a.stats["hanging"] == 1 and b.stats["hanging"] == 1)
    assert gw.rt.scheduler.bodies.total == 0
    waiting = [asyncio.create_task(post("gen", "alice"))]
    await wait_until(lambda: depth("gen") == 1)
    # alice's second waiting body, on another route: over her 512 KiB.
    status, body = await post("two", "alice")
    assert status == 429 and body["error"]["type"] == "queue_full", body
    assert "max_queued_body_mb_per_key" in body["error"]["message"]
    waiting.append(asyncio.create_task(post("two", "bob")))
    await wait_until(lambda: depth("two") == 1)
    assert gw.rt.scheduler.bodies.total == 2 * len(BODY)
    # carol has nothing waiting, but the gateway holds 600 KiB of 800.
    status, body = await post("gen", "carol")
    assert status == 503 and body["error"]["type"] == "queue_full", body
    assert "max_queued_body_mb" in body["error"]["message"] and int(body["error"]["retry_after_sec"]) >= 1
    # The waiting leave (their clients go): what they held is given back.
    for t in waiting:
        t.cancel()
    await wait_until(lambda: depth("gen") == 0 and depth("two") == 0)
    assert gw.rt.scheduler.bodies.total == 0 and not gw.rt.scheduler.bodies.by_key
    waiting = [asyncio.create_task(post("gen", "carol"))]
    await wait_until(lambda: depth("gen") == 1)
    assert gw.rt.scheduler.bodies.by_key == {"carol": len(BODY)}
    # Served: leased, it no longer counts as waiting.
    a.set_control(hang=False)
    running[0].cancel()
    assert (await waiting[0])[0] == 200
    assert gw.rt.scheduler.bodies.total == 0
    running[1].cancel()


def test_a_body_alone_larger_than_a_bound_may_still_wait_when_nothing_else_does() -> None:
    """The bounds are on memory parked: max_body_mb caps one body, and a key (or the gateway)
    with nothing waiting always queues one, whatever its size; the count is undone once."""
    b = WaitingBodies(total_limit=4 * MB, per_key_limit=1 * MB)
    big = Ticket(1, "r", "alice", 0, 0.0, body=3 * MB)
    assert b.refusal("alice", big.body) is None
    b.hold(big)
    b.hold(big)  # once, however often
    assert b.refusal("alice", 1)[0] == 429  # type: ignore[index]
    assert b.refusal("bob", 1 * MB) is None and b.refusal("bob", 1 * MB + 1)[0] == 503  # type: ignore[index]
    b.release(big)
    b.release(big)
    assert b.total == 0 and not b.by_key and b.refusal("alice", 5 * MB) is None

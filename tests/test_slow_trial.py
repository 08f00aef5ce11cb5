"""A trial does not forget (SPEC §14): a node still slow when its eject period ends is out again
after ``evaluations`` of its requests, for twice as long — not after a fresh ``samples`` requests
at full share. A real gateway over three simulated GPUs (one ``--slowdown``), over loopback."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from conftest import auth, base_config, wait_until

from kilolined.scheduling.speed import MS_REQUEST, client_model

SLOW = {"samples": 12, "evaluations": 2, "min_gap_ms": 1}
BREAKER = {"consecutive_failures": 3, "open_sec": 1, "max_open_sec": 60, "slow_start_sec": 0}
JOB = {"steps": 5, "step_ms": 10}


async def load(http: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> None:
    while not stop.is_set():
        async with http.post(url + "/gen/generate", json=JOB, headers=auth()) as r:
            await r.read()
            assert r.status == 200


async def test_a_node_still_slow_after_its_trial_is_out_again_within_evaluations_requests(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    a, b, c = await fakegpus(), await fakegpus(), await fakegpus(slowdown=2.5)
    cfg = base_config({"a": a.url, "b": b.url, "c": c.url}, max_concurrency=2)
    cfg["routes"]["gen"].update(nodes=["a", "b", "c"], standby=[])
    for n in "abc":
        cfg["nodes"][n].update(slow=SLOW, breaker=BREAKER)
    gw = await gateway(cfg)
    ns, book = gw.rt.scheduler.nodes["c"], gw.rt.speed.book
    key = ("c", "gen", client_model("", "alice"), MS_REQUEST)
    ejects: list[tuple[int, float]] = []  # c's measured requests and its eject period, at each node_slow
    gw.rt.node_watchers.append(lambda node, ev: ejects.append((book.series[key].count, ns.slow_period))
                               if node == "c" and ev == "node_slow" else None)
    stop = asyncio.Event()
    workers = [asyncio.create_task(load(http, gw.url, stop)) for _ in range(6)]
    try:
        await wait_until(lambda: len(ejects) == 1, timeout=60)
        # its period over, the trial: c serves again (slots back), judged from its first request
        await wait_until(lambda: ns.slow_state == "trial", timeout=10, step=0.005)
        at_trial = book.series[key].count
        await wait_until(lambda: len(ejects) == 2, timeout=30)
    finally:
        stop.set()
        await asyncio.gather(*workers)
    (_, first), (at_second, second) = ejects
    # out again after `evaluations` (2) of its trial's requests, give or take the two its slots
    # had running when the verdict came — far fewer than a fresh `samples` (12)
    assert at_second - at_trial <= SLOW["evaluations"] + 2, (at_trial, ejects)
    assert (first, second) == (1, 2)  # for twice as long

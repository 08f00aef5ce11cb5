"""Affinity end to end (SPEC §13): the real daemon over loopback in front of small llama.cpp-like
servers that keep a prompt cache and report it as llama.cpp does (``timings.cache_n``/``prompt_n``,
``usage.prompt_tokens_details.cached_tokens``), on the JSON answer and on the last SSE chunk."""

from __future__ import annotations

import logging
import time
from typing import Any

import aiohttp
import pytest
from affinity_llamas import DOC_TOKENS, ask, chat, config, metrics, value
from conftest import ADMIN, auth, wait_until


async def admin_state(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/admin/state", headers=ADMIN) as r:
        doc: dict[str, Any] = await r.json()
        return doc


async def test_follow_ups_go_where_the_document_is_and_the_reuse_shows(
        llamas: Any, gateway: Any, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kilolined.access")
    servers = await llamas(3)
    gw = await gateway(config(servers))
    for round_ in range(4):
        for doc in range(3):
            await ask(http, gw.url, chat(doc, f"question {round_}?", stream=round_ % 2 == 1))
    # Every document stayed on one node: each node prefilled it once, then reused it.
    for doc in range(3):
        holders = [s for s in servers if any(d.startswith(f"{doc}: ") for d in s.docs)]
        assert len(holders) == 1, [len(s.docs) for s in servers]
    text = await metrics(http, gw.url)
    assert value(text, "kiloline_affinity_decisions_total", route="gen", outcome="miss") == 3
    assert value(text, "kiloline_affinity_decisions_total", route="gen", outcome="hit") == 9
    cached = sum(value(text, "kiloline_prompt_tokens_total", route="gen", node=f"n{i}", cached="true")
                 for i in range(3))
    computed = sum(value(text, "kiloline_prompt_tokens_total", route="gen", node=f"n{i}", cached="false")
                   for i in range(3))
    assert (cached, computed) == (9 * DOC_TOKENS, 3 * (DOC_TOKENS + 5) + 9 * 5)  # streamed ones counted too
    state = await admin_state(http, gw.url)
    route = state["routes"]["gen"]
    assert route["affinity"] == "prefix"
    assert {n for n, k in route["index_keys"].items() if k > 0} == {f"n{i}" for i, s in enumerate(servers) if s.docs}
    assert route["prompt_tokens"] == {"cached": int(cached), "total": int(cached + computed)}
    lines = [r.getMessage() for r in caplog.records if r.name == "kilolined.access"]
    assert sum(" affinity=miss" in ln and " cached=0" in ln for ln in lines) == 3, lines
    assert sum(" affinity=hit" in ln and f" cached={DOC_TOKENS}" in ln for ln in lines) == 9, lines


async def test_a_node_that_lost_the_prefix_is_a_misprediction_and_its_keys_go(
        llamas: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    servers = await llamas(2)
    gw = await gateway(config(servers))
    await ask(http, gw.url, chat(1, "first?"))
    holder = next(i for i, s in enumerate(servers) if s.docs)
    servers[holder].held.clear()  # its prompt cache was evicted behind the gateway's back
    await ask(http, gw.url, chat(1, "second?"))
    text = await metrics(http, gw.url)
    assert value(text, "kiloline_affinity_mispredictions_total", route="gen", node=f"n{holder}") == 1
    # The document's keys were dropped there: the next request for it is a miss, not a hit.
    await ask(http, gw.url, chat(1, "third?"))
    text = await metrics(http, gw.url)
    assert value(text, "kiloline_affinity_decisions_total", route="gen", outcome="miss") == 2
    assert value(text, "kiloline_affinity_decisions_total", route="gen", outcome="hit") == 1


async def test_a_node_that_goes_down_forgets_its_index(
        llamas: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    servers = await llamas(2)
    cfg = config(servers)
    for n in cfg["nodes"].values():
        n["health"] = {"path": "/health", "interval_sec": 0.1, "timeout_sec": 1, "fall": 1, "rise": 1}
    gw = await gateway(cfg)
    await wait_until(lambda: all(ns.healthy for ns in gw.rt.scheduler.nodes.values()))
    await ask(http, gw.url, chat(1, "q?"))
    holder = next(i for i, s in enumerate(servers) if s.docs)
    assert gw.rt.scheduler.index_keys(f"n{holder}") > 0
    servers[holder].healthy = False
    await wait_until(lambda: gw.rt.scheduler.index_keys(f"n{holder}") == 0)
    assert not gw.rt.scheduler.nodes[f"n{holder}"].healthy


async def test_a_node_whose_breaker_opens_forgets_its_index(
        llamas: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    servers = await llamas(2)
    cfg = config(servers)
    for n in cfg["nodes"].values():
        n["breaker"] = {"consecutive_failures": 1, "open_sec": 60}
    gw = await gateway(cfg)
    await ask(http, gw.url, chat(1, "q?"))
    holder = next(i for i, s in enumerate(servers) if s.docs)
    assert gw.rt.scheduler.index_keys(f"n{holder}") > 0
    servers[holder].failing = True
    async with http.post(gw.url + "/v1/chat/completions", json=chat(1, "again?"), headers=auth()) as r:
        assert r.status == 500  # the node's own answer, passed on; and a failure for its breaker
    assert gw.rt.scheduler.nodes[f"n{holder}"].breaker == "open"
    assert gw.rt.scheduler.index_keys(f"n{holder}") == 0


async def test_a_node_whose_process_restarted_forgets_its_index(
        llamas: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    servers = await llamas(2)
    cfg = config(servers)
    for n in cfg["nodes"].values():
        n["health"] = {"path": "/health", "interval_sec": 0.1, "timeout_sec": 1}
    gw = await gateway(cfg)
    sched = gw.rt.scheduler
    await wait_until(lambda: all(ns.started is not None for ns in sched.nodes.values()))
    await ask(http, gw.url, chat(1, "q?"))
    holder = next(i for i, s in enumerate(servers) if s.docs)
    assert sched.index_keys(f"n{holder}") > 0
    await ask(http, gw.url, chat(1, "q2?"))
    assert sched.index_keys(f"n{holder}") > 0  # the same process: its uptime keeps growing
    servers[holder].started = time.time()  # restarted between two checks: never seen down
    await wait_until(lambda: sched.index_keys(f"n{holder}") == 0)
    assert sched.nodes[f"n{holder}"].healthy


async def test_session_affinity_sticks_by_header_or_user(
        llamas: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    servers = await llamas(3)
    gw = await gateway(config(servers, affinity="session"))
    for doc in range(4):  # different prompts, one session: one node
        await ask(http, gw.url, chat(doc, "q?"), **{"X-Session-Id": "s-1"})
    assert sorted(len(s.docs) for s in servers) == [0, 0, 4]
    for doc in range(4):
        await ask(http, gw.url, {**chat(doc, "q?"), "user": "u-9"})
    assert max(len(s.docs) for s in servers) in (4, 8) and sum(len(s.docs) for s in servers) == 8
    assert sorted(len(s.docs) for s in servers) in ([0, 0, 8], [0, 4, 4])
    text = await metrics(http, gw.url)
    assert value(text, "kiloline_affinity_decisions_total", route="gen", outcome="hit") == 8


async def test_affinity_is_switched_live_on_reload(llamas: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    servers = await llamas(2)
    cfg = config(servers)
    cfg["routes"]["gen"]["affinity"] = "off"
    gw = await gateway(cfg)
    await ask(http, gw.url, chat(1, "q?"))
    assert "kiloline_affinity_decisions_total{" not in await metrics(http, gw.url)
    cfg["routes"]["gen"]["affinity"] = "prefix"
    cfg["routes"]["gen"]["affinity_block_bytes"] = 64
    gw.write_config(cfg)
    async with http.post(gw.url + "/admin/reload", headers=ADMIN) as r:
        assert r.status == 200, await r.text()
    assert (await admin_state(http, gw.url))["routes"]["gen"]["affinity"] == "prefix"
    await ask(http, gw.url, chat(2, "q?"))
    await ask(http, gw.url, chat(2, "again?"))
    text = await metrics(http, gw.url)
    assert value(text, "kiloline_affinity_decisions_total", route="gen", outcome="hit") == 1

"""A stalled stream (no byte for ``slow.stall_sec``) in every client mode: the node is out at
once (breaker open, ``node_slow`` state "stalled"), the request ends, its slot is freed — unless
it is the last node of its route that can take work (a stall obeys the caps of a slow verdict)."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import ADMIN, auth, base_config, wait_until

MESSAGES = [{"role": "user", "content": "say something please"}]


@pytest.mark.parametrize("mode", ["sync", "sse", "async"])
async def test_a_stream_that_stalls_ejects_its_node_and_frees_the_slot(fakegpus, gateway, http, mode) -> None:
    fake, spare = await fakegpus("openai", step_ms=20), await fakegpus("openai", step_ms=20)
    # no retry: a stall, even before the first byte (which would re-queue), ends the request;
    # the standby can take work, so o is not the route's last node
    cfg = base_config({"o": fake.url, "spare": spare.url}, kind="openai", path="/v1", max_concurrency=1,
                      retry_on_failover=0)
    for n in ("o", "spare"):
        cfg["nodes"][n].update(slow={"stall_sec": 0.4},
                               breaker={"consecutive_failures": 3, "open_sec": 30, "slow_start_sec": 0})
    gw = await gateway(cfg)
    body = {"model": "fake-llm", "messages": MESSAGES, "stream": True, "max_tokens": 8}
    fake.set_control(drip_ms=1500)  # each piece of the answer comes 1.5 s after the last
    headers: dict[str, Any] = {**auth(), **({} if mode == "sync" else {"X-KiloLine-Mode": mode})}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
        # sync: nothing went out before the stall, so the client gets a clean 502
        assert r.status == {"sync": 502, "sse": 200, "async": 202}[mode]
        if mode != "async":
            text = await r.text()
    if mode == "sync":
        assert "stalled" in text and "upstream_error" in text, text
    elif mode == "sse":
        assert "event: failed" in text and "stalled" in text, text
    ns = gw.rt.scheduler.nodes["o"]
    await wait_until(lambda: ns.breaker == "open", timeout=10)
    await wait_until(lambda: gw.rt.scheduler.routes["gen"].inflight.get("o", 0) == 0, timeout=10)
    async with http.get(gw.url + "/admin/state", headers=ADMIN) as r:
        st = (await r.json())["nodes"]["o"]
    assert st["breaker"] == "open" and "stalled" in (st["last_error"] or "")
    assert st["speed"]["state"] == "stalled"


async def test_a_stall_on_the_last_node_of_a_route_fails_the_request_but_keeps_the_node(fakegpus, gateway,
                                                                                       http) -> None:
    fake = await fakegpus("openai", step_ms=20)
    cfg = base_config({"o": fake.url}, kind="openai", path="/v1", max_concurrency=1, retry_on_failover=0)
    cfg["nodes"]["o"].update(slow={"stall_sec": 0.4},
                             breaker={"consecutive_failures": 1, "open_sec": 30, "slow_start_sec": 0})
    gw = await gateway(cfg)
    fake.set_control(drip_ms=1500)
    body = {"model": "fake-llm", "messages": MESSAGES, "stream": True, "max_tokens": 8}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
        assert r.status == 502 and "stalled" in await r.text()
    ns = gw.rt.scheduler.nodes["o"]
    # never the last node: no eject, and a stall is no breaker failure either (one would open it here)
    assert ns.breaker == "closed" and ns.slow_state == "ok" and "stalled" in (ns.last_error or "")
    fake.set_control(drip_ms=0)
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
        assert r.status == 200 and (await r.text()).rstrip().endswith("data: [DONE]")

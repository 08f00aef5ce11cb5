"""A stalled stream (no byte for ``slow.stall_sec``) in every client mode: the node is out at
once (breaker open, ``node_slow`` state "stalled"), the request ends, its slot is freed."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import ADMIN, auth, base_config, wait_until

MESSAGES = [{"role": "user", "content": "say something please"}]


@pytest.mark.parametrize("mode", ["sync", "sse", "async"])
async def test_a_stream_that_stalls_ejects_its_node_and_frees_the_slot(fakegpus, gateway, http, mode) -> None:
    fake = await fakegpus("openai", step_ms=20)
    # no retry: a stall, even before the first byte (which would re-queue), ends the request
    cfg = base_config({"o": fake.url}, kind="openai", path="/v1", max_concurrency=1, retry_on_failover=0)
    cfg["nodes"]["o"].update(slow={"stall_sec": 0.4},
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

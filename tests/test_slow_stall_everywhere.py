"""A request that stalls on every node (its first token later than ``stall_sec`` wherever it runs:
a long prefill) is the request's doing, not the nodes' (SPEC §14): after it stalled on two nodes
it fails ``stalled``, and stalls obey the caps of a slow verdict — never more than max(1, 10 %)
of a route's nodes out at once, never the last. Three simulated GPUs over loopback."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from conftest import auth, base_config, wait_until

MESSAGES = [{"role": "user", "content": "a prompt that takes long to read"}]
BREAKER = {"consecutive_failures": 3, "open_sec": 60, "slow_start_sec": 0}


async def ask(http: aiohttp.ClientSession, url: str, mode: str) -> tuple[int, str]:
    body = {"model": "fake-llm", "messages": MESSAGES, "stream": True, "max_tokens": 4}
    headers: dict[str, Any] = {**auth(), **({} if mode == "sync" else {"X-KiloLine-Mode": mode})}
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        return r.status, await r.text()


@pytest.mark.parametrize("mode", ["sync", "sse"])
async def test_a_request_that_stalls_on_every_node_fails_after_two_and_ejects_one(fakegpus, gateway, http,
                                                                                   mode: str) -> None:
    gpus = [await fakegpus("openai", step_ms=20) for _ in range(3)]
    for g in gpus:
        g.set_control(drip_ms=20_000)  # headers at once, the first token 20 s later: on every node
    cfg = base_config({n: g.url for n, g in zip("abc", gpus, strict=True)}, kind="openai", path="/v1",
                      max_concurrency=1, retry_on_failover=2)
    cfg["routes"]["gen"].update(nodes=["a", "b", "c"], standby=[])
    for n in "abc":
        cfg["nodes"][n].update(slow={"stall_sec": 0.4}, breaker=BREAKER)
    gw = await gateway(cfg)
    nodes = gw.rt.scheduler.nodes
    for _ in range(2):  # a second such request finds the cap taken: it ejects nobody
        status, text = await ask(http, gw.url, mode)
        if mode == "sync":  # nothing reached the client before the stalls: a clean 502
            assert status == 502 and "stalled" in text and "upstream_error" in text, text
        else:
            assert status == 200 and "event: rerouted" in text and "event: failed" in text, text
            assert "stalled" in text.split("event: failed", 1)[1], text
        stalled_on = [n for n in "abc" if "stalled" in (nodes[n].last_error or "")]
        out = [n for n in "abc" if nodes[n].breaker != "closed" or nodes[n].slow_state != "ok"]
        assert len(out) == 1 and out[0] in stalled_on, (out, stalled_on)
        assert nodes[out[0]].slow_state == "stalled"
    assert len(stalled_on) >= 2
    # each request ran on two nodes, left when it stalled there; no third was tried
    await wait_until(lambda: sum(g.stats["aborted"] for g in gpus) >= 4, timeout=10)
    assert sum(g.stats["aborted"] for g in gpus) == 4

"""A stream that stalls before its first byte (headers sent, then silence for ``slow.stall_sec``)
in every client mode: no byte of the answer reached the client, so the request is re-queued to
another node and completes there, while the stalled node's breaker opens."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest
from conftest import auth, base_config, wait_until

MESSAGES = [{"role": "user", "content": "say something please"}]
BREAKER = {"consecutive_failures": 3, "open_sec": 60, "slow_start_sec": 0}


@pytest.mark.parametrize("mode", ["sync", "sse", "async"])
async def test_a_stream_silent_before_its_first_byte_is_requeued(fakegpus: Any, gateway: Any,
                                                                 http: aiohttp.ClientSession, mode: str) -> None:
    stuck = await fakegpus("openai", step_ms=20)
    fine = await fakegpus("openai", step_ms=20)
    stuck.set_control(drip_ms=20_000)  # headers at once, then the first piece 20 s later
    cfg = base_config({"s": stuck.url, "f": fine.url}, kind="openai", path="/v1", max_concurrency=1)
    for n in ("s", "f"):
        cfg["nodes"][n].update(slow={"stall_sec": 0.4}, breaker=BREAKER)
    gw = await gateway(cfg)  # s is the primary, f its standby
    body = {"model": "fake-llm", "messages": MESSAGES, "stream": True, "max_tokens": 4}
    headers: dict[str, Any] = {**auth(), **({} if mode == "sync" else {"X-KiloLine-Mode": mode})}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == (202 if mode == "async" else 200)
        text = await r.text()
    if mode == "sync":
        assert text.rstrip().endswith("data: [DONE]") and "stalled" not in text, text
    elif mode == "sse":
        assert "event: rerouted" in text and "stalled" in text and "event: failed" not in text, text
    else:
        job_id = orjson.loads(text)["job_id"]
        await wait_until(lambda: gw.jobs.jobs[job_id].status in ("completed", "failed"), timeout=20)
        assert gw.jobs.jobs[job_id].status == "completed"
    assert fine.stats["served"] == 1
    ns = gw.rt.scheduler.nodes["s"]
    await wait_until(lambda: ns.breaker == "open", timeout=10)
    assert "stalled" in (ns.last_error or "")

"""A node lost after its answer began, on a route with ``continue_streams: false`` (on, a stream
goes on on another node: test_continuation.py): the request fails (no replay), and what the client is told
names the node and what happened — "node n failed: node lost (…)" — never an exception class or an
address (Failure.mid_response). The node's breaker hears of it once, through the lease scope.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from comfy_client import SSE, inflight
from conftest import base_config, wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True}


async def test_an_sse_job_whose_node_dies_mid_answer_fails_in_words(fakegpus: Any, gateway: Any,
                                                                   http: aiohttp.ClientSession) -> None:
    fake = await fakegpus("openai", steps=40, step_ms=50)
    gw = await gateway(base_config({"n": fake.url}, kind="openai", max_concurrency=1, retry_on_failover=1,
                                   continue_streams=False))
    events: list[tuple[str, dict[str, Any]]] = []
    killed = False
    async with http.post(gw.url + "/gen/v1/chat/completions", json=CHAT, headers=SSE) as r:
        assert r.status == 200
        name = "message"
        async for raw in r.content:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                events.append((name, json.loads(line[5:])))
                if name == "step_progress" and not killed:
                    killed = True  # tokens arrived: the answer has begun, and now the node is lost
                    await fake.kill()
                if name in ("failed", "output_ready"):
                    break
    assert killed, events
    failed = [d for n, d in events if n == "failed"]
    assert failed, events
    message = failed[0]["error"]["message"]
    assert message.startswith("node n failed: node lost"), message
    assert "mid-response" in message, message
    assert "Error" not in message and "127.0.0.1" not in message, message
    # Mid-answer there is no replay: the job was never re-queued.
    assert not [d for n, d in events if n == "rerouted"], events
    await wait_until(lambda: inflight(gw) == 0, timeout=15)
    assert "mid-response" in (gw.rt.scheduler.nodes["n"].last_error or "")

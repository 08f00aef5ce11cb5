"""A prompt whose node is lost and that is not re-queued (no retry left, or no node took it
again) ends on its client's ``/ws`` as ComfyUI ends a prompt that failed: an ``execution_error``
in ComfyUI's shape, the route's ``status``, then ``executing`` with node null — so the web UI
stops showing it running (docs/API.md "ComfyUI over several GPUs"). Sync prompts and jobs alike."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from comfy_client import ASYNC
from comfy_gpus import graph, hear, kinds_of
from conftest import auth, base_config


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_a_lost_prompt_that_runs_nowhere_ends_on_its_socket(fakegpus: Any, gateway: Any,
                                                                  http: aiohttp.ClientSession, mode: str) -> None:
    node = await fakegpus("comfyui", step_ms=50)
    gw = await gateway(base_config({"a": node.url}, kind="comfyui", max_concurrency=1, retry_on_failover=0))
    async with http.ws_connect(gw.url + "/gen/ws?clientId=page", headers=auth()) as ws, \
            http.ws_connect(gw.url + "/gen/ws?clientId=page", headers=auth("bob")) as bobs:
        await ws.receive_json(timeout=5)
        await bobs.receive_json(timeout=5)
        headers = {**auth(), **(ASYNC if mode == "async" else {})}
        async with http.post(gw.url + "/gen/prompt", json={"prompt": graph(40, 1), "client_id": "page"},
                             headers=headers) as r:
            assert r.status in (200, 202), await r.text()
        frames = []
        while not frames or frames[-1][0] != "progress":  # the sampler runs: then the node dies
            got = await ws.receive_json(timeout=10)
            frames.append((got["type"], got["data"]))
        pid = frames[-1][1]["prompt_id"]
        await node.kill()
        frames += await hear(ws, {pid})
        with pytest.raises(TimeoutError):  # another key under the same client id hears nothing of it
            while (await bobs.receive_json(timeout=0.3))["type"] == "status":
                pass
    kinds = kinds_of(frames, pid)
    assert kinds[0] == "execution_start"
    assert kinds[-2:] == ["execution_error", "executing"], kinds
    error = next(d for k, d in frames if k == "execution_error")
    assert set(error) == {"prompt_id", "node_id", "node_type", "executed", "exception_message", "exception_type",
                          "current_inputs", "current_outputs", "timestamp"}
    assert error["node_id"] == "3" and error["node_type"] == "KSampler"  # where it was running
    assert error["exception_message"].startswith("node lost while running the prompt")
    # the route's queue is empty again before the prompt's execution ends, as ComfyUI says it
    after = frames[[k for k, _ in frames].index("execution_error"):]
    assert [k for k, _ in after] == ["execution_error", "status", "executing"]
    assert after[1][1]["status"]["exec_info"]["queue_remaining"] == 0
    assert after[2][1] == {"node": None, "prompt_id": pid}

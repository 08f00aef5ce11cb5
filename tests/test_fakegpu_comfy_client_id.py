"""The simulated ComfyUI targets a prompt's events as ComfyUI 0.19 does (execution.py sets the
server's client_id to whatever the body said, and only None broadcasts): an absent or null
``client_id`` broadcasts the progress; any other value, even ``""``, sends it to that socket
alone, and ``""`` names none. The gateway's stall watch relies on this (docs/CONFIG.md "Slow nodes")."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from comfy_events import drain, graph, kinds
from fakegpu_util import MakeGPU, eventually


@pytest.mark.parametrize(("extra", "broadcast"), [({"client_id": None}, True), ({}, True),
                                                   ({"client_id": ""}, False), ({"client_id": 7}, False)])
async def test_only_a_null_client_id_broadcasts_progress(make_gpu: MakeGPU, http: aiohttp.ClientSession,
                                                         extra: dict[str, Any], broadcast: bool) -> None:
    gpu = await make_gpu("comfyui")
    async with http.ws_connect(gpu.url + "/ws?clientId=watcher") as ws:
        await ws.receive_json()
        async with http.post(gpu.url + "/prompt", json={"prompt": graph(3), **extra}) as r:
            assert r.status == 200
        await eventually(lambda: gpu.stats["served"] == 1)
        found = set(kinds(await drain(ws)))
    assert "status" in found  # queue changes reach every socket
    assert ({"progress", "progress_state"} <= found) is broadcast, found
    assert not found & {"execution_start", "executing", "execution_success"}

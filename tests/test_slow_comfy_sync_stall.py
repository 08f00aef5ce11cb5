"""A sync-mode ComfyUI prompt that stops moving on its node (docs/CONFIG.md "Slow nodes").

The gateway sends every prompt under its own client id, so the node's monitor socket hears its
progress whatever client_id the client gave (the client hears it on the gateway's /ws). Silent
for ``stall_sec`` while the node runs it: the prompt is interrupted there, the breaker opens
(speed state "stalled"), the slot is freed. The client already had its answer (the prompt id): it
sees the interrupt on its socket. While the monitor is down the silence is not judged.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from comfy_client import graph, inflight, sse_job
from conftest import ADMIN, auth, base_config, wait_until

from kilolined.adapters import comfy_control
from kilolined.adapters.comfy_control import comfy_state

BREAKER = {"consecutive_failures": 3, "open_sec": 60, "slow_start_sec": 0}


async def one_node(fakegpus: Any, gateway: Any, stall_sec: float, spare: bool = False,
                   **fake: Any) -> tuple[Any, Any]:
    """Node c, and with ``spare`` a standby that can take work (c is then not the route's last
    node, so a stall ejects it)."""
    node = await fakegpus("comfyui", **fake)
    nodes = {"c": node.url, **({"spare": (await fakegpus("comfyui", step_ms=20)).url} if spare else {})}
    cfg = base_config(nodes, kind="comfyui", max_concurrency=1)
    for n in nodes:
        cfg["nodes"][n].update(slow={"stall_sec": stall_sec}, breaker=BREAKER)
    return node, await gateway(cfg)


async def submit(http: aiohttp.ClientSession, gw: Any, body: dict[str, Any]) -> str:
    async with http.post(gw.url + "/gen/prompt", json=body, headers=auth()) as r:
        assert r.status == 200, await r.text()
        return str((await r.json())["prompt_id"])


async def stalled(http: aiohttp.ClientSession, gw: Any, node: Any) -> None:
    """Interrupted on the node, its slot freed, its breaker open for a stall."""
    await wait_until(lambda: node.stats["interrupts"] == 1 and node.stats["running"] == 0, timeout=15)
    await wait_until(lambda: inflight(gw) == 0, timeout=10)
    async with http.get(gw.url + "/admin/state", headers=ADMIN) as r:
        st = (await r.json())["nodes"]["c"]
    assert st["breaker"] == "open" and "stalled" in (st["last_error"] or ""), st
    assert st["speed"]["state"] == "stalled"
    assert node.stats["max_concurrent"] <= 1


async def test_a_stalled_prompt_is_interrupted_and_its_client_hears_it(fakegpus: Any, gateway: Any,
                                                                       http: aiohttp.ClientSession) -> None:
    # a step of 20 ms × 10,000: the sampler starts, then nothing comes for minutes
    node, gw = await one_node(fakegpus, gateway, 0.5, spare=True, step_ms=20, slowdown=10_000)
    async with http.ws_connect(gw.url + "/gen/ws?clientId=mine", headers=auth()) as ws:
        assert (await ws.receive_json(timeout=5))["data"]["sid"] == "mine"
        pid = await submit(http, gw, {"prompt": graph(3), "client_id": "mine"})
        await stalled(http, gw, node)
        # The client's own socket tells it how its prompt ended.
        while (msg := await ws.receive_json(timeout=10))["type"] != "execution_interrupted":
            pass
        assert msg["data"]["prompt_id"] == pid
    # Nothing kept once the socket and the prompt are gone.
    state = comfy_state(gw.rt)
    await wait_until(lambda: not state.hub.clients, timeout=10)
    assert len(state.activity) == 0


async def test_a_stalled_prompt_without_client_id_is_interrupted(fakegpus: Any, gateway: Any,
                                                                 http: aiohttp.ClientSession) -> None:
    # No client_id: ComfyUI broadcasts the prompt's progress, which the node's monitor socket hears.
    node, gw = await one_node(fakegpus, gateway, 0.5, spare=True, step_ms=20, slowdown=10_000)
    await submit(http, gw, {"prompt": graph(3)})
    await stalled(http, gw, node)
    assert len(comfy_state(gw.rt).activity) == 0


async def test_a_prompt_that_keeps_moving_is_no_stall(fakegpus: Any, gateway: Any,
                                                              http: aiohttp.ClientSession) -> None:
    # 25 steps of 100 ms: it runs well past stall_sec, but a frame comes every step (stall_sec
    # is 10 steps: room for a loaded box).
    node, gw = await one_node(fakegpus, gateway, 1.0, step_ms=100)
    async with http.ws_connect(gw.url + "/gen/ws?clientId=mine", headers=auth()) as ws:
        await ws.receive_json(timeout=5)
        pid = await submit(http, gw, {"prompt": graph(25), "client_id": "mine"})
        while (msg := await ws.receive_json(timeout=15))["type"] != "execution_success":
            pass
        assert msg["data"]["prompt_id"] == pid
    await wait_until(lambda: inflight(gw) == 0, timeout=10)
    assert node.stats["interrupts"] == 0 and gw.rt.scheduler.nodes["c"].breaker == "closed"


@pytest.mark.parametrize("client_id", ["elsewhere", ""])
async def test_a_prompt_for_a_socket_nobody_opened_is_still_watched_and_not_a_stall(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession, client_id: str) -> None:
    # Its client listens nowhere ("" names no socket at all): the node still sends its frames to
    # the gateway's id, so 15 steps of 100 ms are progress, not silence.
    node, gw = await one_node(fakegpus, gateway, 0.3, step_ms=100)
    pid = await submit(http, gw, {"prompt": graph(15), "client_id": client_id})

    async def finished() -> bool:
        async with http.get(f"{gw.url}/gen/history/{pid}", headers=auth()) as r:
            return bool(await r.json())

    await wait_until(finished, timeout=20)
    await wait_until(lambda: inflight(gw) == 0, timeout=10)
    assert node.stats["interrupts"] == 0 and node.stats["served"] == 1
    assert gw.rt.scheduler.nodes["c"].breaker == "closed"


async def test_activity_is_kept_only_while_a_prompt_runs(fakegpus: Any, gateway: Any,
                                                         http: aiohttp.ClientSession) -> None:
    _, gw = await one_node(fakegpus, gateway, 5.0, step_ms=20)
    for _ in range(2):
        events = await sse_job(http, gw.url + "/gen/prompt", {"prompt": graph(3)})
        assert events[-1][0] == "output_ready"
    await wait_until(lambda: inflight(gw) == 0, timeout=10)
    assert len(comfy_state(gw.rt).activity) == 0


def test_node_activity_lives_from_the_first_watcher_to_the_last() -> None:
    act = comfy_control.NodeActivity()
    act.seen("a", 1.0)  # nobody watches a: nothing kept
    assert len(act) == 0 and act.last("a") is None
    act.watch("a", 2.0)
    act.watch("a", 3.0)  # a second prompt there: the node is given stall_sec from now
    act.seen("a", 4.0)
    assert act.last("a") == 4.0
    act.unwatch("a")
    assert act.last("a") == 4.0
    act.unwatch("a")
    assert len(act) == 0 and act.last("a") is None
    act.unwatch("gone")  # an extra unwatch never goes negative
    act.watch("gone", 5.0)
    act.unwatch("gone")
    assert len(act) == 0


async def test_a_socket_without_client_id_is_given_one(fakegpus: Any, gateway: Any,
                                                      http: aiohttp.ClientSession) -> None:
    _, gw = await one_node(fakegpus, gateway, 5.0, step_ms=20)
    state = comfy_state(gw.rt)
    async with http.ws_connect(gw.url + "/gen/ws", headers=auth()) as ws:
        sid = (await ws.receive_json(timeout=5))["data"]["sid"]
        assert len(sid) == 32 and [c.client_id for c in state.hub.clients["gen"]] == [sid]
    await wait_until(lambda: not state.hub.clients, timeout=10)

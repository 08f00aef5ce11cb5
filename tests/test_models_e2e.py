"""Multi-model nodes end to end (docs/CONFIG.md#multi-model-nodes): discovery, 404 for a model no
node serves, warm affinity across two nodes, collation on one node, the swap in the dispatched
event, the metric and the access log, and keep-alive comments while a node swaps. Over loopback
sockets to fake OpenAI servers in their multi-model mode."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest
from conftest import ADMIN, auth, base_config, wait_until

from kilolined.fakegpu import FakeGPU

FAST = {"steps": 2, "step_ms": 5}


def models_config(nodes: dict[str, tuple[str, Any]], **route: Any) -> dict[str, Any]:
    """One openai route /v1 over the nodes (name -> (url, models))."""
    cfg = base_config({n: u for n, (u, _) in nodes.items()})
    for n, (_, models) in nodes.items():
        cfg["nodes"][n]["models"] = models
    cfg["routes"] = {"llm": {"path": "/v1", "kind": "openai", "nodes": list(nodes), "max_concurrency": 1,
                             "queue_timeout_sec": 60, "request_timeout_sec": 60, **route}}
    return cfg


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


async def post(http: aiohttp.ClientSession, gw: Any, body: dict[str, Any],
               **headers: str) -> tuple[int, dict[str, Any], str]:
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers={**auth(), **headers}) as r:
        return r.status, await r.json(), r.headers.get("X-KiloLine-Node", "-")


async def node_state(http: aiohttp.ClientSession, gw: Any, node: str) -> dict[str, Any]:
    async with http.get(gw.url + "/admin/state", headers=ADMIN) as r:
        return (await r.json())["nodes"][node]


async def test_discover_reads_the_nodes_models_and_what_it_holds_loaded(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    gpu: FakeGPU = await fakegpus("openai", models=["a", "b", "c"], **FAST)
    cfg = models_config({"box": (gpu.url, "discover")})
    cfg["nodes"]["box"]["health"] = {"path": "/health", "interval_sec": 0.2}
    gw = await gateway(cfg)

    async def discovered() -> bool:
        st = await node_state(http, gw, "box")
        return st["models"] == ["a", "b", "c"] and st["warm"] == ["a"]

    await wait_until(discovered)
    assert (await node_state(http, gw, "box"))["warm_models"] == 1
    status, body, _ = await post(http, gw, chat("zeta"))
    assert status == 404 and body["error"]["type"] == "model_not_found" and "'zeta'" in body["error"]["message"]
    assert gpu.backend.asked == []  # type: ignore[attr-defined]
    assert (await post(http, gw, chat("b")))[0] == 200
    assert gpu.stats["swaps"] == 1 and (await node_state(http, gw, "box"))["warm"] == ["b"]
    # Someone else makes the node load c, past the gateway: the next GET /running tells it.
    async with http.post(gpu.url + "/v1/chat/completions", json=chat("c")) as r:
        assert r.status == 200

    async def told() -> bool:
        return (await node_state(http, gw, "box"))["warm"] == ["c"]

    await wait_until(told)
    assert (await post(http, gw, chat("b")))[0] == 200
    assert gw.rt.scheduler.swaps["box"] == 2  # b after c: the gateway knew it was a swap


async def test_discover_without_a_health_check_asks_once_at_start(fakegpus: Any, gateway: Any,
                                                                  http: aiohttp.ClientSession) -> None:
    gpu: FakeGPU = await fakegpus("openai", models=["a", "b"], **FAST)
    gw = await gateway(models_config({"box": (gpu.url, "discover")}))
    await wait_until(lambda: gw.rt.scheduler.nodes["box"].models.discovered == ("a", "b"))
    assert (await post(http, gw, chat("c")))[0] == 404


async def test_a_node_a_reload_adds_is_asked_for_its_models(fakegpus: Any, gateway: Any,
                                                            http: aiohttp.ClientSession) -> None:
    """No health check: asked once when it appears, whether at start or by a reload."""
    a: FakeGPU = await fakegpus("openai", models=["a"], **FAST)
    b: FakeGPU = await fakegpus("openai", models=["b", "c"], **FAST)
    gw = await gateway(models_config({"x": (a.url, "discover")}))
    await wait_until(lambda: gw.rt.scheduler.nodes["x"].models.discovered == ("a",))
    assert (await post(http, gw, chat("c")))[0] == 404
    cfg = models_config({"x": (a.url, "discover"), "y": (b.url, "discover")})
    cfg["server"]["listen"] = f"127.0.0.1:{gw.server.port}"
    gw.write_config(cfg)
    async with http.post(f"http://127.0.0.1:{gw.server.port}/admin/reload", headers=ADMIN) as r:
        assert r.status == 200, await r.text()
    await wait_until(lambda: "y" in gw.rt.scheduler.nodes
                     and gw.rt.scheduler.nodes["y"].models.discovered == ("b", "c"))
    assert (await post(http, gw, chat("c")))[0] == 200


async def test_a_model_no_node_lists_is_404_at_admission(fakegpus: Any, gateway: Any,
                                                         http: aiohttp.ClientSession) -> None:
    x: FakeGPU = await fakegpus("openai", models=["a", "b"], **FAST)
    y: FakeGPU = await fakegpus("openai", models=["c"], **FAST)
    gw = await gateway(models_config({"x": (x.url, ["a", "b"]), "y": (y.url, ["c"])}))
    status, body, _ = await post(http, gw, chat("llama3.3:70b"))
    assert status == 404 and body["error"]["type"] == "model_not_found"
    assert "llama3.3:70b" in body["error"]["message"] and "llm" in body["error"]["message"]
    assert x.requests == [] or all(r["path"] != "/v1/chat/completions" for r in x.requests)
    status, _, node = await post(http, gw, chat("c"))
    assert status == 200 and node == "y"  # only y lists c, though x is first


async def test_a_model_warm_on_the_second_node_goes_there(fakegpus: Any, gateway: Any,
                                                          http: aiohttp.ClientSession) -> None:
    # Each fake starts with its first model warm: a on x, b on y (the gateway reads GET /running).
    x: FakeGPU = await fakegpus("openai", models=["a", "b"], swap_ms=300, **FAST)
    y: FakeGPU = await fakegpus("openai", models=["b", "a"], swap_ms=300, **FAST)
    gw = await gateway(models_config({"x": (x.url, ["a", "b"]), "y": (y.url, ["a", "b"])}))
    nodes = gw.rt.scheduler.nodes
    await wait_until(lambda: nodes["x"].models.warm == ["a"] and nodes["y"].models.warm == ["b"])
    for model, where in [("b", "y"), ("a", "x"), ("b", "y"), ("a", "x")]:
        status, _, node = await post(http, gw, chat(model))
        assert (status, node) == (200, where)
    assert x.stats["swaps"] == y.stats["swaps"] == 0
    assert gw.rt.scheduler.swaps.total() == 0


async def test_a_mixed_queue_reaches_a_one_model_node_collated(fakegpus: Any, gateway: Any,
                                                              http: aiohttp.ClientSession) -> None:
    gpu: FakeGPU = await fakegpus("openai", models=["a", "b", "c"], swap_ms=50, steps=4, step_ms=30)
    gw = await gateway(models_config({"box": (gpu.url, ["a", "b", "c"])}, strategy="fifo"))
    rq = gw.rt.scheduler.routes["llm"]
    tasks = []
    for i, model in enumerate("abaacabc"):
        # One at a time, so the queue holds them in this order; the first holds the node meanwhile.
        tasks.append(asyncio.create_task(post(http, gw, chat(model, max_tokens=60 if i == 0 else 2))))
        await wait_until(lambda i=i: len(rq.waiting) == i)
    results = await asyncio.gather(*tasks)
    assert all(status == 200 for status, _, _ in results)
    assert "".join(gpu.backend.asked) == "aaaabbcc"  # type: ignore[attr-defined]
    assert gpu.stats["swaps"] == 2 and gw.rt.scheduler.swaps["box"] == 2


async def test_without_collation_the_same_queue_swaps_six_times(fakegpus: Any, gateway: Any,
                                                                http: aiohttp.ClientSession) -> None:
    gpu: FakeGPU = await fakegpus("openai", models=["a", "b", "c"], swap_ms=50, steps=4, step_ms=30)
    gw = await gateway(models_config({"box": (gpu.url, ["a", "b", "c"])}, strategy="fifo", max_swap_bypass=0))
    rq = gw.rt.scheduler.routes["llm"]
    tasks = []
    for i, model in enumerate("abaacabc"):
        tasks.append(asyncio.create_task(post(http, gw, chat(model, max_tokens=60 if i == 0 else 2))))
        await wait_until(lambda i=i: len(rq.waiting) == i)
    await asyncio.gather(*tasks)
    assert "".join(gpu.backend.asked) == "abaacabc"  # type: ignore[attr-defined]
    assert gpu.stats["swaps"] == 6


@pytest.mark.parametrize("json_log", [False, True])
async def test_a_swap_shows_in_the_event_the_metric_and_the_access_log(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture,
        json_log: bool) -> None:
    gpu: FakeGPU = await fakegpus("openai", models=["a", "b"], swap_ms=20, **FAST)
    gw = await gateway(models_config({"box": (gpu.url, ["a", "b"])}))
    gw.server.gateway.log_json = json_log
    await wait_until(lambda: gw.rt.scheduler.nodes["box"].models.warm == ["a"])
    caplog.set_level(logging.INFO, logger="kilolined.access")
    assert (await post(http, gw, chat("a")))[0] == 200
    assert (await post(http, gw, chat("b")))[0] == 200
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "kilolined.access"]
    if json_log:
        assert [json.loads(line)["swap"] for line in lines] == [False, True]
    else:
        assert [" swap=false" in lines[0], " swap=true" in lines[1]] == [True, True]
    async with http.post(gw.url + "/v1/chat/completions", json=chat("a"),
                         headers={**auth(), "X-KiloLine-Mode": "sse"}) as r:
        assert r.status == 200
        text = ""
        while "event: dispatched" not in text or not text.endswith("\n\n"):
            text += (await r.content.readuntil(b"\n\n")).decode()
        await r.read()  # to the job's end: the sse request's access-log line is written then
    data = text.split("event: dispatched", 1)[1].split("data: ", 1)[1].split("\n", 1)[0]
    assert json.loads(data)["swap"] is True and json.loads(data)["node"] == "box"
    await wait_until(lambda: len([r for r in caplog.records if r.name == "kilolined.access"]) == 3)
    sse_line = [rec.getMessage() for rec in caplog.records if rec.name == "kilolined.access"][2]
    assert (json.loads(sse_line)["swap"] is True) if json_log else (" swap=true" in sse_line), sse_line
    async with http.get(gw.url + "/metrics", headers=ADMIN) as r:
        metrics = await r.text()
    assert 'kiloline_model_swaps_total{node="box"} 2.0' in metrics


async def test_keep_alive_comments_go_on_while_the_node_swaps(fakegpus: Any, gateway: Any,
                                                              http: aiohttp.ClientSession) -> None:
    gpu: FakeGPU = await fakegpus("openai", models=["a", "b"], swap_ms=1500, **FAST)
    cfg = models_config({"box": (gpu.url, ["a", "b"])})
    cfg["server"]["heartbeat_sec"] = 0.2
    gw = await gateway(cfg)
    await wait_until(lambda: gw.rt.scheduler.nodes["box"].models.warm == ["a"])
    async with http.post(gw.url + "/v1/chat/completions", json=chat("b", stream=True), headers=auth()) as r:
        assert r.status == 200
        body = (await r.read()).decode()
    before_data = body.split("data:", 1)[0]
    # 1.5 s of swapping before the node's first byte, one comment every 0.2 s: several, not one.
    assert before_data.count(": waiting for the node") >= 3
    assert "data: [DONE]" in body and gpu.stats["swaps"] == 1


async def test_models_on_a_shared_path_lists_the_declared_models(fakegpus: Any, gateway: Any,
                                                                  http: aiohttp.ClientSession) -> None:
    box: FakeGPU = await fakegpus("openai", models=["a", "b", "secret"], **FAST)
    other: FakeGPU = await fakegpus("openai", models=["z"], **FAST)
    cfg = models_config({"box": (box.url, ["a", "b"]), "other": (other.url, "discover")})
    common = {"path": "/v1", "kind": "openai", "max_concurrency": 1}
    cfg["routes"] = {"coder": {**common, "nodes": ["box"], "match": {"model": ["a", "b"]}},
                     "rest": {**common, "nodes": ["other"]}}
    gw = await gateway(cfg)
    async with http.get(gw.url + "/v1/models", headers=auth()) as r:
        assert r.status == 200
        ids = [m["id"] for m in (await r.json())["data"]]
    assert ids == ["a", "b", "z"]  # box's declared list (not its "secret"), other's own answer

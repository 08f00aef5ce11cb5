"""`GET /health` at the gateway's root (SPEC §19): where vLLM, SGLang, TGI and llama.cpp answer
it, and where clients and benchmarks (guidellm) probe before they start. 200 while some route can
serve, 503 otherwise; no key, like /healthz. /readyz stays stricter: every route."""

from __future__ import annotations

from conftest import ADMIN, base_config


async def health(http, url: str) -> tuple[int, dict]:
    async with http.get(url + "/health") as r:
        assert "X-KiloLine-Node" not in r.headers  # the gateway's answer, not a node's through a route
        return r.status, await r.json()


async def test_health_is_200_while_some_route_can_serve_and_503_when_none_can(fakegpus, gateway, http) -> None:
    a, b = await fakegpus("openai", step_ms=1), await fakegpus("generic", step_ms=1)
    cfg = base_config({"a": a.url}, kind="openai", path="/v1")
    cfg["nodes"]["b"] = {"url": b.url}
    # A route at "/" does not take the gateway's /health to its node.
    cfg["routes"]["other"] = {"path": "/", "nodes": ["b"], "kind": "generic", "queue_timeout_sec": 1}
    gw = await gateway(cfg)
    assert await health(http, gw.url) == (200, {"status": "ok"})
    # guidellm's start (its OpenAI backend's validate()): GET {target}/health with its Bearer key.
    async with http.get(gw.url + "/health", headers={"Authorization": "Bearer any-key-at-all"}) as r:
        assert r.status == 200

    async with http.post(gw.url + "/admin/nodes/a/drain", headers=ADMIN) as r:
        assert r.status == 200
    async with http.get(gw.url + "/readyz") as r:
        assert r.status == 503  # not every route can serve …
    assert (await health(http, gw.url))[0] == 200  # … but one can: a client may start

    async with http.post(gw.url + "/admin/nodes/b/drain", headers=ADMIN) as r:
        assert r.status == 200
    status, body = await health(http, gw.url)
    assert status == 503 and body["status"] == "unavailable"
    assert any("gen" in reason for reason in body["reasons"]) and any("other" in x for x in body["reasons"])

    async with http.post(gw.url + "/admin/nodes/b/undrain", headers=ADMIN) as r:
        assert r.status == 200
    assert await health(http, gw.url) == (200, {"status": "ok"})

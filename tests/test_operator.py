"""The operator's view: /metrics, /admin/state during a burst, `status`, `demo --once`, and the
promise that no payload ever reaches a log line or a file."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import ADMIN, ADMIN_KEY, auth, base_config, wait_until
from prometheus_client.parser import text_string_to_metric_families

from kilolined.ops import views

FAMILIES = {
    # name (as the parser reports it): (type, label names)
    "kiloline_requests": ("counter", {"route", "outcome"}),
    "kiloline_queue_depth": ("gauge", {"route"}),
    "kiloline_inflight": ("gauge", {"route", "node"}),
    "kiloline_slots": ("gauge", {"route", "node"}),
    "kiloline_queue_wait_seconds": ("histogram", {"route"}),
    "kiloline_upstream_seconds": ("histogram", {"route", "node"}),
    "kiloline_ttft_seconds": ("histogram", {"route"}),
    "kiloline_node_up": ("gauge", {"node"}),
    "kiloline_breaker_state": ("gauge", {"node"}),
    "kiloline_rejections": ("counter", {"route", "reason"}),
    "kiloline_failovers": ("counter", {"route"}),
    "kiloline_reloads": ("counter", {"result"}),
    "kiloline_tokens": ("counter", {"route", "key"}),
}


async def test_metrics_parse_and_have_every_family(fakegpus, gateway, http) -> None:
    a = await fakegpus(steps=2, step_ms=30)
    llm = await fakegpus("openai", step_ms=1)
    cfg = base_config({"a": a.url}, max_concurrency=1, max_queue_depth=2)
    cfg["nodes"]["llm"] = {"url": llm.url}
    cfg["routes"]["llm"] = {"path": "/v1", "kind": "openai", "nodes": ["llm"]}
    gw = await gateway(cfg)
    statuses = await asyncio.gather(*[_post(http, gw.url + "/gen/generate", {}) for _ in range(6)])
    assert 429 in statuses and 200 in statuses
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert await _post(http, gw.url + "/v1/chat/completions", body) == 200
    async with http.post(gw.url + "/admin/reload", headers=ADMIN) as r:
        assert r.status == 200
    async with http.get(gw.url + "/metrics") as r:
        assert r.status == 401  # admin key needed unless public_metrics
    async with http.get(gw.url + "/metrics", headers=ADMIN) as r:
        assert r.status == 200
        text = await r.text()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name, (kind, labels) in FAMILIES.items():
        assert name in fams, name
        assert fams[name].type == kind, (name, fams[name].type)
        samples = [s for s in fams[name].samples if not s.name.endswith(("_created", "_bucket"))]
        assert samples, f"{name} has no samples after traffic"
        for s in samples:
            assert set(s.labels) == labels, (name, s.labels)
    outcomes = {s.labels["outcome"] for s in fams["kiloline_requests"].samples if s.name.endswith("_total")}
    assert "ok" in outcomes
    reasons = {s.labels["reason"] for s in fams["kiloline_rejections"].samples if s.name.endswith("_total")}
    assert "queue_full" in reasons


async def _post(http, url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> int:
    async with http.post(url, json=body, headers=headers or auth()) as r:
        await r.read()
        return r.status


async def test_admin_state_matches_a_burst_and_a_failover(fakegpus, gateway, http) -> None:
    a = await fakegpus(steps=10, step_ms=40)
    b = await fakegpus(steps=10, step_ms=40)
    cfg = base_config({"a": a.url, "b": b.url}, max_concurrency=2, max_queue_depth=50)
    for n in ("a", "b"):
        cfg["nodes"][n]["health"] = {"path": "/health", "interval_sec": 0.1, "timeout_sec": 0.3, "fall": 1, "rise": 1}
        cfg["nodes"][n]["label"] = f"GPU {n.upper()}"
    gw = await gateway(cfg)

    async def state() -> dict[str, Any]:
        async with http.get(gw.url + "/admin/state", headers=ADMIN) as r:
            assert r.status == 200
            return await r.json()

    tasks = [asyncio.create_task(_post(http, gw.url + "/gen/generate", {}, auth(k)))
             for k in ("alice", "alice", "alice", "bob", "bob", "carol")]
    await wait_until(lambda: a.stats["running"] == 2)
    st = await state()
    route, node_a = st["routes"]["gen"], st["nodes"]["a"]
    assert route["inflight"] == 2 and route["slots"] == 2 and route["mode"] == "primary"
    assert route["queue_depth"] == 4 == sum(route["waiting_by_key"].values())
    assert set(route["waiting_by_key"]) <= {"alice", "bob", "carol"}
    assert node_a["inflight"] == 2 and node_a["health"] == "up" and node_a["breaker"] == "closed"
    assert node_a["label"] == "GPU A" and st["nodes"]["b"]["inflight"] == 0
    assert st["config"]["version"] == gw.rt.version and st["config"]["last_error"] is None
    await a.kill()
    await wait_until(lambda: views.state(gw.rt)["routes"]["gen"]["mode"] == "failover", timeout=10)
    await wait_until(lambda: views.state(gw.rt)["nodes"]["a"]["health"] == "down", timeout=10)
    st = await state()
    assert st["nodes"]["a"]["health"] == "down" and st["routes"]["gen"]["active_nodes"] == ["b"]
    assert await asyncio.gather(*tasks) == [200] * 6
    st = await state()
    assert st["routes"]["gen"]["inflight"] == 0 and st["routes"]["gen"]["queue_depth"] == 0


async def test_status_cli_prints_the_tables(fakegpus, gateway) -> None:
    a = await fakegpus()
    gw = await gateway(base_config({"a": a.url}))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kilolined", "status", "--url", gw.url, "--admin-key", ADMIN_KEY,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err
    text = out.decode()
    assert "ROUTE" in text and "gen" in text and "NODE" in text and "closed" in text
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kilolined", "status", "--url", gw.url, "--admin-key", "wrong",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = await proc.communicate()
    assert proc.returncode == 1 and b"admin key" in err


async def test_slow_start_shows_in_state_and_status(fakegpus, gateway, http) -> None:
    """After a recovery the node runs below its slots for a while: /admin/state and `status` say
    so and say when it ends (it showed a bare 1/2 before)."""
    a = await fakegpus()
    cfg = base_config({"a": a.url}, max_concurrency=2)
    cfg["nodes"]["a"]["health"] = {"path": "/health", "interval_sec": 0.1, "timeout_sec": 0.3, "fall": 1, "rise": 1}
    cfg["nodes"]["a"]["breaker"] = {"slow_start_sec": 600}
    gw = await gateway(cfg)
    await a.kill()
    await wait_until(lambda: views.state(gw.rt)["nodes"]["a"]["health"] == "down", timeout=10)
    await a.revive()
    await wait_until(lambda: views.state(gw.rt)["nodes"]["a"]["health"] == "up", timeout=10)
    async with http.get(gw.url + "/admin/state", headers=ADMIN) as r:
        node = (await r.json())["nodes"]["a"]
    assert (node["slots"], node["full_slots"], node["ramping"]) == (1, 2, True)
    assert 500 < node["full_in_sec"] <= 600
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kilolined", "status", "--url", gw.url, "--admin-key", ADMIN_KEY,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err
    row = next(line for line in out.decode().splitlines() if line.startswith("a "))
    assert "ramping 1→2, full in " in row and " 0/1 " in row, row


async def test_history_of_a_burst_outlives_it(fakegpus, gateway, http) -> None:
    """The chart's series are kept by the gateway: after the burst, /admin/history and the first
    events of a new /admin/events stream still hold it (a page opened late showed nothing)."""
    a = await fakegpus(steps=10, step_ms=60)
    gw = await gateway(base_config({"a": a.url}, max_concurrency=1))
    burst = [asyncio.create_task(_post(http, gw.url + "/gen/generate", {})) for _ in range(6)]
    await wait_until(lambda: views.state(gw.rt)["routes"]["gen"]["queue_depth"] == 5)
    assert await asyncio.gather(*burst) == [200] * 6
    async with http.get(gw.url + "/admin/history") as r:
        assert r.status == 401
    async with http.get(gw.url + "/admin/history", headers=ADMIN) as r:
        assert r.status == 200
        hist = await r.json()
    assert hist["step_sec"] == 1 and hist["span_sec"] == 600
    gen = hist["routes"]["gen"]
    assert max(q or 0 for q in gen["queue_depth"]) == 5 and max(i or 0 for i in gen["inflight"]) == 1
    assert len(gen["queue_depth"]) == len(gen["inflight"]) <= 600
    async with http.get(gw.url + "/admin/events", headers=ADMIN) as r:
        kind = None
        async for line in r.content:
            if line.startswith(b"event: "):
                kind = line[7:].strip()
            elif line.startswith(b"data: ") and kind == b"history":
                streamed = json.loads(line[6:])
                break
    assert max(q or 0 for q in streamed["routes"]["gen"]["queue_depth"]) == 5


MARKER = "SECRET-PAYLOAD-7f3a9c"


async def test_no_payload_in_logs_or_files(fakegpus, gateway, http, tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    gen = await fakegpus(steps=1, step_ms=5)
    llm = await fakegpus("openai", step_ms=1)
    comfy = await fakegpus("comfyui", steps=2, step_ms=5)
    state_dir = tmp_path / "state"
    cfg = base_config({"a": gen.url})
    cfg["server"]["state_dir"] = str(state_dir)
    cfg["keys"]["alice"]["budget"] = {"requests_per_day": 1000}
    cfg["jobs"] = {"webhook_allow_private": True, "webhook_backoff_sec": [0.05]}
    cfg["nodes"]["llm"] = {"url": llm.url}
    cfg["nodes"]["c"] = {"url": comfy.url}
    cfg["routes"]["llm"] = {"path": "/v1", "kind": "openai", "nodes": ["llm"]}
    cfg["routes"]["comfy"] = {"path": "/comfy", "kind": "comfyui", "nodes": ["c"]}
    gw = await gateway(cfg)
    chat = {"model": "m", "messages": [{"role": "user", "content": MARKER}], "max_tokens": 2}
    prompt = {"prompt": {"1": {"class_type": "CLIPTextEncode", "inputs": {"text": MARKER}},
                         "2": {"class_type": "KSampler", "inputs": {"steps": 2}},
                         "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": MARKER}}}}
    for mode in ("sync", "sse", "async"):
        h = {**auth(), "X-KiloLine-Mode": mode}
        for url, body in ((gw.url + "/gen/generate", {"echo": MARKER}), (gw.url + "/v1/chat/completions", chat),
                          (gw.url + "/comfy/prompt", prompt)):
            async with http.post(url, json=body, headers=h) as r:
                await r.read()
                assert r.status in (200, 202), (url, mode, r.status)
    stream = {**chat, "stream": True}
    async with http.post(gw.url + "/v1/chat/completions", json=stream, headers=auth()) as r:
        await r.read()
    await wait_until(lambda: not gw.jobs.active, timeout=15)
    gw.rt.budgets.save()
    logged = "\n".join(rec.getMessage() for rec in caplog.records)
    assert "access" in {rec.name.split(".")[-1] for rec in caplog.records}  # the access log did run
    assert MARKER not in logged
    written = [p for p in state_dir.rglob("*") if p.is_file()]
    assert written, "state_dir holds the budget counters"
    for p in [*written, gw.path]:
        assert MARKER.encode() not in p.read_bytes(), p

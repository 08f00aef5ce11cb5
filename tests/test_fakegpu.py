"""The simulated GPU's card (VRAM, crashes, knobs) and its generic kind, over real loopback sockets."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fakegpu_util import MakeGPU, eventually, refused, sse_data

from kilolined.fakegpu import BLOB_PATTERN


def test_package_has_no_import_cycle_between_card_and_kinds() -> None:
    """The kinds import the card; the card and base never import a kind or the package."""
    package = Path(__file__).resolve().parent.parent / "kilolined" / "fakegpu"
    for name in ("base.py", "card.py", "comfy_graph.py"):
        tree = ast.parse((package / name).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert not imported & {"kilolined.fakegpu", "kilolined.fakegpu.comfy", "kilolined.fakegpu.openai",
                               "kilolined.fakegpu.generic"}, name


# ----------------------------------------------------------------------------- generic


async def test_generic_job_answers_json_and_counts(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu(steps=3)
    async with http.post(gpu.url + "/generate", json={"echo": {"n": 7}}) as r:
        assert r.status == 200
        assert await r.json() == {"ok": True, "steps": 3, "echo": {"n": 7}, "node": str(gpu.port)}
    async with http.post(gpu.url + "/generate") as r:  # no body at all: the defaults
        assert (await r.json())["steps"] == 3
    async with http.post(gpu.url + "/generate", json={"steps": 1, "step_ms": 1}) as r:
        assert (await r.json())["steps"] == 1
    async with http.post(gpu.url + "/generate", data=b"{not json") as r:
        assert r.status == 400 and "error" in await r.json()
    async with http.get(gpu.url + "/health") as r:
        assert await r.json() == {"status": "ok"}
    async with http.get(gpu.url + "/_fake/stats") as r:
        stats = await r.json()
    assert stats["served"] == 3 and stats["running"] == 0 and stats["max_concurrent"] == 1
    assert stats["oom_count"] == 0 and stats["crashed"] is False and stats["health_checks"] == 1


async def test_generic_stream_writes_one_event_per_step(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu(steps=4)
    async with http.post(gpu.url + "/generate", json={"stream": True}) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = await sse_data(r)
    assert events[-1] == "[DONE]"
    assert [json.loads(e) for e in events[:-1]] == [{"step": i, "total": 4} for i in range(1, 5)]
    assert gpu.stats["served"] == 1


async def test_concurrent_jobs_within_vram_all_served(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu(vram_gb=24, job_vram_gb=4, steps=5, step_ms=20)

    async def one() -> int:
        async with http.post(gpu.url + "/generate") as r:
            return r.status

    assert await asyncio.gather(*(one() for _ in range(5))) == [200] * 5
    assert gpu.stats["max_concurrent"] == 5 and gpu.stats["served"] == 5 and gpu.stats["running"] == 0


async def test_burst_past_vram_fails_every_job_and_crashes(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu(vram_gb=24, job_vram_gb=10, steps=25, step_ms=20, crash_sec=0.4)

    async def one() -> tuple[int, Any]:
        async with http.post(gpu.url + "/generate") as r:
            return r.status, await r.json()

    first = [asyncio.create_task(one()) for _ in range(2)]
    await eventually(lambda: gpu.stats["running"] == 2)
    results = [await one(), *await asyncio.gather(*first)]
    assert [status for status, _ in results] == [500, 500, 500]
    assert all("CUDA out of memory" in body["error"] for _, body in results)
    stats = gpu.stats
    assert stats["oom_count"] == 3 and stats["crashes"] == 1 and stats["crashed"] is True
    assert stats["max_concurrent"] == 2 and stats["running"] == 0 and stats["served"] == 0

    await eventually(lambda: not gpu.up)
    assert await refused(gpu.url)
    await eventually(lambda: gpu.up, timeout=3)
    async with http.get(gpu.url + "/health") as r:
        assert r.status == 200
    assert gpu.stats["crashed"] is False
    async with http.post(gpu.url + "/generate", json={"steps": 1}) as r:
        assert r.status == 200


async def test_client_disconnect_counts_aborted_and_frees_vram(
    make_gpu: MakeGPU, http: aiohttp.ClientSession
) -> None:
    gpu = await make_gpu(steps=100, step_ms=20)
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(gpu.url + "/generate", timeout=aiohttp.ClientTimeout(total=0.15)) as r:
            await r.read()
    await eventually(lambda: gpu.stats["aborted"] == 1)
    assert gpu.stats["running"] == 0 and gpu.stats["served"] == 0 and gpu.vram_used_gb == 0


async def test_kill_resets_connections_and_revive_listens_again(
    make_gpu: MakeGPU, http: aiohttp.ClientSession
) -> None:
    gpu = await make_gpu(steps=100, step_ms=20)
    port = gpu.port
    job = asyncio.create_task(http.post(gpu.url + "/generate"))
    await eventually(lambda: gpu.stats["running"] == 1)
    await gpu.kill()
    with pytest.raises(aiohttp.ClientConnectionError):
        await job
    await eventually(lambda: gpu.stats["killed_jobs"] == 1)
    assert await refused(gpu.url)
    await asyncio.sleep(0.2)
    assert await refused(gpu.url)  # stays down, unlike a crash
    await gpu.revive()
    assert gpu.port == port
    async with http.get(gpu.url + "/health") as r:
        assert r.status == 200


async def test_control_knobs(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu(steps=1)
    control = gpu.url + "/_fake/control"
    async with http.post(control, json={"health_status": 503}) as r:
        assert r.status == 200 and (await r.json())["health_status"] == 503
    async with http.get(gpu.url + "/health") as r:
        assert r.status == 503
    async with http.post(control, json={"health_status": 200, "fail_status": 500}) as r:
        assert r.status == 200
    async with http.post(gpu.url + "/generate") as r:
        assert r.status == 500 and "error" in await r.json()
    assert gpu.stats["rejected"] == 1 and gpu.stats["served"] == 0
    async with http.post(control, json={"fail_status": None, "hang": True}) as r:
        assert r.status == 200
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(gpu.url + "/generate", timeout=aiohttp.ClientTimeout(total=0.2)):
            pass
    await eventually(lambda: gpu.stats["hanging"] == 0)
    async with http.post(control, json={"hang": False, "health_hang": True}) as r:
        assert r.status == 200
    with pytest.raises(asyncio.TimeoutError):
        async with http.get(gpu.url + "/health", timeout=aiohttp.ClientTimeout(total=0.2)):
            pass
    async with http.post(control, json={"health_hang": False, "bogus": 1, "drip_ms": -1}) as r:
        assert r.status == 400  # nothing is applied when any knob is wrong
    assert gpu.knobs.health_hang is True
    gpu.set_control(health_hang=False)
    async with http.post(gpu.url + "/generate") as r:
        assert r.status == 200
    async with http.post(gpu.url + "/_fake/reset") as r:
        stats = await r.json()
    assert stats["served"] == 0 and stats["rejected"] == 0 and stats["max_concurrent"] == 0


async def test_request_log_keeps_method_path_query_headers(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu(steps=1)
    async with http.post(gpu.url + "/generate?a=1&b=two", headers={"X-Probe": "yes"}) as r:
        assert r.status == 200
    async with http.get(gpu.url + "/_fake/stats"):
        pass
    async with http.get(gpu.url + "/_fake/requests") as r:
        seen = await r.json()
    assert len(seen) == 1  # /_fake/* is not logged
    assert seen[0]["method"] == "POST" and seen[0]["path"] == "/generate" and seen[0]["query"] == "a=1&b=two"
    assert seen[0]["headers"]["x-probe"] == "yes" and "host" in seen[0]["headers"]


async def test_blob_streams_the_pattern_and_unknown_paths_404(
    make_gpu: MakeGPU, http: aiohttp.ClientSession
) -> None:
    gpu = await make_gpu()
    size = 200_000
    async with http.get(gpu.url + "/blob", params={"bytes": str(size)}) as r:
        body = await r.read()
        assert r.headers["Content-Length"] == str(size)
    assert len(body) == size
    assert body == (BLOB_PATTERN * 4)[:size]
    async with http.get(gpu.url + "/blob?bytes=lots") as r:
        assert r.status == 400
    async with http.get(gpu.url + "/nope") as r:
        assert r.status == 404 and "error" in await r.json()
    assert gpu.stats["served"] == 0  # a download is not a job


async def test_cli_run_prints_url_and_exits_cleanly_on_sigterm() -> None:
    code = ("import sys; from kilolined.fakegpu import run; sys.exit(run('generic', host='127.0.0.1', port=0, "
            "vram_gb=24, job_vram_gb=10, steps=2, step_ms=5, crash_sec=1))")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        assert proc.stderr is not None
        line = (await asyncio.wait_for(proc.stderr.readline(), 10)).decode()
        assert line.startswith("fakegpu generic listening on http://127.0.0.1:")
        async with aiohttp.ClientSession() as s, s.post(line.split()[-1] + "/generate") as r:
            assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()



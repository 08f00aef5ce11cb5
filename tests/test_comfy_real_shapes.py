"""The shapes the gateway's ComfyUI views and socket depend on, checked against ComfyUI 0.19.3's
own source (the copy in ../shared/real, never fetched): its jobs normalisation run on the fake's
queue and history, its preview frames run through the hub, its routes and preview metadata, its
cache middleware on the fake's page files.

Skipped when the source archive is not beside the repository.
"""

from __future__ import annotations

import ast
import asyncio
import re
import struct
import tarfile
from io import BytesIO
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from comfy_gpus import graph
from conftest import wait_until

from kilolined.adapters.comfy_hub import plain_preview, preview_prompt
from kilolined.core import comfy_jobs
from kilolined.core.page_assets import hashed_asset
from kilolined.fakegpu import comfy_user
from kilolined.fakegpu.comfy_page import LOGO_PATH, SCRIPT, STYLE, add_page_routes

# ../shared beside the repository (a worktree sits one level deeper)
ARCHIVE = next((found for up in Path(__file__).resolve().parents[1:4]
                if (found := up / "shared" / "real" / "comfyui-0.19.3.tar.xz").exists()),
               Path("../shared/real/comfyui-0.19.3.tar.xz"))
WANTED = ("ComfyUI/server.py", "ComfyUI/comfy_execution/jobs.py", "ComfyUI/comfy_execution/progress.py",
          "ComfyUI/comfy_api/internal/__init__.py", "ComfyUI/protocol.py", "ComfyUI/app/user_manager.py",
          "ComfyUI/app/app_settings.py", "ComfyUI/middleware/cache_middleware.py")


@pytest.fixture(scope="module")
def real() -> dict[str, str]:
    if not ARCHIVE.exists():
        pytest.skip(f"needs ComfyUI's source at {ARCHIVE}")
    out: dict[str, str] = {}
    with tarfile.open(ARCHIVE, "r:xz") as tar:
        for member in tar:
            if member.name in WANTED:
                f = tar.extractfile(member)
                assert f is not None
                out[member.name.removeprefix("ComfyUI/")] = f.read().decode()
            if len(out) == len(WANTED):
                break
    return out


def functions(source: str, names: set[str], ns: dict[str, Any], within: str | None = None) -> dict[str, Any]:
    """The real source's functions ``names`` (module level, or methods of class ``within``),
    compiled into ``ns``."""
    tree = ast.parse(source)
    body = tree.body
    if within is not None:
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == within).body
    picked = [n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in names]
    assert {n.name for n in picked} == names
    module = ast.Module(body=picked, type_ignores=[])
    exec(compile(module, "<comfyui>", "exec"), ns)
    return ns


@pytest.fixture(scope="module")
def real_jobs(real: dict[str, str]) -> dict[str, Any]:
    ns: dict[str, Any] = {}
    functions(real["comfy_api/internal/__init__.py"], {"prune_dict"}, ns)
    tree = ast.parse(real["comfy_execution/jobs.py"])
    tree.body = [n for n in tree.body if not isinstance(n, (ast.Import, ast.ImportFrom))]
    exec(compile(ast.fix_missing_locations(tree), "<comfyui jobs.py>", "exec"), ns)
    return ns


async def test_jobs_records_are_comfyuis_own(fakegpus: Any, http: aiohttp.ClientSession,
                                             real_jobs: dict[str, Any]) -> None:
    # A fake node with a finished, a failed, an interrupted, a running and a pending prompt.
    fake = await fakegpus("comfyui", step_ms=20, parallel=1)
    failing = graph(2, 2)
    failing["8"] = {"class_type": "FailNode", "inputs": {"message": "boom", "x": ["3", 0]}}
    for body in ({"prompt": graph(2, 1), "extra_data": {"extra_pnginfo": {"workflow": {"id": "wf-1"}}}},
                 {"prompt": failing}, {"prompt": graph(2000, 3)}):
        async with http.post(fake.url + "/prompt", json=body) as r:
            assert r.status == 200
    await wait_until(lambda: fake.stats["running"] == 1 and len(fake.backend.history) == 2)
    async with http.post(fake.url + "/interrupt", json={}):
        pass
    await wait_until(lambda: len(fake.backend.history) == 3)
    for seed in (4, 5):
        async with http.post(fake.url + "/prompt", json={"prompt": graph(2000, seed)}) as r:
            assert r.status == 200
    await wait_until(lambda: fake.stats["running"] == 1)
    async with http.get(fake.url + "/queue") as r:
        queue = await r.json()
    async with http.get(fake.url + "/history") as r:
        history = await r.json()
    running, pending = queue["queue_running"], queue["queue_pending"]
    assert len(running) == len(pending) == 1 and len(history) == 3

    queries: list[dict[str, str]] = [
        {}, {"status": "completed,failed"}, {"status": "cancelled"}, {"status": "pending,in_progress"},
        {"sort_order": "asc"}, {"sort_by": "execution_duration"}, {"limit": "2", "offset": "1"},
        {"workflow_id": "wf-1"},
    ]
    for q in queries:
        status, ours = comfy_jobs.listing(running, pending, list(history.items()), q)
        jobs, total = real_jobs["get_all_jobs"](
            running, pending, history, status_filter=q["status"].split(",") if "status" in q else None,
            workflow_id=q.get("workflow_id"), sort_by=q.get("sort_by", "created_at"),
            sort_order=q.get("sort_order", "desc"), limit=int(q["limit"]) if "limit" in q else None,
            offset=int(q.get("offset", "0")))
        assert status == 200 and ours["jobs"] == jobs and ours["pagination"]["total"] == total, q
    for pid in [*history, running[0][1], pending[0][1], "nope"]:
        assert comfy_jobs.find(pid, running, pending, history) == real_jobs["get_job"](pid, running, pending, history)
    async with http.post(fake.url + "/interrupt", json={}):
        pass


@pytest.mark.parametrize("image_type", ["JPEG", "PNG"])
def test_a_preview_with_metadata_becomes_the_plain_preview_comfyui_sends(real: dict[str, str],
                                                                         image_type: str) -> None:
    image_module = pytest.importorskip("PIL.Image")
    image_ops = pytest.importorskip("PIL.ImageOps")
    protocol: dict[str, Any] = {}
    exec(compile(real["protocol.py"], "<comfyui protocol.py>", "exec"), protocol)
    sent: list[bytes] = []

    class Server:
        async def send_bytes(self, event: int, data: bytes, sid: str | None = None) -> None:
            sent.append(bytes(self.encode_bytes(event, data)))  # type: ignore[attr-defined]

    ns = functions(real["server.py"], {"encode_bytes", "send_image", "send_image_with_metadata"},
                   {"struct": struct, "BytesIO": BytesIO, "Image": image_module, "ImageOps": image_ops,
                    "BinaryEventTypes": protocol["BinaryEventTypes"]}, within="PromptServer")
    for name in ("encode_bytes", "send_image", "send_image_with_metadata"):
        setattr(Server, name, ns[name])
    server = Server()
    picture = image_module.new("RGB", (16, 16), (200, 30, 90))
    meta = {"node_id": "3", "prompt_id": "p-1", "display_node_id": "3", "parent_node_id": None, "real_node_id": "3"}

    async def both() -> None:
        await server.send_image_with_metadata((image_type, picture, None), dict(meta))  # type: ignore[attr-defined]
        await server.send_image((image_type, picture, None))  # type: ignore[attr-defined]

    asyncio.run(both())
    with_metadata, plain = sent
    assert preview_prompt(with_metadata) == "p-1"
    assert plain_preview(with_metadata) == plain


def test_the_views_and_preview_metadata_are_comfyuis(real: dict[str, str]) -> None:
    tree = ast.parse(real["server.py"])
    gets = {d.args[0].value for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef) for d in n.decorator_list
            if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "get"
            and d.args and isinstance(d.args[0], ast.Constant)}
    assert {"/history", "/history/{prompt_id}", "/queue", "/prompt", "/api/jobs", "/api/jobs/{job_id}", "/ws"} <= gets
    # the keys ComfyUI puts in a preview's metadata, which the fake sends too (prompt_id routes it)
    progress = ast.parse(real["comfy_execution/progress.py"])
    keys = next({k.value for k in n.value.keys if isinstance(k, ast.Constant)} for n in ast.walk(progress)
                if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == "metadata" for t in n.targets))
    assert keys == {"node_id", "prompt_id", "display_node_id", "parent_node_id", "real_node_id"}


async def test_the_fakes_page_files_are_named_and_cached_as_comfyuis(fakegpus: Any, http: aiohttp.ClientSession,
                                                                     real: dict[str, str]) -> None:
    """The fake's page names its script and stylesheet as the real frontend does (content-hashed,
    under ``assets/``), and every page file has the Cache-Control ComfyUI's own middleware gives the
    same handlers' answers: ``no-store`` on scripts and styles, hashed or not."""
    ns: dict[str, Any] = {}
    exec(compile(real["middleware/cache_middleware.py"], "<comfyui cache_middleware.py>", "exec"), ns)
    app = web.Application(middlewares=[ns["cache_control"]])
    add_page_routes(app)

    async def missing(_: web.Request) -> web.Response:
        return web.Response(status=404)  # ComfyUI's static route answers a file it lacks (no raise)

    app.router.add_get("/{tail:.*}", missing)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    comfy = f"http://127.0.0.1:{runner.addresses[0][1]}"
    fake = await fakegpus("comfyui")
    try:
        async with http.get(fake.url + "/") as r:
            named = re.findall(r'(?:href|src)="\.(/assets/[^"]+)"', await r.text())
        assert sorted(named) == sorted([SCRIPT, STYLE]) and all(hashed_asset(n) for n in named)
        for path in ["/", *named, LOGO_PATH, "/assets/gone-AbCdEf12.js", "/extensions/core/widgets.js",
                     "/assets/images/gone.png", "/templates/index.json"]:
            async with http.get(fake.url + path) as mine, http.get(comfy + path) as theirs:
                assert mine.status == theirs.status, path
                assert mine.headers.get("Cache-Control") == theirs.headers.get("Cache-Control"), path
        async with http.get(fake.url + SCRIPT) as r:
            assert r.headers["Cache-Control"] == "no-store"
    finally:
        await runner.cleanup()


def _routes_and_texts(source: str) -> tuple[set[tuple[str, str]], set[str]]:
    """A module's ``@routes.<method>("path")`` handlers and the ``text=`` of its plain answers."""
    tree = ast.parse(source)
    routes = {(d.func.attr.upper(), d.args[0].value) for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef)
              for d in n.decorator_list if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
              and d.args and isinstance(d.args[0], ast.Constant)}
    texts = {k.value.value for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords
             if k.arg == "text" and isinstance(k.value, ast.Constant)}
    return routes, texts


def test_the_fakes_user_data_is_comfyuis(real: dict[str, str]) -> None:
    """The fake's user directory has ComfyUI's routes (each also under /api) and its plain answers."""
    routes, texts = _routes_and_texts(real["app/user_manager.py"])
    settings, _ = _routes_and_texts(real["app/app_settings.py"])
    app = web.Application()
    comfy_user.UserDir().add_routes(app)
    fake = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"
            and r.resource is not None}
    single_user = routes - {("POST", "/users")}  # adding a user is --multi-user's
    assert fake == {(m, prefix + p) for m, p in single_user | settings for prefix in ("", "/api")}
    # every plain answer the fake gives is ComfyUI's (not the other way: a bad user, a disk error)
    assert _routes_and_texts(Path(comfy_user.__file__).read_text())[1] <= texts
    assert {"Directory not provided", "Invalid directory", "Invalid path requested"} <= texts  # the gateway's too

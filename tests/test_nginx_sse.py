"""End to end: an sse job through a real nginx with its default ``proxy_buffering on``.

nginx holds proxied responses back in its buffers unless the upstream says
``X-Accel-Buffering: no`` (PROTOCOLS §6); the gateway sends that header on every event stream,
so the events must arrive one by one, not in a lump at the end.

Tried both ways nginx talks to the upstream: its default HTTP/1.0 (where buffering really bites:
the control upstream, which streams *without* the header, arrives in one lump) and
``proxy_http_version 1.1`` (chunked; nginx 1.22 happens to pass chunks on as they come).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from comfy_client import graph as comfy_graph
from conftest import auth, base_config
from jobs_client import SSEReader

NGINX = Path("/usr/sbin/nginx")

pytestmark = pytest.mark.skipif(
    not (NGINX.exists() and os.access(NGINX, os.X_OK)),
    reason="nginx is not installed (/usr/sbin/nginx missing); `apt-get install -y nginx` to run this test",
)

CONF = """
daemon off;
master_process off;
worker_processes 1;
error_log {tmp}/error.log warn;
pid {tmp}/nginx.pid;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy_temp;
    fastcgi_temp_path {tmp}/fastcgi_temp;
    uwsgi_temp_path {tmp}/uwsgi_temp;
    scgi_temp_path {tmp}/scgi_temp;
    server {{
        listen 127.0.0.1:{port};
        # nginx's defaults: proxy_buffering on, HTTP/1.0 to the upstream.
        location /control/ {{
            proxy_pass http://127.0.0.1:{control};
        }}
        location /h10/ {{
            proxy_pass http://127.0.0.1:{gateway}/;
            proxy_read_timeout 30s;
        }}
        location / {{
            proxy_pass http://127.0.0.1:{gateway};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_read_timeout 30s;
        }}
    }}
}}
"""


README = Path(__file__).resolve().parents[1] / "README.md"


def readme_block() -> str:
    """The README's nginx block, as a reader copies it."""
    blocks = re.findall(r"^```nginx\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    assert len(blocks) == 1, "README.md should hold exactly one nginx block"
    return blocks[0]


def readme_conf(tmp: Path, port: int, gateway: int) -> str:
    """nginx.conf around the README's block: only its listen address and the gateway's port
    changed (and temp paths a test can write)."""
    block = readme_block()
    assert "listen 80;" in block and "127.0.0.1:8080" in block
    block = block.replace("listen 80;", f"listen 127.0.0.1:{port};").replace("127.0.0.1:8080", f"127.0.0.1:{gateway}")
    head, _, _ = CONF.partition("    server {{")
    return head.format(tmp=tmp) + block + "}\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def port_open(port: int) -> bool:
    try:
        _, w = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    w.close()
    with contextlib.suppress(OSError):
        await w.wait_closed()
    return True


async def control_upstream(request: web.Request) -> web.StreamResponse:
    """An event stream *without* X-Accel-Buffering: nginx is free to buffer it."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    await resp.write(b"event: first\ndata: {}\n\n")
    await asyncio.sleep(1.0)
    await resp.write(b"event: second\ndata: {}\n\n")
    await resp.write_eof()
    return resp


def nginx_args(conf_dir: Path) -> list[str]:
    args = [str(NGINX), "-p", str(conf_dir), "-c", str(conf_dir / "nginx.conf")]
    # -e (nginx >= 1.19.5) keeps the startup error log out of /var/log, which may not be writable.
    usage = subprocess.run([str(NGINX), "-h"], capture_output=True, timeout=10)
    if b"-e filename" in usage.stdout + usage.stderr:
        args += ["-e", str(conf_dir / "error.log")]
    return args


@pytest.fixture
async def nginx(tmp_path: Path) -> AsyncIterator[Callable[[int], Awaitable[str]]]:
    """``await nginx(gateway_port)`` starts nginx in front of it and returns its base URL."""
    procs: list[asyncio.subprocess.Process] = []
    runners: list[web.AppRunner] = []
    conf_dir = tmp_path / "nginx"

    async def start(gateway_port: int, readme: bool = False) -> str:
        app = web.Application()
        app.router.add_get("/control/stream", control_upstream)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        control = runner.addresses[0][1]
        conf_dir.mkdir(exist_ok=True)
        log = conf_dir / "error.log"
        for _ in range(3):  # the free port may be taken before nginx binds it: try another
            port = free_port()
            (conf_dir / "nginx.conf").write_text(
                readme_conf(conf_dir, port, gateway_port) if readme
                else CONF.format(tmp=conf_dir, port=port, gateway=gateway_port, control=control))
            proc = await asyncio.create_subprocess_exec(
                *nginx_args(conf_dir), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            procs.append(proc)
            deadline = time.monotonic() + 10
            while proc.returncode is None and time.monotonic() < deadline:
                if await port_open(port):
                    await asyncio.sleep(0.1)
                    if proc.returncode is None:  # listening, and not someone else's port
                        return f"http://127.0.0.1:{port}"
                    break
                await asyncio.sleep(0.05)
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        raise AssertionError(f"nginx did not start: {log.read_text() if log.exists() else '(no error.log)'}")

    yield start
    for proc in procs:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), timeout=5)
            except TimeoutError:
                proc.kill()
                await proc.wait()
    for runner in runners:
        await runner.cleanup()


@pytest.mark.parametrize(("prefix", "readme"), [("/h10", False), ("", False), ("", True)],
                         ids=["proxy_http_1.0", "proxy_http_1.1", "readme_block"])
async def test_sse_events_are_not_buffered_by_nginx(fakegpus, gateway, http, nginx, prefix, readme) -> None:
    gpu = await fakegpus(steps=5, step_ms=300)  # the job runs ~1.5 s
    gw = await gateway(base_config({"a": gpu.url}))
    front = await nginx(gw.server.port, readme=readme)

    sent = time.monotonic()
    async with http.post(front + prefix + "/gen/generate", json={"echo": "via-nginx"},
                         headers={**auth(), "X-KiloLine-Mode": "sse"}) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert r.headers["X-KiloLine-Job"]
        reader = SSEReader(r)
        events = await reader.rest(timeout=20)
    names = [e.event for e in events]
    assert names[0] == "queued" and "dispatched" in names and names[-1] == "output_ready", names
    assert reader.lines[0] == "retry: 3000"
    assert events[-1].json["result"]["echo"] == "via-nginx"
    queued_at, ready_at = events[0].at, events[-1].at
    assert queued_at - sent < 1.0, "the queued event must arrive at once"
    assert ready_at - queued_at >= 0.5, f"events arrived in a lump: {[(e.event, e.at - sent) for e in events]}"


async def test_control_stream_without_the_header_is_buffered(gateway, fakegpus, http, nginx) -> None:
    """Proves the test above can fail: without X-Accel-Buffering: no, this nginx holds events back
    (over its default HTTP/1.0 to the upstream)."""
    gpu = await fakegpus()
    gw = await gateway(base_config({"a": gpu.url}))
    front = await nginx(gw.server.port)
    sent = time.monotonic()
    async with http.get(front + "/control/stream") as r:
        assert r.status == 200
        events = await SSEReader(r).rest(timeout=10)
    assert [e.event for e in events] == ["first", "second"]
    assert events[0].at - sent >= 0.8, [e.at - sent for e in events]  # held until the end
    assert events[1].at - events[0].at < 0.5, [e.at - sent for e in events]


async def test_llm_keepalive_comments_pass_nginx_while_queued(fakegpus, gateway, http, nginx) -> None:
    """An openai ``stream: true`` request waiting ~1.5 s in the queue: its ``: queued`` comments must
    reach the client through nginx while it waits, or a proxy/client timeout would still fire."""
    fake = await fakegpus("openai", step_ms=100)
    cfg = base_config({"o": fake.url}, kind="openai", path="/v1", max_concurrency=1)
    cfg["server"]["heartbeat_sec"] = 0.3
    gw = await gateway(cfg)
    front = await nginx(gw.server.port)
    messages = [{"role": "user", "content": "hi"}]

    async def blocker() -> int:
        body = {"model": "m", "messages": messages, "max_tokens": 15}
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth("bob")) as r:
            await r.read()
            return r.status

    ahead = asyncio.create_task(blocker())
    deadline = time.monotonic() + 10
    while fake.stats["running"] != 1:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    sent = time.monotonic()
    body = {"model": "m", "messages": messages, "stream": True, "max_tokens": 2}
    async with http.post(front + "/h10/v1/chat/completions", json=body, headers=auth()) as r:
        assert r.status == 200
        reader = SSEReader(r)
        events = await reader.rest(timeout=20)
    assert await ahead == 200
    assert events[-1].data == "[DONE]"
    queued = [at for at, text in reader.comments if text.startswith("queued position=")]
    assert len(queued) >= 2, reader.comments
    assert queued[0] - sent < 1.0, "the first keep-alive comment must not wait for the queue"
    assert events[0].at - queued[0] >= 0.5, "comments and chunks arrived in one lump"


async def test_readme_block_carries_comfyui_websockets(fakegpus, gateway, http, nginx) -> None:
    """nginx → gateway → ComfyUI's /ws: without the Upgrade and Connection headers nginx sends the
    handshake as a plain GET and the client gets no websocket."""
    fake = await fakegpus("comfyui", step_ms=20)
    gw = await gateway(base_config({"c": fake.url}, kind="comfyui", max_concurrency=1))
    front = await nginx(gw.server.port, readme=True)
    async with http.ws_connect(front + "/gen/ws?clientId=mine", headers=auth()) as ws:
        hello = await ws.receive_json(timeout=10)
        assert hello["type"] == "status" and hello["data"]["sid"] == "mine"
        async with http.post(front + "/gen/prompt", json={"prompt": comfy_graph(3), "client_id": "mine"},
                             headers=auth()) as r:
            assert r.status == 200, await r.text()
            pid = (await r.json())["prompt_id"]
        kinds = []
        while True:
            msg = await ws.receive_json(timeout=10)
            kinds.append(msg["type"])
            if msg["type"] == "executing" and msg["data"]["node"] is None and msg["data"]["prompt_id"] == pid:
                break
    assert "progress" in kinds and "execution_success" in kinds


async def test_readme_block_leaves_the_body_limit_to_max_body_mb(fakegpus, gateway, http, nginx) -> None:
    """nginx's own default (client_max_body_size 1m) refused a 2 MB image upload with an HTML 413;
    through the README's block the gateway's server.max_body_mb decides, with its JSON 413."""
    gpu = await fakegpus()
    cfg = base_config({"a": gpu.url})
    cfg["server"]["max_body_mb"] = 3
    gw = await gateway(cfg)
    front = await nginx(gw.server.port, readme=True)
    big = "x" * (2 * 1024 * 1024)  # over nginx's 1 MB default, under max_body_mb
    async with http.post(front + "/gen/generate", json={"echo": big}, headers=auth()) as r:
        assert r.status == 200, (await r.text())[:300]
        assert (await r.json())["echo"] == big
    too_big = "x" * (4 * 1024 * 1024)
    async with http.post(front + "/gen/generate", json={"echo": too_big}, headers=auth()) as r:
        assert r.status == 413
        assert (await r.json())["error"]["type"] == "payload_too_large"  # the gateway's answer, not nginx's

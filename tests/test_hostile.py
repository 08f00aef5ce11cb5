"""The adversarial suite: hostile clients and hostile nodes against a real gateway on loopback,
one test (or more) per row of docs/SECURITY.md. Where the fix is a limit, the test shows the
limit and that normal traffic is not touched by it. Raw sockets where an HTTP library would
tidy the attack away (it normalises ``..``, refuses to send bad bytes)."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from conftest import KEYS, auth, base_config, wait_until
from hostile import HostileNode, RawClient, echo_path, endless_headers, exchange

ALICE = f"Authorization: Bearer {KEYS['alice']}\r\n".encode()


@pytest.fixture
async def node() -> AsyncIterator[Callable[..., Awaitable[HostileNode]]]:
    made: list[HostileNode] = []

    async def make(behaviour: Any = echo_path) -> HostileNode:
        n = await HostileNode(behaviour).start()
        made.append(n)
        return n

    yield make
    for n in made:
        await n.stop()


def get(path: str, extra: bytes = b"", method: str = "GET") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: gw\r\n".encode() + ALICE + extra + b"\r\n"


def assert_json_error(a: Any, status: int, type_: str) -> dict[str, Any]:
    assert a.status == status, (a.status_line, a.body[:300])
    assert (a.header("Content-Type") or "").startswith("application/json"), a.headers
    err = a.json()["error"]
    assert err["type"] == type_ and err["request_id"] and set(err) >= {"message", "retry_after_sec"}, err
    assert a.header("Server") == "kilolined"
    return err


# --- rows 2 and 3: dot parts and NUL in the raw path -------------------------------------------


async def test_history_dotdot_prompt_does_not_bypass_the_queue(node: Any, gateway: Any) -> None:
    n = await node()
    gw = await gateway(base_config({"a": n.url}, unqueued_paths=["/history*"]))
    a = await exchange(gw.server.port, get("/gen/history/../prompt", b"Content-Length: 2\r\n", "POST") + b"{}")
    assert_json_error(a, 400, "bad_request")
    assert n.seen == []  # nothing reached the node
    ok = await exchange(gw.server.port, get("/gen/history/12"))
    assert ok.status == 200 and n.seen == ["GET /history/12 HTTP/1.1"]  # the unqueued path still works


@pytest.mark.parametrize("path", [
    "/gen/evil/../x", "/gen/evil/%2e%2e/x", "/gen/evil/%2E%2e/x", "/gen/a/..%2f..%2fx", "/gen/a/x%5c..%5cy",
    "/gen/a\\..\\b", "/gen/.", "/gen/./x", "/gen/a%00b", "/gen/a%2f.%2fb", "/gen/..",
    "http://gw/gen/a/../b",  # absolute form
    "/v1/proxy/../admin/state", "/v1/jobs/../admin/state", "/admin/../healthz", "/healthz/..",
])
async def test_dot_parts_and_nul_are_refused_before_routing(node: Any, gateway: Any, path: str) -> None:
    n = await node()
    gw = await gateway(base_config({"a": n.url}))
    a = await exchange(gw.server.port, get(path))
    assert_json_error(a, 400, "bad_request")
    assert n.seen == []


@pytest.mark.parametrize(("path", "node_sees"), [
    ("/gen/v1/models/org%2Fmodel", "/v1/models/org%2Fmodel"),  # a Hugging Face id is data
    ("/gen/.well-known/x", "/.well-known/x"), ("/gen/a..b/c.d", "/a..b/c.d"), ("/gen/x?q=../..", "/x?q=../.."),
])
async def test_paths_with_dots_that_are_not_dot_parts_pass_as_sent(node: Any, gateway: Any, path: str,
                                                                    node_sees: str) -> None:
    n = await node()
    gw = await gateway(base_config({"a": n.url}))
    a = await exchange(gw.server.port, get(path))
    assert a.status == 200, a.body
    assert n.seen == [f"GET {node_sees} HTTP/1.1"]


# --- row 4: a node that sends endless response headers ------------------------------------------


async def test_endless_headers_from_a_node_are_a_502_and_nothing_is_relayed(node: Any, gateway: Any) -> None:
    bad = await node(endless_headers)
    gw = await gateway(base_config({"a": bad.url}, retry_on_failover=0))
    a = await exchange(gw.server.port, get("/gen/x"), timeout=10)
    assert_json_error(a, 502, "upstream_error")
    assert not any(k.lower().startswith("x-flood") for k, _ in a.headers)
    assert b"127.0.0.1" not in a.body  # the node's address never reaches the client
    assert (await exchange(gw.server.port, get("/healthz"))).status == 200


# --- row 5: malformed requests are one log line, without their bytes ------------------------------


@pytest.mark.parametrize("raw", [
    b"GET /gen/x HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer kl_SECRET_in_header\x7f\r\n\r\n",
    b"POST /gen/x HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer kl_SECRET_key\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"zz\r\nkl_SECRET_body\r\n0\r\n\r\n",
], ids=["bad-header-byte", "bad-chunk"])
async def test_malformed_request_is_one_line_without_bytes(node: Any, gateway: Any, caplog: Any, raw: bytes) -> None:
    n = await node()
    gw = await gateway(base_config({"a": n.url}))
    caplog.set_level(logging.DEBUG)
    caplog.clear()
    a = await exchange(gw.server.port, raw)
    err = assert_json_error(a, 400, "bad_request")
    assert "SECRET" not in a.body.decode()  # not echoed back either
    text = "\n".join(r.getMessage() + (r.exc_text or "") + str(r.exc_info or "") for r in caplog.records)
    assert "SECRET" not in text, text
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    msg = lines[0].getMessage()
    assert "127.0.0.1" in msg and err["request_id"] in msg and "malformed" in msg
    assert lines[0].exc_info is None and "\n" not in msg


# --- row 8: slowloris, silent and idle connections, max_connections --------------------------------


def limits(n: HostileNode, **server: Any) -> dict[str, Any]:
    cfg = base_config({"a": n.url})
    cfg["server"].update(server)
    return cfg


async def test_header_dribble_is_closed_by_header_timeout(node: Any, gateway: Any) -> None:
    gw = await gateway(limits(await node(), header_timeout_sec=0.5))
    c = await RawClient.connect(gw.server.port)
    closed = False
    try:
        await c.send(b"GET /healthz HTTP/1.1\r\n")
        for _ in range(60):  # one byte every 0.1 s: a head that would take 6 s
            await asyncio.sleep(0.1)
            await c.send(b"X")
    except ConnectionError:
        closed = True
    if not closed:
        closed = await c.closed(timeout=1) == b""
    assert closed
    c.close()


async def test_silent_connection_is_closed(node: Any, gateway: Any) -> None:
    gw = await gateway(limits(await node(), header_timeout_sec=0.3))
    c = await RawClient.connect(gw.server.port)
    assert await c.closed(timeout=5) == b""  # closed without an answer
    c.close()


async def test_a_head_in_pieces_within_the_timeout_is_served(node: Any, gateway: Any) -> None:
    gw = await gateway(limits(await node(), header_timeout_sec=1, idle_timeout_sec=1))
    c = await RawClient.connect(gw.server.port)
    for piece in (b"GET /hea", b"lthz HTTP/1.1\r\nHo", b"st: gw\r\n\r\n"):
        await c.send(piece)
        await asyncio.sleep(0.05)
    assert (await c.answer()).status == 200
    await c.send(b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n")  # same keep-alive connection
    assert (await c.answer()).status == 200
    c.close()


async def test_idle_keep_alive_connection_is_closed(node: Any, gateway: Any) -> None:
    gw = await gateway(limits(await node(), idle_timeout_sec=0.3))
    c = await RawClient.connect(gw.server.port)
    await c.send(b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n")
    assert (await c.answer()).status == 200
    assert await c.closed(timeout=5) == b""
    c.close()


async def test_max_connections_pauses_accepting_and_healthz_is_served_when_one_frees(node: Any,
                                                                                     gateway: Any) -> None:
    gw = await gateway(limits(await node(), max_connections=3))
    held = [await RawClient.connect(gw.server.port) for _ in range(3)]
    await wait_until(lambda: gw.server.gate.count == 3, timeout=5)
    assert gw.server.gate.paused
    extra = await RawClient.connect(gw.server.port)  # completes in the kernel's backlog
    await extra.send(b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n")
    assert await extra.silent_for(0.5)  # not accepted: neither answered nor refused
    held[0].close()
    a = await extra.answer(timeout=5)
    assert a.status == 200  # taken from the backlog as soon as a connection freed
    await wait_until(lambda: gw.server.gate.count <= 3, timeout=5)
    for c in (*held[1:], extra):
        c.close()
    await wait_until(lambda: not gw.server.gate.paused, timeout=5)
    for _ in range(5):  # and below the limit everything is as usual
        assert (await exchange(gw.server.port, b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n")).status == 200


# --- row 9: a bug is a JSON 500; a non-ASCII token is not a bug ------------------------------------


async def test_a_bug_is_a_json_internal_error_logged_with_its_traceback(node: Any, gateway: Any, caplog: Any,
                                                                        monkeypatch: Any) -> None:
    gw = await gateway(base_config({"a": (await node()).url}))

    def boom(_path: str) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(gw.rt.router, "match", boom)
    caplog.set_level(logging.INFO)
    a = await exchange(gw.server.port, get("/gen/x", b"X-Private: kl_SECRET_header\r\n"))
    err = assert_json_error(a, 500, "internal_error")
    bugs = [r for r in caplog.records if r.exc_info and r.exc_info[0] is RuntimeError]
    assert len(bugs) == 1 and err["request_id"] in bugs[0].getMessage()
    assert "SECRET" not in "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)


async def test_non_ascii_token_is_a_404_not_a_500(node: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    gw = await gateway(base_config({"a": (await node()).url}))
    async with http.post(gw.url + "/gen/x", data=b"{}", headers={**auth(), "Prefer": "respond-async"}) as r:
        assert r.status == 202, await r.text()
        job = await r.json()
    for token in ("%C3%A9t%C3%A9", "%FF"):
        a = await exchange(gw.server.port, f"GET /v1/jobs/{job['job_id']}?token={token} HTTP/1.1\r\nHost: gw\r\n\r\n"
                           .encode())
        assert_json_error(a, 404, "not_found")


# --- row 10: a YAML alias bomb ------------------------------------------------------------------

BOMB = "".join(['a0: &a0 ["lol"]\n'] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 10)]
               ) + "nodes: *a9\n"


def test_check_refuses_an_alias_bomb_at_once(tmp_path: Path) -> None:
    f = tmp_path / "bomb.yaml"
    f.write_text(BOMB)
    p = subprocess.run([sys.executable, "-m", "kilolined", "check", "-c", str(f)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1
    assert p.stdout.strip() == f"{f}:1: (yaml): aliases expand to more than 10000 nodes"


async def test_alias_bomb_written_to_the_config_changes_nothing_and_serving_goes_on(
        node: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    gw = await gateway(base_config({"a": (await node()).url}), watch=True)
    v0 = gw.rt.version
    gw.path.write_text(BOMB)
    await wait_until(lambda: gw.rt.last_error is not None, timeout=10)
    assert any("aliases expand" in e for e in gw.rt.last_error)
    assert gw.rt.version == v0
    async with http.get(gw.url + "/healthz") as r:
        assert r.status == 200


# --- row 11: a config file written slowly, in place -----------------------------------------------


async def test_a_file_still_being_written_is_not_applied(node: Any, gateway: Any) -> None:
    n = await node()
    cfg = base_config({"a": n.url})
    cfg["routes"]["img"] = {"path": "/img", "nodes": ["a"]}
    gw = await gateway(cfg, watch=True)
    await asyncio.sleep(0.5)  # the watch is up
    full = yaml.safe_dump(cfg, sort_keys=False) + "# edited\n"
    cut = full.index("  img:")
    partial, rest = full[:cut], full[cut:]  # valid YAML on its own: a config without route img
    statuses: list[int] = []
    stop = asyncio.Event()

    async def probe() -> None:
        while not stop.is_set():
            statuses.append((await exchange(gw.server.port, get("/img/x"))).status)
            await asyncio.sleep(0.01)

    prober = asyncio.create_task(probe())
    with gw.path.open("w") as f:  # in place, as `cat > file` or a slow network copy
        f.write(partial)
        f.flush()
        await asyncio.sleep(0.15)  # a pause mid-write: the partial file is valid
        f.write(rest)
    digest = hashlib.sha256(full.encode()).hexdigest()
    await wait_until(lambda: gw.rt.version == digest, timeout=10)
    await asyncio.sleep(0.1)
    stop.set()
    await prober
    assert statuses and 404 not in statuses, statuses
    assert set(gw.rt.cfg.routes) == {"gen", "img"}


# --- row 12: aiohttp's own errors are JSON too; no HTTP/0.9 ------------------------------------------


async def test_oversized_body_on_an_unqueued_path_is_a_json_413(node: Any, gateway: Any) -> None:
    n = await node()
    cfg = base_config({"a": n.url}, unqueued_paths=["/upload*"])
    cfg["server"]["max_body_mb"] = 1
    gw = await gateway(cfg)
    body = b"x" * (2 * 1024 * 1024)
    c = await RawClient.connect(gw.server.port)
    await c.send(get("/gen/upload", f"Content-Length: {len(body)}\r\n".encode(), "POST"))
    try:
        await c.send(body)
    except ConnectionError:
        pass  # the gateway may close before reading it all; the answer is already there
    assert_json_error(await c.answer(), 413, "payload_too_large")
    c.close()
    assert n.seen == []
    small = copy.deepcopy(get("/gen/upload", b"Content-Length: 2\r\n", "POST")) + b"ok"
    assert (await exchange(gw.server.port, small)).status == 200  # under the limit: forwarded


async def test_http09_request_gets_no_http09_answer(node: Any, gateway: Any) -> None:
    gw = await gateway(base_config({"a": (await node()).url}))
    c = await RawClient.connect(gw.server.port)
    await c.send(b"GET /healthz\r\n\r\n")
    assert await c.closed() == b""
    c.close()


async def _head_then_body(conn: Any) -> None:
    """A node whose answer is streamed back: its head, then (later) a chunked body."""
    while True:
        await conn.read_head()
        await conn.send(b"HTTP/1.1 200 OK\r\nServer: node/1.2.3\r\nTransfer-Encoding: chunked\r\n\r\n")
        await asyncio.sleep(0.05)
        await conn.send(b"5\r\nhello\r\n0\r\n\r\n")


async def test_server_header_names_no_versions(node: Any, gateway: Any) -> None:
    gw = await gateway(base_config({"a": (await node()).url}))
    for raw in (b"GET /gen/x HTTP/1.1\r\nHost: gw\r\n\r\n",  # 401 to a stranger
                b"GET /nowhere HTTP/1.1\r\nHost: gw\r\n\r\n",  # 404
                get("/gen/x"),  # a node's answer
                get("/gen/x", b"X-KiloLine-Mode: sse\r\nConnection: close\r\n"),  # an SSE job's stream
                b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n",  # an admin handler
                b"GET /v1/jobs/nope HTTP/1.1\r\nHost: gw\r\n\r\n",  # a jobs handler's 404
                b"GET /healthz HTTP/1.1\r\nHost: gw\r\nBad\x01: x\r\n\r\n"):  # aiohttp's 400
        a = await exchange(gw.server.port, raw)
        assert a.header("Server") == "kilolined", (a.status, a.headers)
    # A streamed answer (prepared before its body) says so too, and never the node's name.
    streamed = await gateway(base_config({"b": (await node(_head_then_body)).url}))
    a = await exchange(streamed.server.port, get("/gen/x", b"Connection: close\r\n"))
    assert a.status == 200 and a.header("Server") == "kilolined", (a.status, a.headers)
    assert b"hello" in a.body

"""What the gateway adds to a relayed exchange, and what it says when it fails: nothing the node or
the client did not send (no Content-Type made up, no Content-Length on a body-less DELETE), an
error that names what happened (a node head too large is not a "connection reset"), and a request
id in every error. A real gateway, raw sockets and nodes that answer fixed bytes."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from conftest import KEYS, auth, base_config, wait_until
from hostile import HostileNode, NodeConn, exchange

ALICE = f"Authorization: Bearer {KEYS['alice']}\r\n"


@pytest.fixture
async def node() -> Any:
    made: list[HostileNode] = []

    async def make(behaviour: Any) -> HostileNode:
        n = await HostileNode(behaviour).start()
        made.append(n)
        return n

    yield make
    for n in made:
        await n.stop()


def answering(answer: bytes) -> Any:
    async def behaviour(conn: NodeConn) -> None:
        while True:
            await conn.read_head()
            await conn.send(answer)

    return behaviour


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",  # whole with its head
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",  # streamed
])
async def test_no_content_type_is_made_up_for_a_node_that_sent_none(node: Any, gateway: Any, answer: bytes) -> None:
    n = await node(answering(answer))
    gw = await gateway(base_config({"a": n.url}))
    a = await exchange(gw.server.port, f"GET /gen/x HTTP/1.1\r\nHost: gw\r\n{ALICE}Connection: close\r\n\r\n".encode())
    assert a.status == 200 and a.header("Content-Type") is None, a.headers
    assert a.body.endswith(b"hello") or b"hello" in a.body


async def test_the_nodes_content_type_passes_as_sent(node: Any, gateway: Any) -> None:
    n = await node(answering(b"HTTP/1.1 200 OK\r\nContent-Type: image/webp\r\nContent-Length: 2\r\n\r\nok"))
    gw = await gateway(base_config({"a": n.url}))
    a = await exchange(gw.server.port, f"GET /gen/x HTTP/1.1\r\nHost: gw\r\n{ALICE}\r\n".encode())
    assert a.header("Content-Type") == "image/webp"


async def echo_head(conn: NodeConn) -> None:
    while True:
        head = await conn.reader.readuntil(b"\r\n\r\n")
        n = next((int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")), 0)
        await conn.reader.readexactly(n)
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(head), head))


@pytest.mark.parametrize("method, length", [
    ("DELETE", None), ("TRACE", None), ("OPTIONS", None), ("GET", None),
    ("POST", "0"), ("PUT", "0"), ("PATCH", "0"),  # methods whose requests carry content: always one
])
async def test_a_bodyless_request_gets_a_content_length_only_when_its_method_carries_content(
        node: Any, gateway: Any, method: str, length: str | None) -> None:
    n = await node(echo_head)
    gw = await gateway(base_config({"a": n.url}))
    a = await exchange(gw.server.port, f"{method} /gen/x HTTP/1.1\r\nHost: gw\r\n{ALICE}\r\n".encode())
    assert a.status == 200
    sent = [ln.split(b": ", 1)[1].decode() for ln in a.body.split(b"\r\n") if ln.lower().startswith(b"content-length")]
    assert sent == ([] if length is None else [length]), a.body


async def many_headers(conn: NodeConn) -> None:
    await conn.read_head()
    await conn.send(b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-H-%d: v\r\n" % i for i in range(300))
                    + b"Content-Length: 0\r\n\r\n")


async def test_a_node_head_over_256_lines_is_named_as_such(node: Any, gateway: Any) -> None:
    n = await node(many_headers)  # small in bytes (~3 KiB), over the line limit
    gw = await gateway(base_config({"a": n.url}, retry_on_failover=0))
    a = await exchange(gw.server.port, f"GET /gen/x HTTP/1.1\r\nHost: gw\r\n{ALICE}\r\n".encode())
    assert a.status == 502
    err = a.json()["error"]
    assert err["type"] == "upstream_error" and "too big a response head" in err["message"], err
    assert "reset" not in err["message"] and "127.0.0.1" not in err["message"]


# --- every error carries the request id ------------------------------------------------------------


async def test_a_bad_last_event_id_names_the_request(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    g = await fakegpus("generic", steps=1, step_ms=1)
    gw = await gateway(base_config({"a": g.url}))
    async with http.post(gw.url + "/gen/generate", json={}, headers={**auth(), "X-KiloLine-Mode": "async"}) as r:
        job = await r.json()
    for how in ({"headers": {**auth(), "Last-Event-ID": "x", "X-Request-Id": "mine-1"}},
                {"params": {"last_event_id": "x"}, "headers": auth()}):
        async with http.get(f"{gw.url}/v1/jobs/{job['job_id']}/events", **how) as r:
            body = await r.json()
            assert r.status == 400 and body["error"]["request_id"], body
            assert body["error"]["request_id"] == r.headers["X-Request-Id"]
    assert body["error"]["request_id"] != "mine-1"
    async with http.get(f"{gw.url}/v1/jobs/{job['job_id']}/events",
                        headers={**auth(), "Last-Event-ID": "x", "X-Request-Id": "mine-1"}) as r:
        assert (await r.json())["error"]["request_id"] == "mine-1"  # the client's own, when it sent one


async def test_a_job_file_the_node_cannot_serve_names_the_request(fakegpus: Any, gateway: Any,
                                                                  http: aiohttp.ClientSession) -> None:
    c = await fakegpus("comfyui", steps=1, step_ms=1)
    cfg = base_config({"c": c.url}, kind="comfyui")
    # A file store too small for the output: the file stays on its node only (the store keeps
    # copies of what fits; ComfyUI over several GPUs, docs/API.md).
    cfg["routes"]["gen"]["comfy"] = {"max_files_mb": 0.0001}
    gw = await gateway(cfg)
    prompt = {"3": {"class_type": "KSampler", "inputs": {"seed": 1, "steps": 1}},
              "9": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": "x"}}}
    async with http.post(gw.url + "/gen/prompt", json={"prompt": prompt},
                         headers={**auth(), "X-KiloLine-Mode": "async"}) as r:
        job_id = (await r.json())["job_id"]

    async def done() -> bool:
        async with http.get(f"{gw.url}/v1/jobs/{job_id}", headers=auth()) as r:
            return (await r.json())["status"] == "completed"

    await wait_until(done)
    await c.stop()  # the node that rendered it is gone
    await asyncio.sleep(0)
    async with http.get(f"{gw.url}/v1/jobs/{job_id}/files/0", headers=auth()) as r:
        body = await r.json()
        assert r.status == 502 and body["error"]["type"] == "upstream_error", body
        assert body["error"]["request_id"] and body["error"]["request_id"] == r.headers["X-Request-Id"]

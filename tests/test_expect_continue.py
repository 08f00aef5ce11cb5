"""``Expect: 100-continue`` (RFC 9110 §10.1.1): the gateway says ``100 Continue`` only once the
request passed auth, the limits and the size check, as nginx does; a refused client gets its
final answer (the spec'd JSON error) instead, without uploading its body. A raw-socket client
that sends the head and waits for the interim answer, as curl does for large bodies."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import pytest
from conftest import KEYS, base_config
from hostile import HostileNode, RawClient, echo_path

BODY = b'{"x": "' + b"y" * 1000 + b'"}'


def head(path: str, key: str | None, length: int, method: str = "POST", extra: str = "") -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key is not None else ""
    return (f"{method} {path} HTTP/1.1\r\nHost: gw\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {length}\r\nExpect: 100-continue\r\n{extra}\r\n").encode()


async def interim(c: RawClient) -> str:
    """The first status line the gateway sends back (100 or the final answer's)."""
    async with asyncio.timeout(5):
        line = await c.reader.readuntil(b"\r\n")
    return line.decode("latin-1").strip()


@pytest.fixture
async def setup(gateway: Any) -> Any:
    node = await HostileNode(echo_path).start()
    cfg = base_config({"a": node.url}, unqueued_paths=["/status*"])
    cfg["server"]["max_body_mb"] = 1
    cfg["keys"]["limited"] = {"key_sha256": hashlib.sha256(b"kl_limited_key_0000000000000000").hexdigest(),
                              "routes": ["*"], "rate": {"per_minute": 1, "burst": 1}}
    gw = await gateway(cfg)
    yield gw, node
    await node.stop()


@pytest.mark.parametrize("path", ["/gen/generate", "/gen/status/1", "/v1/proxy/generate"])
async def test_a_wrong_key_gets_401_instead_of_100_continue(setup: Any, path: str) -> None:
    gw, node = setup
    c = await RawClient.connect(gw.server.port)
    try:
        await c.send(head(path, "kl_wrong_key_00000000000000000000", len(BODY)))
        assert (await interim(c)).startswith("HTTP/1.1 401 ")
        rest = await c.closed()  # the answer, then the connection is closed: no body is awaited
        assert b'"type":"unauthorized"' in rest and b'"request_id":"' in rest
    finally:
        c.close()
    assert node.seen == []


@pytest.mark.parametrize("path", ["/gen/generate", "/gen/status/1"])
async def test_a_body_over_max_body_mb_gets_413_instead_of_100_continue(setup: Any, path: str) -> None:
    gw, node = setup
    c = await RawClient.connect(gw.server.port)
    try:
        await c.send(head(path, KEYS["alice"], 5 * 1024 * 1024))
        assert (await interim(c)).startswith("HTTP/1.1 413 ")
        rest = await c.closed()
        assert b'"type":"payload_too_large"' in rest
    finally:
        c.close()
    assert node.seen == []


async def test_a_rate_limited_key_gets_429_instead_of_100_continue(setup: Any) -> None:
    gw, _ = setup
    for want in ("HTTP/1.1 100 ", "HTTP/1.1 429 "):  # the bucket holds one request
        c = await RawClient.connect(gw.server.port)
        try:
            await c.send(head("/gen/generate", "kl_limited_key_0000000000000000", len(BODY)))
            assert (await interim(c)).startswith(want)
        finally:
            c.close()


@pytest.mark.parametrize("path, node_line", [
    ("/gen/generate", "POST /generate HTTP/1.1"),
    ("/gen/status/1", "POST /status/1 HTTP/1.1"),  # an unqueued path reads the body too
])
async def test_an_accepted_request_gets_100_continue_then_its_answer(setup: Any, path: str, node_line: str) -> None:
    gw, _ = setup
    c = await RawClient.connect(gw.server.port)
    try:
        await c.send(head(path, KEYS["alice"], len(BODY)))
        assert await interim(c) == "HTTP/1.1 100 Continue"
        assert await c.reader.readuntil(b"\r\n") == b"\r\n"  # the interim answer's end
        await c.send(BODY)
        a = await c.answer()
        assert a.status == 200 and a.body == node_line.encode()
    finally:
        c.close()

"""What a node learns of the client's address (docs/SECURITY.md, "trusted proxies"): the client's
own word — ``X-Forwarded-For``, ``Forwarded`` (RFC 7239), ``X-Real-Ip`` — is believed only from a
peer in ``server.trusted_proxies``; from anyone else it is replaced by the peer's address, so a
node that reads any of the three never sees a forged one. A real gateway and a node that answers
with the head it received."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import KEYS, base_config
from hostile import HostileNode, NodeConn, exchange

FORGED = "203.0.113.66"


async def echo_head(conn: NodeConn) -> None:
    while True:
        head = await conn.reader.readuntil(b"\r\n\r\n")
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s"
                        % (len(head), head))


def node_headers(body: bytes) -> list[tuple[str, str]]:
    lines = body.decode("latin-1").split("\r\n")[1:]
    return [(k.lower(), v) for k, _, v in (ln.partition(": ") for ln in lines if ln)]


@pytest.fixture
async def node() -> Any:
    n = await HostileNode(echo_head).start()
    yield n
    await n.stop()


def request(path: str) -> bytes:
    return (f"GET {path} HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {KEYS['alice']}\r\n"
            f"X-Forwarded-For: {FORGED}\r\nForwarded: for={FORGED};proto=https\r\nforwarded: for=198.51.100.7\r\n"
            f"X-Real-IP: {FORGED}\r\n\r\n").encode()


@pytest.mark.parametrize("path", ["/gen/generate", "/gen/status/1"])  # queued, and an unqueued path
async def test_an_untrusted_client_cannot_name_its_own_address(node: Any, gateway: Any, path: str) -> None:
    gw = await gateway(base_config({"a": node.url}, unqueued_paths=["/status*"]))
    a = await exchange(gw.server.port, request(path))
    assert a.status == 200, a.body
    got = node_headers(a.body)
    assert FORGED.encode() not in a.body and b"198.51.100.7" not in a.body, got
    assert ("x-forwarded-for", "127.0.0.1") in got
    assert [v for k, v in got if k == "forwarded"] == ["for=127.0.0.1"]
    assert [v for k, v in got if k == "x-real-ip"] == ["127.0.0.1"]


@pytest.mark.parametrize("path", ["/gen/generate", "/gen/status/1"])
async def test_a_trusted_proxy_passes_the_chain_on_with_itself_added(node: Any, gateway: Any, path: str) -> None:
    cfg = base_config({"a": node.url}, unqueued_paths=["/status*"])
    cfg["server"]["trusted_proxies"] = ["127.0.0.1/32"]
    gw = await gateway(cfg)
    a = await exchange(gw.server.port, request(path))
    assert a.status == 200, a.body
    got = node_headers(a.body)
    assert ("x-forwarded-for", f"{FORGED}, 127.0.0.1") in got
    assert [v for k, v in got if k == "forwarded"] == [f"for={FORGED};proto=https, for=198.51.100.7, for=127.0.0.1"]
    assert [v for k, v in got if k == "x-real-ip"] == [FORGED]


async def test_nothing_is_added_that_the_client_did_not_send(node: Any, gateway: Any) -> None:
    gw = await gateway(base_config({"a": node.url}))
    a = await exchange(gw.server.port, f"GET /gen/x HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {KEYS['alice']}"
                                       "\r\n\r\n".encode())
    names = [k for k, _ in node_headers(a.body)]
    assert "x-forwarded-for" in names and "forwarded" not in names and "x-real-ip" not in names

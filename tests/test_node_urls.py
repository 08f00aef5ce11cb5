"""A node's URLs to itself in Location, Content-Location and Link come back through the route
(nginx's ``proxy_redirect default``): the node's address never reaches the client in a header."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import KEYS, base_config
from hostile import HostileNode, NodeConn, exchange

from kilolined.wire.node_urls import for_client, links_to_route, to_route


@pytest.mark.parametrize("url, node_url, route, want", [
    ("http://node:8000/x?y=1", "http://node:8000", "/gen", "/gen/x?y=1"),
    ("http://node:8000", "http://node:8000", "/gen", "/gen/"),
    ("http://node:8000?q", "http://node:8000", "/", "/?q"),
    ("http://node:8000/base/x", "http://user:pw@node:8000/base/", "/gen", "/gen/x"),  # userinfo, base path
    ("HTTP://Node:8000/x", "http://node:8000", "/gen", "/gen/x"),  # scheme and host are case-blind
    ("http://node/x", "http://node:80", "/gen", "/gen/x"),  # the default port left out
    ("https://node:443/x", "https://node", "/gen", "/gen/x"),  # ... or spelled
    ("http://[::1]:9000/x", "http://[::1]:9000", "/gen", "/gen/x"),
    ("http://node:8000/basement", "http://node:8000/base", "/gen", "http://node:8000/basement"),  # not under it
    ("http://node:80001/x", "http://node:8000", "/gen", "http://node:80001/x"),  # another port
    ("https://elsewhere.example/x", "http://node:8000", "/gen", "https://elsewhere.example/x"),
    ("/relative", "http://node:8000", "/gen", "/relative"),
])
def test_to_route(url: str, node_url: str, route: str, want: str) -> None:
    assert to_route(url, node_url, route) == want


def test_links_to_route_rewrites_each_target_that_points_at_the_node() -> None:
    value = '<http://node:8000/v1/x?page=2>; rel="next", </y>; rel=prev, <https://cdn.example/z>; rel=preload'
    assert links_to_route(value, "http://node:8000", "/gen") == \
        '</gen/v1/x?page=2>; rel="next", </gen/y>; rel=prev, <https://cdn.example/z>; rel=preload'


@pytest.mark.parametrize("url, node_url, route, want", [
    ("http://node:8000/x", "http://node:8000", "/gen", "/gen/x"),  # the node's own URL: once, not /gen/gen/x
    ("/x?y=1", "http://node:8000", "/gen", "/gen/x?y=1"),  # root-relative: under the prefix
    ("/gen/x", "http://node:8000", "/gen", "/gen/gen/x"),  # the node knows no prefix: /gen/x is its own path
    ("/base/x", "http://node:8000/base", "/gen", "/gen/x"),  # under the node's base path: as its absolute URL
    ("/other", "http://node:8000/base", "/gen", "/gen/other"),
    ("/x", "http://node:8000", "/", "/x"),  # strip_path: false forwards the whole path
    ("//cdn.example/x", "http://node:8000", "/gen", "//cdn.example/x"),  # another host
    ("next", "http://node:8000", "/gen", "next"),  # relative: the client resolves it
    ("https://elsewhere.example/x", "http://node:8000", "/gen", "https://elsewhere.example/x"),
])
def test_for_client_rewrites_each_url_once(url: str, node_url: str, route: str, want: str) -> None:
    assert for_client(url, node_url, route) == want


async def test_link_and_location_headers_never_name_the_node(gateway: Any) -> None:
    async def behaviour(conn: NodeConn) -> None:
        await conn.read_head()
        await conn.send(b"HTTP/1.1 302 Found\r\n"
                        b"Location: " + me.encode() + b"/next\r\n"
                        b"Content-Location: " + me.encode() + b"/here\r\n"
                        b"Link: <" + me.encode() + b"/page/2>; rel=\"next\", <" + me.encode() + b">; rel=index\r\n"
                        b"Content-Length: 0\r\n\r\n")

    node = await HostileNode(behaviour).start()
    me = node.url
    try:
        gw = await gateway(base_config({"a": me}))
        a = await exchange(gw.server.port, f"GET /gen/x HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {KEYS['alice']}"
                                           "\r\n\r\n".encode())
        assert a.status == 302
        assert a.header("Location") == "/gen/next" and a.header("Content-Location") == "/gen/here"
        assert a.header("Link") == '</gen/page/2>; rel="next", </gen/>; rel=index'
        assert "127.0.0.1" not in str(a.headers)
    finally:
        await node.stop()

"""What a node is sent of a client's headers (Exchange.upstream_header_pairs): the end-to-end
headers in their order and spelling, without credentials, hop-by-hop headers, the gateway's own
controls or what Connection names; the forwarding headers after them."""

from __future__ import annotations

from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from kilolined.wire.proxy import Exchange, request_id


def pairs(headers: list[tuple[str, str]], node: dict[str, str] | None = None,
          extra: dict[str, str] | None = None, drop: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    req = make_mocked_request("POST", "/gen/x", headers=CIMultiDict(headers))
    ex = Exchange(req, "POST", "/x", b"{}", "rid1", "10.0.0.9", drop_headers=drop, extra_headers=extra or {})
    return ex.upstream_header_pairs(node or {}, "http://user:pw@node:8000/base")


def test_end_to_end_headers_pass_in_order_and_ours_are_added() -> None:
    got = pairs([("Content-Type", "application/json"), ("X-Custom", "1"), ("Authorization", "Bearer k"),
                 ("x-custom", "2"), ("Accept", "*/*"), ("Host", "gw"), ("Content-Length", "2")])
    assert got[:4] == [("Content-Type", "application/json"), ("X-Custom", "1"), ("x-custom", "2"),
                       ("Accept", "*/*")]
    assert [k for k, _ in got[4:]] == ["X-Forwarded-For", "X-Forwarded-Proto", "X-Request-Id", "Host"]
    assert dict(got[4:])["Host"] == "node:8000"
    assert dict(got[4:])["X-Request-Id"] == "rid1"


def test_credentials_controls_and_hop_by_hop_never_pass() -> None:
    strip = ["Authorization", "X-Api-Key", "Proxy-Authorization", "Proxy-Connection", "Keep-Alive", "TE",
             "Trailer", "Transfer-Encoding", "Upgrade", "X-Target-Host", "X-Concurrency-Slot", "Prefer", "Expect",
             "X-Forwarded-Host", "X-Request-Id", "X-KiloLine-Mode", "x-kiloline-anything", "X-KILOLINE-NODE"]
    got = pairs([(h, "v") for h in strip] + [("X-Keep", "yes"), ("X-KiloLinE", "not ours: no dash")])
    assert [k for k, _ in got if k not in ("X-Forwarded-For", "X-Forwarded-Proto", "X-Request-Id", "Host")] == \
        ["X-Keep", "X-KiloLinE"]


def test_what_connection_names_and_what_the_node_sets_is_dropped() -> None:
    got = pairs([("Connection", "close, X-Secret"), ("x-secret", "s"), ("X-Node", "client"), ("X-Drop", "d"),
                 ("X-Keep", "k")], node={"x-node": "configured"}, extra={"X-Extra": "e"},
                drop=frozenset({"x-drop"}))
    names = [k for k, _ in got]
    assert "x-secret" not in names and "Connection" not in names and "X-Drop" not in names
    assert ("X-Node", "client") not in got and ("x-node", "configured") in got
    assert names[0] == "X-Keep" and names[-1] == "X-Extra"


def test_request_id_is_the_clients_only_when_sane() -> None:
    def rid(headers: list[tuple[str, str]]) -> str:
        return request_id(make_mocked_request("GET", "/", headers=CIMultiDict(headers)))

    assert rid([("X-Request-Id", "abc-1.2:3_4")]) == "abc-1.2:3_4"
    for bad in ([], [("X-Request-Id", "")], [("X-Request-Id", "a b")], [("X-Request-Id", "x" * 129)]):
        got = rid(bad)
        assert len(got) == 32 and int(got, 16) >= 0
    assert rid([]) != rid([])

"""/v1/proxy X-Target-Host with IPv6 literals (docs/API.md#v1proxy): `[v6]:port` and `[v6]` are
targets like any other wherever a key's glob allows them; malformed ones are still 400."""

from __future__ import annotations

import json
import socket

import pytest
from conftest import auth, base_config

from kilolined.edge.targets import parse_target, target_allowed


def v6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize(("raw", "want"), [
    ("http://[::1]:8000", "http://[::1]:8000"),
    ("http://[::1]", "http://[::1]"),
    ("https://[0:0:0:0:0:0:0:1]:443/", "https://[::1]:443"),
    ("http://[FD00::7]:8188", "http://[fd00::7]:8188"),
    ("http://[::ffff:10.0.0.1]:80", "http://[::ffff:a00:1]:80"),
    ("http://10.0.0.1:8188", "http://10.0.0.1:8188"),
    ("http://gpu-1.example.com", "http://gpu-1.example.com"),
])
def test_targets_parse_to_their_canonical_form(raw: str, want: str) -> None:
    assert parse_target(raw) == want


@pytest.mark.parametrize("raw", [
    "http://::1:8000", "http://[::1", "http://::1]:80", "http://[::1]:0", "http://[::1]:65536", "http://[::g]:80",
    "http://[fe80::1%eth0]:80", "http://[1.2.3.4]:80", "http://[]:80", "ftp://[::1]:80", "http://[::1]:80/x",
    "http://u@[::1]:80", "http://[::1]x:80", "http://a[::1]:80", "", "[::1]:80",
])
def test_malformed_targets_are_refused(raw: str) -> None:
    assert parse_target(raw) is None


def test_globs_name_ipv6_literals_with_their_brackets() -> None:
    assert target_allowed(["http://[::1]:*"], "http://[::1]:8000")
    assert target_allowed(["http://[::1]*"], "http://[::1]")
    assert target_allowed(["http://[fd00::*]:*"], "http://[fd00::7]:8188")
    assert not target_allowed(["http://[::1]:*"], "http://[::2]:8000")
    assert not target_allowed(["http://[::1]:*"], "http://1:8000")
    assert target_allowed(["http://10.0.0.[1-3]:*"], "http://10.0.0.2:80")  # a class stays a class


@pytest.mark.skipif(not v6_loopback(), reason="no IPv6 loopback on this machine")
async def test_ipv6_target_is_served_through_the_gateway(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=1, step_ms=1, host="::1")
    other = await fakegpus()
    cfg = base_config({"a": other.url})
    cfg["keys"]["bob"]["adhoc_targets"] = ["http://[::1]:*"]
    gw = await gateway(cfg)
    assert g.url.startswith("http://[::1]:")
    async with http.post(gw.url + "/v1/proxy/generate", json={"echo": "v6"},
                         headers={**auth("bob"), "X-Target-Host": g.url}) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["echo"] == "v6"
    assert g.stats["served"] == 1 and other.stats["served"] == 0
    assert g.requests[-1]["headers"]["host"] == f"[::1]:{g.port}"
    # the same address spelled long is the same target, still within the glob
    async with http.post(gw.url + "/v1/proxy/generate", json={},
                         headers={**auth("bob"), "X-Target-Host": f"http://[0::1]:{g.port}"}) as r:
        assert r.status == 200
    # another key's glob does not name it; a malformed literal is 400
    async with http.post(gw.url + "/v1/proxy/generate", json={},
                         headers={**auth("alice"), "X-Target-Host": g.url}) as r:
        assert r.status == 403
    async with http.post(gw.url + "/v1/proxy/generate", json={},
                         headers={**auth("bob"), "X-Target-Host": f"http://[::1:{g.port}"}) as r:
        assert r.status == 400 and json.loads(await r.read())["error"]["type"] == "bad_request"

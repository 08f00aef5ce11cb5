"""The ComfyUI web UI's content-hashed files, held and answered by the gateway (docs/API.md
"ComfyUI over several GPUs"): one fetch per file from a node, then immutable, tagged, gzipped for
a client that takes gzip, and still there with no node up; everything else of the page passes
through as the node sends it. Two fake ComfyUI nodes over loopback, whose page names its script
and stylesheet as the real frontend does (``assets/<name>-<hash>.<ext>``) and sends ComfyUI's
``no-store`` on them.
"""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from conftest import ADMIN, auth, base_config
from multidict import CIMultiDict

from kilolined.core.page_assets import IMMUTABLE, PageAssets, accepts_gzip, hashed_asset, make_asset
from kilolined.fakegpu.comfy_page import CSS, JS, LOGO_PATH, SCRIPT, STYLE


@pytest.fixture
async def raw() -> AsyncIterator[aiohttp.ClientSession]:
    """A client that shows the bytes as sent (no decompression, no Accept-Encoding of its own)."""
    async with aiohttp.ClientSession(auto_decompress=False, skip_auto_headers=("Accept-Encoding",)) as s:
        yield s


async def two_nodes(fakegpus: Any, gateway: Any) -> tuple[Any, Any, Any]:
    a = await fakegpus("comfyui", step_ms=20)
    b = await fakegpus("comfyui", step_ms=20)
    cfg = base_config({"a": a.url, "b": b.url}, kind="comfyui", max_concurrency=1)
    cfg["routes"]["gen"].update(nodes=["a", "b"], standby=[])
    return a, b, await gateway(cfg)


def asked(path: str, *nodes: Any) -> int:
    return sum(1 for g in nodes for r in g.requests if r["path"] == path)


async def fetch(s: aiohttp.ClientSession, url: str, method: str = "GET",
                **headers: str) -> tuple[int, CIMultiDict[str], bytes]:
    async with s.request(method, url, headers={**auth(), **headers}) as r:
        return r.status, CIMultiDict(r.headers), await r.read()


async def test_a_hashed_file_is_fetched_once_then_answered_immutable_tagged_and_gzipped(
        fakegpus: Any, gateway: Any, raw: aiohttp.ClientSession) -> None:
    a, b, gw = await two_nodes(fakegpus, gateway)
    original = JS.encode()
    url = gw.url + "/gen" + SCRIPT
    answers = await asyncio.gather(*(fetch(raw, url, **{"Accept-Encoding": "gzip, deflate, br"})
                                     for _ in range(20)))
    assert asked(SCRIPT, a, b) == 1  # one fetch for 20 askers at once
    for status, headers, body in answers:
        assert status == 200 and headers["Cache-Control"] == IMMUTABLE
        assert headers["Content-Encoding"] == "gzip" and headers["Vary"] == "Accept-Encoding"
        assert headers["Content-Type"].startswith("application/javascript")
        assert gzip.decompress(body) == original and len(body) < len(original)
    gz_tag = answers[0][1]["ETag"]
    # identity for a client that does not take gzip, with the tag of that representation
    for accept in ("identity", "gzip;q=0", "br", "gzip;q=0, *"):
        status, headers, body = await fetch(raw, url, **{"Accept-Encoding": accept})
        assert status == 200 and body == original and "Content-Encoding" not in headers, accept
        assert headers["Cache-Control"] == IMMUTABLE and headers["Vary"] == "Accept-Encoding"
        tag = headers["ETag"]
    status, headers, body = await fetch(raw, url)  # no Accept-Encoding at all
    assert body == original and "Content-Encoding" not in headers
    assert tag.startswith('"sha256-') and tag != gz_tag
    # a browser's revalidation: 304, no body, either tag
    for held in (tag, gz_tag, f'"other", {tag}'):
        status, headers, body = await fetch(raw, url, **{"If-None-Match": held, "Accept-Encoding": "gzip"})
        assert status == 304 and body == b"" and headers["ETag"] == gz_tag, held
    status, _, _ = await fetch(raw, url, **{"If-None-Match": '"sha256-stale"'})
    assert status == 200
    status, headers, body = await fetch(raw, url, "HEAD", **{"Accept-Encoding": "gzip"})
    assert status == 200 and body == b"" and headers["Content-Encoding"] == "gzip"
    assert int(headers["Content-Length"]) == len(answers[0][2])
    assert asked(SCRIPT, a, b) == 1  # none of these went to a node
    # what /admin/state shows for the route
    async with raw.get(gw.url + "/admin/state", headers=ADMIN) as r:
        held_now = (await r.json())["routes"]["gen"]["page_assets"]
    assert held_now == {"files": 1, "bytes": len(original) + len(answers[0][2])}


async def test_a_held_file_is_answered_with_no_node_up(fakegpus: Any, gateway: Any,
                                                       raw: aiohttp.ClientSession) -> None:
    a, b, gw = await two_nodes(fakegpus, gateway)
    for path in (SCRIPT, STYLE):
        assert (await fetch(raw, gw.url + "/gen" + path))[0] == 200
    await a.kill()
    await b.kill()
    status, headers, body = await fetch(raw, gw.url + "/gen" + SCRIPT, **{"Accept-Encoding": "gzip"})
    assert status == 200 and gzip.decompress(body) == JS.encode() and headers["Cache-Control"] == IMMUTABLE
    # a file too small for gzip to shrink is held and sent as it is, in one representation
    status, headers, body = await fetch(raw, gw.url + "/gen" + STYLE, **{"Accept-Encoding": "gzip"})
    assert status == 200 and body == CSS.encode() and headers["Cache-Control"] == IMMUTABLE
    assert "Content-Encoding" not in headers and "Vary" not in headers
    assert (await fetch(raw, gw.url + "/gen/"))[0] == 502  # the page itself is the node's


async def test_the_rest_of_the_page_passes_through_as_the_node_sends_it(fakegpus: Any, gateway: Any,
                                                                       raw: aiohttp.ClientSession) -> None:
    a, b, gw = await two_nodes(fakegpus, gateway)
    for path in ("/", LOGO_PATH, "/api/object_info", "/object_info", "/extensions/core/widgets.js",
                 "/assets/index.js", "/assets/sorted-custom-node-map.json", "/assets/images/logo-AbCdEf12.svg"):
        direct, mine, body = await fetch(raw, a.url + path, **{"Accept-Encoding": "gzip"})
        for _ in range(2):
            status, headers, through = await fetch(raw, gw.url + "/gen" + path, **{"Accept-Encoding": "gzip"})
            assert status == direct and through == body, path
            assert headers.get("Cache-Control") == mine.get("Cache-Control"), path
            assert "Content-Encoding" not in headers and "ETag" not in headers, path
    assert asked("/", a, b) == 3 and asked(LOGO_PATH, a, b) == 3  # every time from a node
    assert (await fetch(raw, gw.url + "/gen/"))[1]["Cache-Control"] == "no-store, must-revalidate"
    assert gw.rt.page_assets.bytes == 0


async def test_a_nodes_404_passes_through_and_is_not_held(fakegpus: Any, gateway: Any,
                                                          raw: aiohttp.ClientSession) -> None:
    a, b, gw = await two_nodes(fakegpus, gateway)
    missing = "/assets/gone-AbCdEf12.js"
    for n in (1, 2):
        status, headers, body = await fetch(raw, gw.url + "/gen" + missing)
        assert status == 404 and headers["Cache-Control"] == "no-store" and b"no route" in body
        assert asked(missing, a, b) == n
    assert gw.rt.page_assets.held == {}


async def test_a_key_is_still_needed(fakegpus: Any, gateway: Any, raw: aiohttp.ClientSession) -> None:
    a, b, gw = await two_nodes(fakegpus, gateway)
    assert (await fetch(raw, gw.url + "/gen" + SCRIPT))[0] == 200  # held now
    for headers in ({}, {"Authorization": "Bearer kl_nobody_000000000000000000000"}):
        async with raw.get(gw.url + "/gen" + SCRIPT, headers=headers) as r:
            assert r.status == 401 and (await r.json())["error"]["type"] == "unauthorized"
    assert asked(SCRIPT, a, b) == 1


async def test_the_least_recently_used_file_goes_and_one_over_the_bound_passes_through(
        fakegpus: Any, gateway: Any, raw: aiohttp.ClientSession) -> None:
    a, b, gw = await two_nodes(fakegpus, gateway)
    script, style = JS.encode(), CSS.encode()
    held = gw.rt.page_assets
    one = make_asset(script, "application/javascript", "js").size
    held.max_bytes = one + 10  # room for the script, not for the script and the stylesheet
    await fetch(raw, gw.url + "/gen" + SCRIPT)
    assert held.bytes == one
    await fetch(raw, gw.url + "/gen" + STYLE)  # the script goes
    assert list(held.held) == [("gen", STYLE)] and held.bytes <= held.max_bytes
    await fetch(raw, gw.url + "/gen" + SCRIPT)  # asked again; the stylesheet goes
    assert asked(SCRIPT, a, b) == 2 and list(held.held) == [("gen", SCRIPT)] and held.bytes <= held.max_bytes
    held.max_bytes = len(style) - 1  # the stylesheet alone is over the bound: never held
    for n in (2, 3):
        status, headers, body = await fetch(raw, gw.url + "/gen" + STYLE, **{"Accept-Encoding": "gzip"})
        assert status == 200 and body == style and headers["Cache-Control"] == "no-store"
        assert asked(STYLE, a, b) == n
    assert ("gen", STYLE) not in held.held


# --- the rules, without sockets ----------------------------------------------------------------

def test_hashed_names_are_the_frontends() -> None:
    assert hashed_asset("/assets/vendor-three-ByVNcHWs.js") == "js"
    assert hashed_asset("/assets/Loader-Bkgmd-vZ.js") == "js"  # a hash may hold "-"
    assert hashed_asset("/assets/dialogService-D9pTJcyh.js.map") == "js.map"
    assert hashed_asset("/assets/index-DLkq2aPf.css") == "css"
    assert hashed_asset("/assets/primeicons-C6QP2o4f.woff2") == "woff2"
    assert hashed_asset("/assets/manifest-B9UzixYD.json") == "json"
    for plain in ("/assets/index.js", "/assets/sorted-custom-node-map.json", "/assets/images/logo-AbCdEf12.svg",
                  "/extensions/core/x-AbCdEf12.js", "/assets/video-BvOHf4P9.mp4", "/assets/primeicons-DMOk5skT.eot",
                  "/assets/dialogService-BBTn6Ech2.js", "/user.css", "/assets/-AbCdEf12.js"):
        assert hashed_asset(plain) is None, plain


def test_accept_encoding() -> None:
    for yes in ("gzip", "gzip, deflate, br, zstd", "br;q=1.0, gzip;q=0.8", "*", "x-gzip", "GZIP;Q=0.5"):
        assert accepts_gzip(yes), yes
    for no in (None, "", "identity", "gzip;q=0", "gzip;q=0.000", "br", "*;q=0", "gzip;q=0, *", "gzip;q=x"):
        assert not accepts_gzip(no), no


def test_the_bound_holds_and_the_least_recently_used_goes_first() -> None:
    held = PageAssets(max_bytes=300)
    files = {n: make_asset(bytes([n]) * 100, "image/png", "png") for n in range(4)}
    for n in (0, 1):
        assert held.put(("r", str(n)), files[n])
    assert held.get(("r", "0")) is files[0]  # 0 is now the more recent
    assert held.put(("r", "2"), files[2]) and held.put(("r", "3"), files[3])
    assert list(held.held) == [("r", "0"), ("r", "2"), ("r", "3")]  # 1, the least recently used, went
    assert held.bytes == sum(a.size for a in held.held.values()) <= 300
    assert not held.put(("r", "big"), make_asset(b"x" * 301, "image/png", "png"))
    assert list(held.by_route()) == [("r", len(held.held), held.bytes)]

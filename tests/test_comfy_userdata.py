"""ComfyUI's user data over two GPUs (docs/API.md "User data"): saved workflows and settings are
each key's own, in a directory of its own on the node, and written to every node of the route.

Two fake ComfyUI nodes (a primary and a standby), each with its own user directory
(kilolined/fakegpu/comfy_user.py, ComfyUI's app/user_manager.py and app/app_settings.py).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
from conftest import ADMIN, auth, base_config

from kilolined.adapters.comfy_userdata import key_dir

ALICE, BOB = key_dir("alice"), key_dir("bob")
WF = "/gen/api/userdata/workflows%2Fsecret.json"


async def two_nodes(fakegpus: Any, gateway: Any, **route: Any) -> tuple[Any, Any, Any]:
    a = await fakegpus("comfyui")
    b = await fakegpus("comfyui")
    return a, b, await gateway(base_config({"a": a.url, "b": b.url}, kind="comfyui", **route))


def files(g: Any) -> dict[str, bytes]:
    """A node's user directory, as it has it."""
    return {p: f.data for p, f in g.backend.user.files.items()}


async def call(http: aiohttp.ClientSession, method: str, url: str, headers: dict[str, str],
               body: Any = None) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) or body is None else orjson.dumps(body)
    async with http.request(method, url, data=data, headers=headers) as r:
        raw = await r.read()
        try:
            return r.status, orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            return r.status, raw.decode()


async def test_a_keys_saved_workflows_are_its_own(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    a, b, gw = await two_nodes(fakegpus, gateway)
    u = gw.url
    assert await call(http, "POST", u + WF, auth(), b'{"alice": 1}') == (200, "workflows/secret.json")
    # bob sees nothing of it: no list, no file
    assert (await call(http, "GET", u + "/gen/api/userdata?dir=workflows", auth("bob")))[0] == 404
    assert (await call(http, "GET", u + WF, auth("bob")))[0] == 404
    status, v2 = await call(http, "GET", u + "/gen/api/v2/userdata", auth("bob"))
    assert status == 200 and [e for e in v2 if e["type"] == "file"] == []
    assert await call(http, "GET", u + "/gen/api/v2/userdata", auth("carol")) == (200, [])  # nothing yet
    # bob saves his own under the same name: each keeps its own
    status, info = await call(http, "POST", u + WF + "?full_info=true", auth("bob"), b'{"bob": 2}')
    assert status == 200 and info["path"] == "workflows/secret.json" and info["size"] == 10
    assert set(info) == {"path", "size", "modified", "created"}
    assert await call(http, "GET", u + WF, auth()) == (200, {"alice": 1})
    assert await call(http, "GET", u + WF, auth("bob")) == (200, {"bob": 2})
    # the listings are the key's, relative as ComfyUI answers them
    assert await call(http, "GET", u + "/gen/api/userdata?dir=workflows&recurse=true", auth()) == \
        (200, ["secret.json"])
    status, listed = await call(http, "GET", u + "/gen/userdata?dir=workflows%2F&full_info=true", auth())
    assert status == 200 and [e["path"] for e in listed] == ["secret.json"]
    status, v2 = await call(http, "GET", u + "/gen/api/v2/userdata", auth())
    assert status == 200 and [(e["name"], e["path"], e["type"]) for e in v2] == \
        [("workflows", "workflows", "directory"), ("secret.json", "workflows/secret.json", "file")]
    status, v2 = await call(http, "GET", u + "/gen/api/v2/userdata?path=workflows", auth())
    assert [e["path"] for e in v2] == ["workflows/secret.json"]
    # a move names both ends in the key's directory, and answers as the key sees it
    assert await call(http, "POST", u + "/gen/api/userdata/workflows%2Fsecret.json/move/workflows%2Fkept.json",
                      auth()) == (200, "workflows/kept.json")
    assert await call(http, "DELETE", u + "/gen/api/userdata/workflows%2Fkept.json", auth()) == (204, None)
    # on the node: a directory per key, on both nodes (the standby too), nothing in the node's own
    want = {f"{BOB}/workflows/secret.json": b'{"bob": 2}'}
    assert files(a) == files(b) == want
    # the admin key sees the node's own user dir, where the keys' directories are
    assert (await call(http, "GET", u + "/gen/api/userdata?dir=workflows", ADMIN))[0] == 404
    status, v2 = await call(http, "GET", u + "/gen/api/v2/userdata", ADMIN)
    assert status == 200 and {e["path"] for e in v2} >= {ALICE, BOB, f"{BOB}/workflows/secret.json"}
    assert await call(http, "POST", u + "/gen/api/userdata/admin.json", ADMIN, b"{}") == (200, "admin.json")
    assert files(a)["admin.json"] == files(b)["admin.json"] == b"{}"
    assert (await call(http, "GET", u + "/gen/api/userdata/admin.json", auth()))[0] == 404


async def test_settings_are_each_keys_own(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    a, b, gw = await two_nodes(fakegpus, gateway)
    u = gw.url + "/gen"
    assert await call(http, "GET", u + "/api/settings", auth()) == (200, {})
    assert await call(http, "POST", u + "/api/settings/Comfy.ColorPalette", auth(), "light") == (200, None)
    assert await call(http, "GET", u + "/api/settings/Comfy.ColorPalette", auth()) == (200, "light")
    assert await call(http, "POST", u + "/settings", auth(), {"Comfy.Locale": "en", "n": 2}) == (200, None)
    assert await call(http, "GET", u + "/settings", auth()) == \
        (200, {"Comfy.ColorPalette": "light", "Comfy.Locale": "en", "n": 2})
    # bob has none of them
    assert await call(http, "GET", u + "/api/settings", auth("bob")) == (200, {})
    assert await call(http, "GET", u + "/api/settings/Comfy.ColorPalette", auth("bob")) == (200, None)
    assert await call(http, "POST", u + "/api/settings/Comfy.ColorPalette", auth("bob"), "dark") == (200, None)
    assert await call(http, "GET", u + "/api/settings/Comfy.ColorPalette", auth()) == (200, "light")
    # kept as ComfyUI keeps them: the key's comfy.settings.json, on both nodes
    for g in (a, b):
        assert orjson.loads(files(g)[f"{ALICE}/comfy.settings.json"]) == \
            {"Comfy.ColorPalette": "light", "Comfy.Locale": "en", "n": 2}
        assert orjson.loads(files(g)[f"{BOB}/comfy.settings.json"]) == {"Comfy.ColorPalette": "dark"}
        assert "comfy.settings.json" not in files(g)
    assert (await call(http, "POST", u + "/api/settings", auth(), [1, 2]))[0] == 400


async def test_a_saved_workflow_outlives_the_node_it_was_read_from(fakegpus: Any, gateway: Any,
                                                                  http: aiohttp.ClientSession) -> None:
    a, _, gw = await two_nodes(fakegpus, gateway)
    assert (await call(http, "POST", gw.url + WF, auth(), b'{"mine": true}'))[0] == 200
    assert (await call(http, "POST", gw.url + "/gen/api/settings/Comfy.ColorPalette", auth(), "light"))[0] == 200
    await a.kill()
    async with http.get(gw.url + "/gen/api/userdata?dir=workflows", headers=auth()) as r:
        assert r.status == 200 and await r.json() == ["secret.json"]
        assert r.headers["X-KiloLine-Node"] == "b"
    assert await call(http, "GET", gw.url + WF, auth()) == (200, {"mine": True})
    assert await call(http, "GET", gw.url + "/gen/api/settings", auth()) == (200, {"Comfy.ColorPalette": "light"})
    # a write the dead node cannot take is the others' (logged, not fatal)
    assert await call(http, "POST", gw.url + "/gen/api/userdata/workflows%2Fnext.json", auth(), b"{}") == \
        (200, "workflows/next.json")


async def test_a_name_never_leaves_the_keys_directory(fakegpus: Any, gateway: Any,
                                                      http: aiohttp.ClientSession) -> None:
    a, b, gw = await two_nodes(fakegpus, gateway)
    u = gw.url + "/gen/api/userdata"
    assert (await call(http, "POST", u + "/secret.json", ADMIN, b'"the node\'s"'))[0] == 200
    assert (await call(http, "POST", u + "/w.json", auth("bob"), b'"bob\'s"'))[0] == 200
    before = files(a)
    assert before == files(b) and set(before) == {"secret.json", f"{BOB}/w.json"}
    # the node's own files are not the key's
    assert (await call(http, "GET", u + "/secret.json", auth()))[0] == 404
    # a dot part, encoded once: refused before routing; twice (ComfyUI decodes twice): refused here
    assert (await call(http, "GET", u + "/..%2F..%2Fdefault%2Fsecret.json", auth()))[0] == 400
    for name in ("..%252Fsecret.json", f"..%252F{BOB}%252Fw.json", "a%252F..%252F..%252Fsecret.json",
                 "%2Fetc%2Fpasswd", "%252Fsecret.json", "a%5Cb.json"):
        for method in ("GET", "POST", "DELETE"):
            assert await call(http, method, f"{u}/{name}", auth(), b'"x"') == (403, None), (method, name)
        assert await call(http, "POST", f"{u}/mine.json/move/{name}", auth()) == (403, None)
        assert await call(http, "POST", f"{u}/{name}/move/mine.json", auth()) == (403, None)
    assert await call(http, "GET", u + "?dir=..%252F", auth()) == (403, "Invalid directory")
    assert await call(http, "GET", u + f"?dir=..%2F{BOB}", auth()) == (403, "Invalid directory")
    assert await call(http, "GET", u + "?dir=%2Fetc", auth()) == (403, "Invalid directory")
    assert await call(http, "GET", gw.url + "/gen/api/v2/userdata?path=..", auth()) == \
        (400, "Invalid path requested")
    assert await call(http, "GET", gw.url + f"/gen/api/v2/userdata?path=..%252F{BOB}", auth()) == \
        (400, "Invalid path requested")
    assert files(a) == files(b) == before


async def test_a_shared_route_keeps_the_nodes_own_user_dir(fakegpus: Any, gateway: Any,
                                                           http: aiohttp.ClientSession) -> None:
    a, b, gw = await two_nodes(fakegpus, gateway, comfy={"shared": True})
    assert await call(http, "POST", gw.url + WF, auth(), b"{}") == (200, "workflows/secret.json")
    assert await call(http, "POST", gw.url + "/gen/api/settings/Comfy.ColorPalette", auth(), "light") == (200, None)
    assert await call(http, "GET", gw.url + "/gen/api/userdata?dir=workflows", auth("bob")) == \
        (200, ["secret.json"])
    assert await call(http, "GET", gw.url + "/gen/api/settings", auth("bob")) == (200, {"Comfy.ColorPalette": "light"})
    assert set(files(a)) == set(files(b)) == {"workflows/secret.json", "comfy.settings.json"}

"""A reload that gives a node another URL makes it another server: the prefix index the gateway
kept under that name is cleared (docs/CONFIG.md#affinity). A reload that keeps the URL keeps it.
The real daemon over loopback in front of two simulated GPUs (kind openai, with their prompt cache)."""

from __future__ import annotations

from typing import Any

import aiohttp
from affinity_llamas import metrics, value
from conftest import ADMIN, auth, base_config


def chat(question: str) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 2,
            "messages": [{"role": "system", "content": "a long document " * 80}, {"role": "user", "content": question}]}


async def ask(http: aiohttp.ClientSession, url: str, question: str) -> str:
    async with http.post(url + "/v1/chat/completions", json=chat(question), headers=auth()) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers["X-KiloLine-Node"]


async def reload(http: aiohttp.ClientSession, gw: Any, cfg: dict[str, Any]) -> None:
    gw.write_config(cfg)
    async with http.post(gw.url + "/admin/reload", headers=ADMIN) as r:
        assert r.status == 200, await r.text()


async def index_keys(http: aiohttp.ClientSession, url: str) -> dict[str, int]:
    async with http.get(url + "/admin/state", headers=ADMIN) as r:
        keys: dict[str, int] = (await r.json())["routes"]["gen"]["index_keys"]
        return keys


async def test_a_node_given_another_url_by_a_reload_forgets_its_index(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    first, second = await fakegpus("openai"), await fakegpus("openai")
    cfg = base_config({"n0": first.url}, kind="openai", path="/v1", affinity="prefix")
    gw = await gateway(cfg)
    assert await ask(http, gw.url, "one?") == "n0"
    held = (await index_keys(http, gw.url))["n0"]
    assert held > 0
    # The same server, another setting: what it holds is still known.
    cfg["routes"]["gen"]["max_concurrency"] = 3
    await reload(http, gw, cfg)
    assert (await index_keys(http, gw.url))["n0"] == held
    # Another server under the same name: it holds nothing the gateway sent to the first.
    cfg["nodes"]["n0"]["url"] = second.url
    await reload(http, gw, cfg)
    assert (await index_keys(http, gw.url)).get("n0", 0) == 0
    await ask(http, gw.url, "two?")
    text = await metrics(http, gw.url)
    assert value(text, "kiloline_affinity_decisions_total", route="gen", outcome="miss") == 2
    assert value(text, "kiloline_affinity_decisions_total", route="gen", outcome="hit") == 0
    assert second.stats["served"] == 1 and first.stats["served"] == 1

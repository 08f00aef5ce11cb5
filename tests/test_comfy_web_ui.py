"""The fake ComfyUI's web UI in a real headless Chromium, through the gateway, over two nodes.

The page loads under the route's prefix (``/gen`` redirects to ``/gen/``; the logo its script and
stylesheet name root-absolutely loads too), opens one socket to the gateway, queues two prompts
that run one on each node, and shows each one's progress, previews and image.

Needs Debian's `chromium` and `chromium-driver` and the `selenium` package; skipped without
them (tests/test_dashboard.py sets the browser up the same way).
"""

from __future__ import annotations

from typing import Any

import aiohttp
from browser_page import Page
from comfy_gpus import node_of
from conftest import KEYS, base_config


async def test_the_web_ui_runs_prompts_on_both_nodes(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession,
                                                     browser: Any) -> None:
    a = await fakegpus("comfyui", step_ms=30, previews=True)
    b = await fakegpus("comfyui", step_ms=30, previews=True)
    cfg = base_config({"a": a.url, "b": b.url}, kind="comfyui", max_concurrency=1)
    cfg["routes"]["gen"].update(nodes=["a", "b"], standby=[])
    gw = await gateway(cfg)
    page = Page(browser)
    # A browser sends the key as a header the way a proxy in front of it would.
    await page.call(browser.execute_cdp_cmd, "Network.enable", {})
    await page.call(browser.execute_cdp_cmd, "Network.setExtraHTTPHeaders",
                    {"headers": {"Authorization": f"Bearer {KEYS['alice']}"}})
    await page.call(browser.get, gw.url + "/gen?steps=8")
    assert (await page.js("return location.pathname;")) == "/gen/"
    await page.until("window.comfyPage && window.comfyPage.socketOpen && window.comfyPage.statuses > 0",
                     "the socket to the gateway")
    await page.until("document.getElementById('logo-img').naturalWidth > 0", "the root-absolute logo")
    assert await page.js("return getComputedStyle(document.getElementById('logo')).backgroundImage;") \
        == 'url("' + gw.url + '/assets/images/logo.svg")'
    await page.click("#queue-button")
    await page.click("#queue-button")
    await page.until("Object.keys(window.comfyPage.prompts).length == 2 && "
                     "Object.values(window.comfyPage.prompts).every(p => p.done)", "both prompts done", timeout=20)
    prompts = await page.js("return window.comfyPage.prompts;")
    assert {node_of(gw, pid) for pid in prompts} == {"a", "b"}
    for pid, p in prompts.items():
        assert p["progress"] == list(range(1, 9)), pid
        assert p["image"].startswith(gw.url + "/gen/api/view?filename=")
    # Both nodes wrote ComfyUI_00001_.png: the page was told two names, each its prompt's file.
    assert len({p["image"] for p in prompts.values()}) == 2
    await page.until("[...document.querySelectorAll('#prompts img.image')]"
                     ".every(i => i.complete && i.naturalWidth > 0)", "both images shown")
    assert await page.js("return window.comfyPage.previews;") == 16

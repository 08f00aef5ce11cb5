"""The dashboard's route card shows a ComfyUI route's files, in a real headless Chromium against a
live gateway (skipped without chromium, as tests/test_dashboard.py)."""

from __future__ import annotations

from typing import Any

import aiohttp
from browser_page import Page
from comfy_files_client import two_nodes, upload
from conftest import ADMIN_KEY

from kilolined.fakegpu.comfy_graph import make_png


async def test_the_route_card_shows_the_files(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession,
                                              browser: Any) -> None:
    gw = await gateway(two_nodes(await fakegpus("comfyui"), await fakegpus("comfyui")))
    page = Page(browser)
    await page.call(browser.get, gw.url + "/dashboard")
    await page.until("!document.querySelector('#login').hidden", "the login form")
    await page.type_into("#admin-key", ADMIN_KEY)
    await page.click("#login-submit")
    line = '[data-route="gen"] [data-field=comfy_files]'
    text = await page.until(f"(e => e && !e.hidden && e.textContent)(document.querySelector('{line}'))",
                            "the files line")
    assert text == "files 0 · 0 B in memory"
    png = make_png("cat")
    await upload(http, gw.url, "cat.png", png)
    got = await page.until(f"(e => e.textContent.startsWith('files 1') && e.textContent)"
                           f"(document.querySelector('{line}'))", "the upload", timeout=15)
    assert got == f"files 1 · {len(png)} B in memory"

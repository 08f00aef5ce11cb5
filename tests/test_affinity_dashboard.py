"""The dashboard's route card shows the cached share of prompt tokens (SPEC §13), in a real
headless Chromium against a live gateway (skipped without chromium, as tests/test_dashboard.py)."""

from __future__ import annotations

from typing import Any

import aiohttp
from affinity_llamas import DOC_TOKENS, ask, chat, config
from browser_page import Page
from conftest import ADMIN_KEY


async def test_the_route_card_shows_the_cached_share(
        llamas: Any, gateway: Any, http: aiohttp.ClientSession, browser: Any) -> None:
    servers = await llamas(2)
    gw = await gateway(config(servers))
    page = Page(browser)
    await page.call(browser.get, gw.url + "/dashboard")
    await page.until("!document.querySelector('#login').hidden", "the login form")
    await page.type_into("#admin-key", ADMIN_KEY)
    await page.click("#login-submit")
    share = '[data-route="gen"] [data-field=cached_share]'
    text = await page.until(f"(e => e && !e.hidden && e.textContent)(document.querySelector('{share}'))",
                            "the affinity line")
    assert text == "prompt cached — of 0 tokens · affinity prefix"
    await ask(http, gw.url, chat(1, "first?"))
    await ask(http, gw.url, chat(1, "second?"))  # the node reuses the document: 100 of 210 tokens
    total = (DOC_TOKENS + 5) + (DOC_TOKENS + 5)
    want = f"prompt cached {round(100 * DOC_TOKENS / total)}% of {total} tokens · affinity prefix"
    got = await page.until(f"(e => e.textContent.includes('% of') && e.textContent)(document.querySelector('{share}'))",
                           "the cached share", timeout=15)
    assert got == want

"""The dashboard's node card shows a node's speed against its peers, and a slow one as slow."""

from __future__ import annotations

import asyncio

from browser_page import Page
from conftest import ADMIN_KEY, wait_until
from slow_fleet import fleet, load


async def test_the_node_card_shows_speed_against_peers(fakegpus, gateway, http, tg, dc, browser) -> None:
    _a, _b, _c, _cfg, gw = await fleet(fakegpus, gateway, tg, dc)
    stop, seen = asyncio.Event(), []
    workers = [asyncio.create_task(load(http, gw.url, stop, seen)) for _ in range(6)]
    try:
        await wait_until(lambda: gw.rt.scheduler.nodes["c"].slowed, timeout=60)
    finally:
        stop.set()
        await asyncio.gather(*workers)
    page = Page(browser)
    await page.call(browser.get, gw.url + "/dashboard")
    await page.until("!document.querySelector('#login').hidden", "the login form")
    await page.type_into("#admin-key", ADMIN_KEY)
    await page.click("#login-submit")
    await page.until("document.querySelector('#conn').dataset.state === 'live'", "the stream live")
    sel = '[data-node="c"] [data-field=speed]'
    await page.until(f"document.querySelector('{sel}')?.dataset.state === 'slow'", "c shown slow")
    text = await page.text(sel)
    assert text.startswith("speed ") and " ms/request vs " in text and "on its peers" in text and text.endswith(
        "· slow"), text
    ok = await page.text('[data-node="a"] [data-field=speed]')
    assert ok.startswith("speed ") and "slow" not in ok, ok

"""A fleet node on the dashboard (docs/FLEET.md): its card says where it is rented and what it
costs, in a real headless Chromium against a live gateway and the fake Vast.ai market."""

from __future__ import annotations

import asyncio
from typing import Any

from browser_page import Page
from conftest import ADMIN_KEY, auth, wait_until
from fleet_market import WAIT, fleet_config, live, pool, serving
from fleet_vast import scaling_config


async def test_a_rented_node_shows_provider_instance_and_price(fakegpus: Any, gateway: Any, market: Any,
                                                               browser: Any) -> None:
    fp = await market()
    static = await fakegpus()
    gw = await gateway(fleet_config(static.url, fp, {"p": pool(size=1)}))
    await wait_until(lambda: len(serving(gw)) == 1, timeout=WAIT)
    inst = live(fp)[0]
    page = Page(browser)
    await page.call(browser.get, gw.url + "/dashboard")
    await page.until("!document.querySelector('#login').hidden", "the login form")
    await page.type_into("#admin-key", ADMIN_KEY)
    await page.click("#login-submit")
    rented = f'[data-node="p-{inst.id}"] [data-field=rented]'
    text = await page.until(f"document.querySelector('{rented}')?.textContent", "the rented line")
    assert text == f"rented: vast #{inst.id} (pool p) · ${inst.price:.3f}/h"
    assert await page.until("document.querySelector('[data-node=\"static\"] [data-field=rented]').hidden",
                            "a static node has no rented line")


async def test_the_pool_panel_shows_each_instance_its_state_and_price_and_spend_against_the_cap(
        fakegpus: Any, gateway: Any, vast: Any, browser: Any, http: Any) -> None:
    """A pool min 0, max 2: empty, then its instance serving or idle with its price and the spend
    against the cap, then stopped (unbilled), then booting again on a resume."""
    static = await fakegpus()
    gw = await gateway(scaling_config(static.url, vast, idle_stop_sec=2))
    page = Page(browser)
    await page.call(browser.get, gw.url + "/dashboard")
    await page.until("!document.querySelector('#login').hidden", "the login form")
    await page.type_into("#admin-key", ADMIN_KEY)
    await page.click("#login-submit")
    panel = "document.querySelector('#fleet')"
    assert await page.until(f"!{panel}.hidden && {panel}.querySelector('[data-pool=p] [data-field=summary]')"
                            "?.textContent.startsWith('no instance')", "an empty pool")
    assert await page.text("#fleet [data-field=spend]") == "$0.00/h of $2.00/h cap"
    async with http.post(gw.url + "/pool/generate", json={}, headers=auth()) as r:
        assert r.status == 200
    inst = next(iter(vast.instances.values()))
    li = f"#fleet li[data-instance=\"p-{inst.id}\"]"
    # The page shows what the last pushed state said: it catches up from booting.
    await page.until(f"['serving', 'idle'].includes(document.querySelector('{li}')?.dataset.state)",
                     "the serving row")
    text = await page.text(li)
    assert text is not None and text.startswith(f"p-{inst.id} · ") and text.endswith(f"${inst.price:.3f}/h")
    assert await page.text("#fleet [data-field=spend]") == f"${inst.price:.2f}/h of $2.00/h cap"
    # Idle past idle_stop_sec: stopped, no longer billed, its price what a resume would cost.
    await page.until(f"document.querySelector('{li}')?.dataset.state === 'stopped'", "the stopped row", timeout=WAIT)
    assert await page.text(li) == f"p-{inst.id} · stopped · ${inst.price:.3f}/h when resumed"
    assert await page.js(f"return document.querySelector('{li}').dataset.billed") == "0"
    assert await page.text("#fleet [data-field=spend]") == "$0.00/h of $2.00/h cap"
    assert await page.text("#fleet [data-pool=p] [data-field=summary]") == "1 stopped · min 0, max 2 · vast"
    # A request resumes it: booting (the fake's resume is made long enough to be seen).
    vast.resume_sec = 60.0
    waiting = asyncio.ensure_future(http.post(gw.url + "/pool/generate", json={}, headers=auth()))
    try:
        await page.until(f"document.querySelector('{li}')?.dataset.state === 'booting'", "the resumed row",
                         timeout=WAIT)
        assert await page.js(f"return document.querySelector('{li}').dataset.billed") == "1"
    finally:
        waiting.cancel()


async def test_fleet_events_show_in_the_feed(fakegpus: Any, gateway: Any, market: Any,
                                             browser: Any) -> None:
    """fleet_node_rented and fleet_node_ready (docs/FLEET.md) reach the feed, in their words;
    a page kept a hand list of kinds and dropped every fleet event."""
    fp = await market()
    static = await fakegpus()
    gw = await gateway(fleet_config(static.url, fp, {"p": pool(size=1)}))
    await wait_until(lambda: len(serving(gw)) == 1, timeout=WAIT)
    inst = live(fp)[0]
    page = Page(browser)
    await page.call(browser.get, gw.url + "/dashboard")
    await page.until("!document.querySelector('#login').hidden", "the login form")
    await page.type_into("#admin-key", ADMIN_KEY)
    await page.click("#login-submit")
    for kind in ("fleet_node_rented", "fleet_node_ready"):  # replayed from the feed's backlog
        await page.until(f"document.querySelector('#feed li[data-kind={kind}]')", f"{kind} in the feed")
    ready = await page.text("#feed li[data-kind=fleet_node_ready] .t")
    assert f"p-{inst.id} serving on pool" in ready
    assert "good" in await page.js("return document.querySelector('#feed li[data-kind=fleet_node_ready]').className")
    # One raised while the page is open arrives too: the instance reclaimed, lost, replaced.
    await fp.reclaim(fp.instances[inst.id])
    await page.until("document.querySelector('#feed li[data-kind=fleet_node_lost]')", "fleet_node_lost in the feed")
    assert "reclaimed by vast" in await page.text("#feed li[data-kind=fleet_node_lost] .t")

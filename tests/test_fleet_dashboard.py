"""A fleet node on the dashboard (docs/FLEET.md): its card says where it is rented and what it
costs, in a real headless Chromium against a live gateway and the fake Vast.ai market."""

from __future__ import annotations

from typing import Any

from conftest import ADMIN_KEY, wait_until
from test_dashboard import Page, browser  # noqa: F401  (the fixture)
from test_fleet import WAIT, fleet_config, live, market, pool, serving  # noqa: F401  (market: the fixture)


async def test_a_rented_node_shows_provider_instance_and_price(fakegpus: Any, gateway: Any, market: Any,  # noqa: F811
                                                               browser: Any) -> None:  # noqa: F811
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


async def test_fleet_events_show_in_the_feed(fakegpus: Any, gateway: Any, market: Any,  # noqa: F811
                                             browser: Any) -> None:  # noqa: F811
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

"""The operator dashboard (SPEC §7) in a real headless Chromium, against a live gateway.

One scenario: sign in (a wrong key first), watch a burst queue up and drain on the route card,
kill the primary mid-burst and see the failover in the feed and on the cards; screenshots at
desktop and phone size go to tests/artifacts/ (gitignored).

Needs Debian's `chromium` and `chromium-driver` and the `selenium` package; skipped without
them. Selenium Manager is never used (no downloads): the driver and browser paths are given.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import re
from pathlib import Path

import aiohttp
import yaml
from browser_page import ROUTE, Page
from conftest import ADMIN_KEY, auth, base_config, sha, wait_until

from kilolined.core.config import parse_config
from kilolined.edge.server import Server

ARTIFACTS = Path(__file__).parent / "artifacts"
RECORD_URLS = """
window.__urls = [];
const ES = window.EventSource, f = window.fetch;
window.EventSource = class extends ES { constructor(u, o) { window.__urls.push(String(u)); super(u, o); } };
window.fetch = (u, o) => { window.__urls.push(String(u)); return f(u, o); };
"""


async def test_dashboard_live_queue_and_failover(fakegpus, gateway, http, browser) -> None:
    # Two 24 GB cards, ~300 ms per job; gen has one slot per node: a primary, b standby.
    primary = await fakegpus(steps=6, step_ms=50, crash_sec=5)
    standby = await fakegpus(steps=6, step_ms=50)
    cfg = base_config({"a": primary.url, "b": standby.url}, max_concurrency=1)
    for node in cfg["nodes"].values():
        node["health"] = {"path": "/health", "interval_sec": 0.2, "timeout_sec": 0.5, "fall": 1, "rise": 1}
    cfg["nodes"]["a"]["label"] = "Vast.ai #8410"
    cfg["cost"] = {"gpu_hourly_usd": 0.30, "serverless_per_sec_usd": 0.0011}
    gw = await gateway(cfg)
    rt = gw.rt
    await wait_until(lambda: primary.stats["health_checks"] > 0 and standby.stats["health_checks"] > 0)

    page = Page(browser)
    # Record every URL the page opens (fetch and EventSource) before its own script runs.
    await page.call(browser.execute_cdp_cmd, "Page.addScriptToEvaluateOnNewDocument", {"source": RECORD_URLS})
    await page.call(browser.get, gw.url + "/dashboard")

    # --- sign in: a wrong key is refused on the form, the right one opens the live view
    await page.until("!document.querySelector('#login').hidden", "the login form")
    await page.type_into("#admin-key", "kl_not_the_admin_key")
    await page.click("#login-submit")
    await page.until("document.querySelector('#login-error').textContent.includes('not accepted')",
                     "the wrong key refused")
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(ARTIFACTS / "dashboard-login.png", 1280, 800)
    assert await page.js("return sessionStorage.getItem('kiloline.adminKey')") is None
    await page.type_into("#admin-key", ADMIN_KEY)
    await page.click("#login-submit")
    await page.until("document.querySelector('#conn').dataset.state === 'live'", "the stream live")
    await page.until(f"document.querySelector('{ROUTE} [data-field=mode]')", "the route card")
    assert await page.js("return sessionStorage.getItem('kiloline.adminKey')") == ADMIN_KEY
    assert await page.text(f"{ROUTE} [data-field=mode]") == "primary"
    assert await page.text(f"{ROUTE} [data-field=queue_depth]") == "0"
    await page.until("document.querySelectorAll('[data-node=a], [data-node=b]').length === 2", "both node cards")
    assert await page.text('[data-node="a"] [data-field=health]') == "up"
    assert await page.text('[data-node="b"] [data-field=breaker]') == "closed"
    assert await page.text('[data-node="a"] [data-field=drained]') == "no"
    assert await page.text('[data-node="a"] [data-field=label]') == "Vast.ai #8410"
    await page.until("document.querySelector('[data-node=a] [data-field=latency]').dataset.points > 1",
                     "a latency sparkline")
    assert await page.js("return !document.querySelector('#cost').hidden")
    # The admin key went in headers only: no URL the page loaded carries it.
    urls = await page.js("return window.__urls")
    assert any(u.startswith("/admin/events?session=") for u in urls), urls
    assert "/admin/session" in urls, urls
    assert not any(ADMIN_KEY in u for u in urls), urls

    async def one(who: str) -> int:
        async with http.post(gw.url + "/gen/generate", json={}, headers=auth(who),
                             timeout=aiohttp.ClientTimeout(total=20)) as r:
            await r.read()
            return r.status

    # --- a burst of 8 on one slot: the queue rises on the card, slots fill, then it drains to 0
    burst = [asyncio.create_task(one("alice" if i % 3 else "bob")) for i in range(8)]
    peak = int(await page.until(
        f"(+document.querySelector('{ROUTE} [data-field=queue_depth]').textContent > 0) && "
        f"document.querySelector('{ROUTE} [data-field=queue_depth]').textContent", "the queue rising"))
    assert peak > 0
    await page.until(f"document.querySelector('{ROUTE} [data-field=waiting_by_key] [data-key=alice]')",
                     "waiting per key")
    await page.until(f"document.querySelectorAll('{ROUTE} [data-field=slots] .slot.busy').length === 1",
                     "the busy slot box")
    assert await page.js(f"return document.querySelectorAll('{ROUTE} [data-field=slots] .slot').length") == 1
    assert sorted(await asyncio.gather(*burst)) == [200] * 8
    await page.until(f"document.querySelector('{ROUTE} [data-field=queue_depth]').textContent === '0'",
                     "the queue back to 0")
    await page.until(f"document.querySelector('{ROUTE} [data-field=outcomes] [data-status=\"200\"] b')"
                     "?.textContent === '8'", "8 × 200 in the outcome counts")
    assert (await page.text(f"{ROUTE} [data-field=duration_p50]")) not in (None, "—")
    assert (await page.text("#cost [data-field=ratio]")).endswith("×")

    # --- kill the primary mid-burst: failover in the feed, mode and node cards follow
    burst = [asyncio.create_task(one("alice")) for _ in range(6)]
    sched = rt.scheduler
    await wait_until(lambda: sched.node_inflight.get("a", 0) == 1 and len(sched.routes["gen"].waiting) > 0)
    await primary.kill()
    await page.until("document.querySelector('#feed li[data-kind=failover]')", "a failover in the feed")
    assert "failing over to b" in await page.text("#feed li[data-kind=failover]")
    await page.until(f"document.querySelector('{ROUTE}').dataset.mode === 'failover'", "mode failover")
    assert await page.text(f"{ROUTE} [data-field=mode]") == "failover"
    await page.until("document.querySelector('[data-node=a] [data-field=health]').textContent === 'down'",
                     "node a down")
    # Newest first, each with its time (HH:MM:SS) and text.
    ids = await page.js("return [...document.querySelectorAll('#feed li')].map(li => +li.dataset.id)")
    assert "node_down" in await page.js("return [...document.querySelectorAll('#feed li')].map(li => li.dataset.kind)")
    assert ids == sorted(ids, reverse=True) and len(ids) >= 2, ids
    assert len(await page.text("#feed li time")) == 8
    await page.screenshot(ARTIFACTS / "dashboard.png", 1280, 800)
    await page.screenshot(ARTIFACTS / "dashboard-phone.png", 390, 844, mobile=True)
    await page.screenshot(ARTIFACTS / "dashboard-phone-full.png", 390, 844, mobile=True, full=True)
    # Phone size: cards stack in one column.
    lefts = await page.js("return [...document.querySelectorAll('[data-route], [data-node]')]"
                          ".map(e => Math.round(e.getBoundingClientRect().left))")
    assert len(set(lefts)) == 1, lefts
    assert await page.js("return document.documentElement.scrollWidth <= 390")

    statuses = await asyncio.gather(*burst)
    assert statuses.count(200) >= 5, statuses  # the one on the dying node may be lost; the rest are served
    await page.until(f"document.querySelector('{ROUTE} [data-field=queue_depth]').textContent === '0'",
                     "the queue drained on the standby")

    # The drain button posts with the admin key in a header; the card and the feed follow.
    await page.call(browser.execute_cdp_cmd, "Emulation.clearDeviceMetricsOverride", {})
    await page.click('[data-node="a"] [data-action=drain]')
    await page.until("document.querySelector('[data-node=a]').dataset.drained === 'true'", "node a drained")
    assert rt.scheduler.nodes["a"].drained
    await page.until("document.querySelector('#feed li[data-kind=drain]')", "the drain in the feed")
    assert await page.text('[data-node="a"] [data-action=drain]') == "Undrain"
    # No script error in the whole run (the wrong key's 401 is the one expected console error).
    logs = await page.call(browser.get_log, "browser")
    errors = [e["message"] for e in logs if e["level"] == "SEVERE" and "/admin/session" not in e["message"]]
    assert not errors, errors
    # Sign out: the key leaves sessionStorage and the login comes back.
    await page.click("#logout")
    await page.until("!document.querySelector('#login').hidden", "the login form again")
    assert await page.js("return sessionStorage.getItem('kiloline.adminKey')") is None


async def test_dashboard_reconnects_and_asks_again_for_a_rotated_key(fakegpus, gateway, browser) -> None:
    """The stream survives a gateway restart (new process, old session refused → a new session);
    when the admin key changed meanwhile, the page asks for it again."""
    gpu = await fakegpus()
    cfg = base_config({"a": gpu.url})
    cfg["server"]["shutdown_grace_sec"] = 0.5
    gw = await gateway(cfg)
    port = gw.server.port
    page = Page(browser)
    await page.call(browser.get, gw.url + "/dashboard")
    await page.until("!document.querySelector('#login').hidden", "the login form")
    await page.type_into("#admin-key", ADMIN_KEY)
    await page.click("#login-submit")
    await page.until("document.querySelector('#conn').dataset.state === 'live'", "the stream live")
    assert await page.js("return document.querySelector('#cost').hidden")  # no prices configured

    async def restart(admin_key: str) -> Server:
        new = copy.deepcopy(cfg)
        new["server"]["listen"] = f"127.0.0.1:{port}"
        new["admin"]["key_sha256"] = sha(admin_key)
        text = yaml.safe_dump(new)
        srv = Server(parse_config(text, env={}), hashlib.sha256(text.encode()).hexdigest(), None, watch=False)
        await srv.start()
        return srv

    servers: list[Server] = []
    try:
        await gw.server.shutdown()
        await page.until("document.querySelector('#conn').dataset.state === 'reconnecting'", "the link lost")
        servers.append(await restart(ADMIN_KEY))
        await page.until("document.querySelector('#conn').dataset.state === 'live'", "live again", timeout=12)
        await page.until("document.querySelector('[data-route=gen] [data-field=mode]').textContent === 'primary'",
                         "the route card after the restart")
        assert not await page.js("return document.querySelector('#app').hidden")

        await servers[-1].shutdown()
        servers.append(await restart("kl_rotated_admin_key_0000000000000"))
        await page.until("!document.querySelector('#login').hidden", "the login after a key change", timeout=12)
        assert "sign in again" in await page.text("#login-error")
        assert await page.js("return sessionStorage.getItem('kiloline.adminKey')") is None
    finally:
        for srv in servers:
            await srv.shutdown()


async def test_a_page_opened_after_a_burst_shows_it_and_a_ramping_node(fakegpus, gateway, http, browser) -> None:
    """The chart's history comes from the gateway, so a page opened after the burst still shows
    its peak; a node back from the dead says it is ramping and when it will be at full strength."""
    gpu = await fakegpus(steps=10, step_ms=60)
    cfg = base_config({"a": gpu.url}, max_concurrency=2)
    cfg["nodes"]["a"]["health"] = {"path": "/health", "interval_sec": 0.1, "timeout_sec": 0.3, "fall": 1, "rise": 1}
    cfg["nodes"]["a"]["breaker"] = {"slow_start_sec": 600}
    gw = await gateway(cfg)
    sched = gw.rt.scheduler

    async def one() -> int:
        async with http.post(gw.url + "/gen/generate", json={}, headers=auth(),
                             timeout=aiohttp.ClientTimeout(total=20)) as r:
            await r.read()
            return r.status

    burst = [asyncio.create_task(one()) for _ in range(8)]
    await wait_until(lambda: len(sched.routes["gen"].waiting) == 6)
    assert await asyncio.gather(*burst) == [200] * 8
    await gpu.kill()
    await wait_until(lambda: not sched.nodes["a"].healthy, timeout=10)
    await gpu.revive()
    await wait_until(lambda: sched.nodes["a"].healthy, timeout=10)
    assert not sched.routes["gen"].waiting  # the burst is over before the page opens

    page = Page(browser)
    await page.call(browser.get, gw.url + "/dashboard")
    await page.until("!document.querySelector('#login').hidden", "the login form")
    await page.type_into("#admin-key", ADMIN_KEY)
    await page.click("#login-submit")
    await page.until("document.querySelector('#conn').dataset.state === 'live'", "the stream live")
    chart = f"{ROUTE} [data-field=queue_history]"
    await page.until(f"document.querySelector('{chart}')?.dataset.peak === '6'", "the burst's peak in the chart")
    assert await page.text(f"{ROUTE} [data-field=hist_max]") == "peak 6 queued"
    assert await page.text(f"{ROUTE} [data-field=queue_depth]") == "0"
    assert await page.js(f"return document.querySelector('{chart} path.q').getAttribute('d').length") > 0
    ramp = '[data-node="a"] [data-field=ramp]'
    text = await page.until(f"document.querySelector('{ramp}')?.textContent", "the ramp line")
    assert re.fullmatch(r"ramping 1→2, full in \d+ s", text), text
    assert 590 <= int(text.split()[-2]) <= 600
    assert await page.js(f"return !document.querySelector('{ramp}').hidden")
    assert await page.text('[data-node="a"] [data-field=slots]') == "1"
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(ARTIFACTS / "dashboard-history-ramp.png", 1280, 800)


async def test_a_multi_model_node_shows_what_it_has_loaded(fakegpus, gateway, http, browser) -> None:
    """llama-swap-like node: the card says which model is loaded, and follows a swap."""
    gpu = await fakegpus("openai", models=["a", "b"], swap_ms=20, steps=2, step_ms=5)
    cfg = base_config({"box": gpu.url})
    cfg["nodes"]["box"]["models"] = ["a", "b"]
    cfg["routes"] = {"llm": {"path": "/v1", "kind": "openai", "nodes": ["box"], "max_concurrency": 1}}
    gw = await gateway(cfg)
    await wait_until(lambda: gw.rt.scheduler.nodes["box"].models.warm == ["a"])
    page = Page(browser)
    await page.call(browser.get, gw.url + "/dashboard")
    await page.until("!document.querySelector('#login').hidden", "the login form")
    await page.type_into("#admin-key", ADMIN_KEY)
    await page.click("#login-submit")
    models = '[data-node="box"] [data-field=models]'
    text = await page.until(f"document.querySelector('{models}')?.dataset.warm === 'a' && "
                            f"document.querySelector('{models}').textContent", "the loaded model")
    assert text == "loaded: a · serves a, b"
    async with http.post(gw.url + "/v1/chat/completions", headers=auth(),
                         json={"model": "b", "messages": [{"role": "user", "content": "hi"}]}) as r:
        assert r.status == 200
    await page.until(f"document.querySelector('{models}').dataset.warm === 'b'", "the swap to b")
    assert await page.text(models) == "loaded: b · serves a, b"


async def test_nodes_on_one_card_show_what_the_card_holds(fakegpus, gateway, http, browser) -> None:
    """Two servers on one GPU (docs/CONFIG.md#cards): each node's card says what runs on the card
    over both, and that it is full; the line follows the request's end."""
    a = await fakegpus(steps=400, step_ms=50)  # runs until the test lets it go
    b = await fakegpus()
    cfg = base_config({"a": a.url}, max_concurrency=2, cost={"base": 4})
    cfg["routes"]["gen2"] = {**cfg["routes"]["gen"], "path": "/gen2", "nodes": ["b"]}
    cfg["nodes"] = {"a": {"url": a.url, "card": "gpu"}, "b": {"url": b.url, "card": "gpu"}}
    cfg["cards"] = {"gpu": {"max_concurrency": 1, "capacity": 8}}
    gw = await gateway(cfg)
    held = asyncio.create_task(http.post(gw.url + "/gen/generate", json={}, headers=auth()))
    await wait_until(lambda: gw.rt.scheduler.cards.inflight["gpu"] == 1)
    page = Page(browser)
    await page.call(browser.get, gw.url + "/dashboard")
    await page.until("!document.querySelector('#login').hidden", "the login form")
    await page.type_into("#admin-key", ADMIN_KEY)
    await page.click("#login-submit")
    for node in ("a", "b"):
        line = f'[data-node="{node}"] [data-field=card]'
        await page.until(f"document.querySelector('{line}')?.dataset.full === '1'", f"{node}'s card full")
        assert await page.text(line) == "card gpu: 1/1 in flight · 4/8 capacity"
        assert await page.js(f"return document.querySelector('{line}').dataset.card") == "gpu"
    held.cancel()  # the client goes: its lease ends, on the card too
    line = '[data-node="b"] [data-field=card]'
    await page.until(f"document.querySelector('{line}').dataset.full === ''", "the card free again")
    assert await page.text(line) == "card gpu: 0/1 in flight · 0/8 capacity"

"""The dashboard in a real Chromium: the `browser` fixture and a Page that reads it."""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ROUTE = '[data-route="gen"]'


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("needs /usr/bin/chromium and /usr/bin/chromedriver (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install selenium)")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", "--window-size=1280,800", f"--user-data-dir={tmp_path / 'chromium'}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(10)
    try:
        yield driver
    finally:
        driver.quit()


class Page:
    """The driver is blocking: every call runs in a thread so the gateway keeps serving."""

    def __init__(self, driver: Any):
        self.d = driver

    async def call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    async def js(self, script: str, *args: Any) -> Any:
        return await self.call(self.d.execute_script, script, *args)

    async def until(self, script: str, what: str, timeout: float = 8) -> Any:
        """Poll a JS expression until it is truthy; returns its value."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            value = await self.js("return (" + script + ");")
            if value:
                return value
            if loop.time() > end:
                raise AssertionError(f"dashboard never showed: {what}")
            await asyncio.sleep(0.05)

    async def text(self, css: str) -> str | None:
        return await self.js("const e = document.querySelector(arguments[0]); return e && e.textContent;", css)

    async def type_into(self, css: str, text: str) -> None:
        from selenium.webdriver.common.by import By

        el = await self.call(self.d.find_element, By.CSS_SELECTOR, css)
        await self.call(el.clear)
        await self.call(el.send_keys, text)

    async def click(self, css: str) -> None:
        from selenium.webdriver.common.by import By

        el = await self.call(self.d.find_element, By.CSS_SELECTOR, css)
        await self.call(el.click)

    async def screenshot(self, path: Path, width: int, height: int, mobile: bool = False, full: bool = False) -> None:
        await self.call(self.d.execute_cdp_cmd, "Emulation.setDeviceMetricsOverride",
                        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile})
        await asyncio.sleep(0.3)  # one state event and a layout pass at the new size
        shot = await self.call(self.d.execute_cdp_cmd, "Page.captureScreenshot",
                               {"format": "png", "captureBeyondViewport": full})
        path.write_bytes(base64.b64decode(shot["data"]))

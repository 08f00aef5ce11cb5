"""Reload through the admin API and read what it reports."""

from __future__ import annotations

import asyncio
import hashlib
import re
from pathlib import Path
from typing import Any

import aiohttp
from conftest import ADMIN, wait_until


async def admin_state(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/admin/state", headers=ADMIN) as r:
        assert r.status == 200
        return await r.json()


async def reloads_total(http: aiohttp.ClientSession, url: str, result: str) -> float:
    async with http.get(url + "/metrics", headers=ADMIN) as r:
        assert r.status == 200
        text = await r.text()
    m = re.search(r'^kiloline_reloads_total\{result="' + re.escape(result) + r'"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


async def admin_reload(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with http.post(url + "/admin/reload", headers=ADMIN) as r:
        return r.status, await r.json()


async def watcher_ready(rt: Any, path: Path, timeout: float = 15) -> None:
    """Rewrite the file with a new trailing comment until the watcher applies it.

    A sync point: afterwards the watch is certainly established, so the test sees how the watcher
    handles the write under test, not the start-up window (see test_change_right_after_start...).
    """
    base = path.read_bytes()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    i = 0
    while loop.time() < deadline:
        i += 1
        data = base + f"# probe {i}\n".encode()
        tmp = path.with_name(".probe.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        digest = hashlib.sha256(data).hexdigest()
        try:
            await wait_until(lambda: rt.version == digest, timeout=0.5)  # noqa: B023
            return
        except AssertionError:
            continue
    raise AssertionError("the config watcher never applied a change")

"""Reads one value from the gateway's Prometheus text."""

from __future__ import annotations

import re

from conftest import ADMIN

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


async def metric(http, gw, name: str, **labels: str) -> float | None:
    """One sample from /metrics, matching labels in any order (their order carries no meaning)."""
    async with http.get(gw.url + "/metrics", headers=ADMIN) as r:
        assert r.status == 200
        text = await r.text()
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and m.group(1) == name and dict(LABEL.findall(m.group(2) or "")) == labels:
            return float(m.group(3))
    return None

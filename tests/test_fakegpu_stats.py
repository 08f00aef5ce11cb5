"""GET /_fake/stats carries the VRAM and swap counters for every kind and capacity mode (SPEC §11.4)."""

from __future__ import annotations

import aiohttp
import pytest

from kilolined.fakegpu import KINDS

MODES = ("fixed", "request")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
async def test_stats_have_vram_and_swaps_for_every_kind_and_mode(fakegpus, http: aiohttp.ClientSession,
                                                                 kind: str, mode: str) -> None:
    gpu = await fakegpus(kind, capacity_mode=mode)
    async with http.get(gpu.url + "/_fake/stats") as r:
        assert r.status == 200
        stats = await r.json()
    assert stats["kind"] == kind and stats["capacity_mode"] == mode
    assert stats["vram_used_gb"] == 0 and stats["peak_vram_gb"] == 0
    assert stats["swaps"] == 0


async def test_stats_count_swaps_on_a_multi_model_card(fakegpus, http: aiohttp.ClientSession) -> None:
    # The backend's own count wins over the card's default of 0.
    gpu = await fakegpus("openai", models=["a", "b"], step_ms=1)
    for model in ("a", "b"):
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        async with http.post(gpu.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
    async with http.get(gpu.url + "/_fake/stats") as r:
        assert (await r.json())["swaps"] == 1

"""The gateway's provider clients (kilolined/fleet/vastai.py) against the fake market over
loopback: the same fake the official ``vastai`` client is checked against, so the two agree on
the wire. Failures are sorted into kinds, a 429's Retry-After is handed up, and the key never
appears in an error.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from conftest import wait_until

from kilolined.core.config import FleetOfferConfig, FleetTemplateConfig
from kilolined.fakegpu.provider import FakeProvider
from kilolined.fakegpu.provider_runpod import RunPodWire
from kilolined.fakegpu.provider_vastai import VastWire
from kilolined.fleet.provider import RUNNING, STOPPED, Provider, ProviderError
from kilolined.fleet.runpod import RunPod
from kilolined.fleet.vastai import VastAI

KEY = "vast-test-key-abcdef0123456789"
OFFER = FleetOfferConfig(gpu_name="RTX 4090", max_dph=0.5, min_reliability=0.97)
TEMPLATE = FleetTemplateConfig(image="fake/generic", port=8080, env={"FAKEGPU_KIND": "generic"})


@pytest.fixture
async def fake() -> AsyncIterator[FakeProvider]:
    fp = FakeProvider(VastWire(), api_key=KEY, boot_sec=0.2, card_options={"steps": 2, "step_ms": 10})
    await fp.start()
    yield fp
    await fp.stop()


async def inject(fake: FakeProvider, plan: dict[str, object]) -> None:
    async with aiohttp.ClientSession() as s, s.post(f"{fake.url}/_fake/fail", json=plan) as r:
        assert r.status == 200


async def test_vast_client_rents_finds_and_destroys(fake: FakeProvider) -> None:
    vast = VastAI(KEY, fake.url)
    try:
        offers = await vast.search(OFFER, frozenset({"501"}), 0.5)
        assert offers and all(o.machine != "501" and o.price <= 0.5 and o.reliability >= 0.97 for o in offers)
        iid = await vast.create(offers[0], OFFER, TEMPLATE, "kiloline:p")
        assert fake.instances[iid].label == "kiloline:p" and fake.instances[iid].interruptible

        async def running() -> bool:
            inst = await vast.status(iid, 8080)
            return inst is not None and inst.status == RUNNING and inst.url is not None
        await wait_until(running, timeout=20)
        inst = await vast.status(iid, 8080)
        assert inst is not None and inst.url is not None
        async with aiohttp.ClientSession() as s, s.get(inst.url + "/health") as r:
            assert r.status == 200  # the mapped port reaches the instance's card
        assert [i.id for i in await vast.list_own(8080)] == [iid]
        async with aiohttp.ClientSession() as s, s.post(f"{fake.url}/_fake/reclaim/{iid}") as r:
            assert r.status == 200
        after = await vast.status(iid, 8080)
        assert after is not None and after.status == STOPPED  # not running: a serving node so is reclaimed
        await vast.destroy(iid)
        assert await vast.status(iid, 8080) is None
        await vast.destroy(iid)  # destroying what is gone is what was asked: no error
    finally:
        await vast.close()


async def test_vast_client_reports_retry_after(fake: FakeProvider) -> None:
    vast = VastAI(KEY, fake.url)
    try:
        await inject(fake, {"status": 429, "retry_after": 2.5, "op": "search"})
        with pytest.raises(ProviderError) as e:
            await vast.search(OFFER, frozenset(), 0.5)
        assert e.value.kind == "rate_limited" and e.value.retry_after == 2.5
        await inject(fake, {"status": 403, "op": "create"})
        offers = await vast.search(OFFER, frozenset(), 0.5)
        with pytest.raises(ProviderError) as e:
            await vast.create(offers[0], OFFER, TEMPLATE, "kiloline:p")
        assert e.value.kind == "client"
    finally:
        await vast.close()


async def test_a_wrong_key_is_refused_and_never_echoed(fake: FakeProvider) -> None:
    wrong = "vast-WRONG-key-that-must-not-leak"
    vast = VastAI(wrong, fake.url)
    try:
        with pytest.raises(ProviderError) as e:
            await vast.list_own(8080)
        assert e.value.kind == "client" and "401" in str(e.value) and wrong not in str(e.value)
        assert wrong not in repr(vast.__dict__)
    finally:
        await vast.close()
    down = VastAI(KEY, "http://127.0.0.1:9")  # nothing listens: the API is unreachable
    try:
        with pytest.raises(ProviderError) as e:
            await asyncio.wait_for(down.list_own(8080), 30)
        assert e.value.kind == "network" and KEY not in str(e.value)
    finally:
        await down.close()


async def test_runpod_client_rents_finds_and_destroys() -> None:
    fake = FakeProvider(RunPodWire(), api_key=KEY, boot_sec=0.2, card_options={"steps": 2, "step_ms": 10})
    await fake.start()
    pod = RunPod(KEY, fake.url)
    try:
        offers = await pod.search(OFFER, frozenset(), 0.5)
        assert offers and all(o.price <= 0.5 for o in offers)
        pid = await pod.create(offers[0], OFFER, TEMPLATE, "kiloline:p")
        assert fake.instances[pid].label == "kiloline:p" and fake.instances[pid].interruptible

        async def running() -> bool:
            inst = await pod.status(pid, 8080)
            return inst is not None and inst.status == RUNNING and inst.url is not None
        await wait_until(running, timeout=20)
        assert [i.id for i in await pod.list_own(8080)] == [pid]
        await fake.reclaim(fake.instances[pid])
        after = await pod.status(pid, 8080)
        assert after is not None and after.status == STOPPED
        await pod.destroy(pid)
        assert await pod.status(pid, 8080) is None
        await inject(fake, {"status": 429, "retry_after": 3, "op": "search"})
        with pytest.raises(ProviderError) as e:
            await pod.search(OFFER, frozenset(), 0.5)
        assert e.value.kind == "rate_limited" and e.value.retry_after == 3
    finally:
        await pod.close()
        await fake.stop()


@pytest.mark.parametrize("wire", ["vastai", "runpod"])
async def test_stop_keeps_the_instance_and_resume_serves_it_again(wire: str) -> None:
    """stop (Vast PUT state stopped; RunPod podStop) leaves it STOPPED, unbilled and listed;
    resume (state running; podResume) brings it back serving after the fake's resume_sec."""
    fake = FakeProvider(VastWire() if wire == "vastai" else RunPodWire(), api_key=KEY, boot_sec=0.2,
                        resume_sec=0.05, card_options={"steps": 2, "step_ms": 10})
    await fake.start()
    prov: Provider = VastAI(KEY, fake.url) if wire == "vastai" else RunPod(KEY, fake.url)

    async def status_is(iid: str, want: str) -> bool:
        inst = await prov.status(iid, 8080)
        return inst is not None and inst.status == want and (want != RUNNING or inst.url is not None)

    try:
        offers = await prov.search(OFFER, frozenset(), 0.5)
        iid = await prov.create(offers[0], OFFER, TEMPLATE, "kiloline:p")
        await wait_until(lambda: status_is(iid, RUNNING), timeout=20)
        await prov.stop(iid)
        assert await status_is(iid, STOPPED)
        assert fake.instances[iid].status == "stopped" and fake.spend_per_hour() == 0
        assert [(i.id, i.status) for i in await prov.list_own(8080)] == [(iid, STOPPED)]
        fake.boot_sec = 60.0  # a resume is not a boot
        await prov.resume(iid, 1)
        await wait_until(lambda: status_is(iid, RUNNING), timeout=20)
        inst = await prov.status(iid, 8080)
        assert inst is not None and inst.url is not None
        async with aiohttp.ClientSession() as s, s.get(inst.url + "/health") as r:
            assert r.status == 200
        assert (fake.calls["stop"], fake.calls["resume"]) == (1, 1)
        await inject(fake, {"status": 500, "op": "resume"})
        await prov.stop(iid)
        with pytest.raises(ProviderError) as e:
            await prov.resume(iid, 1)
        assert e.value.kind == "server" and KEY not in str(e.value)
    finally:
        await prov.close()
        await fake.stop()


async def answering(routes: dict[str, str]) -> tuple[web.AppRunner, str]:
    """A provider API that answers each path with the given JSON text, as a provider could send
    it: Python's and most JSON parsers take ``NaN`` and ``Infinity``."""

    async def answer(request: web.Request) -> web.Response:
        return web.Response(text=routes.get(request.path, "{}"), content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_a_price_that_is_not_a_number_is_not_taken_as_one() -> None:
    offers = ('{"offers": [{"id": 1, "machine_id": 7, "dph_total": NaN, "gpu_name": "RTX 4090", "num_gpus": 1, '
              '"reliability": 0.99}, {"id": 2, "machine_id": 8, "dph_total": Infinity, "gpu_name": "RTX 4090", '
              '"num_gpus": NaN, "reliability": 0.99}, {"id": 3, "machine_id": 9, "dph_total": 0.3, '
              '"gpu_name": "RTX 4090", "num_gpus": 1, "reliability": 0.99}]}')
    status = '{"instances": {"id": 5, "label": "kiloline:p", "actual_status": "running", "dph_total": NaN}}'
    runner, url = await answering({"/api/v0/search/asks/": offers, "/api/v0/instances/5/": status})
    vast = VastAI(KEY, url)
    try:
        assert [(o.id, o.price) for o in await vast.search(OFFER, frozenset(), 0.5)] == [("3", 0.3)]
        inst = await vast.status("5", 8080)
        assert inst is not None and inst.price == 0.0  # not given: the loop keeps the rent's price
    finally:
        await vast.close()
        await runner.cleanup()

"""`kilolined fakegpu --provider vastai`: the fake Vast.ai API, checked with the official `vastai`
client (SDK and CLI) pointed at it by its base-URL settings, so the fake speaks Vast's wire and
not only ours. The client is synchronous (requests): it runs in a thread while the fake serves on
this loop.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests
from conftest import wait_until
from fakeprovider_util import CARD, answers, fail, fake_state, reclaim

from kilolined.fakegpu.provider import FakeProvider
from kilolined.fakegpu.provider_vastai import VastWire

KEY = "vast-test-key"


@pytest.fixture
async def vast() -> AsyncIterator[FakeProvider]:
    market = FakeProvider(VastWire(), api_key=KEY, boot_sec=0.2, card_options=CARD)
    await market.start()
    yield market
    await market.stop()


def client(market: FakeProvider | str, key: str = KEY, retry: int = 3) -> Any:
    """The official SDK pointed at the fake by its base-URL setting. Imported on first use: it
    takes seconds, which every xdist worker would pay at collection."""
    vastai_sdk = importlib.import_module("vastai.sdk")
    url = market if isinstance(market, str) else market.url
    return vastai_sdk.VastAI(api_key=key, server_url=url, retry=retry)


async def running_row(vai: Any, iid: int) -> dict[str, Any]:
    row: dict[str, Any] = {}

    async def up() -> bool:
        row.update(await asyncio.to_thread(vai.show_instance, iid) or {})
        return row.get("actual_status") == "running"

    await wait_until(up, timeout=15, step=0.05)
    return row


async def test_sdk_searches_creates_shows_and_destroys(vast: FakeProvider) -> None:
    vai = client(vast)
    offers = await asyncio.to_thread(
        vai.search_offers, "gpu_name=RTX_4090 num_gpus=1 dph_total<=0.43 reliability>0.97", order="dph_total")
    # The filter as the client parses it (strings for numbers, "_" for spaces) picks the fitting offers.
    assert [(o["id"], o["dph_total"]) for o in offers] == [(1001, 0.40), (1002, 0.42)]
    assert {o["machine_id"] for o in offers} == {501, 502} and all(o["reliability2"] > 0.97 for o in offers)
    # The same through PUT /api/v0/search/asks/ (the client's search_offers_new), and spot prices with type bid.
    new = await asyncio.to_thread(vai.search_offers_new, "gpu_name=RTX_4090 num_gpus=1 dph_total<=0.43 "
                                  "reliability>0.97", order="dph_total")
    assert [o["id"] for o in new] == [1001, 1002]
    spot = await asyncio.to_thread(vai.search_offers_new, "gpu_name=RTX_4090 machine_id!=504", type="bid",
                                   order="dph_total")
    assert [(o["id"], o["dph_total"]) for o in spot] == [(1001, 0.25), (1002, 0.26), (1003, 0.28)]
    created = await asyncio.to_thread(vai.create_instance, 1001, image="ghcr.io/ai-dock/comfyui:latest",
                                      env="-p 8188:8188 -e PORT=8188", label="kiloline:comfy")
    assert created["success"] is True
    iid = created["new_contract"]
    first = await asyncio.to_thread(vai.show_instance, iid)
    assert first is not None and first["actual_status"] in ("loading", "running")
    assert first["label"] == "kiloline:comfy" and first["dph_total"] == 0.40 and first["machine_id"] == 501
    assert first["extra_env"] == {"PORT": "8188"}
    row = await running_row(vai, iid)
    port = row["ports"]["8188/tcp"][0]["HostPort"]
    node = f"http://{row['public_ipaddr']}:{port}"
    # The image names ComfyUI, so the card is the comfyui kind: its health path answers.
    async with aiohttp.ClientSession() as s, s.get(f"{node}/system_stats") as r:
        assert r.status == 200
    # A rented offer is off the market; the list shows the instance with its label.
    again = await asyncio.to_thread(vai.search_offers, "gpu_name=RTX_4090")
    assert 1001 not in {o["id"] for o in again}
    listed = await asyncio.to_thread(vai.show_instances)
    assert [(i["id"], i["label"]) for i in listed] == [(iid, "kiloline:comfy")]
    assert (await asyncio.to_thread(vai.destroy_instance, iid))["success"] is True
    assert await asyncio.to_thread(vai.show_instance, iid) is None
    assert not await answers(f"{node}/system_stats")
    assert await asyncio.to_thread(vai.show_instances) == []
    state = await fake_state(vast)
    assert [(i["id"], i["status"]) for i in state["instances"]] == [(str(iid), "destroyed")]
    assert state["spend_per_hour"] == 0


async def test_boot_takes_boot_sec_and_kind_follows_the_image(vast: FakeProvider) -> None:
    vast.boot_sec = 0.6
    vai = client(vast)
    a = (await asyncio.to_thread(vai.create_instance, 1005, image="vllm/vllm-openai:latest"))["new_contract"]
    b = (await asyncio.to_thread(vai.create_instance, 1006, image="busybox", env={"FAKEGPU_KIND": "comfyui"}))
    loading = await asyncio.to_thread(vai.show_instance, a)
    # Created a moment ago with a 0.6 s boot: no port yet, nothing to reach.
    assert loading["actual_status"] == "loading" and loading["ports"] == {} and loading["public_ipaddr"] is None
    row_a = await running_row(vai, a)
    row_b = await running_row(vai, b["new_contract"])
    # No -p asked: the kind's usual port is mapped (openai 8000, comfyui 8188).
    port_a = row_a["ports"]["8000/tcp"][0]["HostPort"]
    port_b = row_b["ports"]["8188/tcp"][0]["HostPort"]
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{port_a}/_fake/stats") as r:
            assert (await r.json())["kind"] == "openai"
        async with s.get(f"http://127.0.0.1:{port_b}/_fake/stats") as r:
            assert (await r.json())["kind"] == "comfyui"
    state = await fake_state(vast)
    assert all(i["ready_at"] - i["created_at"] >= 0.6 for i in state["instances"])
    assert state["spend_per_hour"] == pytest.approx(0.22 + 0.24)


async def test_reclaim_exits_the_instance_and_silences_its_card(vast: FakeProvider) -> None:
    vai = client(vast)
    iid = (await asyncio.to_thread(vai.create_instance, 1002, image="ghcr.io/ai-dock/comfyui:latest",
                                   price=0.3, label="kiloline:comfy"))["new_contract"]
    row = await running_row(vai, iid)
    assert row["is_bid"] is True and row["dph_total"] == 0.3
    node = f"http://127.0.0.1:{row['ports']['8188/tcp'][0]['HostPort']}/system_stats"
    assert await answers(node)
    assert (await reclaim(vast, iid))["status"] == "exited"
    gone = await asyncio.to_thread(vai.show_instance, iid)
    assert gone["actual_status"] == "exited" and gone["ports"] == {}
    assert not await answers(node)
    # Still the renter's until destroyed: listed, its machine off the market, and no longer billed.
    assert [i["actual_status"] for i in await asyncio.to_thread(vai.show_instances)] == ["exited"]
    assert 1002 not in {o["id"] for o in await asyncio.to_thread(vai.search_offers, "gpu_name=RTX_4090")}
    assert (await fake_state(vast))["spend_per_hour"] == 0
    await asyncio.to_thread(vai.destroy_instance, iid)
    assert 1002 in {o["id"] for o in await asyncio.to_thread(vai.search_offers, "gpu_name=RTX_4090")}
    async with aiohttp.ClientSession() as s, s.post(f"{vast.url}/_fake/reclaim/999") as r:
        assert r.status == 404


async def test_the_client_stops_and_resumes_an_instance_which_serves_again_after_resume_sec(
        vast: FakeProvider) -> None:
    """stop_instance and start_instance (PUT /api/v0/instances/{id}/ with state): stopped, the
    card is gone, the machine stays rented and the bill stops; resumed, it serves again after
    resume_sec, not boot_sec."""
    vast.resume_sec = 0.05
    vai = client(vast)
    iid = (await asyncio.to_thread(vai.create_instance, 1001, image="ghcr.io/ai-dock/comfyui:latest",
                                   label="kiloline:comfy"))["new_contract"]
    row = await running_row(vai, iid)
    node = f"http://127.0.0.1:{row['ports']['8188/tcp'][0]['HostPort']}/system_stats"
    assert (await asyncio.to_thread(vai.stop_instance, iid))["success"] is True
    stopped = await asyncio.to_thread(vai.show_instance, iid)
    assert (stopped["actual_status"], stopped["intended_status"], stopped["ports"]) == ("exited", "stopped", {})
    assert not await answers(node)
    assert 1001 not in {o["id"] for o in await asyncio.to_thread(vai.search_offers, "gpu_name=RTX_4090")}
    state = await fake_state(vast)
    assert state["spend_per_hour"] == 0 and state["instances"][0]["status"] == "stopped"
    vast.boot_sec = 60.0  # a resume does not boot again: only resume_sec passes
    assert (await asyncio.to_thread(vai.start_instance, iid))["success"] is True
    row = await running_row(vai, iid)
    async with aiohttp.ClientSession() as s, \
            s.get(f"http://127.0.0.1:{row['ports']['8188/tcp'][0]['HostPort']}/system_stats") as r:
        assert r.status == 200
    assert (await fake_state(vast))["spend_per_hour"] == 0.40
    assert vast.calls["stop"] == 1 and vast.calls["resume"] == 1
    await fail(vast, {"status": 500, "op": "resume"})
    await asyncio.to_thread(vai.stop_instance, iid)
    with pytest.raises(requests.HTTPError):
        await asyncio.to_thread(vai.start_instance, iid)


async def test_a_partition_silences_the_card_but_the_provider_still_says_running(vast: FakeProvider) -> None:
    vai = client(vast)
    iid = (await asyncio.to_thread(vai.create_instance, 1005, image="comfyui"))["new_contract"]
    row = await running_row(vai, iid)
    node = f"http://127.0.0.1:{row['ports']['8188/tcp'][0]['HostPort']}/system_stats"
    async with aiohttp.ClientSession() as s, s.post(f"{vast.url}/_fake/partition/{iid}") as r:
        assert r.status == 200 and (await r.json())["partitioned"] is True
    assert not await answers(node)
    still = await asyncio.to_thread(vai.show_instance, iid)
    assert still["actual_status"] == "running" and still["ports"] == row["ports"]
    async with aiohttp.ClientSession() as s, s.post(f"{vast.url}/_fake/heal/{iid}") as r:
        assert r.status == 200
    assert await answers(node)
    async with aiohttp.ClientSession() as s, s.post(f"{vast.url}/_fake/heal/{iid}") as r:
        assert r.status == 409  # not partitioned


async def test_reclaim_during_boot_never_serves(vast: FakeProvider) -> None:
    async with aiohttp.ClientSession() as s, s.post(f"{vast.url}/_fake/control", json={"boot_sec": 30}) as r:
        assert r.status == 200 and (await r.json())["boot_sec"] == 30  # the reclaim comes long before
    vai = client(vast)
    iid = (await asyncio.to_thread(vai.create_instance, 1003, image="comfyui"))["new_contract"]
    await reclaim(vast, iid)
    # The reclaim called the boot off and waited for it: no card will ever start.
    boot = vast.instances[str(iid)].boot
    assert boot is not None and boot.cancelled() and vast.instances[str(iid)].card is None
    row = await asyncio.to_thread(vai.show_instance, iid)
    assert row["actual_status"] == "exited" and row["ports"] == {}


async def test_the_client_waits_out_retry_after_and_gets_the_429_when_it_persists(vast: FakeProvider) -> None:
    vai = client(vast, retry=3)
    await fail(vast, {"status": 429, "count": 2, "retry_after": 0.05, "op": "search"})
    # The official client retries a 429 after its Retry-After: the third try gets through.
    offers = await asyncio.to_thread(vai.search_offers, "gpu_name=RTX_3090")
    assert {o["id"] for o in offers} == {1005, 1006}
    state = await fake_state(vast)
    assert state["calls"]["search"] == 3 and state["failed_calls"]["search"] == 2
    # A Retry-After over the client's 60 s cap is handed back instead of waited out.
    await fail(vast, {"status": 429, "count": None, "retry_after": 120, "op": "create"})
    with pytest.raises(requests.HTTPError) as err:
        await asyncio.to_thread(vai.create_instance, 1005, image="comfyui")
    assert err.value.response.status_code == 429 and err.value.response.headers["Retry-After"] == "120"
    assert err.value.response.json()["success"] is False
    # Only creates fail; the rest of the API still answers, and nothing was rented.
    assert await asyncio.to_thread(vai.show_instances) == []
    async with aiohttp.ClientSession() as s, s.delete(f"{vast.url}/_fake/fail") as r:
        assert r.status == 200
    assert (await asyncio.to_thread(vai.create_instance, 1005, image="comfyui"))["success"] is True


async def test_bad_key_bad_offer_and_bad_body_are_refused(vast: FakeProvider) -> None:
    with pytest.raises(requests.HTTPError) as err:
        await asyncio.to_thread(client(vast, key="wrong").search_offers, "")
    assert err.value.response.status_code == 401
    vai = client(vast)
    with pytest.raises(requests.HTTPError) as err:
        await asyncio.to_thread(vai.create_instance, 4242, image="comfyui")
    assert err.value.response.status_code == 400 and err.value.response.json()["error"] == "no_such_ask"
    with pytest.raises(requests.HTTPError) as err:  # a bid under the offer's min_bid
        await asyncio.to_thread(vai.create_instance, 1001, image="comfyui", price=0.01)
    assert err.value.response.json()["error"] == "invalid_price"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
        async with s.put(f"{vast.url}/api/v0/asks/1001/", data=b"[1,") as r:
            assert r.status == 400 and (await r.json())["success"] is False
        async with s.put(f"{vast.url}/api/v0/asks/1001/", json={"env": {}}) as r:  # no image
            assert r.status == 400
        async with s.post(f"{vast.url}/_fake/fail", json={"status": 200}) as r:
            assert r.status == 400
        async with s.put(f"{vast.url}/_fake/offers", json=[{"id": 1, "gpu_name": "X"}]) as r:
            assert r.status == 400 and "machine_id: missing" in (await r.json())["error"]
    assert (await fake_state(vast))["instances"] == []


async def test_a_market_with_no_fitting_offer_rents_nothing(vast: FakeProvider) -> None:
    async with aiohttp.ClientSession() as s, s.put(f"{vast.url}/_fake/offers", json=[
            {"id": 7, "machine_id": 70, "gpu_name": "RTX 4090", "dph_total": 0.9}]) as r:
        assert r.status == 200 and (await r.json())["offers"][0]["min_bid"] == pytest.approx(0.54)
    vai = client(vast)
    assert await asyncio.to_thread(vai.search_offers, "gpu_name=RTX_4090 dph_total<0.5") == []
    assert [o["id"] for o in await asyncio.to_thread(vai.search_offers, "gpu_name=RTX_4090")] == [7]


async def vastai_cli(tmp_path: Path, *args: str, url: str | None = None) -> Any:
    """The `vastai` command line, --raw: its JSON answer. Pointed at the fake by `--url` when
    `url` is given, else by the VAST_URL the caller put in `args`' environment."""
    env = {**os.environ, "NO_COLOR": "1", "VASTAI_NO_UPDATE_CHECK": "1", "XDG_CONFIG_HOME": str(tmp_path)}
    argv = [str(Path(sys.executable).parent / "vastai")]
    if url is not None:
        argv += ["--url", url]
    else:
        env["VAST_URL"] = args[0]
        args = args[1:]
    proc = await asyncio.create_subprocess_exec(*argv, "--api-key", KEY, "--raw", *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode == 0, err.decode()
    return json.loads(out)


async def test_the_vastai_cli_searches_and_creates(vast: FakeProvider, tmp_path: Path) -> None:
    """The command line, pointed at the fake by --url, then by VAST_URL."""
    offers = await vastai_cli(tmp_path, "search", "offers", "gpu_name=RTX_3090 dph_total<0.23", url=vast.url)
    assert [(o["id"], o["machine_id"], o["dph_total"]) for o in offers] == [(1005, 505, 0.22)]
    created = await vastai_cli(tmp_path, vast.url, "create", "instance", "1005", "--image",
                               "ghcr.io/ai-dock/comfyui:latest", "--env", "-p 8188:8188", "--label", "kiloline:comfy")
    iid = created["new_contract"]
    row = await running_row(client(vast), iid)
    assert row["label"] == "kiloline:comfy" and row["machine_id"] == 505
    assert await answers(f"http://127.0.0.1:{row['ports']['8188/tcp'][0]['HostPort']}/system_stats")

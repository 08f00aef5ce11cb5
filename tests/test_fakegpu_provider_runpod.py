"""`kilolined fakegpu --provider runpod`: the fake RunPod GraphQL API, checked with the official
`runpod` client pointed at it by `RUNPOD_API_BASE_URL`: its SDK calls (get_gpus, get_gpu,
create_pod, get_pod, get_pods, terminate_pod) and, for what the SDK has no call for
(`podRentInterruptable`), its GraphQL transport with RunPod's documented mutation.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest
import requests
from conftest import wait_until
from fakeprovider_util import CARD, answers, fail, fake_state, in_thread, reclaim, start_cli_provider

from kilolined.fakegpu.provider import FakeProvider
from kilolined.fakegpu.provider_runpod import GraphQLError, RunPodWire, parse

KEY = "runpod-test-key"
RTX4090 = "NVIDIA GeForce RTX 4090"
# RunPod's documented spot mutation (docs.runpod.io, "Manage Pods" with GraphQL), arguments inline.
RENT_SPOT = """
mutation {
  podRentInterruptable(
    input: {
      bidPerGpu: %s
      cloudType: SECURE
      gpuCount: 1
      volumeInGb: 40
      containerDiskInGb: 40
      minVcpuCount: 2
      minMemoryInGb: 15
      gpuTypeId: "NVIDIA GeForce RTX 4090"
      name: "kiloline:spot"
      imageName: "ghcr.io/ai-dock/comfyui:latest"
      dockerArgs: ""
      ports: "8188/http"
      volumeMountPath: "/workspace"
      env: [{ key: "PORT", value: "8188" }]
    }
  ) {
    id
    imageName
    env
    machineId
    costPerHr
    machine { podHostId }
  }
}
"""


def import_runpod() -> ModuleType:
    """The client, imported on first use (it takes seconds, which every xdist worker would pay
    at collection). Its import calls logging.basicConfig; the root logger is put back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        return importlib.import_module("runpod")
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


@pytest.fixture
async def market() -> AsyncIterator[FakeProvider]:
    fake = FakeProvider(RunPodWire(), api_key=KEY, boot_sec=0.2, card_options=CARD)
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
def runpod(market: FakeProvider, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The official client pointed at the fake: its base URL setting and its global key."""
    module = import_runpod()
    monkeypatch.setenv("RUNPOD_API_BASE_URL", market.url)
    monkeypatch.setattr(module, "api_key", KEY)
    yield module


async def serving_pod(runpod: ModuleType, pod_id: str) -> dict[str, Any]:
    pod: dict[str, Any] = {}

    async def up() -> bool:
        pod.update(await in_thread(runpod.get_pod, pod_id) or {})
        return pod.get("runtime") is not None

    await wait_until(up, timeout=15, step=0.05)
    return pod


def public(pod: dict[str, Any], private: int) -> str:
    port = next(p for p in pod["runtime"]["ports"] if p["privatePort"] == private)
    return f"http://{port['ip']}:{port['publicPort']}"


async def test_sdk_stops_and_resumes_a_pod_which_serves_again_after_resume_sec(
        runpod: ModuleType, market: FakeProvider) -> None:
    """stop_pod (podStop) and resume_pod (podResume with gpuCount): EXITED and unbilled while
    stopped, serving again after resume_sec rather than boot_sec."""
    market.resume_sec = 0.05
    pod_id = (await in_thread(runpod.create_pod, "kiloline:comfy", "ghcr.io/ai-dock/comfyui:latest", RTX4090,
                              ports="8188/http", env={"PORT": "8188"}))["id"]
    node = public(await serving_pod(runpod, pod_id), 8188)
    stopped = await in_thread(runpod.stop_pod, pod_id)
    assert stopped == {"id": pod_id, "desiredStatus": "EXITED"}
    assert not await answers(f"{node}/system_stats")
    assert (await fake_state(market))["spend_per_hour"] == 0
    market.boot_sec = 60.0
    resumed = await in_thread(runpod.resume_pod, pod_id, 1)
    assert resumed["id"] == pod_id and resumed["desiredStatus"] == "RUNNING"
    node = public(await serving_pod(runpod, pod_id), 8188)
    async with aiohttp.ClientSession() as s, s.get(f"{node}/system_stats") as r:
        assert r.status == 200
    assert market.calls["stop"] == 1 and market.calls["resume"] == 1
    with pytest.raises(runpod.error.QueryError, match="gpuCount"):
        await in_thread(runpod.resume_pod, pod_id, 2)


async def test_sdk_lists_gpus_creates_gets_and_terminates(runpod: ModuleType, market: FakeProvider) -> None:
    gpus = await in_thread(runpod.get_gpus)
    assert {"id": RTX4090, "displayName": "RTX 4090", "memoryInGb": 24} in gpus
    gpu = await in_thread(runpod.get_gpu, RTX4090)
    # Per GPU, from what is on the market: the cheapest 4090 is $0.38 on demand, $0.22 spot.
    assert gpu["lowestPrice"] == {"minimumBidPrice": 0.22, "uninterruptablePrice": 0.38}
    assert gpu["communityPrice"] == 0.38 and gpu["maxGpuCount"] == 1
    created = await in_thread(runpod.create_pod, "kiloline:comfy", "ghcr.io/ai-dock/comfyui:latest", RTX4090,
                              cloud_type="COMMUNITY", ports="8188/http,22/tcp", env={"PORT": "8188"})
    pod_id = created["id"]
    assert created["machineId"] == "504" and created["env"] == ["PORT=8188"]
    assert created["machine"]["podHostId"].startswith(pod_id)
    first = await in_thread(runpod.get_pod, pod_id)
    assert first["desiredStatus"] == "RUNNING" and first["name"] == "kiloline:comfy"
    assert first["costPerHr"] == 0.38 and first["podType"] == "RESERVED"
    pod = await serving_pod(runpod, pod_id)
    assert {p["privatePort"] for p in pod["runtime"]["ports"]} == {8188, 22}
    node = public(pod, 8188)
    async with aiohttp.ClientSession() as s, s.get(f"{node}/system_stats") as r:
        assert r.status == 200  # the image names ComfyUI: a comfyui card
    assert [(p["id"], p["name"]) for p in await in_thread(runpod.get_pods)] == [(pod_id, "kiloline:comfy")]
    # That machine is taken: the next 4090 on demand is $0.40.
    assert (await in_thread(runpod.get_gpu, RTX4090))["lowestPrice"]["uninterruptablePrice"] == 0.40
    await in_thread(runpod.terminate_pod, pod_id)
    assert await in_thread(runpod.get_pod, pod_id) is None
    assert await in_thread(runpod.get_pods) == []
    assert not await answers(f"{node}/system_stats")
    with pytest.raises(runpod.error.QueryError, match="Pod not found"):
        await in_thread(runpod.terminate_pod, pod_id)
    assert [i["status"] for i in (await fake_state(market))["instances"]] == ["destroyed"]


async def test_spot_pod_from_the_documented_mutation_and_its_reclaim(runpod: ModuleType,
                                                                     market: FakeProvider) -> None:
    from_graphql = runpod.api.graphql.run_graphql_query
    with pytest.raises(runpod.error.QueryError, match="no longer any instances available"):
        await in_thread(from_graphql, RENT_SPOT % "0.1")  # under every 4090's minimum bid
    rented = (await in_thread(from_graphql, RENT_SPOT % "0.3"))["data"]["podRentInterruptable"]
    # The cheapest spot 4090 whose floor the bid meets; billed at the bid.
    assert rented["machineId"] == "504" and rented["costPerHr"] == 0.3 and rented["env"] == ["PORT=8188"]
    pod = await serving_pod(runpod, rented["id"])
    assert pod["podType"] == "INTERRUPTABLE" and pod["name"] == "kiloline:spot"
    node = f"{public(pod, 8188)}/system_stats"
    assert await answers(node)
    assert (await reclaim(market, rented["id"]))["status"] == "exited"
    gone = await in_thread(runpod.get_pod, rented["id"])
    assert gone["desiredStatus"] == "EXITED" and gone["runtime"] is None
    assert not await answers(node)
    assert [p["desiredStatus"] for p in await in_thread(runpod.get_pods)] == ["EXITED"]
    assert (await fake_state(market))["spend_per_hour"] == 0


async def test_injected_failures_and_a_wrong_key(runpod: ModuleType, market: FakeProvider) -> None:
    await fail(market, {"status": 429, "count": 1, "retry_after": 3, "op": "create"})
    resp = await in_thread(requests.post, f"{market.url}/graphql", headers={"Authorization": f"Bearer {KEY}"},
                           json={"query": RENT_SPOT % "0.3"}, timeout=10)
    assert resp.status_code == 429 and resp.headers["Retry-After"] == "3" and "errors" in resp.json()
    # One failure only, and only for creates: the SDK's reads went through meanwhile.
    assert await in_thread(runpod.get_pods) == []
    assert (await in_thread(runpod.api.graphql.run_graphql_query, RENT_SPOT % "0.3"))["data"]
    state = await fake_state(market)
    assert state["calls"]["create"] == 2 and state["failed_calls"]["create"] == 1
    with pytest.raises(runpod.error.AuthenticationError):
        await in_thread(runpod.get_pods, api_key="wrong")
    # The documented ?api_key= form is taken too.
    resp = await in_thread(requests.post, f"{market.url}/graphql?api_key={KEY}",
                           json={"query": "query { myself { pods { id } } }"}, timeout=10)
    assert resp.status_code == 200 and len(resp.json()["data"]["myself"]["pods"]) == 1


async def test_variables_aliases_and_bad_queries(market: FakeProvider) -> None:
    """The wire a hand-written client (the gateway's) may use: variables, aliases, errors."""
    headers = {"Authorization": f"Bearer {KEY}"}
    deploy = """mutation Deploy($input: PodFindAndDeployOnDemandInput!) {
        pod: podFindAndDeployOnDemand(input: $input) { id costPerHr desiredStatus __typename } }"""
    variables = {"input": {"gpuTypeId": "NVIDIA GeForce RTX 3090", "gpuCount": 1, "cloudType": "ALL",
                           "imageName": "vllm/vllm-openai", "name": "kiloline:llm", "ports": "8000/http",
                           "env": [{"key": "A", "value": "1"}]}}
    async with aiohttp.ClientSession(headers=headers) as s:
        async with s.post(f"{market.url}/graphql", json={"query": deploy, "variables": variables}) as r:
            body = await r.json()
            assert r.status == 200, body
            pod = body["data"]["pod"]
            assert pod["costPerHr"] == 0.22 and pod["desiredStatus"] == "RUNNING" and set(pod) == {
                "id", "costPerHr", "desiredStatus", "__typename"}
        for bad, why in (("query { nope }", 'Cannot query field "nope"'),
                         ("query { myself { pods { nope } } }", 'Cannot query field "nope" on type "pods"'),
                         ("query { myself { ", "Syntax Error"),
                         ("fragment F on Pod { id } query { myself { pods { ...F } } }", "query and mutation")):
            async with s.post(f"{market.url}/graphql", json={"query": bad}) as r:
                assert r.status in (200, 400)
                assert why in " ".join(e["message"] for e in (await r.json())["errors"])
        async with s.post(f"{market.url}/graphql", data=b"{") as r:
            assert r.status == 400
    assert [i["kind"] for i in (await fake_state(market))["instances"]] == ["openai"]


def test_parse_reads_inline_arguments_variables_and_block_strings() -> None:
    op = parse('query Q($id: String = "x") { a: pod(input: {podId: $id, n: -1.5e1, l: [1, true, null, ENUM]}) '
               '{ id } s: x(t: """he said "hi" """) }')
    assert op.kind == "query" and [f.alias for f in op.fields] == ["a", "s"]
    assert op.fields[0].name == "pod" and op.fields[0].args == {"input": {"podId": "x", "n": -15.0,
                                                                         "l": [1, True, None, "ENUM"]}}
    assert op.fields[1].args == {"t": 'he said "hi" '}
    with pytest.raises(GraphQLError, match="multiple operations"):
        parse("query A { a } query B { b }")
    assert parse("query A { a } query B { b }", operation="B").fields[0].name == "b"


def test_the_runpod_client_works_against_kilolined_fakegpu_provider(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`kilolined fakegpu --provider runpod --offers FILE` in a process of its own, the client
    pointed at it."""
    offers = tmp_path / "offers.json"
    offers.write_text(json.dumps([{"id": 1, "machine_id": 10, "gpu_name": "RTX 3090", "dph_total": 0.31,
                                   "gpu_type_id": "NVIDIA GeForce RTX 3090"}]))
    proc, url = start_cli_provider("runpod", "--boot-sec", "0.2", "--api-key", KEY, "--offers", str(offers),
                                   "--steps", "2", "--step-ms", "5")
    try:
        rp = import_runpod()
        monkeypatch.setenv("RUNPOD_API_BASE_URL", url)
        monkeypatch.setattr(rp, "api_key", KEY)
        pod = rp.create_pod("kiloline:x", "some/generic-server", "NVIDIA GeForce RTX 3090", ports="8080/http")
        assert rp.get_pod(pod["id"])["costPerHr"] == 0.31 and pod["machineId"] == "10"
        rp.terminate_pod(pod["id"])
        assert rp.get_pods() == []
    finally:
        proc.terminate()
        proc.wait(timeout=10)

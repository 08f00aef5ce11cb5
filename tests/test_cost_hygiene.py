"""Cost hygiene: a request's cost is what it really asks for, always finite and ≥ 0 or refused at
admission, and a node's usage report can only ever spend a budget (docs/SECURITY.md).

Pure cost functions are checked with hypothesis; admission and usage end to end through the real
gateway over loopback (a fake ComfyUI / generic card, and a tiny OpenAI-shaped node whose usage
reports the test chooses).
"""

from __future__ import annotations

import math
import time
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from conftest import ADMIN, auth, base_config
from fakes import _FakeServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kilolined.adapters.openai import MAX_USAGE_TOKENS, StreamParser, estimate_tokens, usage_count
from kilolined.core.config import RequestCostConfig
from kilolined.fakegpu import FakeGPU
from kilolined.scheduling.costs import (
    MAX_COST,
    MAX_UNITS,
    CostTooLarge,
    UnitError,
    header_number,
    request_cost,
    token_estimate,
    workflow_megapixels,
)


def latent(w: Any, h: Any, b: Any = 1) -> dict[str, Any]:
    return {"class_type": "EmptyLatentImage", "inputs": {"width": w, "height": h, "batch_size": b}}


def node(cls: str, **inputs: Any) -> dict[str, Any]:
    return {"class_type": cls, "inputs": inputs}


# ----------------------------------------------------------------------------------------------
# Pure: what a ComfyUI workflow asks for


@pytest.mark.parametrize(("w", "h", "b"), [
    (1e200, 1e200, 0),          # batch 0: no ComfyUI node takes it
    (512, 512, -1),
    (-512, 512, 1),
    ("512", 512, 1),            # a size must be a number (or a link)
    (512, None, 1),
    (True, 512, 1),
    (512, 512, "4"),
    (512, {"v": 1}, 1),
])
def test_malformed_sizes_are_unit_errors(w: Any, h: Any, b: Any) -> None:
    with pytest.raises(UnitError) as e:
        workflow_megapixels({"5": latent(w, h, b)})
    assert type(e.value) is UnitError


@pytest.mark.parametrize("graph", [
    {"5": latent(1e200, 1e200, 1)},
    {"5": latent(1e154, 1e154, 1e154)},
    {"5": latent(4096, 4096, 1), "6": node("LatentUpscaleBy", samples=["5", 0], scale_by=1e300)},
    {"5": latent(4096, 4096, 1), "6": node("RepeatLatentBatch", samples=["5", 0], amount=1e300)},
])
def test_sizes_no_gpu_could_make_are_too_large(graph: dict[str, Any]) -> None:
    with pytest.raises(CostTooLarge):
        workflow_megapixels(graph)


def test_upscale_and_repeat_nodes_raise_the_megapixels() -> None:
    graph = {
        "1": latent(512, 512, 2),                                                  # 512² × 2
        "2": node("LatentUpscaleBy", samples=["1", 0], scale_by=2),                # 1024² × 2
        "3": node("RepeatLatentBatch", samples=["2", 0], amount=3),                # 1024² × 6
        "4": node("KSampler", latent_image=["3", 0], seed=1, steps=20),            # passes 1024² × 6 on
        "5": node("VAEDecode", samples=["4", 0], vae=["9", 2]),
        "6": node("ImageScaleBy", image=["5", 0], scale_by=1.5),                   # 1536² × 6
        "7": node("LatentUpscale", samples=["1", 0], width=1024, height=0),       # 1024² × 2 (aspect kept)
        "8": node("RepeatImageBatch", image=["5", 0], amount=2),                   # 1024² × 12
        "9": node("ImageScaleToTotalPixels", image=["5", 0], megapixels=2),        # 2 MP × 6
        "10": node("ImageScale", image=["5", 0], width=2048, height=2048),         # 2048² × 6
    }
    mp = 1024 * 1024 / 1e6
    expected = (512 * 512 * 2 / 1e6 + mp * 2 + mp * 6 + 1536 * 1536 * 6 / 1e6 + mp * 2 + mp * 12 + 2 * 6
                + 2048 * 2048 * 6 / 1e6)
    assert workflow_megapixels(graph) == pytest.approx(expected)


def test_links_cycles_and_long_chains_do_not_break_the_walk() -> None:
    cycle = {"1": node("LatentUpscaleBy", samples=["2", 0], scale_by=2),
             "2": node("LatentUpscaleBy", samples=["1", 0], scale_by=2)}
    assert workflow_megapixels(cycle) == 0
    chain: dict[str, Any] = {"0": latent(64, 64, 1)}
    for i in range(1, 20_000):  # deeper than Python's recursion limit
        chain[str(i)] = node("KSampler", latent_image=[str(i - 1), 0])
    chain["top"] = node("RepeatLatentBatch", samples=["19999", 0], amount=2)
    assert workflow_megapixels(chain) == pytest.approx(64 * 64 * 3 / 1e6)
    # A linked width or batch is not a number: the node is skipped / counts 1, as before.
    assert workflow_megapixels({"1": latent(["4", 0], 512), "2": latent(512, 512, ["7", 0])}) == \
        pytest.approx(512 * 512 / 1e6)


# ----------------------------------------------------------------------------------------------
# Pure: what an OpenAI request asks for


def test_n_token_ids_and_tools_count() -> None:
    assert token_estimate({"prompt": "abcd", "max_tokens": 10, "n": 4}, 0) == 1 + 40
    assert token_estimate({"prompt": "abcd", "max_tokens": 10, "n": 2, "best_of": 5}, 0) == 1 + 50
    assert token_estimate({"prompt": [1, 2, 3, 4, 5], "max_tokens": 1}, 0) == 5 + 1
    assert token_estimate({"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 1}, 0) == 5 + 1
    tools = [{"type": "function", "function": {"name": "f" * 400, "parameters": {"type": "object"}}}]
    with_tools = token_estimate({"messages": [], "tools": tools, "max_tokens": 0}, 0)
    assert with_tools == math.ceil(len(orjson.dumps(tools)) / 4) and with_tools > 100
    for bad in ({"n": 0}, {"n": "4"}, {"n": 2.5}, {"best_of": True}):
        with pytest.raises(UnitError):
            token_estimate({"prompt": "x", **bad}, 1)
    with pytest.raises(CostTooLarge):
        token_estimate({"prompt": "x", "max_tokens": 1e300, "n": 2 ** 63}, 1)


def test_the_budget_reservation_counts_the_same_things() -> None:
    tools = [{"type": "function", "function": {"name": "g" * 40}}]
    assert estimate_tokens({"prompt": [1, 2, 3], "max_tokens": 10, "n": 3}) == 3 + 30
    assert estimate_tokens({"messages": [], "tools": tools}) == math.ceil(len(orjson.dumps(tools)) / 4)
    assert estimate_tokens({"prompt": "abcd", "max_tokens": 10, "n": "x"}) == 1 + 10  # lenient past admission


# ----------------------------------------------------------------------------------------------
# Pure: header units and usage reports


@pytest.mark.parametrize("raw", ["1_0", "١٢", "１２", "1e3", "inf", "nan", "+1", "-1", "0x10", "1.", ".5", "", "1 2"])
def test_header_units_are_ascii_decimals_only(raw: str) -> None:
    with pytest.raises(UnitError):
        header_number({"X-Frames": raw}, "X-Frames")


def test_header_units_read_plain_decimals() -> None:
    assert header_number({"X-Frames": "12"}, "X-Frames") == 12
    assert header_number({"X-Frames": " 2.5 "}, "X-Frames") == 2.5
    assert header_number({}, "X-Frames") == 0


def test_usage_is_clamped_to_sane_integers() -> None:
    def tokens(usage: Any) -> int:
        p = StreamParser()
        p.feed(orjson.dumps({"choices": [], "usage": usage}))
        p.done(True)
        return p.tokens()

    assert tokens({"total_tokens": -6800}) == 0
    assert tokens({"total_tokens": 10 ** 19}) == MAX_USAGE_TOKENS
    assert tokens({"total_tokens": "12", "prompt_tokens": 3, "completion_tokens": 4}) == 7
    assert tokens({"prompt_tokens": -3, "completion_tokens": 4.2}) == 5
    assert tokens({"total_tokens": True, "prompt_tokens": 2}) == 2


# ----------------------------------------------------------------------------------------------
# Hypothesis: a cost is always finite and ≥ 0, or refused

numbers = st.one_of(st.integers(-(2 ** 63), 2 ** 64 - 1),  # what JSON (orjson) carries
                     st.floats(allow_nan=False, allow_infinity=False))
ids = st.sampled_from(["1", "2", "3", "4", "9"])
values = st.one_of(numbers, st.tuples(ids, st.integers(0, 2)).map(list), st.text(max_size=4), st.booleans(),
                   st.none(), st.lists(numbers, max_size=3))
classes = st.sampled_from(["EmptyLatentImage", "LatentUpscale", "LatentUpscaleBy", "ImageScaleBy", "ImageScale",
                           "RepeatLatentBatch", "RepeatImageBatch", "ImageScaleToTotalPixels", "KSampler", "X"])
input_names = st.sampled_from(["width", "height", "batch_size", "scale_by", "amount", "megapixels", "samples",
                               "image", "seed"])
graphs = st.dictionaries(ids, st.fixed_dictionaries({"class_type": classes,
                                                     "inputs": st.dictionaries(input_names, values, max_size=6)}),
                         max_size=5)


def finite_or_refused(f: Any) -> float | None:
    try:
        v = f()
    except UnitError:
        return None
    assert isinstance(v, float | int) and math.isfinite(v) and v >= 0
    return float(v)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # a loaded CI box
@given(graph=graphs, base=st.floats(0, 1e300), per=st.floats(0, 1e300))
def test_comfy_costs_are_finite_or_refused(graph: dict[str, Any], base: float, per: float) -> None:
    mp = finite_or_refused(lambda: workflow_megapixels(graph))
    assert mp is None or mp <= MAX_UNITS
    cfg = RequestCostConfig(base=base, per_unit=per, unit="megapixels")
    body = orjson.dumps({"prompt": graph})
    c = finite_or_refused(lambda: request_cost(cfg, "comfyui", "POST", "/prompt", body, {}))
    assert c is None or c <= MAX_COST


texts = st.one_of(st.text(max_size=20), st.lists(st.one_of(st.text(max_size=5), numbers),
                                                  max_size=4), numbers, st.none())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # a loaded CI box
@given(doc=st.fixed_dictionaries({}, optional={"prompt": st.one_of(texts, st.lists(st.lists(numbers, max_size=3),
                                                                                   max_size=3)),
                                               "messages": st.lists(st.fixed_dictionaries({"content": texts}),
                                                                    max_size=3),
                                               "tools": st.lists(st.dictionaries(st.text(max_size=3), texts),
                                                                 max_size=2),
                                               "n": values, "best_of": values,
                                               "max_tokens": values}),
       per=st.floats(0, 1e300))
def test_token_costs_are_finite_or_refused(doc: dict[str, Any], per: float) -> None:
    cfg = RequestCostConfig(per_unit=per, unit="tokens", default_max_tokens=1024)
    body = orjson.dumps(doc)
    finite_or_refused(lambda: request_cost(cfg, "openai", "POST", "/v1/completions", body, {}))
    assert estimate_tokens(doc) >= 0


@given(raw=st.text(max_size=12))
def test_header_numbers_are_finite_ascii_decimals_or_refused(raw: str) -> None:
    v = finite_or_refused(lambda: header_number({"H": raw}, "H"))
    if v is not None:
        assert raw.strip(" \t").replace(".", "", 1).isascii() and raw.strip(" \t").replace(".", "", 1).isdigit()


@given(v=st.one_of(numbers, st.text(max_size=3), st.booleans(), st.none(), st.floats()))
def test_usage_counts_are_sane_integers(v: Any) -> None:
    n = usage_count(v)
    assert n is None or (type(n) is int and 0 <= n <= MAX_USAGE_TOKENS)


# ----------------------------------------------------------------------------------------------
# End to end: refused at admission, never queued


async def error_type(r: aiohttp.ClientResponse) -> str:
    return str((await r.json())["error"]["type"])


def comfy_cfg(url: str, capacity: float | None) -> dict[str, Any]:
    # A short queue_timeout: a request whose cost no node could ever fit would come back 503
    # queue_timeout after it, instead of being refused at once.
    cfg = base_config({"c": url}, kind="comfyui", max_concurrency=2, queue_timeout_sec=2,
                      cost={"base": 4, "per_unit": 1.5, "unit": "megapixels"})
    if capacity is not None:
        cfg["nodes"]["c"]["capacity"] = capacity
    return cfg


@pytest.mark.parametrize("capacity", [22, None])
async def test_absurd_comfy_prompts_are_refused_at_admission(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession,
                                                             capacity: float | None) -> None:
    gpu: FakeGPU = await fakegpus("comfyui")
    gw = await gateway(comfy_cfg(gpu.url, capacity))
    cases = [(latent(1e200, 1e200, 0), 400, "bad_request"), (latent(-512, 512), 400, "bad_request"),
             (latent("512", 512), 400, "bad_request"),
             (latent(1e200, 1e200, 1), 422, "exceeds_capacity")]
    for graph, status, type_ in cases:
        async with http.post(gw.url + "/gen/prompt", json={"prompt": {"5": graph}}, headers=auth()) as r:
            assert (r.status, await error_type(r)) == (status, type_), graph
    assert [q for q in gpu.requests if q["path"].endswith("/prompt")] == []
    assert not gw.rt.scheduler.capacity_used and gw.rt.scheduler.routes["gen"].capacity_used == 0


async def test_repeat_nodes_count_against_capacity(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    gpu: FakeGPU = await fakegpus("comfyui")
    gw = await gateway(comfy_cfg(gpu.url, 22))
    # 4 + 1.5 × (1 MP + 1 MP × 16): 29.5, more than the card's 22; the latent alone would be 7.
    graph = {"5": latent(1000, 1000), "6": node("RepeatLatentBatch", samples=["5", 0], amount=16)}
    async with http.post(gw.url + "/gen/prompt", json={"prompt": graph}, headers=auth()) as r:
        assert r.status == 422 and await error_type(r) == "exceeds_capacity"


async def test_header_cost_units_are_ascii_decimals(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    gpu: FakeGPU = await fakegpus("generic", steps=1, step_ms=1)
    cfg = base_config({"g": gpu.url}, cost={"base": 1, "per_unit": 1, "unit": "header:X-Frames"})
    cfg["nodes"]["g"]["capacity"] = 100
    gw = await gateway(cfg)
    for raw in ("1_0", "١٢", "1e1"):
        async with http.post(gw.url + "/gen/generate", json={}, headers={**auth(), "X-Frames": raw}) as r:
            assert (r.status, await error_type(r)) == (400, "bad_request"), raw
    async with http.post(gw.url + "/gen/generate", json={}, headers={**auth(), "X-Frames": "12"}) as r:
        assert r.status == 200


async def test_n_token_ids_and_tools_count_against_capacity(fakegpus: Any, gateway: Any,
                                                            http: aiohttp.ClientSession) -> None:
    gpu: FakeGPU = await fakegpus("openai", step_ms=1)
    cfg = base_config({"o": gpu.url}, kind="openai", path="/v1", cost={"per_unit": 1, "unit": "tokens"})
    cfg["nodes"]["o"]["capacity"] = 100
    gw = await gateway(cfg)
    url = gw.url + "/v1/chat/completions"
    one = {"model": "fake-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30}
    async with http.post(url, json=one, headers=auth()) as r:
        assert r.status == 200, await r.text()
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 600}}]
    for big in ({**one, "n": 4}, {**one, "tools": tools},
                {"model": "fake-llm", "prompt": [7] * 90, "max_tokens": 30}):
        target = url if "messages" in big else gw.url + "/v1/completions"
        async with http.post(target, json=big, headers=auth()) as r:
            assert (r.status, await error_type(r)) == (422, "exceeds_capacity"), big
    async with http.post(url, json={**one, "n": "4"}, headers=auth()) as r:
        assert (r.status, await error_type(r)) == (400, "bad_request")


# ----------------------------------------------------------------------------------------------
# End to end: a node's usage report can only spend


class UsageNode(_FakeServer):
    """An OpenAI-shaped node that answers each completion with the next usage report given."""

    def __init__(self, reports: list[Any]) -> None:
        super().__init__()
        self.reports = reports
        self.app.router.add_post("/v1/chat/completions", self.complete)

    async def complete(self, request: web.Request) -> web.Response:
        await request.read()
        self.requests += 1
        usage = self.reports.pop(0)
        body = {"id": "x", "object": "chat.completion", "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
                "usage": usage}
        return web.json_response(body)


async def tokens_metric(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(url + "/metrics", headers=ADMIN) as r:
        text = await r.text()
    for ln in text.splitlines():
        if ln.startswith('kiloline_tokens_total{key="alice"'):
            return float(ln.rsplit(" ", 1)[1])
    return 0.0


async def test_a_node_usage_report_never_refills_a_budget(gateway: Any, http: aiohttp.ClientSession) -> None:
    reports = [{"total_tokens": -8_000_000}, {"total_tokens": "12", "prompt_tokens": 3, "completion_tokens": 4},
               {"total_tokens": 2 ** 64 - 1}]
    async with UsageNode(reports) as node_:
        cfg = base_config({"o": node_.base_url}, kind="openai", path="/v1")
        cfg["keys"]["alice"]["budget"] = {"tokens_per_day": 1000}
        gw = await gateway(cfg)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}

        async def spent() -> float:
            return gw.rt.budgets.usage("alice", time.time())["tokens"]

        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
            assert r.status == 200
        assert await spent() == 0 and await tokens_metric(http, gw.url) == 0
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
            assert r.status == 200
        assert await spent() == 7 and await tokens_metric(http, gw.url) == 7
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
            assert r.status == 200
        assert await spent() == 7 + MAX_USAGE_TOKENS
        assert await tokens_metric(http, gw.url) == 7 + MAX_USAGE_TOKENS
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
            assert (r.status, await error_type(r)) == (429, "budget_exhausted")
        assert node_.requests == 3

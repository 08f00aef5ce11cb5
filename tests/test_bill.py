"""The bill, end to end over loopback: two keys on two routes of fake LLMs; /admin/usage (JSON and
CSV) and /v1/usage agree with what was sent, the GPU seconds metric with the bill, and a restart
keeps it (``server.state_dir``)."""

from __future__ import annotations

import copy
import csv
import io
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ADMIN, KEYS, auth, base_config
from openai import AsyncOpenAI

from kilolined.core.config import NodeConfig
from kilolined.ops.runtime import PoolNode
from kilolined.scheduling.bill import utc_day

MESSAGES = [{"role": "user", "content": "say something please"}]
PRICE = 3.6  # $/h: a GPU second costs $0.001


def bill_cfg(a: Any, b: Any, state: Path) -> dict[str, Any]:
    cfg = base_config({"a": a.url}, kind="openai", path="/v1")
    cfg["nodes"]["b"] = {"url": b.url}
    cfg["routes"]["other"] = {"path": "/b", "kind": "openai", "nodes": ["b"], "max_concurrency": 2}
    cfg["server"]["state_dir"] = str(state)
    cfg["cost"] = {"gpu_hourly_usd": PRICE}
    cfg["keys"]["alice"]["budget"] = {"requests_per_day": 10, "tokens_per_day": 1000, "period": "month"}
    return cfg


async def _send(gw: Any) -> dict[tuple[str, str], list[int]]:
    """Requests of alice and bob on both routes; (key, route) -> [requests, prompt, completion]."""
    sent: dict[tuple[str, str], list[int]] = {}

    def note(key: str, route: str, prompt: int, completion: int) -> None:
        s = sent.setdefault((key, route), [0, 0, 0])
        s[0] += 1
        s[1] += prompt
        s[2] += completion

    for key, route, base, n in (("alice", "gen", "/v1", 3), ("alice", "other", "/b/v1", 5),
                                ("bob", "other", "/b/v1", 2)):
        llm = AsyncOpenAI(base_url=gw.url + base, api_key=KEYS[key], max_retries=0, timeout=30)
        r = await llm.chat.completions.create(model="fake-llm", messages=MESSAGES, max_tokens=n)
        assert r.usage is not None
        note(key, route, r.usage.prompt_tokens, r.usage.completion_tokens)
    # a stream: its usage comes in the last chunk (the gateway asks for it)
    llm = AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS["alice"], max_retries=0, timeout=30)
    stream = await llm.chat.completions.create(model="fake-llm", messages=MESSAGES, max_tokens=4, stream=True,
                                               stream_options={"include_usage": True})
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
    assert usage is not None
    note("alice", "gen", usage.prompt_tokens, usage.completion_tokens)
    return sent


async def _get(http: Any, url: str, headers: dict[str, str]) -> tuple[int, Any, dict[str, str]]:
    async with http.get(url, headers=headers) as r:
        body = await r.json() if r.content_type == "application/json" else await r.text()
        return r.status, body, dict(r.headers)


async def test_usage_endpoints_agree_with_what_was_sent(fakegpus, gateway, http, tmp_path: Path) -> None:
    a, b = await fakegpus("openai", step_ms=1), await fakegpus("openai", step_ms=1)
    cfg = bill_cfg(a, b, tmp_path / "state")
    gw = await gateway(copy.deepcopy(cfg))
    sent = await _send(gw)
    today = utc_day(time.time())

    status, body, headers = await _get(http, gw.url + "/admin/usage?group_by=key,route", ADMIN)
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert body["group_by"] == ["key", "route"]
    got = {(r["key"], r["route"]): [r["requests"], r["prompt_tokens"], r["completion_tokens"]] for r in body["rows"]}
    assert got == sent
    for r in body["rows"]:
        assert r["gpu_seconds"] > 0
        assert abs(r["cost_usd"] - r["gpu_seconds"] * PRICE / 3600) < 1e-5  # both rounded to 6 places
    assert body["total"]["requests"] == sum(s[0] for s in sent.values())

    # The same, by day and model: one day, one model, the same sums.
    _, by_day, _ = await _get(http, gw.url + f"/admin/usage?group_by=day,model&from={today}&to={today}", ADMIN)
    assert [(r["day"], r["model"]) for r in by_day["rows"]] == [(today, "fake-llm")]
    assert by_day["total"] == body["total"]
    _, none, _ = await _get(http, gw.url + "/admin/usage?to=2000-01-01", ADMIN)
    assert none["rows"] == [] and none["total"]["requests"] == 0

    # CSV says what the JSON says.
    csv_headers = {**ADMIN, "Accept": "text/csv"}
    status, text, headers = await _get(http, gw.url + "/admin/usage?group_by=key,route", csv_headers)
    assert status == 200 and headers["Content-Type"].startswith("text/csv")
    lines = list(csv.DictReader(io.StringIO(text)))
    assert [list(r) for r in lines[:1]] == [["key", "route", "requests", "prompt_tokens", "completion_tokens",
                                            "gpu_seconds", "cost_usd"]]
    assert {(r["key"], r["route"]): [int(r["requests"]), int(r["prompt_tokens"]), int(r["completion_tokens"])]
            for r in lines} == sent
    assert [float(r["gpu_seconds"]) for r in lines] == [r["gpu_seconds"] for r in body["rows"]]

    # kiloline_gpu_seconds_total{route,key} counts what the bill counts.
    async with http.get(gw.url + "/metrics", headers=ADMIN) as r:
        metrics = await r.text()
    series = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in metrics.splitlines()
              if ln.startswith("kiloline_gpu_seconds_total{")}
    for row in body["rows"]:
        name = f'kiloline_gpu_seconds_total{{key="{row["key"]}",route="{row["route"]}"}}'
        assert abs(series[name] - row["gpu_seconds"]) < 1e-5

    # A key sees its own, and what is left of its budgets.
    status, mine, _ = await _get(http, gw.url + "/v1/usage?group_by=route", auth("alice"))
    assert status == 200 and mine["key"] == "alice"
    assert {r["route"]: [r["requests"], r["prompt_tokens"], r["completion_tokens"]] for r in mine["rows"]} == {
        route: v for (key, route), v in sent.items() if key == "alice"}
    alice_tokens = sum(v[1] + v[2] for (key, _), v in sent.items() if key == "alice")
    budget = mine["budget"]
    assert budget["period"] == "month" and budget["window"] == today[:7]
    assert budget["limits"] == {"requests_per_day": 10, "tokens_per_day": 1000}
    assert budget["remaining"] == {"requests_per_day": 10 - 3, "tokens_per_day": 1000 - alice_tokens}
    assert budget["resets_in_sec"] >= 1
    status, bobs, _ = await _get(http, gw.url + "/v1/usage", auth("bob"))
    assert status == 200 and bobs["budget"] is None
    assert {r["key"] for r in bobs["rows"]} == {"bob"} and bobs["total"]["requests"] == 1
    _, carol, _ = await _get(http, gw.url + "/v1/usage", auth("carol"))
    assert carol["rows"] == [] and carol["total"]["requests"] == 0

    # Restart: the bill is read back from state_dir.
    await gw.server.shutdown()
    assert (tmp_path / "state" / "usage.json").exists()
    gw2 = await gateway(copy.deepcopy(cfg))
    _, again, _ = await _get(http, gw2.url + "/admin/usage?group_by=key,route", ADMIN)
    assert again["rows"] == body["rows"]
    _, mine2, _ = await _get(http, gw2.url + "/v1/usage?group_by=route", auth("alice"))
    assert mine2["budget"]["remaining"] == budget["remaining"]


async def test_usage_refuses_bad_queries_and_strangers(fakegpus, gateway, http, tmp_path: Path) -> None:
    a, b = await fakegpus("openai", step_ms=1), await fakegpus("openai", step_ms=1)
    gw = await gateway(bill_cfg(a, b, tmp_path / "state"))
    for query in ("from=2026-13-01", "to=yesterday", "from=2026-12-06&to=2026-12-01", "group_by=node",
                  "group_by=", "from=2026-1-1"):
        for path, headers in (("/admin/usage", ADMIN), ("/v1/usage", auth("alice"))):
            status, body, h = await _get(http, f"{gw.url}{path}?{query}", headers)
            assert status == 400, (path, query)
            assert body["error"]["type"] == "bad_request" and h["Content-Type"].startswith("application/json"), body
    # the admin view needs the admin key; a key's view needs a key
    for path, headers in (("/admin/usage", auth("alice")), ("/admin/usage", {}), ("/v1/usage", {}),
                          ("/v1/usage", {"Authorization": "Bearer kl_nobody_000000000000000000000"}),
                          ("/v1/usage", ADMIN)):
        status, body, h = await _get(http, gw.url + path, headers)
        assert status == 401 and body["error"]["type"] == "unauthorized", (path, headers)
        assert "WWW-Authenticate" in h


async def test_a_rented_node_bills_at_its_own_price(fakegpus, gateway, http, tmp_path: Path) -> None:
    """A fleet node's ``price_per_hour``, not ``cost.gpu_hourly_usd``, prices its GPU seconds."""
    a, b, c = [await fakegpus("openai", step_ms=1) for _ in range(3)]
    gw = await gateway(bill_cfg(a, b, tmp_path / "state"))
    gw.rt.set_pool_node("p-7", PoolNode(pool="p", cfg=NodeConfig(url=c.url), routes=("other",), provider="vastai",
                                        instance_id="7", price_per_hour=36.0))
    async with http.post(gw.url + "/admin/nodes/b/drain", headers=ADMIN) as r:
        assert r.status == 200
    llm = AsyncOpenAI(base_url=gw.url + "/b/v1", api_key=KEYS["bob"], max_retries=0, timeout=30)
    await llm.chat.completions.create(model="fake-llm", messages=MESSAGES, max_tokens=2)
    assert c.stats["served"] == 1
    _, body, _ = await _get(http, gw.url + "/admin/usage?group_by=key", ADMIN)
    [row] = body["rows"]
    assert row["key"] == "bob" and row["gpu_seconds"] > 0
    assert abs(row["cost_usd"] - row["gpu_seconds"] * 36.0 / 3600) < 1e-5


async def test_anthropic_messages_are_on_the_bill(fakegpus, gateway, http, tmp_path: Path) -> None:
    """Anthropic Messages on an openai route: its usage (input/output tokens) is on the bill as
    OpenAI's is, with the model the request names."""
    pytest.importorskip("kilolined.adapters.anthropic")  # the Messages surface of the openai kind
    from anthropic import AsyncAnthropic

    fake = await fakegpus("openai", step_ms=1)
    gw = await gateway(base_config({"o": fake.url}, kind="openai", path="/v1"))
    claude = AsyncAnthropic(base_url=gw.url, api_key=KEYS["alice"], max_retries=0, timeout=30)
    one = await claude.messages.create(model="claude-x", messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
    async with claude.messages.stream(model="claude-x", messages=MESSAGES, max_tokens=3) as s:  # type: ignore[arg-type]
        two = await s.get_final_message()
    _, body, _ = await _get(http, gw.url + "/admin/usage?group_by=key,model", ADMIN)
    lines = [(r["key"], r["model"], r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in body["rows"]]
    assert lines == [("alice", "claude-x", 2, one.usage.input_tokens + two.usage.input_tokens,
                      one.usage.output_tokens + two.usage.output_tokens)]

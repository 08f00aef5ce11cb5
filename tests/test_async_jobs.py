"""End to end: async jobs with signed webhooks (SPEC §4.3) and the Jobs API (§4.4).

Webhooks go to a real local receiver (fakes.FakeWebhookReceiver) and are checked with an
independent Standard Webhooks verifier (fakes.verify_standard_webhook), not with kilolined's.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import yaml
from conftest import ADMIN, auth, base_config, wait_until
from fakes import FakeWebhookReceiver, verify_standard_webhook
from jobs_client import SSEReader, job_status, node_answer, read_all, submit_async, token_of, wait_status

from kilolined.core.config import ConfigError, parse_config

SECRET = "whsec_" + base64.b64encode(bytes(range(100, 132))).decode()
OTHER_SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
SSE = {"X-KiloLine-Mode": "sse"}
WEBHOOK_KEYS = {"type", "job_id", "route", "status", "http_status", "duration_sec", "queue_wait_sec",
                "result_url", "result"}


def jobs_cfg(nodes: dict[str, str], *, allow_private: bool = True, **jobs_over: Any) -> dict[str, Any]:
    route_over = jobs_over.pop("route", {})
    cfg = base_config(nodes, **route_over)
    cfg["jobs"] = {"webhook_secret": SECRET, "webhook_allow_private": allow_private,
                   "webhook_backoff_sec": [0.1, 0.1, 0.1, 0.1, 0.1], **jobs_over}
    return cfg


@pytest.fixture
async def receiver() -> AsyncIterator[FakeWebhookReceiver]:
    async with FakeWebhookReceiver() as r:
        yield r


async def admin_state(http, gw) -> dict[str, Any]:
    async with http.get(gw.url + "/admin/state", headers=ADMIN) as r:
        assert r.status == 200
        return await r.json()


async def run_sse(http, gw, body: dict[str, Any]) -> list[Any]:
    """An sse job from submission to output_ready/failed."""
    async with http.post(gw.url + "/gen/generate", json=body, headers={**auth(), **SSE}) as r:
        assert r.status == 200, await r.text()
        return await SSEReader(r).rest(timeout=30)


# ----------------------------------------------------------------------------------------------
# Submission and webhooks


async def test_async_202_then_signed_job_completed_webhook(fakegpus, gateway, http, receiver) -> None:
    gpu = await fakegpus(steps=3, step_ms=150)
    gw = await gateway(jobs_cfg({"a": gpu.url}, route={"max_concurrency": 1, "expected_duration_sec": 1}))
    await submit_async(http, gw, {"echo": "blocker"})  # no callback: no webhook for this one
    await wait_until(lambda: gpu.stats["running"] == 1)

    async with http.post(gw.url + "/gen/generate", json={"echo": "hooked"},
                         headers={**auth(), "Prefer": "respond-async", "X-KiloLine-Callback": receiver.url()}) as r:
        assert r.status == 202, await r.text()
        assert r.headers["Content-Type"].startswith("application/json")
        location = r.headers["Location"]
        sub = await r.json()
    job_id = sub["job_id"]
    assert set(sub) == {"job_id", "status", "position", "est_wait_sec", "status_url", "events_url", "result_url"}
    assert location == f"/v1/jobs/{job_id}" == sub["status_url"]
    assert sub["status"] == "queued"
    assert sub["position"] == 1
    assert isinstance(sub["est_wait_sec"], int | float) and sub["est_wait_sec"] > 0
    assert sub["events_url"].startswith(f"/v1/jobs/{job_id}/events?token=")
    assert sub["result_url"].startswith(f"/v1/jobs/{job_id}/result?token=")
    assert len(job_id) >= 21  # ≥ 122 random bits in url-safe base64
    async with http.get(gw.url + location, headers=auth()) as r:
        assert (await r.json())["status"] in ("queued", "running", "completed")

    [hook] = await receiver.wait_for(1, timeout=15)
    assert hook["method"] == "POST" and hook["path"] == "/hook"
    assert hook["headers"]["content-type"].startswith("application/json")
    assert verify_standard_webhook(SECRET, hook["headers"], hook["body"])
    assert not verify_standard_webhook(OTHER_SECRET, hook["headers"], hook["body"])
    assert not verify_standard_webhook(SECRET, hook["headers"], hook["body"].replace(b"hooked", b"hacked"))
    data = hook["json"]
    assert set(data) >= WEBHOOK_KEYS
    assert data["type"] == "job.completed"
    assert data["job_id"] == job_id and data["route"] == "gen" and data["status"] == "completed"
    assert data["http_status"] == 200
    assert data["result"] == node_answer(gpu, 3, "hooked")
    assert data["result_url"] == sub["result_url"]
    assert isinstance(data["duration_sec"], int | float) and data["duration_sec"] >= 0
    assert isinstance(data["queue_wait_sec"], int | float) and data["queue_wait_sec"] > 0
    assert "\n" not in hook["headers"]["webhook-id"] and "." not in hook["headers"]["webhook-id"]

    async with http.get(gw.url + data["result_url"]) as r:
        assert r.status == 200 and (await r.json()) == data["result"]
    await asyncio.sleep(0.3)
    assert len(receiver.attempts) == 1  # the blocker had no callback, and nothing was sent twice


@pytest.mark.parametrize("how", ["header", "query", "prefer"])
async def test_async_mode_selectors(fakegpus, gateway, http, how) -> None:
    gpu = await fakegpus(steps=1, step_ms=10)
    gw = await gateway(base_config({"a": gpu.url}))
    url, headers = gw.url + "/gen/generate", auth()
    if how == "header":
        headers["X-KiloLine-Mode"] = "ASYNC"
    elif how == "query":
        url += "?kl_mode=async"
    else:
        headers["Prefer"] = "respond-async, wait=10"
    async with http.post(url, json={"echo": how}, headers=headers) as r:
        assert r.status == 202, await r.text()
        sub = await r.json()
    await wait_status(http, gw, sub["job_id"], "completed")
    assert gpu.requests[-1]["query"] == ""


async def test_webhook_retried_until_accepted_with_one_webhook_id(fakegpus, gateway, http, receiver) -> None:
    gpu = await fakegpus(steps=1, step_ms=10)
    gw = await gateway(jobs_cfg({"a": gpu.url}))
    receiver.fail_next = 3
    sub = await submit_async(http, gw, {"echo": "retry"}, headers={"X-KiloLine-Callback": receiver.url("/cb?x=1")})
    await receiver.wait_for(1, timeout=15)
    await asyncio.sleep(0.4)  # > one backoff: a stray extra attempt would show up
    attempts = receiver.attempts
    assert [a["status"] for a in attempts] == [500, 500, 500, 200]
    assert len(receiver.deliveries) == 1
    ids = {a["headers"]["webhook-id"] for a in attempts}
    assert len(ids) == 1, ids
    for a in attempts:
        assert verify_standard_webhook(SECRET, a["headers"], a["body"])
        assert a["body"] == attempts[0]["body"]  # the very same payload every time
    assert receiver.deliveries[0]["json"]["job_id"] == sub["job_id"]
    assert receiver.deliveries[0]["path"] == "/cb"


async def test_webhook_honours_retry_after(fakegpus, gateway, http, receiver) -> None:
    gpu = await fakegpus(steps=1, step_ms=10)
    gw = await gateway(jobs_cfg({"a": gpu.url}))
    receiver.fail_next, receiver.fail_status, receiver.retry_after = 1, 503, "1"
    await submit_async(http, gw, {"echo": "ra"}, headers={"X-KiloLine-Callback": receiver.url()})
    await receiver.wait_for(1, timeout=10)
    first, second = receiver.attempts
    assert first["status"] == 503 and second["status"] == 200
    assert second["at"] - first["at"] >= 0.9  # Retry-After: 1 beats the 0.1 s backoff
    assert first["headers"]["webhook-id"] == second["headers"]["webhook-id"]


async def test_key_webhook_url_is_the_default_callback(fakegpus, gateway, http, receiver) -> None:
    gpu = await fakegpus(steps=1, step_ms=10)
    cfg = jobs_cfg({"a": gpu.url})
    cfg["keys"]["carol"]["webhook_url"] = receiver.url("/carol")
    gw = await gateway(cfg)
    sub = await submit_async(http, gw, {"echo": "carol"}, who="carol")
    [hook] = await receiver.wait_for(1, timeout=15)
    assert hook["path"] == "/carol"
    assert hook["json"]["job_id"] == sub["job_id"] and hook["json"]["type"] == "job.completed"
    assert verify_standard_webhook(SECRET, hook["headers"], hook["body"])


@pytest.mark.parametrize("callback", ["{recv}", "http://localhost:{port}/hook", "http://[::1]:{port}/x",
                                      "http://169.254.169.254/latest/meta-data", "http://10.1.2.3/hook",
                                      "ftp://example.com/hook"])
async def test_private_callback_refused_with_400(fakegpus, gateway, http, receiver, callback) -> None:
    gpu = await fakegpus(steps=1, step_ms=10)
    gw = await gateway(jobs_cfg({"a": gpu.url}, allow_private=False))
    url = callback.format(recv=receiver.url(), port=receiver.port)
    async with http.post(gw.url + "/gen/generate", json={"echo": 1},
                         headers={**auth(), "Prefer": "respond-async", "X-KiloLine-Callback": url}) as r:
        assert r.status == 400, await r.text()
        assert r.headers["Content-Type"].startswith("application/json")
        err = (await r.json())["error"]
    assert err["type"] == "bad_request"
    assert "callback" in err["message"].lower()
    assert "169.254.169.254/latest" not in err["message"]  # the reason, not the whole URL
    await asyncio.sleep(0.2)
    assert gpu.requests == []
    assert receiver.requests == 0
    st = await admin_state(http, gw)
    assert st["routes"]["gen"]["queue_depth"] == 0 and st["routes"]["gen"]["inflight"] == 0
    assert gw.jobs.jobs == {}


async def test_failing_job_sends_job_failed(fakegpus, gateway, http, receiver) -> None:
    gpu = await fakegpus(steps=1, step_ms=10)
    gw = await gateway(jobs_cfg({"a": gpu.url}))
    gpu.set_control(fail_status=500)
    sub = await submit_async(http, gw, {"echo": "boom"}, headers={"X-KiloLine-Callback": receiver.url()})
    [hook] = await receiver.wait_for(1, timeout=15)
    assert verify_standard_webhook(SECRET, hook["headers"], hook["body"])
    data = hook["json"]
    assert set(data) >= WEBHOOK_KEYS
    assert data["type"] == "job.failed"
    assert data["job_id"] == sub["job_id"] and data["status"] == "failed" and data["route"] == "gen"
    assert data["http_status"] == 500
    assert data["result"] is None
    st = await job_status(http, gw, sub["job_id"])
    assert st["status"] == "failed" and st["http_status"] == 500
    assert st["error"]["type"] and st["error"]["message"]
    _, _, events = await read_all(http, gw.url + sub["events_url"])
    assert events[-1].event == "failed"
    failed = events[-1].json
    assert failed["status"] == "failed" and failed["http_status"] == 500
    assert set(failed["error"]) >= {"type", "message"}
    assert "127.0.0.1" not in hook["body"].decode() and str(gpu.port) not in failed["error"]["message"]


# ----------------------------------------------------------------------------------------------
# The Jobs API


async def test_result_not_ready_then_the_nodes_answer(fakegpus, gateway, http) -> None:
    gpu = await fakegpus(steps=5, step_ms=120)
    gw = await gateway(base_config({"a": gpu.url}))
    sub = await submit_async(http, gw, {"echo": "res"})
    async with http.get(gw.url + sub["result_url"]) as r:
        assert r.status == 425
        assert r.headers["Content-Type"].startswith("application/json")
        assert (await r.json())["error"]["type"] == "not_ready"
        assert int(r.headers.get("Retry-After", "1")) >= 1
    await wait_status(http, gw, sub["job_id"], "completed")
    async with http.get(gw.url + sub["result_url"]) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "application/json; charset=utf-8"  # the node's own
        raw = await r.read()
    assert orjson.loads(raw) == node_answer(gpu, 5, "res")
    async with http.get(f"{gw.url}/v1/jobs/{sub['job_id']}/result", headers=auth()) as r:
        assert r.status == 200 and await r.read() == raw


async def test_result_expires_after_result_ttl_sec(fakegpus, gateway, http) -> None:
    gpu = await fakegpus(steps=1, step_ms=10)
    gw = await gateway(jobs_cfg({"a": gpu.url}, result_ttl_sec=0.8))
    events = await run_sse(http, gw, {"echo": "ttl"})
    result_url = events[-1].json["result_url"]
    async with http.get(gw.url + result_url) as r:
        assert r.status == 200
    async def gone() -> bool:
        async with http.get(gw.url + result_url) as r:
            return r.status == 404 and (await r.json())["error"]["type"] == "not_found"

    await wait_until(gone, timeout=10, step=0.1)


async def test_max_results_mb_evicts_the_oldest_result(fakegpus, gateway, http) -> None:
    gpu = await fakegpus(steps=1, step_ms=10)
    gw = await gateway(jobs_cfg({"a": gpu.url}, max_results_mb=0.001))  # ~1048 bytes
    cap = 0.001 * 1024 * 1024
    first = await run_sse(http, gw, {"echo": "1" * 600})
    first_url = first[-1].json["result_url"]
    async with http.get(gw.url + first_url) as r:
        assert r.status == 200
        assert cap / 2 < len(await r.read()) < cap
    second = await run_sse(http, gw, {"echo": "2" * 600})
    assert second[-1].event == "output_ready", second[-1]
    async with http.get(gw.url + first_url) as r:
        assert r.status == 404
        assert (await r.json())["error"]["type"] == "not_found"
    async with http.get(gw.url + second[-1].json["result_url"]) as r:
        assert r.status == 200
        assert (await r.json())["echo"] == "2" * 600


async def test_delete_while_queued_never_reaches_the_node(fakegpus, gateway, http) -> None:
    gpu = await fakegpus(steps=8, step_ms=100)
    gw = await gateway(base_config({"a": gpu.url}, max_concurrency=1))
    blocker = await submit_async(http, gw, {"echo": "blocker"})
    await wait_until(lambda: gpu.stats["running"] == 1)
    sub = await submit_async(http, gw, {"echo": "doomed"})
    queued = await job_status(http, gw, sub["job_id"])
    assert queued["status"] == "queued" and queued["position"] == 1 and queued["node"] is None

    async with http.get(gw.url + sub["events_url"]) as ev:
        reader = SSEReader(ev)
        await reader.until("queued")
        async with http.delete(f"{gw.url}/v1/jobs/{sub['job_id']}", headers=auth()) as r:
            assert r.status == 200
            view = await r.json()
        tail = await reader.rest()
    assert view["job_id"] == sub["job_id"] and view["status"] == "cancelled"
    assert tail and tail[-1].event == "failed" and tail[-1].json["status"] == "cancelled"
    assert (await job_status(http, gw, sub["job_id"]))["status"] == "cancelled"
    st = await admin_state(http, gw)
    assert st["routes"]["gen"]["queue_depth"] == 0

    await wait_status(http, gw, blocker["job_id"], "completed")
    await asyncio.sleep(0.2)
    assert len([q for q in gpu.requests if q["path"] == "/generate"]) == 1
    assert gpu.stats["served"] == 1
    async with http.get(gw.url + sub["result_url"]) as r:
        assert r.status == 404  # cancelled: no result, ever


async def test_delete_while_running_aborts_the_node_and_frees_the_slot(fakegpus, gateway, http) -> None:
    gpu = await fakegpus(steps=50, step_ms=100)  # 5 s of work
    gw = await gateway(base_config({"a": gpu.url}, max_concurrency=1))
    sub = await submit_async(http, gw, {"echo": "long"})
    await wait_until(lambda: gpu.stats["running"] == 1)
    await wait_status(http, gw, sub["job_id"], "running")

    async with http.delete(f"{gw.url}/v1/jobs/{sub['job_id']}?token={token_of(sub['events_url'])}") as r:
        assert r.status == 200
        assert (await r.json())["status"] == "cancelled"
    await wait_until(lambda: gpu.stats["aborted"] >= 1, timeout=5)
    assert gpu.stats["running"] == 0 and gpu.stats["served"] == 0
    st = await admin_state(http, gw)
    assert st["routes"]["gen"]["inflight"] == 0
    assert st["nodes"]["a"]["inflight"] == 0
    # The slot really is free: a short request goes straight through.
    async with asyncio.timeout(3):
        async with http.post(gw.url + "/gen/generate", json={"steps": 1, "step_ms": 10}, headers=auth()) as r:
            assert r.status == 200
            assert int(r.headers["X-KiloLine-Queue-Wait-Ms"]) < 2000
    _, _, events = await read_all(http, gw.url + sub["events_url"])
    assert events[-1].event == "failed" and events[-1].json["status"] == "cancelled"
    # Cancelling again is harmless.
    async with http.delete(f"{gw.url}/v1/jobs/{sub['job_id']}", headers=auth()) as r:
        assert r.status == 200 and (await r.json())["status"] == "cancelled"


async def test_queue_timeout_fails_the_job_and_sends_job_failed(fakegpus, gateway, http, receiver) -> None:
    gpu = await fakegpus(steps=15, step_ms=100)  # the blocker holds the slot for 1.5 s
    gw = await gateway(jobs_cfg({"a": gpu.url}, route={"max_concurrency": 1, "queue_timeout_sec": 0.5}))
    blocker = await submit_async(http, gw, {"echo": "blocker"})
    await wait_until(lambda: gpu.stats["running"] == 1)
    sub = await submit_async(http, gw, {"echo": "late"}, headers={"X-KiloLine-Callback": receiver.url()})
    [hook] = await receiver.wait_for(1, timeout=10)
    assert verify_standard_webhook(SECRET, hook["headers"], hook["body"])
    data = hook["json"]
    assert data["type"] == "job.failed" and data["job_id"] == sub["job_id"] and data["status"] == "failed"
    assert data["http_status"] == 503 and data["result"] is None
    st = await job_status(http, gw, sub["job_id"])
    assert st["status"] == "failed" and st["error"]["type"] == "queue_timeout"
    _, _, events = await read_all(http, gw.url + sub["events_url"])
    assert events[0].event == "queued" and events[-1].event == "failed"
    assert "dispatched" not in [e.event for e in events]
    assert events[-1].json["error"]["type"] == "queue_timeout"
    await wait_status(http, gw, blocker["job_id"], "completed")
    assert len([q for q in gpu.requests if q["path"] == "/generate"]) == 1


async def test_refused_callback_costs_no_budget(fakegpus, gateway, http) -> None:
    """A 400 for a bad callback URL is a refusal like a bad mode: it must not use up the day's budget."""
    gpu = await fakegpus(steps=1, step_ms=10)
    cfg = jobs_cfg({"a": gpu.url}, allow_private=False)
    cfg["keys"]["alice"]["budget"] = {"requests_per_day": 1}
    gw = await gateway(cfg)
    async with http.post(gw.url + "/gen/generate", json={}, headers={
            **auth(), "Prefer": "respond-async", "X-KiloLine-Callback": "http://127.0.0.1:9/hook"}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["type"] == "bad_request"
    async with http.post(gw.url + "/gen/generate", json={"echo": "paid"}, headers=auth()) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["echo"] == "paid"


async def test_cap_evicted_jobs_still_expire_after_result_ttl_sec(fakegpus, gateway, http) -> None:
    """A job whose result was evicted for max_results_mb must still leave memory at its TTL, like any
    other finished job — else a busy gateway keeps every such job (and its event log) forever."""
    gpu = await fakegpus(steps=1, step_ms=10)
    gw = await gateway(jobs_cfg({"a": gpu.url}, max_results_mb=0.001, result_ttl_sec=0.6))
    first = (await run_sse(http, gw, {"echo": "1" * 600}))[0].json["job_id"]
    second = (await run_sse(http, gw, {"echo": "2" * 600}))[0].json["job_id"]  # evicts first's result
    third = (await run_sse(http, gw, {"echo": "small"}))[0].json["job_id"]

    async def status(job_id: str) -> int:
        async with http.get(f"{gw.url}/v1/jobs/{job_id}", headers=auth()) as r:
            return r.status

    async def normal_ones_gone() -> bool:
        return [await status(second), await status(third)] == [404, 404]

    await wait_until(normal_ones_gone, timeout=6, step=0.1)  # TTL-expired: gone from memory
    await asyncio.sleep(0.5)  # a few more ticks of the jobs loop
    assert await status(first) == 404, "the cap-evicted job is still kept after its TTL"
    assert first not in gw.jobs.jobs


async def test_public_url_makes_every_handed_out_url_absolute(fakegpus, gateway, http, receiver) -> None:
    """A webhook receiver on another host cannot use /v1/jobs/…; with server.public_url it need not."""
    g = await fakegpus()
    cfg = jobs_cfg({"a": g.url})
    cfg["server"]["public_url"] = "https://gw.example.com/"
    gw = await gateway(cfg)
    async with http.post(gw.url + "/gen/generate", json={"echo": "abs"},
                         headers={**auth(), "Prefer": "respond-async", "X-KiloLine-Callback": receiver.url()}) as r:
        assert r.status == 202
        sub = await r.json()
        assert r.headers["Location"] == f"https://gw.example.com/v1/jobs/{sub['job_id']}"
    for k in ("status_url", "events_url", "result_url"):
        assert sub[k].startswith(f"https://gw.example.com/v1/jobs/{sub['job_id']}"), sub
    [hook] = await receiver.wait_for(1, timeout=15)
    body = orjson.loads(hook["body"])
    assert body["result_url"].startswith("https://gw.example.com/v1/jobs/"), body
    # The paths still work against the gateway itself.
    rel = sub["result_url"].removeprefix("https://gw.example.com")
    async with http.get(gw.url + rel) as r:
        assert r.status == 200


async def test_public_url_must_be_an_http_url() -> None:
    cfg = jobs_cfg({"a": "http://127.0.0.1:9"})
    cfg["server"]["public_url"] = "gw.example.com"
    with pytest.raises(ConfigError, match="public_url"):
        parse_config(yaml.safe_dump(cfg))

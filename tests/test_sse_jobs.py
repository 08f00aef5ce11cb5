"""End to end: sse jobs (SPEC §4.2), replay after a reconnect, and who may read a job (§4.4).

Everything runs for real on loopback: a FakeGPU, the gateway, and an aiohttp client reading the
event stream line by line with a small WHATWG-style parser (comments, ``retry:``, ``id:``).
"""

from __future__ import annotations

import asyncio

import orjson
import pytest
from conftest import ADMIN, auth, base_config, wait_until
from jobs_client import Event, SSEReader, job_status, node_answer, read_all, submit_async, token_of, wait_status

SSE = {"X-KiloLine-Mode": "sse"}
TERMINAL_EVENTS = ("output_ready", "failed")


# ----------------------------------------------------------------------------------------------
# A small SSE reader (shared with the other end-to-end files)


# ----------------------------------------------------------------------------------------------
# The full life of an sse job


async def test_sse_job_full_sequence_behind_a_busy_slot(fakegpus, gateway, http) -> None:
    gpu = await fakegpus(steps=6, step_ms=200)  # ~1.2 s a job: positions change slower than 1/s
    gw = await gateway(base_config({"a": gpu.url}, max_concurrency=1, expected_duration_sec=1.2))
    for i in range(3):
        await submit_async(http, gw, {"echo": f"ahead-{i}"})
    await wait_until(lambda: gpu.stats["running"] == 1)  # the first one holds the only slot

    body = {"echo": "target", "steps": 1, "step_ms": 20}
    async with http.post(gw.url + "/gen/generate", json=body, headers={**auth(), **SSE}) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert r.headers["Cache-Control"] == "no-cache"
        assert r.headers["X-Accel-Buffering"] == "no"
        job_header = r.headers["X-KiloLine-Job"]
        reader = SSEReader(r)
        events = await reader.rest(timeout=30)
    assert reader.eof, "the stream must close after output_ready"
    assert reader.lines[0] == "retry: 3000", reader.lines[:3]
    assert reader.retry == 3000

    names = [e.event for e in events]
    assert [e.id for e in events] == [str(i) for i in range(1, len(events) + 1)], names
    assert all(isinstance(e.json, dict) for e in events)  # every data line is a JSON object
    assert names[0] == "queued" and names[-1] == "output_ready", names
    assert names.count("dispatched") == 1 and names.count("output_ready") == 1, names
    d = names.index("dispatched")
    assert set(names[1:d]) <= {"queue_status", "heartbeat"}, names
    assert set(names[d + 1 : -1]) <= {"heartbeat", "step_progress"}, names

    queued = events[0].json
    job_id = queued["job_id"]
    assert job_id == job_header
    assert set(queued) == {"job_id", "route", "position", "queue_depth", "est_wait_sec", "events_url", "result_url"}
    assert queued["route"] == "gen"
    assert queued["position"] == 3
    assert queued["queue_depth"] >= 3
    assert isinstance(queued["est_wait_sec"], int | float) and queued["est_wait_sec"] > 0
    assert queued["events_url"].startswith(f"/v1/jobs/{job_id}/events?token=")
    assert queued["result_url"].startswith(f"/v1/jobs/{job_id}/result?token=")
    assert token_of(queued["events_url"]) == token_of(queued["result_url"])

    statuses = [e.json for e in events if e.event == "queue_status"]
    positions = [s["position"] for s in statuses]
    assert positions, names
    for s in statuses:
        assert set(s) == {"position", "queue_depth", "est_wait_sec", "waiting_for_node"}
        assert s["waiting_for_node"] is False
        assert s["queue_depth"] >= s["position"]
    assert positions == sorted(positions, reverse=True), positions
    assert 2 in positions and positions[-1] == 1, positions

    dispatched = events[d].json
    assert dispatched["node"] == "a"
    assert dispatched["queue_wait_sec"] >= 1.0  # waited behind ~3.6 s of work

    ready = events[-1].json
    assert ready["status"] == "completed"
    assert ready["http_status"] == 200
    assert ready["content_type"].startswith("application/json")
    assert ready["result"] == node_answer(gpu, 1, "target")
    assert ready["result_url"] == queued["result_url"]
    assert ready["queue_wait_sec"] == dispatched["queue_wait_sec"]
    assert isinstance(ready["duration_sec"], int | float) and ready["duration_sec"] >= 0

    async with http.get(gw.url + ready["result_url"]) as res:
        assert res.status == 200
        assert orjson.loads(await res.read()) == ready["result"]


async def test_sse_heartbeats_while_queued_then_running(fakegpus, gateway, http) -> None:
    gpu = await fakegpus(steps=5, step_ms=200)
    cfg = base_config({"a": gpu.url}, max_concurrency=1)
    cfg["server"]["heartbeat_sec"] = 0.3
    gw = await gateway(cfg)
    await submit_async(http, gw, {"echo": "blocker"})
    await wait_until(lambda: gpu.stats["running"] == 1)

    async with http.post(gw.url + "/gen/generate", json={"echo": "hb"}, headers={**auth(), **SSE}) as r:
        assert r.status == 200
        events = await SSEReader(r).rest(timeout=30)
    names = [e.event for e in events]
    assert names[-1] == "output_ready", names
    d = names.index("dispatched")
    before = [e.json for e in events[:d] if e.event == "heartbeat"]
    after = [e.json for e in events[d:] if e.event == "heartbeat"]
    assert before and all(h["state"] == "queued" for h in before), names
    assert after and all(h["state"] == "running" for h in after), names
    elapsed = [h["elapsed_sec"] for h in before + after]
    assert elapsed == sorted(elapsed), elapsed
    # "queue_status … at every heartbeat while queued"
    assert names[:d].count("queue_status") >= len(before), names
    assert [e.id for e in events] == [str(i) for i in range(1, len(events) + 1)]


async def test_kl_mode_selects_sse_and_is_not_forwarded(fakegpus, gateway, http) -> None:
    gpu = await fakegpus(steps=1, step_ms=10)
    gw = await gateway(base_config({"a": gpu.url}))
    for query, forwarded in (("?kl_mode=sse&foo=bar", "foo=bar"), ("?kl_mode=sse", "")):
        async with http.post(gw.url + "/gen/generate" + query, json={"echo": query}, headers=auth()) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = await SSEReader(r).rest()
        assert events[-1].event == "output_ready"
        assert events[-1].json["result"]["echo"] == query
        async with http.get(gpu.url + "/_fake/requests") as fr:
            seen = [q for q in await fr.json() if q["path"] == "/generate"]
        assert seen[-1]["query"] == forwarded, seen[-1]
        assert "kl_mode" not in seen[-1]["query"]


@pytest.mark.parametrize("how", [{"headers": {"X-KiloLine-Mode": "stream"}}, {"query": "?kl_mode=nope"}])
async def test_bad_mode_is_a_400_json_error(fakegpus, gateway, http, how) -> None:
    gpu = await fakegpus()
    gw = await gateway(base_config({"a": gpu.url}))
    url = gw.url + "/gen/generate" + how.get("query", "")
    async with http.post(url, json={}, headers={**auth(), **how.get("headers", {})}) as r:
        assert r.status == 400
        assert r.headers["Content-Type"].startswith("application/json")
        err = (await r.json())["error"]
    assert err["type"] == "bad_request"
    assert err["message"] and err["request_id"]
    assert gpu.requests == []


async def test_output_ready_result_is_null_unless_json_of_at_most_1_mb(fakegpus, gateway, http) -> None:
    gpu = await fakegpus(steps=1, step_ms=10)
    gw = await gateway(base_config({"a": gpu.url}))
    # bytes that are not JSON: result null, the body itself behind result_url
    async with http.get(gw.url + "/gen/blob?bytes=70000", headers={**auth(), **SSE}) as r:
        assert r.status == 200
        events = await SSEReader(r).rest()
    ready = events[-1].json
    assert events[-1].event == "output_ready"
    assert ready["result"] is None and ready["content_type"] == "application/octet-stream"
    async with http.get(gw.url + ready["result_url"]) as r:
        assert r.status == 200 and r.headers["Content-Type"] == "application/octet-stream"
        blob = await r.read()
    assert len(blob) == 70000 and blob[:256] == bytes(range(256))
    # JSON over 1 MB: too big to inline, still served whole
    big = "x" * (1024 * 1024 + 10)
    async with http.post(gw.url + "/gen/generate", json={"echo": big}, headers={**auth(), **SSE}) as r:
        events = await SSEReader(r).rest()
    ready = events[-1].json
    assert events[-1].event == "output_ready" and ready["result"] is None
    assert ready["content_type"].startswith("application/json")
    async with http.get(gw.url + ready["result_url"]) as r:
        assert (await r.json())["echo"] == big


async def test_sse_job_rerouted_to_the_standby_when_its_node_dies(fakegpus, gateway, http) -> None:
    a = await fakegpus(steps=1, step_ms=10)
    b = await fakegpus(steps=1, step_ms=10)
    cfg = base_config({"a": a.url, "b": b.url})
    cfg["nodes"]["a"]["breaker"] = {"consecutive_failures": 1, "open_sec": 30}
    gw = await gateway(cfg)
    await a.kill()  # a spot machine gone: connection refused
    async with http.post(gw.url + "/gen/generate", json={"echo": "moved"}, headers={**auth(), **SSE}) as r:
        assert r.status == 200
        events = await SSEReader(r).rest()
    names = [e.event for e in events]
    assert [n for n in names if n != "heartbeat"] == ["queued", "dispatched", "rerouted", "dispatched",
                                                      "output_ready"], names
    assert [e.id for e in events] == [str(i) for i in range(1, len(events) + 1)]
    first, moved, second = (events[names.index("dispatched")].json, events[names.index("rerouted")].json,
                            events[len(names) - 1 - names[::-1].index("dispatched")].json)
    assert first["node"] == "a" and second["node"] == "b"
    assert moved["from_node"] == "a" and moved["to_node"] == "b" and moved["reason"]
    assert str(a.port) not in moved["reason"] and "127.0.0.1" not in moved["reason"]
    assert events[-1].json["result"] == node_answer(b, 1, "moved")


async def test_queue_status_says_waiting_for_node_while_no_node_can_take_work(fakegpus, gateway, http) -> None:
    gpu = await fakegpus(steps=1, step_ms=10)
    cfg = base_config({"a": gpu.url})
    cfg["server"]["heartbeat_sec"] = 0.3
    gw = await gateway(cfg)
    async with http.post(gw.url + "/admin/nodes/a/drain", headers=ADMIN) as r:
        assert r.status == 200
    async with http.post(gw.url + "/gen/generate", json={"echo": "w"}, headers={**auth(), **SSE}) as r:
        reader = SSEReader(r)
        before = await reader.until("queue_status")
        assert before[-1].json["waiting_for_node"] is True and before[-1].json["position"] == 1
        async with http.post(gw.url + "/admin/nodes/a/undrain", headers=ADMIN) as u:
            assert u.status == 200
        after = await reader.rest()
    assert after[-1].event == "output_ready" and after[-1].json["result"]["echo"] == "w"
    assert "dispatched" in [e.event for e in after]


# ----------------------------------------------------------------------------------------------
# Reconnect and replay


async def test_reconnect_replays_missed_events_then_live_ones(fakegpus, gateway, http) -> None:
    gpu = await fakegpus(steps=8, step_ms=200)  # runs ~1.6 s: heartbeats go out while we are away
    cfg = base_config({"a": gpu.url}, max_concurrency=1)
    cfg["server"]["heartbeat_sec"] = 0.3
    gw = await gateway(cfg)

    async with http.post(gw.url + "/gen/generate", json={"echo": "rc"}, headers={**auth(), **SSE}) as r:
        assert r.status == 200
        first = await SSEReader(r).until("dispatched")
        r.close()  # drop the connection mid-job
    job_id = first[0].json["job_id"]
    events_url = first[0].json["events_url"]
    cut = int(first[-1].id or 0)
    assert first[0].event == "queued"

    job = gw.jobs.jobs[job_id]
    await wait_until(lambda: job.next_id - 1 > cut, timeout=5)  # something happened while we were away
    assert (await job_status(http, gw, job_id))["status"] == "running"
    missed_upto = job.next_id - 1

    async def by_header() -> list[Event]:
        return (await read_all(http, f"{gw.url}/v1/jobs/{job_id}/events", {**auth(), "Last-Event-ID": str(cut)}))[2]

    async def by_query() -> list[Event]:
        return (await read_all(http, f"{gw.url}{events_url}&last_event_id={cut}"))[2]

    got_header, got_query = await asyncio.gather(by_header(), by_query())

    # The job was not cancelled by the disconnect: it ran to the end on the node.
    st = await job_status(http, gw, job_id)
    assert st["status"] == "completed" and st["node"] == "a" and st["http_status"] == 200
    assert gpu.stats["served"] == 1 and gpu.stats["aborted"] == 0

    full = (await read_all(http, gw.url + events_url))[2]
    assert [e.id for e in full] == [str(i) for i in range(1, len(full) + 1)]
    assert [(e.id, e.event, e.data) for e in full[: len(first)]] == [(e.id, e.event, e.data) for e in first]
    expected = [(e.id, e.event, e.data) for e in full if int(e.id or 0) > cut]
    for got in (got_header, got_query):
        assert [(e.id, e.event, e.data) for e in got] == expected
        assert int(got[0].id or 0) == cut + 1
        assert got[-1].event == "output_ready"
        # replayed (missed) events first, then live ones — the job was still running at reconnect
        assert any(int(e.id or 0) <= missed_upto for e in got)
        assert any(int(e.id or 0) > missed_upto for e in got)


async def test_replay_of_a_finished_job_from_the_middle(fakegpus, gateway, http) -> None:
    gpu = await fakegpus(steps=2, step_ms=20)
    gw = await gateway(base_config({"a": gpu.url}))
    async with http.post(gw.url + "/gen/generate", json={"echo": 1}, headers={**auth(), **SSE}) as r:
        live = await SSEReader(r).rest()
    events_url = live[0].json["events_url"]
    for after in range(len(live) + 1):
        _, reader, got = await read_all(http, f"{gw.url}{events_url}&last_event_id={after}")
        assert reader.lines[0] == "retry: 3000"
        assert [(e.id, e.event, e.data) for e in got] == [(e.id, e.event, e.data) for e in live[after:]]
    async with http.get(gw.url + events_url, headers={"Last-Event-ID": "not-a-number"}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["type"] == "bad_request"


async def test_disconnect_while_queued_does_not_cancel_an_sse_job(fakegpus, gateway, http) -> None:
    gpu = await fakegpus(steps=4, step_ms=150)
    gw = await gateway(base_config({"a": gpu.url}, max_concurrency=1))
    await submit_async(http, gw, {"echo": "blocker"})
    await wait_until(lambda: gpu.stats["running"] == 1)
    async with http.post(gw.url + "/gen/generate", json={"echo": "gone"}, headers={**auth(), **SSE}) as r:
        queued = (await SSEReader(r).until("queued"))[0].json
        r.close()
    assert queued["position"] == 1
    await wait_status(http, gw, queued["job_id"], "completed")
    async with http.get(gw.url + queued["result_url"]) as res:
        assert res.status == 200
        assert (await res.json())["echo"] == "gone"
    assert gpu.stats["served"] == 2


# ----------------------------------------------------------------------------------------------
# Who may read a job


async def test_job_access_by_token_key_and_strangers(fakegpus, gateway, http) -> None:
    gpu = await fakegpus(steps=1, step_ms=10)
    gw = await gateway(base_config({"a": gpu.url}))
    sub = await submit_async(http, gw, {"echo": "secret-job"})
    job_id, token = sub["job_id"], token_of(sub["events_url"])
    await wait_status(http, gw, job_id, "completed")
    base = f"{gw.url}/v1/jobs/{job_id}"

    # An unauthenticated consumer holding the token (a browser EventSource).
    async with http.get(f"{base}?token={token}") as r:
        assert r.status == 200
        st = await r.json()
    assert st["job_id"] == job_id and st["status"] == "completed" and st["route"] == "gen"
    for k in ("job_id", "route", "status", "position", "est_wait_sec", "node", "created_at", "started_at",
              "finished_at", "http_status", "error"):
        assert k in st
    _, _, events = await read_all(http, gw.url + sub["events_url"])
    assert events[0].event == "queued" and events[-1].event == "output_ready"
    async with http.get(gw.url + sub["result_url"]) as r:
        assert r.status == 200
        assert (await r.json()) == node_answer(gpu, 1, "secret-job")

    # The key that created it, without the token.
    async with http.get(base + "/result", headers=auth("alice")) as r:
        assert r.status == 200

    async def expect_404(method: str, url: str, headers: dict[str, str] | None = None) -> None:
        async with http.request(method, url, headers=headers or {}) as r:
            assert r.status == 404, (method, url, r.status)
            assert r.headers["Content-Type"].startswith("application/json")
            assert (await r.json())["error"]["type"] == "not_found"

    for suffix in ("", "/events", "/result"):
        await expect_404("GET", f"{base}{suffix}?token=wrong-{token}")
        await expect_404("GET", f"{base}{suffix}?token=")
        await expect_404("GET", f"{base}{suffix}", auth("bob"))
        await expect_404("GET", f"{gw.url}/v1/jobs/unknown{suffix}", auth("alice"))
    other = await submit_async(http, gw, {"echo": "other"})
    await expect_404("GET", f"{base}?token={token_of(other['events_url'])}")  # another job's token
    await expect_404("GET", f"{gw.url}{other['status_url']}?token={token}")
    await expect_404("DELETE", base, auth("bob"))
    await expect_404("DELETE", f"{base}?token=nope")
    await expect_404("DELETE", f"{gw.url}/v1/jobs/unknown", auth("alice"))
    async with http.get(base) as r:  # neither key nor token
        assert r.status in (401, 404)
    # Nothing a stranger did changed the job.
    assert (await job_status(http, gw, job_id))["status"] == "completed"
    await wait_status(http, gw, other["job_id"], "completed")
    async with http.get(gw.url + "/admin/state", headers=ADMIN) as r:
        assert (await r.json())["routes"]["gen"]["inflight"] == 0


# --- the subscriber a live stream reads from --------------------------------------------------------


async def test_subscriber_hands_over_everything_pending_in_one_batch() -> None:
    from kilolined.modes.jobs import Subscriber

    sub = Subscriber()
    sub.push((1, "heartbeat", b"a"))
    sub.push((2, "queue_status", b"b"))
    assert await sub.batch() == [(1, "heartbeat", b"a"), (2, "queue_status", b"b")]  # one wake-up, one write
    waiter = asyncio.ensure_future(sub.batch())
    await asyncio.sleep(0.01)
    assert not waiter.done()  # nothing pending: it waits
    sub.push((3, "heartbeat", b"c"))
    assert await asyncio.wait_for(waiter, 1) == [(3, "heartbeat", b"c")]
    sub.push((4, "output_ready", b"d"))
    sub.push(None)  # the job ended: what is pending still goes out, then the end
    assert await sub.batch() == [(4, "output_ready", b"d")]
    assert await sub.batch() is None

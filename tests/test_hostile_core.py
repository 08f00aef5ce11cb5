"""Attacks on the request path after the edge (issue rows owned by the pipeline and the jobs):

- row 6: the request budget is taken in the same step that checks it, however the bodies arrive;
- row 7: a node whose Content-Type holds a byte ≥ 0x80 cannot stop an sse/async job from ending;
- row 9: an X-Target-Host that matches a glob but has a bad port is a 400, not a 500.
"""

from __future__ import annotations

import asyncio
import time

import orjson
from conftest import KEYS, auth, base_config
from hostile import HostileNode, NodeConn


async def _two_piece_post(port: int, path: str, key: str) -> int:
    """A POST whose body arrives in two writes, the second after the others were sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b'{"steps": 0, "pad": "xxxxxxxx"}'
    writer.write(b"POST %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (path.encode(), key.encode(), len(body), body[:5]))
    await writer.drain()
    await asyncio.sleep(0.3)  # every request is past its limits check before any body is whole
    writer.write(body[5:])
    await writer.drain()
    line = await reader.readline()
    writer.close()
    return int(line.split()[1])


async def test_concurrent_requests_against_a_request_budget_admit_exactly_the_budget(fakegpus, gateway) -> None:
    g = await fakegpus(steps=0, step_ms=0)
    cfg = base_config({"a": g.url}, max_concurrency=64, max_queue_depth=1000)
    cfg["keys"]["alice"]["budget"] = {"requests_per_day": 10}
    gw = await gateway(cfg)
    port = int(gw.url.rsplit(":", 1)[1])
    statuses = await asyncio.gather(*(_two_piece_post(port, "/gen/generate", KEYS["alice"]) for _ in range(200)))
    assert statuses.count(200) == 10, sorted(set(statuses))
    assert statuses.count(429) == 190
    assert g.stats["served"] == 10


async def test_a_refused_request_gives_its_budget_back(fakegpus, gateway, http) -> None:
    g = await fakegpus(steps=0, step_ms=0)
    cfg = base_config({"a": g.url})
    cfg["server"]["max_body_mb"] = 1
    cfg["keys"]["alice"]["budget"] = {"requests_per_day": 2}
    gw = await gateway(cfg)
    for _ in range(3):  # refused after the budget step (body too large): the budget comes back
        async with http.post(gw.url + "/gen/generate", data=b"x" * (2 * 1024 * 1024), headers=auth()) as r:
            assert r.status == 413
    statuses = []
    for _ in range(3):
        async with http.post(gw.url + "/gen/generate", json={"steps": 0}, headers=auth()) as r:
            statuses.append(r.status)
    assert statuses == [200, 200, 429]
    assert gw.rt.budgets.usage("alice", time.time())["requests"] == 2


async def test_a_node_content_type_with_high_bytes_still_ends_the_job(gateway, http) -> None:
    async def odd_type(conn: NodeConn) -> None:
        await conn.read_head()
        body = b'{"ok": true}'
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: application/json; x=\xff\xfe\r\nContent-Length: %d\r\n\r\n%s"
                        % (len(body), body))

    node = await HostileNode(odd_type).start()
    try:
        gw = await gateway(base_config({"a": node.url}))
        async with http.post(gw.url + "/gen/x", json={}, headers={**auth(), "X-KiloLine-Mode": "sse"}) as r:
            assert r.status == 200
            text = (await asyncio.wait_for(r.read(), 10)).decode()
        assert "event: output_ready" in text, text
        job_id = r.headers["X-KiloLine-Job"]
        async with http.get(f"{gw.url}/v1/jobs/{job_id}", headers=auth()) as r2:
            assert (await r2.json())["status"] == "completed"
    finally:
        await node.stop()


async def test_a_target_with_a_bad_port_is_a_bad_request(gateway, http) -> None:
    cfg = base_config({"a": "http://127.0.0.1:9"})
    cfg["keys"]["alice"]["adhoc_targets"] = ["http://127.0.0.1:*"]
    gw = await gateway(cfg)
    for target in ("http://127.0.0.1:18490.x", "http://127.0.0.1:99999", "http://127.0.0.1:0"):
        async with http.post(gw.url + "/v1/proxy/x", json={}, headers={**auth(), "X-Target-Host": target}) as r:
            assert r.status == 400, (target, r.status)
            err = orjson.loads(await r.read())["error"]
            assert err["type"] == "bad_request"

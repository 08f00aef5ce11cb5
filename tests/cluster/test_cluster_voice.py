"""Cluster mode, one voice (docs/CLUSTER.md): a leader elected by a Redis lease runs the health
checks and sends the alerts; node health, breakers, slow start and drain are shared; and
``kilolined check`` warns about a Redis that persists. End to end with a real redis-server and
real gateway processes; the pure parts with a hand-driven clock."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
import yaml
from conftest import ADMIN, auth
from fakes import FakeTelegram

from kilolined.cluster.leader import LeaderLease, Leadership
from kilolined.cluster.nodes import NodeSync
from kilolined.cluster.nodestate import apply, changed_groups, export, snapshot
from kilolined.cluster.persistence import persistence
from kilolined.cluster.view import ClusterView
from kilolined.core.config import BreakerConfig, ClusterConfig, HealthConfig, NodeConfig
from kilolined.fakegpu import FakeGPU
from kilolined.scheduling.nodes import CLOSED, HALF_OPEN, OPEN, NodeState

from .harness import GatewayProc, RedisServer, cluster_config, free_port, make_gateways, start_all, until

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "123456:ABC-voice-token"


# --- the pure parts ------------------------------------------------------------------------------
def test_leadership_ends_with_its_lease_even_without_an_answer() -> None:
    st = Leadership("gw0", ttl_sec=3)
    st.held(sent_at=100.0)
    assert st.is_leader(102.9) and st.leader == "gw0"
    # No renewal came back: counted from before the call, it ends when Redis' lease can end.
    assert not st.is_leader(103.0)
    st.held(sent_at=101.0)
    st.seen("gw1")
    assert not st.is_leader(101.5) and st.leader == "gw1"


def test_only_the_leader_speaks_and_checks_while_redis_is_up() -> None:
    a, b = Leadership("a", 3), Leadership("b", 3)
    a.held(0.0)
    b.seen("a")
    assert a.speaks(1.0, True, "node_down") and not b.speaks(1.0, True, "node_down")
    assert a.checks(1.0, True) and not b.checks(1.0, True)
    # A reload failure is about one gateway's own file: it says it whoever leads.
    assert b.speaks(1.0, True, "reload_failed")
    # Redis down: every gateway checks with its own view; the one that led goes on speaking.
    b.unreachable()
    assert b.checks(1.0, False)


def test_degraded_is_said_once_by_the_leader_and_restored_once_by_the_next_leader() -> None:
    a, b = Leadership("a", 3), Leadership("b", 3)
    a.held(0.0)
    b.seen("a")
    a.unreachable()  # its renewal fails first; it still led when Redis was lost
    assert a.redis_lost() is True and b.redis_lost() is False
    assert a.redis_lost() is False  # once
    assert a.speaks(5.0, False, "node_down") and not b.speaks(5.0, False, "node_down")
    # Redis is back; b is elected first: it says cluster_restored, a does not.
    a.redis_back()
    b.redis_back()
    b.held(10.0)
    a.seen("b")
    assert b.round_done(10.5) is True and a.round_done(10.5) is False
    assert b.round_done(11.0) is False  # once
    assert not a.speaks(11.0, True, "node_down")


def node(**breaker: Any) -> NodeState:
    b = {"consecutive_failures": 3, "open_sec": 10, "max_open_sec": 40, "slow_start_sec": 20, **breaker}
    return NodeState("gpu", NodeConfig(url="http://127.0.0.1:1", breaker=BreakerConfig(**b),
                                       health=HealthConfig(fall=1, rise=1)))


def share(src: NodeState, dst: NodeState, now_src: float, now_dst: float) -> list[str]:
    """One publish from src applied on dst (their clocks differ), as the Redis sync does."""
    return apply(dst, export(src, now_src, changed_groups(None, snapshot(src))), now_dst)


def test_a_breaker_opened_on_one_gateway_opens_on_another_once() -> None:
    a, b = node(), node()
    for _ in range(3):
        a.record_failure(50.0, "connection reset")
    assert a.breaker == OPEN
    assert share(a, b, 52.0, 1000.0) == ["breaker_open"]
    assert not b.available(1000.0) and b.last_error == "connection reset"
    assert b.open_until == pytest.approx(1008.0)  # the time left travels, not a clock reading
    assert share(a, b, 52.0, 1000.01) == []  # the same trip read again (the sweep): no new event
    # Half-open on b's own clock; a's trial fails: a re-trip, doubled, is news again.
    assert b.breaker_state(1008.5) == HALF_OPEN
    a.record_failure(60.5, "timeout", trial=a.on_dispatch(60.5))
    assert a.open_period == 20
    assert share(a, b, 60.5, 1008.6) == ["breaker_open"]
    assert not b.available(1010.0)


def test_breaker_closed_and_slow_start_are_shared() -> None:
    a, b = node(), node()
    for _ in range(3):
        a.record_failure(0.0, "500")
    share(a, b, 0.0, 500.0)
    a.record_success(10.0, trial=a.on_dispatch(10.0))
    assert a.breaker == CLOSED
    assert share(a, b, 15.0, 505.0) == ["breaker_closed"]
    # The ramp began 5 s ago on a: b ramps from the same moment (a quarter of 20 s).
    assert b.effective(9, 505.0) == a.effective(9, 15.0) == 3


def test_health_and_drain_are_shared_and_changes_come_in_groups() -> None:
    a, b = node(), node()
    before = snapshot(a)
    a.record_check(False, 1.0, None, "connection refused")
    assert changed_groups(before, snapshot(a)) == ["health"]
    assert share(a, b, 1.0, 7.0) == ["node_down"]
    assert not b.healthy and b.last_error == "connection refused"
    before = snapshot(a)
    a.drained = True
    assert changed_groups(before, snapshot(a)) == ["drain"]
    # Only the drain travels: it does not undo anything b learnt elsewhere meanwhile.
    b.record_check(True, 8.0, 1.0, None)
    assert apply(b, export(a, 2.0, ["drain"]), 8.0) == []
    assert b.drained and b.healthy


def test_failures_seen_on_every_gateway_open_the_breaker() -> None:
    ns = node()
    ns.record_failure(0.0, "reset")  # 1 here
    assert ns.merge_failures(2, 0.1) == []  # 2 in the cluster so far
    assert ns.merge_failures(3, 0.2) == ["breaker_open"]
    assert ns.merge_failures(4, 0.3) == []  # already open


def test_persistence_settings() -> None:
    assert persistence("", "no") == []
    assert persistence("3600 1 300 100", "no") == ['save "3600 1 300 100"']
    assert persistence("", "yes") == ["appendonly yes"]


# --- the Redis parts in-process, on a real redis-server ------------------------------------------
async def test_leader_lease_renews_only_its_own_lease(redis_server: RedisServer) -> None:
    now = [0.0]
    alerts: list[str] = []
    made = []
    for gid in ("a", "b"):
        cfg = ClusterConfig(redis_url=redis_server.url, gateway_id=gid, lease_ttl_sec=30, key_prefix="ll:")
        r = aioredis.from_url(redis_server.url)
        view = ClusterView(gid, redis_up=True)
        made.append((LeaderLease(r, cfg, f"{gid}#1", view, Leadership(gid, 30), clock=lambda: now[0],
                                 alert=lambda ev, _t, _n: alerts.append(ev)), r))
    (a, ra), (b, rb) = made
    await a.round()
    await b.round()
    assert a.state.is_leader(0.0) and not b.state.is_leader(0.0)
    assert a.view.leader == b.view.leader == "a"
    # a's lease lapsed (a paused longer than the TTL) and b took it: a must not renew b's lease.
    await ra.set("ll:leader", "b#1")
    await a.round()
    assert not a.state.is_leader(0.0) and a.view.leader == "b"
    assert await ra.get("ll:leader") == b"b#1"
    # Redis came back: the leader of the next round says so, once.
    a.state.redis_back()
    b.state.redis_back()
    await a.round()
    await b.round()
    await b.round()
    assert alerts == ["cluster_restored"]
    await a.stop()  # not the holder: leaves b's lease alone
    assert await ra.get("ll:leader") == b"b#1"
    b.state.held(now[0])
    await b.stop()  # the holder: hands it on at once
    assert await ra.get("ll:leader") is None
    await ra.aclose()
    await rb.aclose()


async def test_node_state_survives_a_redis_that_restarted_empty(redis_server: RedisServer) -> None:
    up = [True]
    nodes = {"a": {"gpu": node()}, "b": {"gpu": node()}}
    syncs = []
    for who in ("a", "b"):
        r = aioredis.from_url(redis_server.url)
        syncs.append(NodeSync(r, "ns:", f"{who}#1", lambda who=who: nodes[who], clock=time.monotonic,
                              redis_up=lambda: up[0], leader=lambda who=who: who == "a",
                              on_applied=lambda _ns, _ev: None, sweep_sec=0.1))
    sa, sb = syncs
    await sa.start()
    await sb.start()
    a, b = nodes["a"]["gpu"], nodes["b"]["gpu"]

    async def drained_on_b(want: bool) -> bool:
        return b.drained is want

    a.drained = True
    sa.changed(a)
    await until(lambda: drained_on_b(True), "b never saw the drain")
    redis_server.kill()
    up[0] = False
    await asyncio.sleep(0.3)
    redis_server.start()  # empty: it counts the changes from 1 again
    up[0] = True
    await asyncio.sleep(0.3)
    a.drained = False
    sa.changed(a)
    await until(lambda: drained_on_b(False), "b skipped the changes of a Redis that restarted empty", timeout=5)
    for s in syncs:
        await s.stop()
        await s.redis.aclose()


# --- end to end ----------------------------------------------------------------------------------
pytestmark = pytest.mark.gpu(steps=1, step_ms=10)


async def leaders(gws: list[GatewayProc]) -> list[str | None]:
    return [st["cluster"]["leader"] for st in await asyncio.gather(*(g.state() for g in gws))]


async def leader_gauge(gw: GatewayProc) -> float:
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/metrics", headers=ADMIN) as r:
        text = await r.text()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kiloline_cluster_leader "))


async def test_one_leader_of_three_and_another_after_kill9(redis_server: RedisServer, gateways: list[GatewayProc],
                                                          gpu: FakeGPU, tmp_path: Path) -> None:
    ttl = 2.0
    gateways += make_gateways(3, tmp_path, redis_server.url, gpu.url, ttl=ttl)
    await start_all(gateways)
    ids = [g.cfg["cluster"]["gateway_id"] for g in gateways]

    async def agreed(gws: list[GatewayProc]) -> bool:
        seen = await leaders(gws)
        return seen[0] is not None and len(set(seen)) == 1

    await until(lambda: agreed(gateways), "the gateways never agreed on a leader")
    first = (await leaders(gateways))[0]
    assert first in ids
    gauges = await asyncio.gather(*(leader_gauge(g) for g in gateways))
    assert gauges == [1.0 if i == first else 0.0 for i in ids]
    r = redis_server.client()
    assert (await r.get("kl-test:leader") or "").startswith(first + "#")
    await r.aclose()
    victim = gateways[ids.index(first)]
    rest = [g for g in gateways if g is not victim]
    victim.kill9()

    async def moved() -> bool:
        seen = await leaders(rest)
        return await agreed(rest) and seen[0] != first

    # The dead leader's lease lapses after lease_ttl_sec; the next round of a live gateway takes it.
    await until(moved, "no other gateway became the leader", timeout=ttl + ttl / 3 + 3)
    second = (await leaders(rest))[0]
    gauges = await asyncio.gather(*(leader_gauge(g) for g in rest))
    assert sorted(gauges) == [0.0, 1.0]
    assert gauges[[g.cfg["cluster"]["gateway_id"] for g in rest].index(second)] == 1.0


def with_node(gws: list[GatewayProc], **node: Any) -> None:
    for g in gws:
        g.cfg["nodes"]["gpu"].update(node)


async def test_a_node_going_down_is_one_alert_from_two_gateways(redis_server: RedisServer,
                                                               gateways: list[GatewayProc], gpu: FakeGPU,
                                                               tmp_path: Path) -> None:
    async with FakeTelegram(token=TOKEN) as tg:
        gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url)
        with_node(gateways, health={"path": "/health", "interval_sec": 0.2, "timeout_sec": 0.5, "fall": 2, "rise": 1})
        for g in gateways:
            g.cfg["notify"] = {"telegram": {"bot_token": TOKEN, "chat_id": "-1001", "api_base": tg.url},
                               "group_sec": 0.1, "min_interval_sec": 0}
        await start_all(gateways)
        await until(lambda: _leader_known(gateways), "no leader")
        checks = gpu.stats["health_checks"]
        await asyncio.sleep(2.0)
        # One gateway probes (about 5 checks a second, at most 12 in 2 s), not both (about 20).
        assert gpu.stats["health_checks"] - checks <= 14, gpu.stats["health_checks"] - checks
        await gpu.kill()

        async def both_down() -> bool:
            states = await asyncio.gather(*(g.state() for g in gateways))
            return all(st["nodes"]["gpu"]["health"] == "down" for st in states)

        await until(both_down, "the node never went down on both gateways")
        await until(lambda: _lines(tg, "gpu DOWN", 1), "no node_down alert")
        await asyncio.sleep(1.5)  # several check intervals and group windows: a second one would be here
        downs = [line for m in tg.messages for line in m["text"].splitlines() if "gpu DOWN" in line]
        assert len(downs) == 1, tg.messages


async def _leader_known(gws: list[GatewayProc]) -> bool:
    seen = await leaders(gws)
    return seen[0] is not None and len(set(seen)) == 1


async def _lines(tg: FakeTelegram, text: str, n: int) -> bool:
    return sum(1 for m in tg.messages for line in m["text"].splitlines() if text in line) >= n


async def post(s: aiohttp.ClientSession, gw: GatewayProc) -> int:
    async with s.post(gw.url + "/gen/generate", json={}, headers=auth("alice")) as r:
        await r.read()
        return r.status


async def node_state(gw: GatewayProc) -> dict[str, Any]:
    return (await gw.state())["nodes"]["gpu"]


async def test_a_breaker_tripped_through_a_stops_b_sending(redis_server: RedisServer, gateways: list[GatewayProc],
                                                          gpu: FakeGPU, tmp_path: Path) -> None:
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, queue_timeout_sec=1, retry_on_failover=0)
    with_node(gateways, breaker={"consecutive_failures": 3, "open_sec": 120, "max_open_sec": 240})
    await start_all(gateways)
    a, b = gateways
    gpu.set_control(fail_status=500)
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            assert await post(s, a) >= 500
        assert (await node_state(a))["breaker"] == "open"

        async def open_on_b() -> bool:
            return (await node_state(b))["breaker"] == "open"

        await until(open_on_b, "the breaker opened on A never opened on B", timeout=5)
        gpu.set_control(fail_status=None)
        gpu.reset()
        # B would send it to the (now healthy) node if its breaker were its own: it waits, then times out.
        assert await post(s, b) == 503
    assert gpu.stats["served"] == 0 and gpu.stats["rejected"] == 0, gpu.stats


async def test_failures_through_two_gateways_add_up(redis_server: RedisServer, gateways: list[GatewayProc],
                                                    gpu: FakeGPU, tmp_path: Path) -> None:
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url, queue_timeout_sec=1, retry_on_failover=0)
    with_node(gateways, breaker={"consecutive_failures": 4, "open_sec": 120, "max_open_sec": 240})
    await start_all(gateways)
    a, b = gateways
    gpu.set_control(fail_status=500)
    async with aiohttp.ClientSession() as s:
        # 2 + 2 failures: neither gateway saw 4 alone; together they are the node's 4 in a row.
        for gw in (a, b, a, b):
            assert await post(s, gw) >= 500

        async def open_on_both() -> bool:
            return all(st["breaker"] == "open" for st in await asyncio.gather(node_state(a), node_state(b)))

        await until(open_on_both, "four failures over two gateways did not open the breaker", timeout=5)


async def test_drain_on_a_is_seen_on_b(redis_server: RedisServer, gateways: list[GatewayProc], gpu: FakeGPU,
                                       tmp_path: Path) -> None:
    gateways += make_gateways(2, tmp_path, redis_server.url, gpu.url)
    await start_all(gateways)
    a, b = gateways
    async with aiohttp.ClientSession() as s:
        async with s.post(a.url + "/admin/nodes/gpu/drain", headers=ADMIN) as r:
            assert r.status == 200

        async def drained(want: bool) -> bool:
            return (await node_state(b))["drained"] is want

        await until(lambda: drained(True), "B never saw the drain made on A", timeout=5)
        async with s.post(b.url + "/admin/nodes/gpu/undrain", headers=ADMIN) as r:
            assert r.status == 200

        async def undrained_on_a() -> bool:
            return (await node_state(a))["drained"] is False

        await until(undrained_on_a, "A never saw the undrain made on B", timeout=5)


# --- kilolined check ----------------------------------------------------------------------------
def check(tmp_path: Path, redis_url: str) -> subprocess.CompletedProcess[str]:
    cfg = cluster_config(redis_url, "http://127.0.0.1:9", free_port(), "gw0")
    path = tmp_path / "check.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "kilolined", "check", "-c", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("persist", [("--save", "3600 1", "--appendonly", "no"),
                                     ("--save", "", "--appendonly", "yes")])
def test_check_warns_when_redis_persists(tmp_path: Path, persist: tuple[str, ...]) -> None:
    if subprocess.run(["which", "redis-server"], capture_output=True).returncode != 0:
        pytest.skip("redis-server is not installed")
    r = RedisServer(tmp_path, persistence=persist)
    r.start()
    try:
        out = check(tmp_path, r.url)
    finally:
        r.kill()
    assert out.returncode == 0, out.stdout + out.stderr
    warnings = [line for line in out.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "persistence on" in warnings[0], out.stdout
    assert ("save" if persist[1] else "appendonly yes") in warnings[0]
    assert 'save ""' in warnings[0] and "appendonly no" in warnings[0]  # how to turn it off


def test_check_is_quiet_when_redis_keeps_nothing_on_disk(redis_server: RedisServer, tmp_path: Path) -> None:
    out = check(tmp_path, redis_server.url)
    assert out.returncode == 0 and out.stdout.startswith("ok:"), out.stdout + out.stderr
    assert "warning:" not in out.stdout


def test_check_warns_when_redis_is_unreachable(tmp_path: Path) -> None:
    out = check(tmp_path, f"redis://:secret@127.0.0.1:{free_port()}/0")
    assert out.returncode == 0, out.stdout + out.stderr
    warnings = [line for line in out.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "cannot read" in warnings[0], out.stdout
    assert "secret" not in out.stdout

"""Hot reload (SPEC §2.1): the file watcher, SIGHUP and POST /admin/reload, applied live and atomically.

Real gateway, real fake GPUs, loopback sockets. Reloads through the watcher are checked by waiting
for ``config.version`` to equal the sha256 of the bytes written; nothing asserts tight timings.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import itertools
import logging
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from conftest import KEYS, auth, base_config, sha, wait_until
from daemon import daemon_factory
from fakes import FakeTelegram
from reload_admin import admin_reload, admin_state, reloads_total, watcher_ready

from kilolined.core.config import parse_config
from kilolined.edge.server import Server
from kilolined.ops import views

# --- helpers ------------------------------------------------------------------------------------

DAVE = "kl_dave_key_0000000000000000000000000"


def file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def generate(http: aiohttp.ClientSession, url: str, who: str = "alice", path: str = "/gen",
                   **body: Any) -> tuple[int, dict[str, Any], Any]:
    async with http.post(url + path + "/generate", json=body, headers=auth(who)) as r:
        return r.status, await r.json(content_type=None), r.headers


def with_key(cfg: dict[str, Any], name: str, secret: str, **extra: Any) -> None:
    cfg["keys"][name] = {"key_sha256": sha(secret), "routes": ["*"], **extra}


def dotted(errors: list[str]) -> bool:
    """Every error names where it is, like nginx -t: ``file:line: a.b.c: message``."""
    return all(re.match(r"^\S+:\d+: [A-Za-z_][\w-]*(\.[\w-]+)*: \S", e) for e in errors)


# --- the watcher under load ---------------------------------------------------------------------


async def test_slots_follow_the_file_under_load(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    g = await fakegpus(steps=3, step_ms=50, vram_gb=100)  # 150 ms a job; 4 jobs fit in VRAM
    cfg = base_config({"a": g.url}, max_concurrency=1, max_queue_depth=100)
    gw = await gateway(cfg, watch=True)
    await watcher_ready(gw.rt, gw.path)
    rq_inflight = lambda: gw.rt.scheduler.node_inflight.get("a", 0)  # noqa: E731
    # The first 16 jobs take ~150 ms, the rest ~50 ms (so the tail at one slot is short).
    tasks = [asyncio.create_task(generate(http, gw.url, echo=i, steps=3 if i < 16 else 1, step_ms=50))
             for i in range(40)]
    await wait_until(lambda: g.stats["served"] >= 1 and views.state(gw.rt)["routes"]["gen"]["queue_depth"] > 20,
                     timeout=15)
    assert g.stats["max_concurrent"] == 1
    v0 = gw.rt.version

    # Slots raised in the file: the waiting requests go out at once, four at a time.
    four = copy.deepcopy(cfg)
    four["routes"]["gen"]["max_concurrency"] = 4
    gw.write_config(four)
    await wait_until(lambda: g.stats["running"] == 4, timeout=5)
    assert gw.rt.version == file_sha(gw.path) != v0
    assert views.state(gw.rt)["routes"]["gen"]["queue_depth"] > 0, "burst over too early to see slots lowered"

    # Back to one: nothing is cut; in-flight only falls, then stays at one.
    gw.write_config(cfg)
    await wait_until(lambda: gw.rt.version == file_sha(gw.path), timeout=5)
    samples: list[int] = []
    while not all(t.done() for t in tasks):
        samples.append(rq_inflight())
        await asyncio.sleep(0.01)
    first_one = next((i for i, n in enumerate(samples) if n <= 1), len(samples))
    assert all(a >= b for a, b in itertools.pairwise(samples[:first_one])), samples
    assert all(n <= 1 for n in samples[first_one:]), samples
    results = [await t for t in tasks]
    assert [s for s, _, _ in results] == [200] * 40
    st = g.stats
    assert st["served"] == 40 and st["oom_count"] == 0 and st["aborted"] == 0


async def test_slots_lowered_wait_for_inflight_to_drop(
    fakegpus: Any, gateway: Any, http: aiohttp.ClientSession
) -> None:
    """After lowering 4 → 1, the node's high-water mark from then on is one job."""
    g = await fakegpus(steps=2, step_ms=100, vram_gb=100)
    cfg = base_config({"a": g.url}, max_concurrency=4)
    gw = await gateway(cfg)
    tasks = [asyncio.create_task(generate(http, gw.url)) for _ in range(10)]
    await wait_until(lambda: g.stats["running"] == 4, timeout=10)
    one = copy.deepcopy(cfg)
    one["routes"]["gen"]["max_concurrency"] = 1
    gw.write_config(one)
    assert (await admin_reload(http, gw.url))[0] == 200
    await wait_until(lambda: g.stats["running"] <= 1, timeout=10)
    g.reset()  # max_concurrent restarts from what runs now
    results = await asyncio.gather(*tasks)
    assert [s for s, _, _ in results] == [200] * 10
    assert g.stats["max_concurrent"] <= 1
    assert g.stats["served"] >= 1  # some work did run under the new limit


# --- invalid files ------------------------------------------------------------------------------


async def test_invalid_file_mid_burst_changes_nothing(
    fakegpus: Any, gateway: Any, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kilolined")
    async with FakeTelegram() as tg:
        g = await fakegpus(steps=2, step_ms=50)
        cfg = base_config({"a": g.url}, max_concurrency=1)
        cfg["notify"] = {"telegram": {"bot_token": "123:abc", "chat_id": "42", "api_base": tg.url},
                         "group_sec": 0, "min_interval_sec": 0}
        gw = await gateway(cfg, watch=True)
        await watcher_ready(gw.rt, gw.path)
        v0 = gw.rt.version
        ok0, err0 = await reloads_total(http, gw.url, "ok"), await reloads_total(http, gw.url, "error")
        tasks = [asyncio.create_task(generate(http, gw.url, echo=i)) for i in range(12)]
        await wait_until(lambda: views.state(gw.rt)["routes"]["gen"]["queue_depth"] > 5, timeout=10)

        bad = copy.deepcopy(cfg)
        bad["routes"]["gen"]["max_concurrency"] = 0
        bad["routes"]["gen"]["max_concurency"] = 4  # a typo
        bad["nodes"]["a"]["url"] = "not a url"
        gw.write_config(bad)
        await wait_until(lambda: gw.rt.last_error is not None, timeout=10)

        st = await admin_state(http, gw.url)
        errors = st["config"]["last_error"]
        assert isinstance(errors, list) and dotted(errors), errors
        where = f"{gw.path}:"
        assert any(e.startswith(where) and ": routes.gen.max_concurrency:" in e for e in errors), errors
        assert any(": routes.gen.max_concurency: unknown key" in e for e in errors), errors
        assert any(": nodes.a.url:" in e for e in errors), errors
        # Nothing changed.
        assert st["config"]["version"] == v0
        assert st["routes"]["gen"]["slots"] == 1 and st["routes"]["gen"]["max_concurrency"] == 1
        assert gw.rt.cfg.nodes["a"].url == g.url
        # Logged, with the dotted paths.
        logged = [r.getMessage() for r in caplog.records if r.name == "kilolined" and r.levelno >= logging.ERROR]
        assert any("routes.gen.max_concurrency" in m for m in logged), logged
        # The operator was told (reload_failed), naming the problem.
        msgs = await tg.wait_for(1, timeout=10)
        assert any("reload" in m["text"].lower() and "routes.gen.max_concurrency" in m["text"] for m in msgs), msgs
        assert await reloads_total(http, gw.url, "error") >= err0 + 1

        # The queue went on at one slot meanwhile.
        assert g.stats["max_concurrent"] == 1

        # The fixed file is applied: last_error cleared, version = sha256 of the new bytes.
        fixed = copy.deepcopy(cfg)
        fixed["routes"]["gen"]["max_concurrency"] = 2
        gw.write_config(fixed)
        await wait_until(lambda: gw.rt.version == file_sha(gw.path), timeout=10)
        st = await admin_state(http, gw.url)
        assert st["config"]["last_error"] is None
        assert st["config"]["version"] == hashlib.sha256(gw.path.read_bytes()).hexdigest()
        assert st["routes"]["gen"]["max_concurrency"] == 2
        assert await reloads_total(http, gw.url, "ok") >= ok0 + 1

        results = await asyncio.gather(*tasks)
        assert [s for s, _, _ in results] == [200] * 12
        assert g.stats["oom_count"] == 0


async def test_yaml_syntax_error_is_refused(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    g = await fakegpus()
    gw = await gateway(base_config({"a": g.url}))
    v0 = gw.rt.version
    gw.path.write_text("server: {listen: [unclosed\nroutes: :\n")
    status, body = await admin_reload(http, gw.url)
    assert status == 422 and body["ok"] is False and body["errors"], body
    st = await admin_state(http, gw.url)
    assert st["config"]["version"] == v0 and st["config"]["last_error"] == body["errors"]
    assert (await generate(http, gw.url))[0] == 200


# --- how editors and orchestrators write files ---------------------------------------------------


def render(cfg: dict[str, Any], concurrency: int) -> bytes:
    c = copy.deepcopy(cfg)
    c["routes"]["gen"]["max_concurrency"] = concurrency
    return yaml.safe_dump(c).encode()


async def test_atomic_rename_reloads(fakegpus: Any, gateway: Any) -> None:
    g = await fakegpus()
    cfg = base_config({"a": g.url})
    gw = await gateway(cfg, watch=True)
    await watcher_ready(gw.rt, gw.path)
    for n in (3, 1, 2):  # several saves in a row: the watch survives the inode changing
        c = copy.deepcopy(cfg)
        c["routes"]["gen"]["max_concurrency"] = n
        gw.write_config(c)
        await wait_until(lambda: gw.rt.version == file_sha(gw.path), timeout=10)
        assert gw.rt.cfg.routes["gen"].max_concurrency == n
        assert gw.rt.last_error is None


async def test_vim_style_backup_copy_then_write_in_place(fakegpus: Any, gateway: Any) -> None:
    """vim with backupcopy=yes: copy to ``kiloline.yaml~``, then truncate and write the file itself."""
    g = await fakegpus()
    cfg = base_config({"a": g.url})
    gw = await gateway(cfg, watch=True)  # the fixture has put the real listen address into cfg
    await watcher_ready(gw.rt, gw.path)
    backup = gw.path.with_name(gw.path.name + "~")
    for n in (3, 1):
        shutil.copyfile(gw.path, backup)
        with open(gw.path, "r+b") as f:
            f.truncate(0)
            f.write(render(cfg, n))
            f.flush()
            os.fsync(f.fileno())
        await wait_until(lambda: gw.rt.version == file_sha(gw.path), timeout=10)
        assert gw.rt.cfg.routes["gen"].max_concurrency == n
    await wait_until(lambda: gw.rt.last_error is None, timeout=5)


async def test_vim_style_rename_to_backup_then_new_file(fakegpus: Any, gateway: Any) -> None:
    """vim's default on Linux: rename the original to ``kiloline.yaml~``, write a brand-new file."""
    g = await fakegpus()
    cfg = base_config({"a": g.url})
    gw = await gateway(cfg, watch=True)
    await watcher_ready(gw.rt, gw.path)
    backup = gw.path.with_name(gw.path.name + "~")
    for n in (3, 1):
        os.replace(gw.path, backup)
        with open(gw.path, "xb") as f:
            f.write(render(cfg, n))
        await wait_until(lambda: gw.rt.version == file_sha(gw.path), timeout=10)
        assert gw.rt.cfg.routes["gen"].max_concurrency == n
        backup.unlink()
    await wait_until(lambda: gw.rt.last_error is None, timeout=5)


async def test_configmap_symlink_swap(fakegpus: Any, tmp_path: Path, http: aiohttp.ClientSession) -> None:
    """Kubernetes ConfigMap volume: kiloline.yaml -> ..data/kiloline.yaml, ..data -> ..<timestamp>;
    an update writes a new timestamped dir and swaps ..data atomically (temp symlink + rename)."""
    g = await fakegpus()
    cfg = base_config({"a": g.url})  # listen 127.0.0.1:0 in the file; the server reports its port
    cm = tmp_path / "configmap"
    cm.mkdir()
    generation = [1]
    (cm / "..2026_v1").mkdir()
    (cm / "..2026_v1" / "kiloline.yaml").write_bytes(render(cfg, 2))
    os.symlink("..2026_v1", cm / "..data")
    os.symlink("..data/kiloline.yaml", cm / "kiloline.yaml")
    link = cm / "kiloline.yaml"

    def publish(data: bytes) -> str:
        """What the kubelet does: new dir, temp symlink, atomic rename over ..data, old dir removed."""
        old = cm / f"..2026_v{generation[0]}"
        generation[0] += 1
        new = cm / f"..2026_v{generation[0]}"
        new.mkdir()
        (new / "kiloline.yaml").write_bytes(data)
        tmp_link = cm / "..data_tmp"
        os.symlink(new.name, tmp_link)
        os.replace(tmp_link, cm / "..data")
        shutil.rmtree(old)
        return hashlib.sha256(data).hexdigest()

    data = link.read_bytes()
    srv = Server(parse_config(data, env={}), hashlib.sha256(data).hexdigest(), str(link), watch=True)
    await srv.start()
    try:
        url = f"http://127.0.0.1:{srv.port}"
        # Sync point: swap in comment-only changes until the watch is seen to be established.
        for i in range(30):
            digest = publish(render(cfg, 2) + f"# probe {i}\n".encode())
            try:
                await wait_until(lambda: srv.rt.version == digest, timeout=0.5)  # noqa: B023
                break
            except AssertionError:
                continue
        else:
            raise AssertionError("the watcher never applied a ConfigMap swap")
        for n in (3, 1):
            digest = publish(render(cfg, n))
            await wait_until(lambda: srv.rt.version == digest, timeout=10)  # noqa: B023
            assert file_sha(link) == digest
            st = await admin_state(http, url)
            assert st["config"]["version"] == digest and st["config"]["last_error"] is None
            assert st["routes"]["gen"]["max_concurrency"] == n
    finally:
        await srv.shutdown()


async def test_change_right_after_start_is_not_missed(fakegpus: Any, gateway: Any) -> None:
    """A write landing between the daemon reading its config and the watch being established
    (a ConfigMap updated as the pod starts, an operator saving twice) must still be applied."""
    g = await fakegpus()
    cfg = base_config({"a": g.url})
    gw = await gateway(cfg, watch=True)
    c = copy.deepcopy(cfg)
    c["routes"]["gen"]["max_concurrency"] = 3
    gw.write_config(c)  # at once: the watcher task has not run yet
    await wait_until(lambda: gw.rt.version == file_sha(gw.path), timeout=3)
    assert gw.rt.cfg.routes["gen"].max_concurrency == 3


async def test_symlink_to_a_file_elsewhere_is_watched(fakegpus: Any, tmp_path: Path) -> None:
    """/etc/kiloline/kiloline.yaml -> /srv/conf/kiloline.yaml (config management, a git checkout):
    an editor saving the target by rename must reload, as for a plain file."""
    g = await fakegpus()
    cfg = base_config({"a": g.url})
    (tmp_path / "etc").mkdir()
    (tmp_path / "srv").mkdir()
    real = tmp_path / "srv" / "kiloline.yaml"
    real.write_bytes(render(cfg, 2))
    link = tmp_path / "etc" / "kiloline.yaml"
    os.symlink(real, link)
    data = link.read_bytes()
    srv = Server(parse_config(data, env={}), hashlib.sha256(data).hexdigest(), str(link), watch=True)
    await srv.start()
    try:
        await asyncio.sleep(1)  # past the start-up window: this test is about where the watch looks
        for n in (3, 1):
            new = render(cfg, n)
            tmp = real.with_name(".kiloline.yaml.swp")
            tmp.write_bytes(new)
            tmp.replace(real)
            digest = hashlib.sha256(new).hexdigest()
            await wait_until(lambda: srv.rt.version == digest, timeout=3)  # noqa: B023
            assert srv.rt.cfg.routes["gen"].max_concurrency == n
    finally:
        await srv.shutdown()


async def test_listen_change_needs_a_restart_the_rest_is_applied(
    fakegpus: Any, gateway: Any, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kilolined")
    g = await fakegpus()
    cfg = base_config({"a": g.url})
    gw = await gateway(cfg)
    changed = copy.deepcopy(cfg)
    changed["server"]["listen"] = "127.0.0.1:1"  # somewhere else entirely
    changed["routes"]["gen"]["max_concurrency"] = 3
    gw.path.write_text(yaml.safe_dump(changed))
    status, body = await admin_reload(http, gw.url)
    assert status == 200 and body["version"] == file_sha(gw.path)
    warnings = [r.getMessage() for r in caplog.records if r.name == "kilolined" and r.levelno == logging.WARNING]
    assert any("listen" in m and "restart" in m for m in warnings), warnings
    # Still serving where it was, with the rest applied.
    st = await admin_state(http, gw.url)
    assert st["routes"]["gen"]["max_concurrency"] == 3 and st["config"]["last_error"] is None
    assert (await generate(http, gw.url))[0] == 200


# --- SIGHUP and POST /admin/reload --------------------------------------------------------------


async def test_admin_reload(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    g = await fakegpus()
    cfg = base_config({"a": g.url})
    gw = await gateway(cfg)  # no watcher: only the API reloads here
    async with http.post(gw.url + "/admin/reload", headers=auth("alice")) as r:
        assert r.status == 401

    # Unchanged file: ok, same version.
    status, body = await admin_reload(http, gw.url)
    assert (status, body) == (200, {"ok": True, "version": gw.rt.version})
    loaded0 = (await admin_state(http, gw.url))["config"]["loaded_at"]

    changed = copy.deepcopy(cfg)
    changed["routes"]["gen"]["max_concurrency"] = 3
    gw.path.write_text(yaml.safe_dump(changed))
    status, body = await admin_reload(http, gw.url)
    assert status == 200 and body == {"ok": True, "version": file_sha(gw.path)}
    st = await admin_state(http, gw.url)
    assert st["config"]["version"] == body["version"] and st["config"]["loaded_at"] >= loaded0
    assert st["routes"]["gen"]["max_concurrency"] == 3

    bad = copy.deepcopy(changed)
    bad["routes"]["gen"]["nodes"] = ["nope"]
    bad["keys"]["alice"]["routes"] = ["missing"]
    gw.path.write_text(yaml.safe_dump(bad))
    status, body = await admin_reload(http, gw.url)
    assert status == 422 and body["ok"] is False, body
    assert set(body) == {"ok", "errors"} and dotted(body["errors"]), body
    lines = gw.path.read_text().splitlines()
    nodes_line = next(i for i, t in enumerate(lines, 1) if "- nope" in t)
    assert f"{gw.path}:{nodes_line}: routes.gen.nodes.0: unknown node 'nope'" in body["errors"], body
    assert any(e.startswith(f"{gw.path}:") and ": keys.alice.routes.0:" in e for e in body["errors"]), body
    st = await admin_state(http, gw.url)
    assert st["config"]["last_error"] == body["errors"]
    assert st["config"]["version"] == hashlib.sha256(yaml.safe_dump(changed).encode()).hexdigest()
    assert (await generate(http, gw.url))[0] == 200

    gw.path.write_text(yaml.safe_dump(changed))
    status, body = await admin_reload(http, gw.url)
    assert status == 200 and body["version"] == file_sha(gw.path)
    assert (await admin_state(http, gw.url))["config"]["last_error"] is None


async def test_sighup_reloads_the_daemon(tmp_path: Path, fakegpus: Any, http: aiohttp.ClientSession) -> None:
    g = await fakegpus()
    cfg = base_config({"a": g.url})
    async with daemon_factory(tmp_path) as daemons:
        d = await daemons(cfg, unwatched=True)  # edits bypass the watcher: SIGHUP is what reloads
        v0 = (await d.state(http))["config"]["version"]
        assert v0 == d.version()

        changed = copy.deepcopy(cfg)
        changed["routes"]["gen"]["max_concurrency"] = 3
        with_key(changed, "dave", DAVE)
        d.write_config(changed)
        d.signal(signal.SIGHUP)

        async def applied() -> bool:
            return (await d.state(http))["config"]["version"] == d.version()

        await wait_until(applied, timeout=15, step=0.1)
        st = await d.state(http)
        assert st["config"]["last_error"] is None and st["routes"]["gen"]["max_concurrency"] == 3
        assert "(SIGHUP)" in d.stderr()
        async with http.post(d.url + "/gen/generate", json={}, headers={"Authorization": f"Bearer {DAVE}"}) as r:
            assert r.status == 200

        # An invalid file on SIGHUP: refused, the daemon keeps serving with what it had.
        bad = copy.deepcopy(changed)
        bad["routes"]["gen"]["max_concurrency"] = -1
        d.write_config(bad)
        d.signal(signal.SIGHUP)

        async def refused() -> bool:
            return bool((await d.state(http))["config"]["last_error"])

        await wait_until(refused, timeout=15, step=0.1)
        st = await d.state(http)
        assert any(": routes.gen.max_concurrency:" in e for e in st["config"]["last_error"])
        assert st["config"]["version"] != d.version() and st["routes"]["gen"]["max_concurrency"] == 3
        async with http.post(d.url + "/gen/generate", json={}, headers=auth()) as r:
            assert r.status == 200
        d.signal(signal.SIGTERM)
        assert await d.wait_exit() == 0


# --- keys and rates live ------------------------------------------------------------------------


async def test_keys_added_removed_live(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    g = await fakegpus(steps=0)
    cfg = base_config({"a": g.url})
    del cfg["keys"]["carol"]
    gw = await gateway(cfg)
    assert (await generate(http, gw.url, "carol"))[0] == 401
    assert (await generate(http, gw.url, "bob"))[0] == 200

    cfg = copy.deepcopy(cfg)
    with_key(cfg, "carol", KEYS["carol"])
    del cfg["keys"]["bob"]
    gw.write_config(cfg)
    assert (await admin_reload(http, gw.url))[0] == 200
    assert (await generate(http, gw.url, "carol"))[0] == 200
    status, body, _ = await generate(http, gw.url, "bob")
    assert status == 401 and body["error"]["type"] == "unauthorized"
    assert (await generate(http, gw.url, "alice"))[0] == 200

    # A key restricted to another route: forbidden right away.
    cfg = copy.deepcopy(cfg)
    cfg["routes"]["other"] = {"path": "/other", "nodes": ["a"]}
    cfg["keys"]["carol"]["routes"] = ["other"]
    gw.write_config(cfg)
    assert (await admin_reload(http, gw.url))[0] == 200
    assert (await generate(http, gw.url, "carol"))[0] == 403
    assert (await generate(http, gw.url, "carol", path="/other"))[0] == 200


async def test_rate_changes_live_and_unchanged_buckets_keep_their_level(
    fakegpus: Any, gateway: Any, http: aiohttp.ClientSession
) -> None:
    g = await fakegpus(steps=0)
    cfg = base_config({"a": g.url})
    gw = await gateway(cfg)

    async def remaining(who: str = "alice") -> tuple[int, int | None]:
        status, _, headers = await generate(http, gw.url, who)
        rem = headers.get("RateLimit-Remaining")
        return status, int(rem) if rem is not None else None

    async def apply(new: dict[str, Any]) -> None:
        gw.write_config(new)
        status, body = await admin_reload(http, gw.url)
        assert status == 200, body

    # A rate added to alice: one token a minute, burst of 5.
    cfg = copy.deepcopy(cfg)
    cfg["keys"]["alice"]["rate"] = {"per_minute": 1, "burst": 5}
    await apply(cfg)
    assert await remaining() == (200, 4)
    assert await remaining() == (200, 3)

    # An unrelated change (a key added, a route timeout): alice's bucket keeps its level.
    cfg = copy.deepcopy(cfg)
    with_key(cfg, "dave", DAVE)
    cfg["routes"]["gen"]["queue_timeout_sec"] = 20
    await apply(cfg)
    assert await remaining() == (200, 2), "bucket level was reset by an unrelated reload"

    # alice's burst lowered to 1: the level (2) is clamped to 1, so one more request, then refused.
    cfg = copy.deepcopy(cfg)
    cfg["keys"]["alice"]["rate"] = {"per_minute": 1, "burst": 1}
    await apply(cfg)
    assert await remaining() == (200, 0)
    status, body, _ = await generate(http, gw.url, "alice")
    assert status == 429 and body["error"]["type"] == "rate_limited"

    # Rate raised to 10/s: tokens come back within moments (at 1/min it would take a minute).
    cfg = copy.deepcopy(cfg)
    cfg["keys"]["alice"]["rate"] = {"per_minute": 600, "burst": 1}
    await apply(cfg)

    async def served() -> bool:
        return (await generate(http, gw.url, "alice"))[0] == 200

    await wait_until(served, timeout=5, step=0.05)

    # Rate removed: no limit at all.
    cfg = copy.deepcopy(cfg)
    del cfg["keys"]["alice"]["rate"]
    await apply(cfg)
    results = await asyncio.gather(*[generate(http, gw.url, "alice") for _ in range(6)])
    assert [s for s, _, _ in results] == [200] * 6
    # bob never had a rate and still has none.
    assert (await remaining("bob")) == (200, None)


# --- routes and nodes removed with work in flight -----------------------------------------------


async def test_removed_route_serves_its_queue_then_404s(
    fakegpus: Any, gateway: Any, http: aiohttp.ClientSession
) -> None:
    g = await fakegpus(steps=0)
    cfg = base_config({"a": g.url}, max_concurrency=1)
    cfg["routes"]["other"] = {"path": "/other", "nodes": ["a"]}
    gw = await gateway(cfg)
    tasks = [asyncio.create_task(generate(http, gw.url, steps=3, step_ms=150, echo=i)) for i in range(3)]

    def one_running_two_waiting() -> bool:
        r = views.state(gw.rt)["routes"]["gen"]
        return r["inflight"] == 1 and r["queue_depth"] == 2

    await wait_until(one_running_two_waiting, timeout=10)
    new = copy.deepcopy(cfg)
    del new["routes"]["gen"]
    gw.write_config(new)
    status, body = await admin_reload(http, gw.url)
    assert status == 200, body

    # New requests to its path: 404 at once, while its own work goes on.
    status, body, _ = await generate(http, gw.url)
    assert status == 404 and body["error"]["type"] == "not_found", body
    assert "gen" not in (await admin_state(http, gw.url))["routes"]
    assert (await generate(http, gw.url, path="/other"))[0] == 200
    assert not all(t.done() for t in tasks)

    results = await asyncio.gather(*tasks)
    assert [s for s, _, _ in results] == [200] * 3
    assert sorted(b["echo"] for _, b, _ in results) == [0, 1, 2]
    await wait_until(lambda: "gen" not in gw.rt.scheduler.routes, timeout=5)


async def test_removed_node_drains_and_added_node_is_health_checked(
    fakegpus: Any, gateway: Any, http: aiohttp.ClientSession
) -> None:
    a = await fakegpus(steps=0)
    b = await fakegpus(steps=0)
    c = await fakegpus(steps=0)
    cfg = base_config({"a": a.url}, max_concurrency=1)
    cfg["nodes"]["b"] = {"url": b.url}
    cfg["routes"]["gen"]["nodes"] = ["a", "b"]
    gw = await gateway(cfg)
    tasks = [asyncio.create_task(generate(http, gw.url, steps=2, step_ms=200)) for _ in range(6)]
    await wait_until(lambda: a.stats["running"] == 1 and b.stats["running"] == 1, timeout=10)

    new = copy.deepcopy(cfg)
    del new["nodes"]["b"]
    new["routes"]["gen"]["nodes"] = ["a"]
    new["nodes"]["c"] = {"url": c.url, "health": {"path": "/health", "interval_sec": 0.1, "timeout_sec": 1}}
    new["routes"]["gen"]["standby"] = ["c"]
    gw.write_config(new)
    status, body = await admin_reload(http, gw.url)
    assert status == 200, body
    st = await admin_state(http, gw.url)
    assert "b" not in st["nodes"] and "c" in st["nodes"]

    await asyncio.sleep(0.1)  # anything already on its way to b lands

    def b_jobs() -> int:
        return sum(1 for r in b.requests if r.get("path") == "/generate")

    at_reload = b_jobs()
    assert at_reload >= 1
    results = await asyncio.gather(*tasks)
    assert [s for s, _, _ in results] == [200] * 6
    # b finished what it held and got nothing new; a took the rest (c is standby and a is up).
    assert b_jobs() == at_reload and b.stats["served"] == at_reload and b.stats["aborted"] == 0
    assert a.stats["served"] + b.stats["served"] == 6 and a.stats["max_concurrent"] == 1
    assert c.stats["served"] == 0
    # The node added starts health-checking.
    await wait_until(lambda: c.stats["health_checks"] >= 2, timeout=10)
    await wait_until(lambda: "b" not in gw.rt.scheduler.nodes, timeout=5)


# --- the watcher is quiet and looks only at the config file; reloads parse off the event loop -------


def test_watched_paths_are_the_file_and_its_symlink_hops(tmp_path: Path) -> None:
    from kilolined.ops.reload import watched_paths

    f = tmp_path / "kiloline.yaml"
    f.write_text("x: 1\n")
    dirs, relevant = watched_paths(str(f))
    assert dirs == {str(tmp_path)} and relevant == {str(f)}
    cm = tmp_path / "cm"
    (cm / "..v1").mkdir(parents=True)
    (cm / "..v1" / "kiloline.yaml").write_text("x: 1\n")
    os.symlink("..v1", cm / "..data")
    os.symlink("..data/kiloline.yaml", cm / "kiloline.yaml")
    dirs, relevant = watched_paths(str(cm / "kiloline.yaml"))
    assert relevant >= {str(cm / "kiloline.yaml"), str(cm / "..data"), str(cm / "..v1" / "kiloline.yaml")}
    assert str(cm / "kiloline.log") not in relevant and str(cm) in dirs


async def test_a_log_written_next_to_the_config_is_not_a_change(fakegpus: Any, gateway: Any,
                                                                 caplog: pytest.LogCaptureFixture,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from kilolined.ops import reload as reload_mod

    g = await fakegpus()
    gw = await gateway(base_config({"a": g.url}), watch=True)
    await watcher_ready(gw.rt, gw.path)
    reads: list[Path] = []
    real_read = Path.read_bytes

    def counting_read(self: Path) -> bytes:
        reads.append(self)
        return real_read(self)

    monkeypatch.setattr(reload_mod.Path, "read_bytes", counting_read)
    caplog.set_level(logging.DEBUG)
    caplog.clear()
    log_file = gw.path.with_name("kiloline.log")
    with log_file.open("a") as f:
        for i in range(30):  # a daemon logging next to its config, as in issue 15
            f.write(f"line {i}\n")
            f.flush()
            await asyncio.sleep(0.03)
    await asyncio.sleep(0.6)
    assert [p for p in reads if p == gw.path] == []  # the config was not even re-read
    assert not [r for r in caplog.records if r.name.startswith("watchfiles")], caplog.records
    # and the watcher still works
    await watcher_ready(gw.rt, gw.path)


async def test_reload_parses_off_the_event_loop(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from kilolined.ops import reload as reload_mod

    g = await fakegpus()
    gw = await gateway(base_config({"a": g.url}))
    real = reload_mod.load_config
    parsing = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow_load(path: str) -> Any:
        loop.call_soon_threadsafe(parsing.set)
        time.sleep(1.0)  # a huge file: the event loop must not wait for this
        return real(path)

    monkeypatch.setattr(reload_mod, "load_config", slow_load)
    c = copy.deepcopy(base_config({"a": g.url}))
    c["routes"]["gen"]["max_concurrency"] = 5
    gw.write_config(c)
    reload = asyncio.create_task(admin_reload(http, gw.url))
    await asyncio.wait_for(parsing.wait(), 5)
    async with http.get(gw.url + "/healthz") as r:
        assert r.status == 200
    assert not reload.done()  # /healthz was served while the reload was still parsing
    status, _ = await reload
    assert status == 200 and gw.rt.cfg.routes["gen"].max_concurrency == 5

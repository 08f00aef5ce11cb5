"""A config file whose bytes are not text, or that cannot be read, is a config error like any
other (issue 21): at its line where there is one, through every entry point — `kilolined check`,
POST /admin/reload, SIGHUP and the file watcher — never a 500, a traceback or a silent keep-going.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from cli_run import kl
from conftest import ADMIN, auth, base_config, wait_until
from daemon import daemon_factory
from fakes import FakeTelegram
from reload_admin import admin_reload, admin_state, reloads_total, watcher_ready

from kilolined.core.config import ConfigError, load_config

GOOD = b"server:\n  listen: 127.0.0.1:0\nnodes: {a: {url: 'http://127.0.0.1:9'}}\nroutes: {r: {path: /r, nodes: [a]}}\n"

# (bytes, the line the error names, what it says)
NOT_TEXT = {
    "nul": (GOOD.replace(b"127.0.0.1:0", b"127.0.0.1:0\x00"), 2, "NUL byte at column 22"),
    "latin1": (GOOD.replace(b"path: /r", b"path: /caf\xe9"), 4, "byte 0xe9 at column 24 is not UTF-8"),
    "stray_continuation_byte": (b"\x80" + GOOD, 1, "byte 0x80 at column 1 is not UTF-8"),
    "truncated_multibyte": (GOOD + b"# \xe2\x82", 5, "byte 0xe2 at column 3 is not UTF-8"),
    "escape_character": (GOOD.replace(b"nodes: {a", b"\x1bnodes: {a"), 3, "control character U+001B at column 1"),
}
DEEP = b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n"


def errors_of(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(path)
    return e.value.errors


@pytest.mark.parametrize("case", list(NOT_TEXT))
def test_bytes_that_are_not_text_are_an_error_at_their_line(case: str, tmp_path: Path) -> None:
    data, line, says = NOT_TEXT[case]
    path = tmp_path / "kiloline.yaml"
    path.write_bytes(data)
    errors = errors_of(path)
    assert len(errors) == 1 and errors[0].startswith(f"{path}:{line}: (encoding): {says}"), errors


def test_nesting_too_deep_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "kiloline.yaml"
    path.write_bytes(DEEP)
    assert errors_of(path) == [f"{path}: (yaml): nested too deeply"]


@pytest.mark.parametrize("bom", ["utf-8-sig", "utf-16"])
def test_a_bom_is_still_text(bom: str, tmp_path: Path) -> None:
    """What YAML itself reads (UTF-8 with a BOM, UTF-16 with a BOM) still loads."""
    path = tmp_path / "kiloline.yaml"
    path.write_bytes(GOOD.decode().encode(bom))
    cfg, _ = load_config(path)
    assert list(cfg.routes) == ["r"]


# --- kilolined check ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [*NOT_TEXT, "deep", "directory", "missing"])
def test_check_prints_one_line_and_exits_1(case: str, tmp_path: Path) -> None:
    path = tmp_path / "kiloline.yaml"
    if case == "deep":
        path.write_bytes(DEEP)
    elif case == "directory":
        path.mkdir()
    elif case != "missing":
        path.write_bytes(NOT_TEXT[case][0])
    r = kl("check", "-c", str(path))
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{path}:"), r.stdout
    if case in NOT_TEXT:
        assert lines[0].startswith(f"{path}:{NOT_TEXT[case][1]}: (encoding): "), r.stdout
    assert "Traceback" not in r.stderr, r.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root to drop to another uid (a file root cannot be denied)")
def test_check_of_a_file_the_user_cannot_read(tmp_path: Path) -> None:
    path = tmp_path / "kiloline.yaml"
    path.write_bytes(GOOD)
    path.chmod(0o600)  # root's; the check below runs as nobody
    tmp_path.chmod(0o755)
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m", "kilolined"]
    probe = subprocess.run([*as_nobody, "--version"], capture_output=True, text=True, timeout=60, cwd="/")
    if probe.returncode != 0:
        pytest.skip(f"the test interpreter cannot run as nobody: {probe.stderr[-200:]}")
    r = subprocess.run([*as_nobody, "check", "-c", str(path)], capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 1 and r.stdout == f"{path}: cannot read: Permission denied\n", (r.stdout, r.stderr)


# --- the daemon: POST /admin/reload, SIGHUP, the watcher -----------------------------------------


def rendered(cfg: dict[str, Any], listen: str) -> bytes:
    return yaml.safe_dump({**cfg, "server": {**cfg["server"], "listen": listen}}).encode()


async def test_admin_reload_of_bytes_that_are_not_text(fakegpus: Any, gateway: Any,
                                                       http: aiohttp.ClientSession) -> None:
    async with FakeTelegram() as tg:
        g = await fakegpus(steps=0)
        cfg = base_config({"a": g.url})
        cfg["notify"] = {"telegram": {"bot_token": "123:abc", "chat_id": "42", "api_base": tg.url},
                         "group_sec": 0, "min_interval_sec": 0}
        gw = await gateway(cfg)
        good = gw.path.read_bytes()
        v0 = gw.rt.version
        err0 = await reloads_total(http, gw.url, "error")
        gw.path.write_bytes(good.replace(b"routes:", b"routes:\x00"))
        status, body = await admin_reload(http, gw.url)
        assert status == 422 and body["ok"] is False, body
        line = good[: good.index(b"routes:")].count(b"\n") + 1
        assert len(body["errors"]) == 1 and body["errors"][0].startswith(f"{gw.path}:{line}: (encoding): NUL byte")
        st = await admin_state(http, gw.url)
        assert st["config"]["last_error"] == body["errors"] and st["config"]["version"] == v0
        assert await reloads_total(http, gw.url, "error") == err0 + 1
        await wait_until(lambda: any("reload failed" in m["text"] for m in tg.messages), timeout=10)
        async with http.post(gw.url + "/gen/generate", json={}, headers=auth()) as r:
            assert r.status == 200  # still serving on what it had

        gw.path.write_bytes(good.replace(b"routes:", b"routes: \xff"))
        status, body = await admin_reload(http, gw.url)
        assert status == 422
        assert re.match(rf"^{re.escape(str(gw.path))}:{line}: \(encoding\): byte 0xff", body["errors"][0]), body

        gw.path.write_bytes(good)
        status, body = await admin_reload(http, gw.url)
        assert status == 200 and body == {"ok": True, "version": v0}
        assert (await admin_state(http, gw.url))["config"]["last_error"] is None


async def test_sighup_with_bytes_that_are_not_text(tmp_path: Path, fakegpus: Any,
                                                   http: aiohttp.ClientSession) -> None:
    g = await fakegpus(steps=0)
    async with daemon_factory(tmp_path) as daemons:
        d = await daemons(base_config({"a": g.url}), unwatched=True)  # only SIGHUP reloads
        assert d.real is not None
        good = d.real.read_bytes()
        d.real.write_bytes(good + b"# caf\xe9\n")
        d.signal(signal.SIGHUP)

        async def refused() -> bool:
            return bool((await d.state(http))["config"]["last_error"])

        await wait_until(refused, timeout=15, step=0.1)
        errors = (await d.state(http))["config"]["last_error"]
        line = good.count(b"\n") + 1
        assert errors == [f"{d.path}:{line}: (encoding): byte 0xe9 at column 6 is not UTF-8: "
                          "the file must be UTF-8 text"], errors
        async with http.post(d.url + "/gen/generate", json={}, headers=auth()) as r:
            assert r.status == 200
        d.signal(signal.SIGTERM)
        assert await d.wait_exit() == 0
        log = d.stderr()
        assert "✗ [reload]" in log and "Traceback" not in log, log


async def test_watcher_refuses_bytes_that_are_not_text_and_a_removed_file(fakegpus: Any, gateway: Any,
                                                                          http: aiohttp.ClientSession) -> None:
    g = await fakegpus(steps=0)
    gw = await gateway(base_config({"a": g.url}), watch=True)
    await watcher_ready(gw.rt, gw.path)
    good = gw.path.read_bytes()

    def save(data: bytes) -> None:
        tmp = gw.path.with_name(".kiloline.yaml.tmp")
        tmp.write_bytes(data)
        tmp.replace(gw.path)

    async def last_error() -> list[str] | None:
        st = await admin_state(http, gw.url)
        return st["config"]["last_error"] if not st["config"]["pending"] else None

    save(good + b"\x00")
    await wait_until(last_error, timeout=10, step=0.1)
    line = good.count(b"\n") + 1
    assert await last_error() == [f"{gw.path}:{line}: (encoding): NUL byte at column 1: the file must be text"]

    save(good)  # put back: the running version, last_error cleared
    await wait_until(lambda: gw.rt.last_error is None, timeout=10)

    gw.path.unlink()  # removed, and nothing comes in its place
    await wait_until(last_error, timeout=10, step=0.1)
    assert await last_error() == [f"{gw.path}: cannot read: No such file or directory"]
    async with http.post(gw.url + "/gen/generate", json={}, headers=auth()) as r:
        assert r.status == 200

    fresh = good + b"# back\n"
    save(fresh)
    await wait_until(lambda: gw.rt.version == hashlib.sha256(fresh).hexdigest(), timeout=10)
    async with http.get(gw.url + "/admin/state", headers=ADMIN) as r:
        assert (await r.json())["config"]["last_error"] is None

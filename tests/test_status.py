"""`kilolined status` finds the daemon where its config says it listens (server.listen)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ADMIN_KEY, base_config

from kilolined.core.config import ConfigError
from kilolined.status import listen_of, render, url_for_listen

ROOT = Path(__file__).resolve().parents[1]


async def status(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    full = {k: v for k, v in os.environ.items() if k not in ("KILOLINE_CONFIG", "KILOLINE_ADMIN_KEY")}
    full.update(env or {})
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "kilolined", "status", *args, cwd=ROOT,
                                                env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_status_with_c_uses_the_configs_listen(fakegpus, gateway) -> None:
    gpu = await fakegpus()
    gw = await gateway(base_config({"a": gpu.url}))
    assert gw.server.port != 8080
    rc, out, err = await status("-c", str(gw.path), "--admin-key", ADMIN_KEY)
    assert rc == 0, err
    assert "ROUTE" in out and "gen" in out and "NODE" in out


async def test_status_uses_the_default_config_without_c(fakegpus, gateway) -> None:
    gpu = await fakegpus()
    gw = await gateway(base_config({"a": gpu.url}))
    rc, out, err = await status(env={"KILOLINE_CONFIG": str(gw.path), "KILOLINE_ADMIN_KEY": ADMIN_KEY})
    assert rc == 0, err
    assert "gen" in out


async def test_status_url_wins_over_the_config(fakegpus, gateway, tmp_path: Path) -> None:
    gpu = await fakegpus()
    gw = await gateway(base_config({"a": gpu.url}))
    elsewhere = tmp_path / "other.yaml"
    elsewhere.write_text("server: {listen: '127.0.0.1:1'}\n")
    rc, out, err = await status("-c", str(elsewhere), "--url", gw.url, "--admin-key", ADMIN_KEY)
    assert rc == 0 and "gen" in out, err


async def test_status_with_an_unreadable_config_names_it(tmp_path: Path) -> None:
    rc, out, err = await status("-c", str(tmp_path / "nope.yaml"), "--admin-key", ADMIN_KEY)
    assert rc == 1 and out == ""
    assert "nope.yaml" in err and "--url" in err


@pytest.mark.parametrize(("listen", "tls", "url"), [
    ("0.0.0.0:9000", False, "http://127.0.0.1:9000"),
    ("[::]:9000", False, "http://[::1]:9000"),
    ("10.0.0.5:8443", True, "https://10.0.0.5:8443"),
    ("[fd00::1]:80", False, "http://[fd00::1]:80"),
    (":7000", False, "http://127.0.0.1:7000"),
])
def test_url_for_listen_asks_a_wildcard_on_loopback(listen: str, tls: bool, url: str) -> None:
    assert url_for_listen(listen, tls) == url


def test_listen_of_reads_only_the_server_section() -> None:
    # Keys from unset variables elsewhere do not matter to status; server.listen's own do.
    text = "server: {listen: '${PORTLESS:-127.0.0.1:9100}', tls: {cert: c, key: k}}\nadmin: {key: '${UNSET}'}\n"
    assert listen_of(text, {}) == ("127.0.0.1:9100", True)
    assert listen_of("nodes: {}\n", {}) == ("0.0.0.0:8080", False)
    with pytest.raises(ConfigError) as ei:
        listen_of("server: {listen: '${NOPE}'}\n", {})
    assert ei.value.errors == ["server.listen: environment variable NOPE is not set"]


def test_status_lists_the_lost_gateways_and_what_to_do() -> None:
    state = {"routes": {}, "nodes": {}, "cluster": {"lost": [
        {"id": "gw1", "lost_sec": 42.4, "reserved": {"routes": {"gen": 1}, "nodes": {"gpu": 1}, "capacity": 0.5}}]}}
    text = render(state)
    assert "LOST GATEWAY" in text and "gw1" in text and "gen 1/node, node gpu 1" in text, text
    assert "POST /admin/cluster/forget/<gateway>" in text
    assert "LOST GATEWAY" not in render({"routes": {}, "nodes": {}, "cluster": {"lost": []}})

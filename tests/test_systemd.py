"""systemd integration (SPEC §10, PROTOCOLS §5): sd_notify from a real daemon process, the unit file.

The daemon runs as a child process (`kilolined run -c <tmp>/etc/kiloline.yaml`) against an in-process
fake GPU; a unix datagram socket bound by the test plays systemd's $NOTIFY_SOCKET. The helpers
here (``Daemon``, ``NotifyListener``, ``free_port``) are also used by test_reload and test_shutdown.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import base_config, wait_until
from daemon import (
    DaemonFactory,
    NotifyListener,
    daemon_factory,
    fields,
    kilolined_bin,
    service_values,
    socket_dir,
    unit_entries,
    verify,
)

from kilolined.ops import systemd

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "systemd" / "kilolined.service"
DROP_IN = REPO / "systemd" / "notify-reload.conf"
UNIT_EXEC = "/opt/kiloline/venv/bin/kilolined"


def monotonic_usec() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


# --- a child daemon ------------------------------------------------------------------------------


@pytest.fixture
async def daemons(tmp_path: Path) -> AsyncIterator[DaemonFactory]:
    async with daemon_factory(tmp_path) as make:
        yield make


# --- a fake $NOTIFY_SOCKET -----------------------------------------------------------------------


def is_ready(f: dict[str, str]) -> bool:
    return f.get("READY") == "1"


# --- sd_notify from a real daemon ----------------------------------------------------------------


@pytest.mark.parametrize("namespace", ["path", "abstract"])
async def test_ready_with_status_then_stopping(
    namespace: str, tmp_path: Path, fakegpus: Any, daemons: DaemonFactory
) -> None:
    g = await fakegpus()
    abstract = f"@kiloline-test-{uuid.uuid4().hex}"
    address = str(socket_dir(tmp_path) / "notify.sock") if namespace == "path" else abstract
    async with NotifyListener(address) as sd:
        d = await daemons(base_config({"a": g.url}), env={"NOTIFY_SOCKET": address})
        i = await sd.wait_for(is_ready)
        ready = fields(sd.messages[i])
        assert "STATUS" in ready, sd.messages[i]
        assert "1 routes" in ready["STATUS"] and "nodes up" in ready["STATUS"], ready["STATUS"]
        # READY=1 comes once the listener is up: the daemon answers now.
        async with aiohttp.ClientSession() as http, http.get(d.url + "/healthz") as r:
            assert r.status == 200
        # No WATCHDOG_USEC in the environment: no keep-alive pings.
        assert not any("WATCHDOG=1" in m for m in sd.messages)
        d.signal(signal.SIGTERM)
        j = await sd.wait_for(lambda f: f.get("STOPPING") == "1", after=i)
        assert j > i
        assert await d.wait_exit() == 0
    assert "Traceback" not in d.stderr()


async def test_sighup_sends_reloading_with_monotonic_usec_then_ready(
    tmp_path: Path, fakegpus: Any, daemons: DaemonFactory
) -> None:
    g = await fakegpus()
    address = str(socket_dir(tmp_path) / "notify.sock")
    cfg = base_config({"a": g.url}, max_concurrency=1)
    async with NotifyListener(address) as sd, aiohttp.ClientSession() as http:
        # Edits bypass the watcher: every RELOADING=1 below comes from a SIGHUP.
        d = await daemons(cfg, env={"NOTIFY_SOCKET": address}, unwatched=True)
        first = await sd.wait_for(is_ready)
        v0 = (await d.state(http))["config"]["version"]

        # A valid change, then SIGHUP: RELOADING=1 + MONOTONIC_USEC in ONE datagram, then READY=1.
        cfg["routes"]["gen"]["max_concurrency"] = 3
        data = d.write_config(cfg)
        before = monotonic_usec()
        d.signal(signal.SIGHUP)
        i = await sd.wait_for(lambda f: f.get("RELOADING") == "1", after=first + 1)
        after = monotonic_usec()
        reloading = fields(sd.messages[i])
        assert "MONOTONIC_USEC" in reloading, f"RELOADING=1 without MONOTONIC_USEC: {sd.messages[i]!r}"
        assert re.fullmatch(r"\d+", reloading["MONOTONIC_USEC"]), reloading
        assert before <= int(reloading["MONOTONIC_USEC"]) <= after
        j = await sd.wait_for(is_ready, after=i + 1)
        assert "STATUS" in fields(sd.messages[j])
        st = await d.state(http)
        assert st["config"]["version"] == hashlib.sha256(data).hexdigest() != v0
        assert st["config"]["last_error"] is None
        assert st["routes"]["gen"]["max_concurrency"] == 3

        # An invalid file: still RELOADING=1 then READY=1 (systemd would otherwise wait for ever),
        # and the running config is kept.
        bad = copy.deepcopy(cfg)
        bad["routes"]["gen"]["max_concurrency"] = 0
        d.write_config(bad)
        d.signal(signal.SIGHUP)
        k = await sd.wait_for(lambda f: f.get("RELOADING") == "1", after=j + 1)
        assert "MONOTONIC_USEC" in fields(sd.messages[k])
        await sd.wait_for(is_ready, after=k + 1)

        async def refused() -> bool:
            return bool((await d.state(http))["config"]["last_error"])

        await wait_until(refused, timeout=10, step=0.05)
        st = await d.state(http)
        assert st["config"]["version"] == hashlib.sha256(data).hexdigest()
        assert any(": routes.gen.max_concurrency:" in e for e in st["config"]["last_error"])

        d.signal(signal.SIGTERM)
        assert await d.wait_exit() == 0


async def test_watchdog_pings_with_watchdog_usec(tmp_path: Path, fakegpus: Any, daemons: DaemonFactory) -> None:
    g = await fakegpus()
    address = str(socket_dir(tmp_path) / "notify.sock")
    async with NotifyListener(address) as sd:
        d = await daemons(base_config({"a": g.url}), env={"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "400000"})
        await sd.wait_for(is_ready)
        # WATCHDOG_USEC/2 = 0.2 s: several pings within a couple of seconds.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        while sum(1 for m in sd.messages if fields(m).get("WATCHDOG") == "1") < 4:
            assert loop.time() < deadline, f"too few WATCHDOG=1 pings: {sd.messages!r}"
            await asyncio.sleep(0.05)
        d.signal(signal.SIGTERM)
        assert await d.wait_exit() == 0


# --- sd_notify in-process ------------------------------------------------------------------------


def test_notify_is_a_no_op_without_notify_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")  # not supported: ignored, not an error
    assert systemd.notify("READY=1") is False


def test_notify_to_a_missing_socket_does_not_raise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(socket_dir(tmp_path) / "nobody-listens.sock"))
    assert systemd.notify("READY=1") is False


@pytest.mark.parametrize("namespace", ["path", "abstract"])
def test_notify_sends_one_datagram(namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if namespace == "path":
        address = str(socket_dir(tmp_path) / "n.sock")
        bind_to = address
    else:
        address = f"@kiloline-unit-{uuid.uuid4().hex}"
        bind_to = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(bind_to)
        s.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", address)
        systemd.reloading()
        msg = s.recv(65536).decode()
        f = fields(msg)
        assert f.get("RELOADING") == "1" and re.fullmatch(r"\d+", f.get("MONOTONIC_USEC", "")), msg
        assert systemd.notify("STOPPING=1") is True
        assert s.recv(65536) == b"STOPPING=1"


def test_watchdog_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert systemd.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "400000")
    assert systemd.watchdog_interval() == pytest.approx(0.2)
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert systemd.watchdog_interval() == pytest.approx(0.2)
    # Meant for another process (sd_watchdog_enabled(3)): not ours to ping.
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert systemd.watchdog_interval() is None


# --- the unit file -------------------------------------------------------------------------------


def systemd_version() -> int | None:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        return None
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    m = re.match(r"systemd (\d+)", out)
    return int(m.group(1)) if m else None


def installable_unit(tmp_path: Path) -> Path:
    """The unit, copied with ExecStart pointing at the real console script (verify checks it exists)."""
    text = UNIT.read_text()
    assert UNIT_EXEC in text, "ExecStart no longer uses the documented install path"
    out = tmp_path / "units"
    out.mkdir()
    (out / "kilolined.service").write_text(text.replace(UNIT_EXEC, kilolined_bin()))
    return out


def test_unit_is_hardened_notify_service() -> None:
    text = UNIT.read_text()
    assert service_values(text, "Type") == ["notify"]
    assert service_values(text, "ExecReload") == ["/bin/kill -HUP $MAINPID"]
    start = service_values(text, "ExecStart")
    assert len(start) == 1 and start[0].split()[0] == UNIT_EXEC and " run" in start[0]
    watchdog = service_values(text, "WatchdogSec")
    assert len(watchdog) == 1 and float(re.sub(r"s$", "", watchdog[0])) > 0, watchdog
    assert service_values(text, "DynamicUser") == ["yes"]
    # The dynamic uid reads /etc/kiloline through install.sh's static group (see test_install), and
    # the config path is the one install.sh renders: no ConfigurationDirectory= (/etc-relative only,
    # and never handed to a dynamic user).
    assert service_values(text, "SupplementaryGroups") == ["kiloline"]
    assert not service_values(text, "ConfigurationDirectory")
    assert start[0].split()[-2:] == ["-c", "/etc/kiloline/kiloline.yaml"]
    assert service_values(text, "EnvironmentFile") == ["-/etc/kiloline/kiloline.env"]
    assert service_values(text, "ProtectSystem") == ["strict"]
    assert service_values(text, "NoNewPrivileges") == ["yes"]
    # An empty assignment: no capabilities at all.
    assert service_values(text, "CapabilityBoundingSet") == [""]
    assert "@system-service" in service_values(text, "SystemCallFilter")
    nofile = service_values(text, "LimitNOFILE")
    assert len(nofile) == 1 and int(nofile[0].split(":")[0]) >= 10000, nofile
    # sd_notify (and the journal) need AF_UNIX if the families are restricted.
    for families in service_values(text, "RestrictAddressFamilies"):
        assert "AF_UNIX" in families.split()
    # Type=notify needs no NotifyAccess=all (only the main process talks), but must not be "none".
    assert "none" not in service_values(text, "NotifyAccess")


def test_notify_reload_drop_in(tmp_path: Path) -> None:
    text = DROP_IN.read_text()
    entries = unit_entries(text)
    assert {s for s, _, _ in entries} == {"Service"}
    assert service_values(text, "Type") == ["notify-reload"]
    # systemd sends the reload signal itself; the daemon reloads on SIGHUP.
    assert service_values(text, "ReloadSignal") in ([], ["SIGHUP"], ["HUP"], ["1"])
    version = systemd_version()
    if version is not None and version >= 253:
        unit_dir = installable_unit(tmp_path)
        (unit_dir / "kilolined.service.d").mkdir()
        shutil.copy(DROP_IN, unit_dir / "kilolined.service.d" / "notify-reload.conf")
        rc, ours = verify(unit_dir)
        assert rc == 0 and not ours, ours


def test_systemd_analyze_verify_is_clean(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed (CI installs the systemd package)")
    unit_dir = installable_unit(tmp_path)
    rc, ours = verify(unit_dir)
    assert rc == 0, ours
    assert not ours, "systemd-analyze verify complained about our unit:\n" + "\n".join(ours)


def test_systemd_analyze_security_exposure_stays_low(tmp_path: Path) -> None:
    version = systemd_version()
    if version is None or version < 250:
        pytest.skip("systemd-analyze security --offline needs systemd >= 250")
    unit = installable_unit(tmp_path) / "kilolined.service"
    # --threshold is the exposure x 10: fail above 1.5 (1.3 today; the old unit scored 1.4).
    p = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--threshold=15", str(unit)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "SYSTEMD_COLORS": "0"})
    overall = [ln for ln in p.stdout.splitlines() if "Overall exposure" in ln]
    assert p.returncode == 0, overall or p.stderr

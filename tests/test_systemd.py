"""systemd integration (SPEC §10, PROTOCOLS §5): sd_notify from a real daemon process, the unit file.

The daemon runs as a child process (`kilolined run -c <tmp>/etc/kiloline.yaml`) against an in-process
fake GPU; a unix datagram socket bound by the test plays systemd's $NOTIFY_SOCKET. The helpers
here (``Daemon``, ``NotifyListener``, ``free_port``) are also used by test_reload and test_shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from conftest import ADMIN, base_config, wait_until

from kilolined.ops import systemd

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "systemd" / "kilolined.service"
DROP_IN = REPO / "systemd" / "notify-reload.conf"
UNIT_EXEC = "/opt/kiloline/venv/bin/kilolined"


def kilolined_bin() -> str:
    """The console script of the interpreter running the tests (the venv's), else the one on PATH."""
    here = Path(sys.executable).with_name("kilolined")
    if here.exists():
        return str(here)
    found = shutil.which("kilolined")
    assert found, "kilolined console script not found"
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def monotonic_usec() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def fields(msg: str) -> dict[str, str]:
    """One sd_notify datagram (newline-separated KEY=VALUE) as a dict."""
    out = {}
    for line in msg.split("\n"):
        k, sep, v = line.partition("=")
        if sep:
            out[k] = v
    return out


# --- a child daemon ------------------------------------------------------------------------------


class Daemon:
    """`kilolined run -c DIR/etc/kiloline.yaml` as a child process; stderr goes to DIR/stderr.log.

    The config lives in its own directory so the daemon's watcher sees nothing but the config.
    With ``unwatched=True`` etc/kiloline.yaml is a symlink to DIR/real/kiloline.yaml and
    ``write_config`` rewrites that target in place: the watcher (on etc/) sees nothing, so only
    SIGHUP or the admin API can be what reloads.
    """

    def __init__(self, directory: Path, cfg: dict[str, Any], env: dict[str, str] | None = None,
                 unwatched: bool = False):
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "etc").mkdir(exist_ok=True)
        self.port = free_port()
        self.cfg = copy.deepcopy(cfg)
        self.cfg["server"]["listen"] = f"127.0.0.1:{self.port}"
        self.path = directory / "etc" / "kiloline.yaml"
        self.real: Path | None = None
        if unwatched:
            self.real = directory / "real" / "kiloline.yaml"
            self.real.parent.mkdir(exist_ok=True)
            self.real.write_text(yaml.safe_dump(self.cfg))
            os.symlink("../real/kiloline.yaml", self.path)
        else:
            self.path.write_text(yaml.safe_dump(self.cfg))
        self.stderr_path = directory / "stderr.log"
        drop = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "KILOLINE_CONFIG")
        self.env = {k: v for k, v in os.environ.items() if k not in drop}
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env.update(env or {})
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""

    def write_config(self, cfg: dict[str, Any]) -> bytes:
        """Atomic replace (temp file + rename), keeping our listen address; returns the bytes written.
        With ``unwatched`` the symlink's target is rewritten in place instead."""
        cfg = copy.deepcopy(cfg)
        cfg["server"]["listen"] = self.cfg["server"]["listen"]
        data = yaml.safe_dump(cfg).encode()
        if self.real is not None:
            self.real.write_bytes(data)
            return data
        tmp = self.path.with_name(".kiloline.yaml.tmp")
        tmp.write_bytes(data)
        tmp.replace(self.path)
        return data

    def version(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    async def start(self, timeout: float = 30) -> None:
        with open(self.stderr_path, "wb") as err:
            self.proc = await asyncio.create_subprocess_exec(
                kilolined_bin(), "run", "-c", str(self.path),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=self.env,
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with aiohttp.ClientSession() as s:
            while True:
                if self.proc.returncode is not None:
                    raise AssertionError(f"kilolined exited with {self.proc.returncode}:\n{self.stderr()}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with s.get(self.url + "/healthz", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return
                if loop.time() > deadline:
                    raise AssertionError(f"kilolined not healthy after {timeout}s:\n{self.stderr()}")
                await asyncio.sleep(0.05)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def wait_exit(self, timeout: float = 30) -> int:
        assert self.proc is not None
        try:
            return await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            raise AssertionError(f"kilolined still running after {timeout}s:\n{self.stderr()}") from None

    async def state(self, http: aiohttp.ClientSession) -> dict[str, Any]:
        async with http.get(self.url + "/admin/state", headers=ADMIN) as r:
            assert r.status == 200
            return await r.json()

    async def close(self) -> None:
        """Teardown: kill the child (only ours, by its own handle) if a test left it running."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()


DaemonFactory = Callable[..., Awaitable[Daemon]]


@contextlib.asynccontextmanager
async def daemon_factory(tmp_path: Path) -> AsyncIterator[DaemonFactory]:
    made: list[Daemon] = []

    async def make(cfg: dict[str, Any], env: dict[str, str] | None = None, unwatched: bool = False) -> Daemon:
        d = Daemon(tmp_path / f"daemon{len(made)}", cfg, env, unwatched)
        made.append(d)
        await d.start()
        return d

    try:
        yield make
    finally:
        for d in made:
            await d.close()


@pytest.fixture
async def daemons(tmp_path: Path) -> AsyncIterator[DaemonFactory]:
    async with daemon_factory(tmp_path) as make:
        yield make


# --- a fake $NOTIFY_SOCKET -----------------------------------------------------------------------


class NotifyListener:
    """A bound AF_UNIX datagram socket; every datagram is kept (decoded) in ``messages``.

    ``address`` is what goes into $NOTIFY_SOCKET: a path, or ``@name`` for the abstract namespace.
    """

    def __init__(self, address: str):
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.setblocking(False)
        self.messages: list[str] = []
        self.times: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> NotifyListener:
        self._task = asyncio.create_task(self._recv())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.sock.close()
        if not self.address.startswith("@"):
            with contextlib.suppress(OSError):
                os.unlink(self.address)

    async def _recv(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await loop.sock_recv(self.sock, 65536)
            self.messages.append(data.decode())
            self.times.append(loop.time())

    async def wait_for(self, pred: Callable[[dict[str, str]], bool], after: int = 0, timeout: float = 15) -> int:
        """Index of the first datagram at or after ``after`` whose fields satisfy ``pred``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            for i in range(after, len(self.messages)):
                if pred(fields(self.messages[i])):
                    return i
            if loop.time() > deadline:
                raise AssertionError(f"no matching sd_notify datagram in {timeout}s; got {self.messages!r}")
            await asyncio.sleep(0.02)


def socket_dir(tmp_path: Path) -> Path:
    """tmp_path, unless the socket path would pass sun_path's 108 bytes (long test names)."""
    if len(str(tmp_path / "notify.sock")) < 100:
        return tmp_path
    return Path(tempfile.mkdtemp(prefix="kl-notify-"))


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


def unit_entries(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) for every assignment, in order (no line continuations in our files)."""
    out = []
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def service_values(text: str, key: str) -> list[str]:
    return [v for s, k, v in unit_entries(text) if s == "Service" and k == key]


def systemd_version() -> int | None:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        return None
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    m = re.match(r"systemd (\d+)", out)
    return int(m.group(1)) if m else None


def verify(unit_dir: Path, unit_name: str = "kilolined.service") -> tuple[int, list[str]]:
    """Run `systemd-analyze verify` on the unit; returns its exit code and the lines about our files."""
    exe = shutil.which("systemd-analyze")
    assert exe is not None
    p = subprocess.run([exe, "verify", str(unit_dir / unit_name)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""})
    ours = [ln for ln in (p.stdout + p.stderr).splitlines() if str(unit_dir) in ln or "kilolined" in ln]
    return p.returncode, ours


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

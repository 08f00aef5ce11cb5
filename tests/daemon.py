"""A gateway run as a daemon under a fake systemd notify socket, and the unit checks."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from conftest import ADMIN


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


def fields(msg: str) -> dict[str, str]:
    """One sd_notify datagram (newline-separated KEY=VALUE) as a dict."""
    out = {}
    for line in msg.split("\n"):
        k, sep, v = line.partition("=")
        if sep:
            out[k] = v
    return out


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


def verify(unit_dir: Path, unit_name: str = "kilolined.service") -> tuple[int, list[str]]:
    """Run `systemd-analyze verify` on the unit; returns its exit code and the lines about our files."""
    exe = shutil.which("systemd-analyze")
    assert exe is not None
    p = subprocess.run([exe, "verify", str(unit_dir / unit_name)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""})
    ours = [ln for ln in (p.stdout + p.stderr).splitlines() if str(unit_dir) in ln or "kilolined" in ln]
    return p.returncode, ours

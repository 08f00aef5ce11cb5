"""server.max_connections above the open-files limit (docs/SECURITY.md): the daemon raises its soft
RLIMIT_NOFILE toward the hard one, or accepts fewer connections with a warning, so that accept()
never fails for want of a descriptor and /healthz answers while idle connections flood it."""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import base_config

from kilolined.edge.listener import FD_RESERVE, fd_plan


def test_fd_plan_raises_toward_the_hard_limit_then_clamps() -> None:
    p = fd_plan(10000, 1024, 1 << 20)
    assert (p.soft, p.max_connections, p.raised, p.clamped) == (10000 + FD_RESERVE, 10000, True, False)
    p = fd_plan(10000, 1024, 4096)
    assert p.soft == 4096 and p.max_connections == 4096 - FD_RESERVE and p.clamped
    p = fd_plan(2000, 256, 256)
    assert p.soft == 256 and p.max_connections == 256 - 64 and not p.raised and p.clamped
    p = fd_plan(100, 1024, 1024)
    assert (p.soft, p.max_connections, p.raised, p.clamped) == (1024, 100, False, False)
    assert fd_plan(5000, 1024, resource.RLIM_INFINITY).soft == 5000 + FD_RESERVE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthz(port: int, timeout: float) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=timeout) as r:
        return int(r.status)


def wait_healthy(proc: subprocess.Popen[bytes], port: int) -> None:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        assert proc.poll() is None, "the daemon exited"
        try:
            if healthz(port, 2) == 200:
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("the daemon did not start")


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[object]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(soft: int, hard: int, max_connections: int) -> tuple[subprocess.Popen[bytes], int]:
        port = free_port()
        cfg = base_config({"a": "http://127.0.0.1:9"})
        cfg["server"].update({"listen": f"127.0.0.1:{port}", "max_connections": max_connections,
                              "header_timeout_sec": 120, "idle_timeout_sec": 120})
        path = tmp_path / "kiloline.yaml"
        path.write_text(yaml.safe_dump(cfg))
        proc = subprocess.Popen(
            [sys.executable, "-m", "kilolined", "run", "-c", str(path)], stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "stderr").open("wb"),
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
        procs.append(proc)
        wait_healthy(proc, port)
        return proc, port

    yield start
    for p in procs:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def flood(port: int, n: int) -> list[socket.socket]:
    """n idle connections: connected, never a byte sent."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        socks.append(s)
    return socks


def test_soft_limit_is_raised_so_healthz_answers_during_a_flood(daemon, tmp_path: Path) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 3000:
        pytest.skip("hard open-files limit too low here")
    proc, port = daemon(256, hard, 2000)
    socks = flood(port, 600)  # more than the soft limit the daemon was started with
    try:
        assert healthz(port, 20) == 200
    finally:
        for s in socks:
            s.close()
    err = (tmp_path / "stderr").read_text()
    assert "raised the open-files limit (RLIMIT_NOFILE) from 256 to" in err
    assert "Too many open files" not in err
    assert proc.poll() is None


def test_hard_limit_too_low_clamps_max_connections_with_a_warning(daemon, tmp_path: Path) -> None:
    proc, port = daemon(300, 300, 2000)
    err = (tmp_path / "stderr").read_text()
    assert "server.max_connections 2000 does not fit the open-files limit" in err
    assert f"at most {300 - 300 // 4} client connections" in err
    socks = flood(port, 150)  # well within what it accepts: every descriptor it needs is there
    try:
        assert healthz(port, 20) == 200
    finally:
        for s in socks:
            s.close()
    assert "Too many open files" not in (tmp_path / "stderr").read_text()
    assert proc.poll() is None

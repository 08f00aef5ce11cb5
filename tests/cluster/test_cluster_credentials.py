"""A Redis that refuses the cluster's credentials is a configuration error, not an outage.

Going on alone with a "safe share" after a WRONGPASS would give every gateway the whole N and the
whole budget (no peer was ever seen to share with): three gateways ran 12 on a node of 4. So
`check` exits 1 and `run` refuses to start, naming the cause and never the password.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import yaml

from .harness import RedisServer, cluster_config, free_port

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "the-right-one-0123456789"


@pytest.fixture
def locked_redis(tmp_path: Path) -> Iterator[int]:
    """A redis-server that wants a password (``requirepass``)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    r = RedisServer(tmp_path, persistence=("--save", "", "--appendonly", "no", "--requirepass", PASSWORD))
    r.start()
    yield r.port
    r.kill()


def kilolined(cmd: str, tmp_path: Path, url: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    path = tmp_path / f"{cmd}.yaml"
    path.write_text(yaml.safe_dump(cluster_config(url, "http://127.0.0.1:9", free_port(), "gw0")))
    return subprocess.run([sys.executable, "-m", "kilolined", cmd, "-c", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("password", ["wrong-password", None])  # WRONGPASS, and NOAUTH
def test_check_and_run_refuse_credentials_redis_refuses(locked_redis: int, tmp_path: Path,
                                                        password: str | None) -> None:
    url = f"redis://{':' + password + '@' if password else ''}127.0.0.1:{locked_redis}/0"
    out = kilolined("check", tmp_path, url)
    assert out.returncode == 1, out.stdout + out.stderr
    errors = [line for line in out.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cluster.redis_url" in errors[0] and "refused" in errors[0], out.stdout
    assert "Traceback" not in out.stderr
    run = kilolined("run", tmp_path, url)  # exits by itself: it never starts serving
    assert run.returncode == 1, run.stdout + run.stderr
    assert "cluster.redis_url" in run.stderr and "refused" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    for text in (out.stdout, run.stderr):
        assert "wrong-password" not in text and PASSWORD not in text


def test_check_passes_with_the_right_password(locked_redis: int, tmp_path: Path) -> None:
    out = kilolined("check", tmp_path, f"redis://:{PASSWORD}@127.0.0.1:{locked_redis}/0")
    assert out.returncode == 0 and out.stdout.startswith("ok:"), out.stdout + out.stderr
    assert "error:" not in out.stdout and "warning:" not in out.stdout


SPECIAL = "Qx7v/Hn3k#Zr8m?Wd2p-0123"  # '/', '#' and '?' end a URL's host part when left as they are


def with_password_var(cmd: str, tmp_path: Path, port: int, password: str) -> subprocess.CompletedProcess[str]:
    """``cmd`` on the documented ``redis://:${REDIS_PASSWORD}@…`` form, the password in the environment."""
    path = tmp_path / f"{cmd}.yaml"
    url = "redis://:${REDIS_PASSWORD}@127.0.0.1:" + f"{port}/0"
    path.write_text(yaml.safe_dump(cluster_config(url, "http://127.0.0.1:9", free_port(), "gw0")))
    env = {**os.environ, "REDIS_PASSWORD": password}
    env.pop("KILOLINE_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "kilolined", cmd, "-c", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("password", [SPECIAL, "Kq4t/Bv9w-0123", "Kq4t#Bv9w-0123", "Kq4t?Bv9w-0123"])
@pytest.mark.parametrize("cmd", ["check", "run"])
def test_a_password_that_breaks_the_url_is_a_located_error_that_never_shows_it(
        tmp_path: Path, cmd: str, password: str) -> None:
    out = with_password_var(cmd, tmp_path, free_port(), password)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "Traceback" not in text
    line = next(t for t in text.splitlines() if "cluster.redis_url" in t)
    assert re.search(rf"{re.escape(str(tmp_path / cmd))}\.yaml:\d+: cluster\.redis_url: ", line), line
    assert "percent-encode" in line
    # Not the password, nor any piece of it a parser would have taken for a host, port or database.
    for piece in re.split(r"[/#?]", password):
        assert piece not in text


def test_the_percent_encoded_password_is_accepted_by_redis(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    r = RedisServer(tmp_path, persistence=("--save", "", "--appendonly", "no", "--requirepass", SPECIAL))
    r.start()
    try:
        out = with_password_var("check", tmp_path, r.port, quote(SPECIAL, safe=""))
    finally:
        r.kill()
    assert out.returncode == 0 and out.stdout.startswith("ok:"), out.stdout + out.stderr
    assert "error:" not in out.stdout

"""`kilolined demo --once` as a user runs it, with its preferred port already taken."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def demo_on_a_taken_port() -> Iterator[tuple[int, subprocess.CompletedProcess[str]]]:
    """One run (it takes half a minute) with another listener on the port it asks for."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "NO_COLOR": "1"}
        # ResourceWarning is ignored by default: shown, an unclosed session or connector would print.
        proc = subprocess.run([sys.executable, "-W", "always::ResourceWarning", "-m", "kilolined", "demo", "--once",
                               "--port", str(port)], capture_output=True, text=True, timeout=300, env=env)
    yield port, proc


def test_demo_on_a_taken_port_picks_another_and_closes_everything(demo_on_a_taken_port) -> None:
    port, proc = demo_on_a_taken_port
    assert proc.returncode == 0, proc.stderr[-3000:]
    for leak in ("Unclosed", "ResourceWarning", "Traceback"):
        assert leak not in proc.stderr, proc.stderr[-3000:]
    m = re.search(r"port (\d+) is taken: the gateway listens on (\d+) instead", proc.stdout)
    assert m and int(m.group(1)) == port and int(m.group(2)) != port, proc.stdout
    # One gateway only: a second, half-started one would log its own health checks of gpu-a too.
    assert proc.stderr.count("kilolined listening on") == 1, proc.stderr


def test_demo_once_shows_the_crash_and_the_rescue(demo_on_a_taken_port) -> None:
    out = demo_on_a_taken_port[1].stdout
    assert "GPU crashed: CUDA out of memory" in out
    assert "all 10 served" in out and "never ran more than 2 at once" in out and "oom_count=0" in out
    assert "nothing lost: 10/10 served" in out
    # The mixed burst: fixed slots for throughput run the card out of memory, cost-aware admission does not.
    mixed = out.split("4) A mixed burst")[1]
    fast, cost_aware = mixed.split("(for throughput)")[1].split("cost-aware")
    assert "oom_count=0" not in fast
    assert "24/24 served, oom_count=0" in cost_aware


def test_demo_once_prints_the_url_and_the_keys(demo_on_a_taken_port) -> None:
    _, proc = demo_on_a_taken_port
    m = re.search(r"port \d+ is taken: the gateway listens on (\d+) instead", proc.stdout)
    assert m, proc.stdout
    url = f"http://127.0.0.1:{m.group(1)}"
    assert f"Dashboard: {url}/dashboard" in proc.stdout
    assert re.search(r"^Admin key: kl_[A-Za-z0-9_-]{32}$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^API key:   kl_[A-Za-z0-9_-]{32} ", proc.stdout, re.M), proc.stdout
    assert "--once: the gateway stops here" in proc.stdout


def test_demo_shows_conversations_with_affinity_off_and_on(demo_on_a_taken_port) -> None:
    """Scene 5: the same chats through `affinity: off` and `affinity: prefix`, every turn served,
    with the TTFT and the cached share the simulated LLM nodes reported, side by side."""
    _, proc = demo_on_a_taken_port
    found = dict(re.findall(r"^   affinity: (off|prefix)\b.*?TTFT p50 +\d+ ms, p95 +\d+ ms; cached share +(\d+) %; "
                            r"(?:\d+)/(?:\d+) served$", proc.stdout, re.M))
    assert set(found) == {"off", "prefix"}, proc.stdout
    served = re.findall(r"^   affinity: .*; (\d+)/(\d+) served$", proc.stdout, re.M)
    assert len(served) == 2 and all(a == b != "0" for a, b in served), served
    # A chat's later turns find their history on the node: the nodes report it cached.
    assert int(found["prefix"]) > 0, proc.stdout

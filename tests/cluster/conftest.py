"""The cluster tests' fixtures: a real redis-server, gateway processes in front of it, and one
fake GPU. A module sets its card with ``pytestmark = pytest.mark.gpu(steps=.., step_ms=..)``
(a test may override it with its own mark); the rest stays at plenty of VRAM, so the card never
crashes and only counts how many jobs ran at once."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kilolined.fakegpu import FakeGPU

from .harness import GatewayProc, RedisServer

GPU = {"vram_gb": 1000, "job_vram_gb": 1, "steps": 2, "step_ms": 20, "crash_sec": 0.4}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu(**options): the options of the cluster tests' fake GPU")


def gpu_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    mark = request.node.get_closest_marker("gpu")
    return {**GPU, **(mark.kwargs if mark else {})}


@pytest.fixture
async def gpu(request: pytest.FixtureRequest) -> AsyncIterator[FakeGPU]:
    g = FakeGPU("generic", **gpu_options(request))
    await g.start()
    yield g
    await g.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run does)")
    r = RedisServer(tmp_path)
    r.start()
    yield r
    r.kill()


@pytest.fixture
async def gateways() -> AsyncIterator[list[GatewayProc]]:
    """Append GatewayProc objects; each is stopped at the end (``start_all`` starts them)."""
    procs: list[GatewayProc] = []
    yield procs
    for p in procs:
        p.stop()

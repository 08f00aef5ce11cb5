"""Plain pieces the simulated GPU is made of: a job, the test knobs, small helpers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard

from aiohttp import web

GIB = 1024**3
BLOB_CHUNK = 64 * 1024
BLOB_PATTERN = bytes(range(256)) * (BLOB_CHUNK // 256)


class Server(Protocol):
    """A fake that listens: a card or a provider."""

    host: str
    port: int

    @property
    def url(self) -> str: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def serve_until_signal(server: Server, name: str) -> int:
    """Serve until Ctrl-C or SIGTERM (for `kilolined fakegpu`); returns the exit code."""
    try:
        return asyncio.run(_serve(server, name))
    except KeyboardInterrupt:  # platforms without loop signal handlers
        return 0


async def _serve(server: Server, name: str) -> int:
    try:
        await server.start()
    except OSError as exc:
        print(f"fakegpu: cannot listen on {server.host}:{server.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"{name} listening on {server.url}", file=sys.stderr, flush=True)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, done.set)
    try:
        await done.wait()
    finally:
        await server.stop()
    return 0


@dataclass(eq=False)
class Job:
    """One unit of GPU work. `stop` is set when the card fails or interrupts it mid-run."""

    id: int
    vram_gb: float
    reason: str | None = None  # "oom" | "interrupted" once stopped
    ended: bool = False
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    # Set once the job's client has been told the outcome; a crash waits for it.
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def failed(self) -> bool:
        return self.reason is not None


@dataclass
class Knobs:
    """Test knobs set through POST /_fake/control; they persist until changed."""

    health_status: int = 200
    health_hang: bool = False
    fail_status: int | None = None
    hang: bool = False
    drip_ms: float = 0.0

    def update(self, data: Any) -> list[str]:
        """Apply `data`; returns the problems, and then nothing is applied."""
        if not isinstance(data, dict):
            return ["body must be a JSON object"]
        checks: dict[str, tuple[Callable[[Any], bool], str]] = {
            "health_status": (is_status, "an HTTP status code"),
            "fail_status": (lambda v: v is None or is_status(v), "an HTTP status code or null"),
            "health_hang": (lambda v: isinstance(v, bool), "a boolean"),
            "hang": (lambda v: isinstance(v, bool), "a boolean"),
            "drip_ms": (lambda v: is_number(v) and v >= 0, "a number >= 0"),
        }
        problems = [f"{key}: unknown knob" if key not in checks else f"{key}: must be {checks[key][1]}"
                    for key, value in data.items() if key not in checks or not checks[key][0](value)]
        if not problems:
            for key, value in data.items():
                setattr(self, key, float(value) if key == "drip_ms" else value)
        return problems


def is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_status(value: Any) -> bool:
    return is_int(value) and 100 <= value <= 599


def is_number(value: Any) -> TypeGuard[float]:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


async def read_json(request: web.Request) -> Any:
    """The body as JSON, None for an empty body; raises ValueError when it is not JSON."""
    raw = await request.read()
    if not raw.strip():
        return None
    return json.loads(raw)


def sse_headers() -> dict[str, str]:
    return {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

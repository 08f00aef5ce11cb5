"""A client for sse and async jobs: submit, read the event stream, poll the status."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from conftest import auth, wait_until

ASYNC = {"X-KiloLine-Mode": "async"}


@dataclass
class Event:
    id: str | None
    event: str
    data: str
    at: float  # time.monotonic() when the blank line that dispatched it arrived

    @property
    def json(self) -> Any:
        return orjson.loads(self.data)


@dataclass
class SSEReader:
    """Parses an event stream incrementally: ``await next()`` gives the next event, None at EOF."""

    resp: aiohttp.ClientResponse
    lines: list[str] = field(default_factory=list)
    comments: list[tuple[float, str]] = field(default_factory=list)
    retry: int | None = None
    eof: bool = False
    last_id: str | None = None

    async def next(self, timeout: float = 15) -> Event | None:
        name, data = "", []
        async with asyncio.timeout(timeout):
            while True:
                raw = await self.resp.content.readline()
                if not raw:
                    self.eof = True
                    return None  # an incomplete event at EOF is discarded
                line = raw.decode("utf-8").rstrip("\n").rstrip("\r")
                self.lines.append(line)
                if line == "":
                    if data:
                        return Event(self.last_id, name or "message", "\n".join(data), time.monotonic())
                    name = ""
                    continue
                if line.startswith(":"):
                    self.comments.append((time.monotonic(), line[1:].removeprefix(" ")))
                    continue
                key, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if key == "event":
                    name = value
                elif key == "data":
                    data.append(value)
                elif key == "id" and "\0" not in value:
                    self.last_id = value
                elif key == "retry" and value.isdigit():
                    self.retry = int(value)

    async def until(self, event: str, timeout: float = 15) -> list[Event]:
        """Events up to and including the first ``event``."""
        out: list[Event] = []
        while True:
            ev = await self.next(timeout)
            assert ev is not None, f"stream ended before {event!r}: {[e.event for e in out]}"
            out.append(ev)
            if ev.event == event:
                return out

    async def rest(self, timeout: float = 20) -> list[Event]:
        """Every event until the server closes the stream."""
        out: list[Event] = []
        async with asyncio.timeout(timeout):
            while (ev := await self.next(timeout)) is not None:
                out.append(ev)
        return out


async def read_all(http: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None,
                   timeout: float = 20) -> tuple[aiohttp.ClientResponse, SSEReader, list[Event]]:
    async with http.get(url, headers=headers or {}) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        reader = SSEReader(r)
        events = await reader.rest(timeout)
        return r, reader, events


async def submit_async(http: aiohttp.ClientSession, gw: Any, body: dict[str, Any], who: str = "alice",
                       headers: dict[str, str] | None = None) -> dict[str, Any]:
    async with http.post(gw.url + "/gen/generate", json=body,
                         headers={**auth(who), **ASYNC, **(headers or {})}) as r:
        assert r.status == 202, await r.text()
        return await r.json()


async def job_status(http: aiohttp.ClientSession, gw: Any, job_id: str, who: str = "alice") -> dict[str, Any]:
    async with http.get(f"{gw.url}/v1/jobs/{job_id}", headers=auth(who)) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def wait_status(http: aiohttp.ClientSession, gw: Any, job_id: str, status: str, timeout: float = 20) -> None:
    async def done() -> bool:
        return (await job_status(http, gw, job_id))["status"] == status

    await wait_until(done, timeout=timeout, step=0.05)


def token_of(url: str) -> str:
    return url.split("token=", 1)[1].split("&", 1)[0]


def node_answer(gpu: Any, steps: int, echo: Any) -> dict[str, Any]:
    """What the generic fake answers to POST /generate."""
    return {"ok": True, "steps": steps, "echo": echo, "node": str(gpu.port)}

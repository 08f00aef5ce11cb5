"""``openai``: OpenAI-compatible servers (vLLM, llama.cpp, Ollama).

Streams pass through unbuffered; on the way we read ``usage`` (the JSON body, or the final
chunk when the client asked for ``stream_options.include_usage``) into token budgets and
metrics, and time the first token. Without a usage chunk, each content chunk counts as one
token — an estimate (servers send one token per chunk by default) and documented as such.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from kilolined.adapters.base import Adapter, Sink, Tee
from kilolined.lease import LeaseScope
from kilolined.proxy import Exchange, Observer
from kilolined.queue import Rejected
from kilolined.runtime import Runtime

COMPLETION_PATHS = ("/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions")


def request_json(ex: Exchange) -> dict[str, Any] | None:
    if not ex.body:
        return None
    try:
        data = orjson.loads(ex.body)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def is_completion(ex: Exchange) -> bool:
    return ex.method == "POST" and ex.tail.split("?", 1)[0].endswith(COMPLETION_PATHS)


def wants_stream(ex: Exchange) -> bool:
    data = request_json(ex)
    return bool(data and data.get("stream") is True)


class StreamParser(Observer):
    """Reads usage and counts content chunks, from either a JSON body or an SSE stream."""

    def __init__(self, on_chunk: Any = None):
        self.first_at: float | None = None
        self.chunks = 0
        self.usage: dict[str, Any] | None = None
        self.buf = bytearray()
        self.stream: bool | None = None
        self.on_chunk = on_chunk

    def feed(self, chunk: bytes) -> None:
        if self.stream is None:
            self.stream = chunk.lstrip().startswith((b"data:", b":", b"event:", b"error:"))
        if not self.stream:
            if len(self.buf) < 8 * 1024 * 1024:
                self.buf += chunk
            if self.first_at is None:
                self.first_at = time.monotonic()
            return
        self.buf += chunk
        *lines, rest = self.buf.split(b"\n")
        self.buf = bytearray(rest)
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            try:
                ev = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(ev, dict):
                continue
            if isinstance(ev.get("usage"), dict):
                self.usage = ev["usage"]
            if _has_content(ev):
                if self.first_at is None:
                    self.first_at = time.monotonic()
                self.chunks += 1
                if self.on_chunk is not None:
                    self.on_chunk(self.chunks)

    def done(self, ok: bool) -> None:
        if not self.stream and self.buf:
            try:
                body = orjson.loads(bytes(self.buf))
                if isinstance(body, dict) and isinstance(body.get("usage"), dict):
                    self.usage = body["usage"]
            except orjson.JSONDecodeError:
                pass

    def tokens(self) -> int:
        if self.usage:
            total = self.usage.get("total_tokens")
            if isinstance(total, int):
                return total
            parts = [self.usage.get("prompt_tokens"), self.usage.get("completion_tokens")]
            return sum(p for p in parts if isinstance(p, int))
        return self.chunks


class UsageObserver(StreamParser):
    """Feeds token budgets, kiloline_tokens_total and kiloline_ttft_seconds."""

    def __init__(self, rt: Runtime, route: str, key: str | None, dispatched: float):
        super().__init__()
        self.rt, self.route, self.key = rt, route, key
        self.dispatched = dispatched

    def done(self, ok: bool) -> None:
        super().done(ok)
        tokens = self.tokens()
        if self.first_at is not None:
            self.rt.metrics.ttft.labels(self.route).observe(max(0.0, self.first_at - self._dispatched_wall()))
        if tokens:
            self.rt.metrics.tokens.labels(self.route, self.key or "-").inc(tokens)
            if self.key is not None:
                self.rt.budgets.add(self.key, time.time(), tokens=tokens)

    def _dispatched_wall(self) -> float:
        # dispatched is on the runtime clock; convert to time.monotonic's frame.
        return time.monotonic() - (self.rt.clock() - self.dispatched)


def _has_content(ev: dict[str, Any]) -> bool:
    choices = ev.get("choices")
    if not isinstance(choices, list):
        return False
    for c in choices:
        if not isinstance(c, dict):
            continue
        d = c.get("delta") or {}
        if isinstance(d, dict) and (d.get("content") or d.get("tool_calls") or d.get("reasoning_content")):
            return True
        if c.get("text"):
            return True
    return False


class OpenAIAdapter(Adapter):
    kind = "openai"

    def prepare(self, ex: Exchange) -> None:
        if is_completion(ex) and request_json(ex) is None:
            raise Rejected(400, "bad_request", "body must be a JSON object")

    def observer(self, rt: Runtime, ex: Exchange, scope: LeaseScope, sink: Sink) -> Observer | None:
        if not is_completion(ex):
            return None
        usage = UsageObserver(rt, rt.route_label(scope.route), scope.key, scope.dispatched_at)
        return Tee(usage, self._progress(ex, sink)) if sink.reports_progress else usage

    @staticmethod
    def _progress(ex: Exchange, sink: Sink) -> Observer | None:
        """step_progress of a streamed job: generated chunks against max_tokens."""
        data = request_json(ex) or {}
        total = data.get("max_tokens") or data.get("max_completion_tokens")
        if not isinstance(total, int) or total <= 0 or not data.get("stream"):
            return None
        last = [-1]

        def on_chunk(n: int) -> None:
            pct = min(100, n * 100 // total)
            if pct != last[0]:
                last[0] = pct
                sink.progress(n, total)

        return StreamParser(on_chunk)

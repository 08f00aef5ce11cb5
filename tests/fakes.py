"""Local stand-ins for Telegram, Discord and a webhook receiver, plus an independent verifier.

Each fake is an aiohttp server on 127.0.0.1 with a random port::

    async with FakeTelegram() as tg:
        ...  # point api_base at tg.url, then `await tg.wait_for(1)`

or ``fake = FakeTelegram(); await fake.start(); …; await fake.stop()``.

Knobs are plain attributes, changed between requests: ``fail_next`` (answer 500 that many times),
``rate_limit_next`` + ``retry_after`` (answer 429 in the service's own shape), ``down`` (reset
connections, or answer 503 with ``down_mode = "503"``). ``requests`` counts every request,
``messages`` / ``deliveries`` hold only the accepted ones.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import time
from collections.abc import Callable, Mapping
from typing import Any, Self

from aiohttp import web


def verify_standard_webhook(secret: str, headers: Mapping[str, str], body: bytes, tolerance: float = 300) -> bool:
    """Standard Webhooks v1 (HMAC-SHA256) verification, written from the spec, not from kilolined.

    Looks headers up case-insensitively, accepts any matching ``v1,`` entry of a space-separated
    signature list, and refuses timestamps more than ``tolerance`` seconds from now.
    """
    lower = {k.lower(): v for k, v in headers.items()}
    msg_id = lower.get("webhook-id")
    ts_text = lower.get("webhook-timestamp")
    sig_header = lower.get("webhook-signature")
    if not msg_id or not ts_text or not sig_header:
        return False
    try:
        ts = int(ts_text)
    except ValueError:
        return False
    if abs(time.time() - ts) > tolerance:
        return False
    raw_secret = secret[len("whsec_") :] if secret.startswith("whsec_") else secret
    key = base64.b64decode(raw_secret + "=" * (-len(raw_secret) % 4))
    signed = msg_id.encode() + b"." + ts_text.encode() + b"." + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest())
    for entry in sig_header.split(" "):
        version, _, value = entry.partition(",")
        if version == "v1" and hmac.compare_digest(value.encode(), expected):
            return True
    return False


def _utf16_len(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


class _FakeServer:
    """Start/stop plumbing and a counter shared by the fakes."""

    def __init__(self) -> None:
        self.app = web.Application()
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.requests = 0  # every request seen, failed or not
        self.down = False
        self.down_mode = "reset"  # "reset": drop the connection; "503": answer 503
        self._changed = asyncio.Event()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Self:
        # A short grace: a stalled handler (delay knobs) must not hold up test teardown.
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _note(self) -> None:
        self._changed.set()

    async def _wait_until(self, count: Callable[[], int], n: int, timeout: float, what: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            # Clear before looking, so a change between the look and the wait is not missed.
            self._changed.clear()
            if count() >= n:
                return
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"{type(self).__name__}: {count()} {what} after {timeout}s, wanted {n}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=left)

    def _down_response(self, request: web.Request) -> web.StreamResponse | None:
        if not self.down:
            return None
        if self.down_mode == "503":
            return web.Response(status=503, text="Service Unavailable")
        # Like a spot machine vanishing mid-request: the client sees the connection dropped.
        if request.transport is not None:
            request.transport.abort()
        raise asyncio.CancelledError


class FakeTelegram(_FakeServer):
    """``POST {url}/bot{token}/sendMessage``; records ``messages`` as {chat_id, text, token, json}."""

    def __init__(self, *, token: str | None = None) -> None:
        super().__init__()
        self.expected_token = token  # when set, another token gets 401 like the real API
        self.messages: list[dict[str, Any]] = []
        self.fail_next = 0
        self.rate_limit_next = 0
        self.retry_after = 1
        self._message_id = 0
        self.app.router.add_route("*", "/bot{token}/{method}", self._handle)

    @property
    def url(self) -> str:
        return self.base_url

    @staticmethod
    def _error(code: int, description: str, **params: Any) -> web.Response:
        body: dict[str, Any] = {"ok": False, "error_code": code, "description": description}
        if params:
            body["parameters"] = params
        return web.json_response(body, status=code)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        self._note()
        down = self._down_response(request)
        if down is not None:
            return down
        if request.match_info["method"] != "sendMessage":
            return self._error(404, "Not Found")
        token = request.match_info["token"]
        if self.expected_token is not None and token != self.expected_token:
            return self._error(401, "Unauthorized")
        if self.fail_next > 0:
            self.fail_next -= 1
            return self._error(500, "Internal Server Error")
        if self.rate_limit_next > 0:
            self.rate_limit_next -= 1
            n = self.retry_after
            return self._error(429, f"Too Many Requests: retry after {n}", retry_after=n)
        if request.content_type == "application/json":
            data = await request.json()
        else:
            data = dict(await request.post())
        text = data.get("text")
        if data.get("chat_id") in (None, ""):
            return self._error(400, "Bad Request: chat_id is empty")
        if not isinstance(text, str) or not text.strip():
            return self._error(400, "Bad Request: message text is empty")
        if _utf16_len(text) > 4096:
            return self._error(400, "Bad Request: message is too long")
        self._message_id += 1
        self.messages.append({"chat_id": data["chat_id"], "text": text, "token": token, "json": data})
        self._note()
        return web.json_response(
            {
                "ok": True,
                "result": {
                    "message_id": self._message_id,
                    "date": int(time.time()),
                    "chat": {"id": data["chat_id"]},
                    "text": text,
                },
            }
        )

    async def wait_for(self, n: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        await self._wait_until(lambda: len(self.messages), n, timeout, "messages")
        return self.messages


class FakeDiscord(_FakeServer):
    """``POST {webhook_url}`` (execute webhook); records ``messages`` as {content, json}; answers 204."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[dict[str, Any]] = []
        self.fail_next = 0
        self.rate_limit_next = 0
        self.retry_after: float = 1.0
        self.gone = False  # answer 404 Unknown Webhook, as for a deleted webhook
        self.app.router.add_post("/api/webhooks/{id}/{token}", self._handle)

    @property
    def webhook_url(self) -> str:
        return f"{self.base_url}/api/webhooks/123/tok"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        self._note()
        down = self._down_response(request)
        if down is not None:
            return down
        if self.gone:
            return web.json_response({"message": "Unknown Webhook", "code": 10015}, status=404)
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.json_response({"message": "500: Internal Server Error", "code": 0}, status=500)
        if self.rate_limit_next > 0:
            self.rate_limit_next -= 1
            ra = self.retry_after
            return web.json_response(
                {"message": "You are being rate limited.", "retry_after": ra, "global": False},
                status=429,
                headers={"Retry-After": f"{ra:g}", "X-RateLimit-Scope": "user", "X-RateLimit-Global": "false"},
            )
        data = await request.json()
        content = data.get("content")
        if not isinstance(content, str) or not content:
            return web.json_response({"message": "Cannot send an empty message", "code": 50006}, status=400)
        if _utf16_len(content) > 2000:
            return web.json_response({"message": "Invalid Form Body", "code": 50035}, status=400)
        self.messages.append({"content": content, "json": data})
        self._note()
        if request.query.get("wait") == "true":
            return web.json_response({"id": str(len(self.messages)), "content": content})
        return web.Response(status=204)

    async def wait_for(self, n: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        await self._wait_until(lambda: len(self.messages), n, timeout, "messages")
        return self.messages


class FakeWebhookReceiver(_FakeServer):
    """Accepts POSTs on any path. ``attempts`` holds every request (with the status answered),
    ``deliveries`` the accepted ones, each {path, headers (lower-case keys), body, json, at}.

    Knobs: ``fail_next`` (answer ``fail_status``, default 500, that many times, with a
    ``Retry-After: retry_after`` header when set), ``status`` (answer this to everything, e.g. 410),
    ``delay_next`` + ``delay_sec`` (stall that many requests, to provoke client timeouts).
    """

    def __init__(self) -> None:
        super().__init__()
        self.attempts: list[dict[str, Any]] = []
        self.deliveries: list[dict[str, Any]] = []
        self.fail_next = 0
        self.fail_status = 500
        self.retry_after: str | None = None
        self.status: int | None = None
        self.delay_next = 0
        self.delay_sec = 0.0
        self.app.router.add_route("*", "/{path:.*}", self._handle)

    def url(self, path: str = "/hook") -> str:
        return self.base_url + path

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        body = await request.read()
        record: dict[str, Any] = {
            "path": request.path,
            "method": request.method,
            "headers": {k.lower(): v for k, v in request.headers.items()},
            "body": body,
            "json": _json_or_none(body),
            "at": time.monotonic(),
        }
        self.attempts.append(record)
        self._note()
        down = self._down_response(request)
        if down is not None:
            record["status"] = 503
            return down
        if self.delay_next > 0:
            self.delay_next -= 1
            await asyncio.sleep(self.delay_sec)
        headers = {"Retry-After": self.retry_after} if self.retry_after is not None else {}
        if self.status is not None:
            record["status"] = self.status
            return web.Response(status=self.status, headers=headers)
        if self.fail_next > 0:
            self.fail_next -= 1
            record["status"] = self.fail_status
            if 300 <= self.fail_status < 400:
                headers["Location"] = self.url("/redirected")
            return web.Response(status=self.fail_status, headers=headers, text="nope")
        record["status"] = 200
        self.deliveries.append(record)
        self._note()
        return web.json_response({"ok": True})

    async def wait_for(self, n: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        await self._wait_until(lambda: len(self.deliveries), n, timeout, "deliveries")
        return self.deliveries

    async def wait_for_attempts(self, n: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        await self._wait_until(lambda: len(self.attempts), n, timeout, "attempts")
        return self.attempts


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None

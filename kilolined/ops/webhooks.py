"""Outgoing webhooks: Standard Webhooks signing, delivery with retries, and the SSRF guard (docs/API.md#async).

Delivery never raises into the caller and never logs a body or a full URL (callback URLs often carry
tokens in their path or query): only the host, the attempt number and the outcome.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import contextlib
import email.utils
import hashlib
import hmac
import ipaddress
import logging
import math
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypedDict
from urllib.parse import urlsplit

import aiohttp
import orjson
from aiohttp.abc import AbstractResolver, ResolveResult

log = logging.getLogger("kilolined.ops.webhooks")

USER_AGENT = "KiloLine-Webhooks/1"
# A receiver asking for a longer pause than this is capped, so one odd Retry-After cannot park a task
# (and its body) for days; the configured backoff still wins when it is longer.
MAX_RETRY_AFTER_SEC = 3600.0
ATTEMPT_LOG_SIZE = 500

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Cloud metadata endpoints (AWS/GCP/Azure/OpenStack, AWS IPv6, Alibaba): refused by name so the
# reason says why, even where another rule (link-local, private) would also catch them.
_METADATA_ADDRS = frozenset(ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200"))
# Python's is_private does not cover RFC 6598 shared address space.
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


# ----------------------------------------------------------------------------------------------
# Signing


def _secret_key(secret: str) -> bytes:
    # The reference library pads before decoding, so unpadded secrets are fine; unlike it we refuse
    # characters outside base64, which it would silently skip (a typo must not become a weak key).
    text = secret.removeprefix("whsec_").strip().rstrip("=")
    try:
        key = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if not key:
        raise ValueError("webhook secret must be whsec_ followed by base64")
    return key


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """``v1,<base64 HMAC-SHA256 of "{msg_id}.{timestamp}.{body}">`` keyed by the decoded secret."""
    mac = hmac.new(_secret_key(secret), f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode("ascii")


def new_msg_id() -> str:
    # token_urlsafe never yields '.', which would break the signed "{id}.{ts}.{body}" framing.
    return "msg_" + secrets.token_urlsafe(18)


def signed_headers(secret: str | None, msg_id: str, body: bytes, now: float | None = None) -> dict[str, str]:
    """Headers of one attempt: a fresh timestamp (and signature) each time, the same id always."""
    ts = int(time.time() if now is None else now)
    headers = {
        "webhook-id": msg_id,
        "webhook-timestamp": str(ts),
        "content-type": "application/json",
    }
    if secret:
        headers["webhook-signature"] = sign(secret, msg_id, ts, body)
    return headers


# ----------------------------------------------------------------------------------------------
# SSRF guard


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    # IPv6 forms that carry an IPv4 address the packet may end up at.
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def address_problem(ip: IPAddress) -> str | None:
    """Why a callback must not go to ``ip`` (e.g. "loopback"), or None when it is a public address."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id:
            ip = ipaddress.IPv6Address(ip.compressed.split("%", 1)[0])
        inner = _embedded_v4(ip)
        if inner is not None:
            return address_problem(inner)
    if ip in _METADATA_ADDRS:
        return "cloud metadata"
    if ip.is_loopback:
        return "loopback"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if isinstance(ip, ipaddress.IPv4Address) and ip in _CGNAT:
        return "shared (CGNAT)"
    if ip.is_private:
        return "private"
    if ip.is_reserved:
        return "reserved"
    return None


def _literal_ip(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


async def check_callback_url(url: str, allow_private: bool) -> str | None:
    """None when ``url`` may receive callbacks, else a reason fit for a 400 answer.

    Every address the host resolves to must be public: one private answer among public ones is
    enough to refuse, since the client may connect to any of them.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "callback URL is not a valid URL"
    if parts.scheme.lower() not in ("http", "https"):
        return "callback URL must be http or https"
    host = parts.hostname
    if not host:
        return "callback URL has no host"
    if allow_private:
        return None
    literal = _literal_ip(host)
    if literal is not None:
        addrs: list[IPAddress] = [literal]
    else:
        try:
            infos = await asyncio.wait_for(
                asyncio.get_running_loop().getaddrinfo(
                    host, port or (443 if parts.scheme.lower() == "https" else 80), type=socket.SOCK_STREAM
                ),
                timeout=10,
            )
        except (OSError, TimeoutError, UnicodeError):
            return f"callback host {host!r} does not resolve"
        addrs = []
        for info in infos:
            ip = _literal_ip(str(info[4][0]).split("%", 1)[0])
            if ip is not None:
                addrs.append(ip)
        if not addrs:
            return f"callback host {host!r} does not resolve"
    for ip in addrs:
        problem = address_problem(ip)
        if problem:
            shown = host if literal is not None else f"{host} ({ip})"
            return f"callback URL points at a {problem} address: {shown}"
    return None


class _GuardedResolver(AbstractResolver):
    """Refuses, at connect time, names that resolve to non-public addresses.

    The submission-time check alone leaves a window for DNS rebinding (a name that was public when
    checked and private when connected); this closes it for names. IP literals never reach a
    resolver, so the deliverer checks those itself.
    """

    def __init__(self, allow: Callable[[], bool]) -> None:
        self._inner = aiohttp.DefaultResolver()
        self._allow = allow

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        if not self._allow():
            for r in results:
                ip = _literal_ip(r["host"].split("%", 1)[0])
                problem = address_problem(ip) if ip is not None else "unparseable"
                if problem:
                    raise OSError(f"{host} resolves to a {problem} address")
        return results

    async def close(self) -> None:
        await self._inner.close()


# ----------------------------------------------------------------------------------------------
# Helpers shared with the notifier


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` as seconds: delta-seconds (decimals tolerated) or an HTTP-date; None if absent."""
    if not value:
        return None
    value = value.strip()
    try:
        sec = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        sec = when.timestamp() - time.time()
    if math.isnan(sec):
        return None
    return max(0.0, min(sec, 1e9))


def describe_error(e: BaseException) -> str:
    """A short reason for a failed request, never echoing the URL (it may hold a token)."""
    if isinstance(e, TimeoutError | aiohttp.ServerTimeoutError):
        return "timeout"
    if isinstance(e, aiohttp.ClientConnectorError):
        os_err = e.os_error
        return f"connect failed: {os_err.strerror or os_err}" if os_err else "connect failed"
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return "server disconnected"
    if isinstance(e, aiohttp.ClientPayloadError | aiohttp.ClientOSError):
        return f"connection error ({type(e).__name__})"
    if isinstance(e, aiohttp.InvalidURL):
        return "invalid URL"
    if isinstance(e, OSError):
        return f"connection error: {e.strerror or e}"
    return type(e).__name__


def url_host(url: str) -> str:
    try:
        return urlsplit(url).hostname or "?"
    except ValueError:
        return "?"


# ----------------------------------------------------------------------------------------------
# Delivery


def _serialised(payload: dict[str, Any], msg_id: str, host: str) -> bytes | None:
    """The payload's JSON, serialised once: every attempt signs and sends the very same bytes.
    None (logged: the delivery is dropped) when it is not JSON-serialisable."""
    try:
        return bytes(memoryview(orjson.dumps(payload)))  # right-sized: kept for every retry
    except (TypeError, orjson.JSONEncodeError) as e:
        log.error("webhook %s to %s dropped: payload is not JSON-serialisable (%s)", msg_id, host, e)
        return None


class DeliveryAttempt(NamedTuple):
    msg_id: str
    url_host: str
    attempt_no: int
    status: int | None  # HTTP status, None when the request itself failed
    error: str | None  # why the request failed, None when an HTTP answer came back
    next_wait: float | None  # seconds until the next attempt; None: no further attempt
    at: float  # wall-clock time of the attempt's end


class WebhookSettings(TypedDict):
    """The keyword arguments of ``WebhookDeliverer`` and its ``configure`` that come from the config."""

    secret: str | None
    backoff_sec: Sequence[float]
    timeout_sec: float
    allow_private: bool


class WebhookDeliverer:
    """Fire-and-forget signed POSTs with the configured retry schedule.

    ``allow_private=False`` additionally re-checks addresses at connect time (DNS rebinding); the
    default, True, leaves that to :func:`check_callback_url` at submission, as the jobs API does.
    A custom ``session_factory`` replaces the connector, so the connect-time check is then skipped.
    """

    def __init__(
        self,
        *,
        secret: str | None,
        backoff_sec: Sequence[float],
        timeout_sec: float = 15,
        session_factory: Callable[[], aiohttp.ClientSession] | None = None,
        allow_private: bool = True,
    ) -> None:
        self._secret = secret
        self._backoff = [float(b) for b in backoff_sec]
        self._timeout = float(timeout_sec)
        self._allow_private = allow_private
        self._session_factory = session_factory
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[bool]] = set()
        # Set by close(): retries sleeping in their backoff stop at once instead of being cancelled.
        self._closing = asyncio.Event()
        self._closed = False
        self.attempts: collections.deque[DeliveryAttempt] = collections.deque(maxlen=ATTEMPT_LOG_SIZE)

    def configure(
        self,
        *,
        secret: str | None,
        backoff_sec: Sequence[float],
        timeout_sec: float,
        allow_private: bool | None = None,
    ) -> None:
        """Hot reload: running deliveries read these at their next attempt."""
        self._secret = secret
        self._backoff = [float(b) for b in backoff_sec]
        self._timeout = float(timeout_sec)
        if allow_private is not None:
            self._allow_private = allow_private

    @property
    def pending(self) -> int:
        return len(self._tasks)

    def submit(self, url: str, payload: dict[str, Any], *, msg_id: str | None = None) -> str:
        """Queue a delivery and return its webhook-id at once; must be called inside the event loop."""
        msg_id = msg_id or new_msg_id()
        host = url_host(url)
        if self._closed:
            log.warning("webhook %s to %s dropped: deliverer is closed", msg_id, host)
            return msg_id
        body = _serialised(payload, msg_id, host)
        if body is not None:
            self._spawn(url, host, body, msg_id)
        return msg_id

    async def deliver(self, url: str, payload: dict[str, Any], *, msg_id: str | None = None) -> bool:
        """Like submit() but waits for the outcome: True once a 2xx came back."""
        msg_id = msg_id or new_msg_id()
        host = url_host(url)
        if self._closed:
            return False
        body = _serialised(payload, msg_id, host)
        return body is not None and await self._spawn(url, host, body, msg_id)

    def _spawn(self, url: str, host: str, body: bytes, msg_id: str) -> asyncio.Task[bool]:
        task = asyncio.get_running_loop().create_task(self._deliver(url, host, body, msg_id), name=f"webhook-{msg_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            if self._session_factory is not None:
                self._session = self._session_factory()
            else:
                connector = aiohttp.TCPConnector(
                    resolver=_GuardedResolver(lambda: self._allow_private),
                    # Cached answers would skip the guard after allow_private changes.
                    use_dns_cache=False,
                    limit=100,
                )
                self._session = aiohttp.ClientSession(
                    connector=connector,
                    headers={"User-Agent": USER_AGENT},
                    # Receivers must not be able to plant cookies that ride along to other receivers.
                    cookie_jar=aiohttp.DummyCookieJar(),
                )
        return self._session

    async def _attempt(self, url: str, body: bytes, msg_id: str) -> tuple[int | None, str | None, float | None]:
        """One POST: (status, error, retry_after)."""
        if not self._allow_private:
            host = urlsplit(url).hostname or ""
            ip = _literal_ip(host)
            problem = address_problem(ip) if ip is not None else None
            if problem:
                return None, f"refused: {problem} address", None
        try:
            headers = signed_headers(self._secret, msg_id, body)
        except ValueError:
            return None, "not sent: webhook secret is not whsec_ base64", None
        try:
            session = self._get_session()
            async with session.post(
                url,
                data=body,
                headers=headers,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=self._timeout),
            ) as resp:
                return resp.status, None, parse_retry_after(resp.headers.get("Retry-After"))
        except asyncio.CancelledError:
            raise
        except ValueError:
            # yarl/aiohttp refuse some URLs outright; their messages echo the URL, so say less.
            return None, "invalid URL", None
        except Exception as e:
            return None, describe_error(e), None

    async def _deliver(self, url: str, host: str, body: bytes, msg_id: str) -> bool:
        try:
            attempt_no = 0
            while True:
                attempt_no += 1
                started = time.monotonic()
                status, error, retry_after = await self._attempt(url, body, msg_id)
                ms = (time.monotonic() - started) * 1000
                outcome = f"{status}" if status is not None else error
                if status is not None and 200 <= status < 300:
                    self._record(msg_id, host, attempt_no, status, None, None)
                    log.info("✓ [webhook] %s %s attempt %d: %s (%.0fms)", host, msg_id, attempt_no, status, ms)
                    return True
                backoff = self._backoff
                if status == 410:
                    self._record(msg_id, host, attempt_no, status, error, None)
                    log.warning("✗ [webhook] %s %s attempt %d: 410 Gone, not retrying", host, msg_id, attempt_no)
                    return False
                if attempt_no > len(backoff):
                    self._record(msg_id, host, attempt_no, status, error, None)
                    log.warning(
                        "✗ [webhook] %s %s attempt %d: %s — giving up after %d attempts",
                        host,
                        msg_id,
                        attempt_no,
                        outcome,
                        attempt_no,
                    )
                    return False
                wait = backoff[attempt_no - 1]
                if retry_after is not None:
                    wait = max(wait, min(retry_after, MAX_RETRY_AFTER_SEC))
                self._record(msg_id, host, attempt_no, status, error, wait)
                log.warning(
                    "✗ [webhook] %s %s attempt %d: %s (%.0fms) — retrying in %gs",
                    host,
                    msg_id,
                    attempt_no,
                    outcome,
                    ms,
                    wait,
                )
                if await self._sleep_unless_closing(wait):
                    log.warning("webhook %s to %s abandoned at shutdown after %d attempts", msg_id, host, attempt_no)
                    return False
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug here must not surface as "Task exception was never retrieved" noise or kill anything.
            log.exception("webhook %s to %s: delivery failed unexpectedly", msg_id, host)
            return False

    async def _sleep_unless_closing(self, wait: float) -> bool:
        """Sleep ``wait`` seconds; True if close() began meanwhile (pending retries are abandoned)."""
        if self._closing.is_set():
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closing.wait(), timeout=wait)
        return self._closing.is_set()

    def _record(
        self, msg_id: str, host: str, n: int, status: int | None, error: str | None, next_wait: float | None
    ) -> None:
        self.attempts.append(DeliveryAttempt(msg_id, host, n, status, error, next_wait, time.time()))

    async def close(self, timeout: float = 2.0) -> None:
        """Give in-flight attempts up to ``timeout`` seconds, drop pending retries, close the session."""
        self._closed = True
        self._closing.set()
        tasks = list(self._tasks)
        if tasks:
            _, still = await asyncio.wait(tasks, timeout=timeout)
            for t in still:
                t.cancel()
            if still:
                await asyncio.gather(*still, return_exceptions=True)
                log.warning("%d webhook deliveries cancelled at shutdown", len(still))
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

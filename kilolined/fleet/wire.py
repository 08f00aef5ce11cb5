"""JSON over HTTP to a provider's API, with its failures sorted into ProviderError kinds.

The API key rides in a header and is never part of an error, a log line or a repr: an error
names the method, the path and the status, and a body excerpt with the key cut out.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from kilolined.fleet.provider import ProviderError

BODY_EXCERPT = 200
_QUOTA_WORDS = ("quota", "limit", "insufficient", "balance", "credit")
_NO_OFFER_WORDS = ("no longer available", "not available", "no instances", "unavailable", "no offer")


class ProviderHTTP:
    def __init__(self, base: str, headers: dict[str, str], timeout_sec: float):
        self.base = base
        self._headers = headers
        self._secrets = [v.split(" ", 1)[-1] for v in headers.values() if v]
        self._timeout = aiohttp.ClientTimeout(total=timeout_sec)
        self._session: aiohttp.ClientSession | None = None
        self._closed = False  # a call after close (a rent still running at shutdown) opens nothing

    def __repr__(self) -> str:
        return f"ProviderHTTP({self.base!r})"

    async def close(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        return self._session

    async def call(self, method: str, path: str, body: Any = None, *, query: dict[str, str] | None = None) -> Any:
        what = f"{method} {path}"
        if self._closed:
            raise ProviderError("network", f"{what}: the gateway is stopping")
        try:
            async with self._sess().request(method, self.base + path, json=body, params=query) as r:
                text = await r.text()
                if r.status >= 400:
                    raise self._error(what, r.status, r.headers.get("Retry-After"), text)
        except aiohttp.ClientError as e:
            raise ProviderError("network", f"{what}: {type(e).__name__}") from None
        except TimeoutError:
            raise ProviderError("network", f"{what}: timed out") from None
        if not text.strip():
            return {}
        try:
            return json.loads(text)
        except ValueError:
            raise ProviderError("server", f"{what}: answer is not JSON") from None

    def clean(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, "***")
        return text[:BODY_EXCERPT]

    def _error(self, what: str, status: int, retry_after: str | None, text: str) -> ProviderError:
        excerpt = self.clean(" ".join(text.split()))
        msg = f"{what}: {status} {excerpt}".rstrip()
        if status == 429:
            return ProviderError("rate_limited", msg, _seconds(retry_after))
        if status >= 500:
            return ProviderError("server", msg)
        low = text.lower()
        if any(w in low for w in _QUOTA_WORDS):
            return ProviderError("quota", msg)
        if any(w in low for w in _NO_OFFER_WORDS):
            return ProviderError("no_offer", msg)
        return ProviderError("client", msg)


def _seconds(v: str | None) -> float | None:
    try:
        return max(0.0, float(v)) if v is not None else None
    except ValueError:
        return None  # an HTTP-date: the pool's own backoff applies

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
#: a run of this many characters of a secret, anywhere in a provider's text, is cut out: an API
#: that echoes part of the key ("invalid key abcd…", a key cut at the excerpt's end) gives away
#: that part
SECRET_RUN = 8
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
        """A provider's text as an error may carry it (log, alert, state): cut to an excerpt, and
        every run of SECRET_RUN or more characters of a secret replaced by ``***``."""
        for s in self._secrets:
            text = redact(text, s)
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


def redact(text: str, secret: str, run: int = SECRET_RUN) -> str:
    """``text`` with every stretch of at least ``run`` characters found in ``secret`` replaced by
    ``***`` (the whole key, its prefix, a piece of it). Bounded work: only the excerpt's worth of
    text is scanned (provider bodies can be large; what is past it is never shown)."""
    text = text[:BODY_EXCERPT * 4]
    if len(secret) < run:
        return text.replace(secret, "***") if secret else text
    out: list[str] = []
    i = 0
    while i < len(text):
        n = run if text[i:i + run] in secret else 0
        while n and i + n < len(text) and text[i:i + n + 1] in secret:
            n += 1
        if n:
            out.append("***")
            i += n
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _seconds(v: str | None) -> float | None:
    try:
        return max(0.0, float(v)) if v is not None else None
    except ValueError:
        return None  # an HTTP-date: the pool's own backoff applies

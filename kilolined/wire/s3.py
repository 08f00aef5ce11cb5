"""A small S3 client: PUT, GET (streamed) and HEAD of one object, signed with AWS Signature V4.

Three calls on path-style URLs (``{endpoint}/{bucket}/{key}``, what MinIO, moto and every
S3-compatible server answer) do not earn botocore's weight: the signer below is the one in the
AWS documentation ("Create a signed AWS API request", SigV4 for S3), header-signed, with the
payload's sha256 (PUT) or the empty body's (GET, HEAD). Errors never carry the endpoint's
address nor the credentials (they reach logs).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import quote, urlsplit

import aiohttp
from yarl import URL

ALGORITHM = "AWS4-HMAC-SHA256"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
CALL_SEC = 30.0


class BucketError(Exception):
    """A bucket call failed (connection, timeout, or an unexpected status)."""


class ObjectExists(BucketError):
    """A PUT that must not overwrite found an object under its key (412)."""


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def signing_key(secret: str, date: str, region: str, service: str = "s3") -> bytes:
    k = _hmac(("AWS4" + secret).encode(), date)
    k = _hmac(k, region)
    k = _hmac(k, service)
    return _hmac(k, "aws4_request")


def sign(method: str, url: str, headers: dict[str, str], payload_sha256: str, access_key: str, secret_key: str,
         region: str, now: datetime) -> dict[str, str]:
    """``headers`` plus Host, X-Amz-Date, X-Amz-Content-Sha256 and Authorization for this request.

    Every header given is signed (they are few and all ours). ``url``'s path must already be
    percent-encoded the way it goes on the wire: S3 signs the path as sent, encoded once."""
    parts = urlsplit(url)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    date = amz_date[:8]
    out = {**headers, "Host": parts.netloc, "X-Amz-Date": amz_date, "X-Amz-Content-Sha256": payload_sha256}
    canon = sorted((k.lower(), " ".join(v.strip().split())) for k, v in out.items())
    signed = ";".join(k for k, _ in canon)
    query = "&".join(sorted(q for q in parts.query.split("&") if q))
    request = "\n".join([method, parts.path or "/", query, *(f"{k}:{v}" for k, v in canon), "", signed,
                         payload_sha256])
    scope = f"{date}/{region}/s3/aws4_request"
    to_sign = "\n".join([ALGORITHM, amz_date, scope, hashlib.sha256(request.encode()).hexdigest()])
    signature = hmac.new(signing_key(secret_key, date, region), to_sign.encode(), hashlib.sha256).hexdigest()
    out["Authorization"] = f"{ALGORITHM} Credential={access_key}/{scope}, SignedHeaders={signed}, Signature={signature}"
    return out


def meta_quote(value: str) -> str:
    """A metadata value as ASCII (S3 user metadata travels in headers)."""
    return quote(value, safe="")


@dataclass(frozen=True)
class Bucket:
    session: aiohttp.ClientSession
    endpoint: str
    bucket: str
    region: str
    access_key: str
    secret_key: str

    def url(self, key: str) -> str:
        """Sent as it is signed (``encoded=True``): yarl would otherwise unquote ``%28`` and the like."""
        return f"{self.endpoint.rstrip('/')}/{self.bucket}/{quote(key, safe='/-_.~')}"

    def _signed(self, method: str, key: str, headers: dict[str, str], payload_sha256: str) -> dict[str, str]:
        return sign(method, self.url(key), headers, payload_sha256, self.access_key, self.secret_key, self.region,
                    datetime.now(UTC))

    async def put(self, key: str, data: bytes, content_type: str, meta: dict[str, str]) -> None:
        """A new object; one already under ``key`` is never replaced (``If-None-Match: *``)."""
        headers = {"Content-Type": content_type, "If-None-Match": "*",
                   **{f"x-amz-meta-{k}": meta_quote(v) for k, v in meta.items()}}
        headers = self._signed("PUT", key, headers, hashlib.sha256(data).hexdigest())
        try:
            async with self.session.put(URL(self.url(key), encoded=True), data=data, headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=CALL_SEC)) as r:
                if r.status == 412:
                    raise ObjectExists("an object is already under that name")
                if r.status != 200:
                    raise BucketError(f"PUT answered HTTP {r.status}")
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise BucketError(f"PUT failed ({type(e).__name__})") from None

    async def open(self, key: str, method: str = "GET") -> aiohttp.ClientResponse | None:
        """The object's response, to stream and release (None: no such object)."""
        headers = self._signed(method, key, {}, EMPTY_SHA256)
        try:
            r = await self.session.request(method, URL(self.url(key), encoded=True), headers=headers,
                                           timeout=aiohttp.ClientTimeout(total=None, sock_connect=10,
                                                                         sock_read=CALL_SEC))
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise BucketError(f"{method} failed ({type(e).__name__})") from None
        if r.status == 404:
            r.release()
            return None
        if r.status != 200:
            r.release()
            raise BucketError(f"{method} answered HTTP {r.status}")
        return r

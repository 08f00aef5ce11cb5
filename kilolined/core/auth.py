"""API keys: lookup by sha256, constant-time compare, and what a key may do."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from aiohttp import web

from kilolined.core.config import Config, KeyConfig


@dataclass(frozen=True)
class Principal:
    key_id: str
    cfg: KeyConfig

    def may_use(self, route: str) -> bool:
        return "*" in self.cfg.routes or route in self.cfg.routes


def presented_key(request: web.BaseRequest) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.headers.get("X-API-Key") or None


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


class KeyStore:
    def __init__(self, cfg: Config):
        self.by_digest: dict[str, Principal] = {}
        for key_id, k in cfg.keys.items():
            d = k.digest()
            assert d is not None
            self.by_digest[d] = Principal(key_id, k)
        self.admin_digest = cfg.admin.digest()

    def lookup(self, key: str | None) -> Principal | None:
        if not key:
            return None
        d = digest(key)
        p = self.by_digest.get(d)
        # The dict lookup finds the candidate; the compare is constant-time so that timing
        # does not tell an attacker how much of a digest matched.
        if p is not None and hmac.compare_digest(d, p.cfg.digest() or ""):
            return p
        return None

    def is_admin(self, key: str | None) -> bool:
        if not key or not self.admin_digest:
            return False
        return hmac.compare_digest(digest(key), self.admin_digest)


def new_key() -> str:
    """``kl_`` + 32 url-safe characters (192 bits)."""
    return "kl_" + secrets.token_urlsafe(24)

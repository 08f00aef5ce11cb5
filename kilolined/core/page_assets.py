"""The ComfyUI web UI's content-hashed files, held by the gateway: which names they are, what a
client may be sent, and the bounded cache that keeps them (docs/API.md "ComfyUI over several GPUs").

The frontend (comfyui_frontend_package, built by Vite) names every file of its bundle after its
content: ``assets/<name>-<hash>.<ext>``, the hash 8 characters of base64url. A new build is new
names, so a name's bytes never change: the gateway may keep them, answer them itself and let a
browser keep them for a year (nginx's ``expires max`` on a hashed-asset location, as Vite's own
deployment guide sets it). ComfyUI sends ``Cache-Control: no-store`` on every ``.js``/``.css``
(middleware/cache_middleware.py) because it also serves files whose names do NOT change with their
content — the extensions' scripts under ``/extensions/``, ``user.css`` —; those pass through as
ComfyUI sends them.

Pure: no I/O, no clock. The I/O (asking a node, gzip in a thread) is kilolined/edge/page_assets.py.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import hashlib
import re
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

#: What the real frontend (1.42, ComfyUI 0.19.3) ships under ``assets/`` with a hashed name, and a
#: browser asks for: scripts, styles, source maps, its web manifest, images and fonts. Not its
#: ``.eot`` (no current browser asks) nor its ``.mp4`` (asked for by range, 6.7 MB).
EXTENSIONS = ("js", "css", "js.map", "css.map", "json", "svg", "png", "woff2", "woff", "ttf")
#: Worth gzip: text, and the one font format that is not compressed already.
COMPRESSIBLE = frozenset({"js", "css", "js.map", "css.map", "json", "svg", "ttf"})
# ``<name>-<hash>.<ext>``; a Vite hash is base64url, and one with no capital and no digit is
# taken for a word (``sorted-custom-node-map.json`` ships too, and its content may change).
_HASHED = re.compile(r"(?s).+-(?=[A-Za-z0-9_-]*[A-Z0-9])[A-Za-z0-9_-]{8}\.(" +
                     "|".join(re.escape(e) for e in EXTENSIONS) + r")")
ASSETS_DIR = "/assets/"
#: Held by one gateway for all its routes: the real frontend's files that one page load asks for
#: are ~11 MB, about 3 MB once gzipped (both kept), so two frontend versions fit.
MAX_BYTES = 64 * 1024 * 1024
GZIP_LEVEL = 6  # nginx's gzip_comp_level is 1; 6 is gzip's own default, once per file
#: Sent with every held file: its name changes when its content does (see the module's docstring).
IMMUTABLE = "public, max-age=31536000, immutable"

Key = tuple[str, str]  # (route, path on the node)


def hashed_asset(path: str) -> str | None:
    """The extension of a page file with a content-hashed name (``/assets/<name>-<hash>.<ext>``,
    straight under ``assets/``), else None."""
    if not path.startswith(ASSETS_DIR):
        return None
    name = path[len(ASSETS_DIR):]
    if "/" in name:
        return None
    m = _HASHED.fullmatch(name)
    return m.group(1) if m else None


def accepts_gzip(accept_encoding: str | None) -> bool:
    """Does an ``Accept-Encoding`` allow gzip (RFC 9110 §12.5.3)? ``gzip`` (or ``x-gzip``) listed
    with a q above 0, or ``*`` above 0 with gzip not listed; no header: identity (as nginx)."""
    if not accept_encoding:
        return False
    star: bool | None = None
    for item in accept_encoding.split(","):
        coding, _, params = item.partition(";")
        coding = coding.strip().lower()
        q = 1.0
        for p in params.split(";"):
            k, _, v = p.partition("=")
            if k.strip().lower() == "q":
                try:
                    q = float(v.strip())
                except ValueError:
                    q = 0.0
        if coding in ("gzip", "x-gzip"):
            return q > 0
        if coding == "*":
            star = q > 0
    return bool(star)


@dataclass(frozen=True, slots=True)
class PageAsset:
    """One file as it is sent: its type, its bytes, and its gzip (None when not smaller)."""

    content_type: str
    identity: bytes
    gzipped: bytes | None
    etag: str  # quoted, strong: of the identity bytes

    @property
    def size(self) -> int:
        return len(self.identity) + (len(self.gzipped) if self.gzipped is not None else 0)

    def gzip_etag(self) -> str:
        """The gzip representation's own strong tag (another representation, another tag: RFC
        9110 §8.8.3), as Apache's mod_deflate marks it."""
        return self.etag[:-1] + '-gzip"'

    def matches(self, if_none_match: str | None) -> bool:
        """``If-None-Match`` names either representation (both are of the same bytes), or ``*``."""
        if not if_none_match:
            return False
        tags = {t.strip().removeprefix("W/") for t in if_none_match.split(",")}
        return "*" in tags or self.etag in tags or self.gzip_etag() in tags


def make_asset(body: bytes, content_type: str, ext: str) -> PageAsset:
    """The held form of a node's file: its sha256 tag and, for text, its gzip when smaller.
    CPU work (a 5 MB script: ~0.1 s): called in a thread."""
    digest = hashlib.sha256(body).digest()
    etag = '"sha256-' + base64.urlsafe_b64encode(digest).decode().rstrip("=") + '"'
    packed = None
    if ext in COMPRESSIBLE:
        packed = gzip.compress(body, GZIP_LEVEL, mtime=0)
        if len(packed) >= len(body):
            packed = None
    return PageAsset(content_type, body, packed, etag)


@dataclass
class PageAssets:
    """The gateway's held page files, least recently used dropped first, ``max_bytes`` never
    exceeded (identity and gzip both count); and the fetches under way, one per file."""

    max_bytes: int = MAX_BYTES
    held: OrderedDict[Key, PageAsset] = field(default_factory=OrderedDict)
    bytes: int = 0
    #: a file being fetched: who asks for it meanwhile waits for that one fetch (None: not kept)
    filling: dict[Key, asyncio.Future[PageAsset | None]] = field(default_factory=dict)

    def get(self, key: Key) -> PageAsset | None:
        got = self.held.get(key)
        if got is not None:
            self.held.move_to_end(key)
        return got

    def fits(self, size: int) -> bool:
        return size <= self.max_bytes

    def put(self, key: Key, asset: PageAsset) -> bool:
        """Hold it (dropping the least recently used until it fits); False for one over the bound."""
        if not self.fits(asset.size):
            return False
        old = self.held.pop(key, None)
        if old is not None:
            self.bytes -= old.size
        while self.held and self.bytes + asset.size > self.max_bytes:
            _, dropped = self.held.popitem(last=False)
            self.bytes -= dropped.size
        self.held[key] = asset
        self.bytes += asset.size
        return True

    def by_route(self) -> Iterator[tuple[str, int, int]]:
        """(route, files, bytes) of every route with held files."""
        totals: dict[str, list[int]] = {}
        for (route, _), a in self.held.items():
            t = totals.setdefault(route, [0, 0])
            t[0] += 1
            t[1] += a.size
        for route, (files, size) in totals.items():
            yield route, files, size

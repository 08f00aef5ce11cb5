"""A node's absolute URLs to itself in its answer's headers, pointed back through the route.

A node names its own address in ``Location`` (a redirect), ``Content-Location`` and ``Link``
(pagination, preload hints). Relayed as sent, they would hand the client the GPU's address,
which it cannot reach and must not learn. As nginx's ``proxy_redirect default`` does for
``Location``, a URL that starts with the node's URL (its scheme, host, port and base path) is
rewritten to the same resource under the route's path. A root-relative URL (``/x``) means the
node's own origin too, which the client knows only as the route: it gets the route's prefix
(wire/redirects.py). ``for_client`` is the one rewrite each URL gets; any other URL passes as
sent. Bodies are not rewritten (docs/API.md "Forwarding").
"""

from __future__ import annotations

import functools
import re

from kilolined.wire.redirects import keep_prefix

_DEFAULT_PORT = {"http": "80", "https": "443"}
_LINK_TARGET = re.compile(r"<([^>]*)>")  # RFC 8288: each link's target between angle brackets


@functools.lru_cache(maxsize=1024)
def _prefixes(node_url: str) -> tuple[str, ...]:
    """How the node's own absolute URLs begin, lower-cased: its configured URL without userinfo
    and trailing slash, with the scheme's default port both spelled and left out."""
    scheme, _, rest = node_url.partition("://")
    authority, slash, path = rest.partition("/")
    hostport = authority.rsplit("@", 1)[-1].lower()
    base = (slash + path).rstrip("/")
    scheme = scheme.lower()
    default = _DEFAULT_PORT.get(scheme)
    hosts = [hostport]
    if default is not None:
        if hostport.endswith(":" + default):
            hosts.append(hostport[: -len(default) - 1])
        elif ":" not in hostport.rpartition("]")[2]:  # no port (an IPv6 host's colons are in brackets)
            hosts.append(f"{hostport}:{default}")
    return tuple(f"{scheme}://{h}{base}" for h in hosts)


def to_route(url: str, node_url: str, route_path: str) -> str:
    """``url`` through the route when it points at the node (``http://node:8000/x?y`` →
    ``/gen/x?y``); any other URL as it is."""
    for p in _prefixes(node_url):
        n = len(p)
        if url[:n].lower() == p and (len(url) == n or url[n] in "/?#"):
            rest = url[n:]
            return route_path.rstrip("/") + (rest if rest[:1] == "/" else "/" + rest)
    return url


def _origin(node_url: str) -> str:
    """``scheme://host:port`` of the node's URL (no userinfo, no base path)."""
    scheme, _, rest = node_url.partition("://")
    return f"{scheme}://{rest.partition('/')[0].rsplit('@', 1)[-1]}"


def for_client(url: str, node_url: str, route_path: str) -> str:
    """A URL of the node's ``Location``, ``Content-Location`` or a ``Link`` target as the client
    must see it, rewritten once: the node's own absolute URL through the route (``to_route``); a
    root-relative path under the node's base path the same way, any other one under the route's
    prefix (``keep_prefix``); anything else as sent."""
    if not url.startswith("/") or url.startswith("//"):
        return to_route(url, node_url, route_path)
    absolute = _origin(node_url) + url
    routed = to_route(absolute, node_url, route_path)
    return routed if routed is not absolute else keep_prefix(url, route_path)


def links_to_route(value: str, node_url: str, route_path: str) -> str:
    """A ``Link`` header with every target rewritten by ``for_client``."""
    if "<" not in value:
        return value
    return _LINK_TARGET.sub(lambda m: f"<{for_client(m.group(1), node_url, route_path)}>", value)

"""The ComfyUI web UI under a route prefix: what a browser asks that is not yet under the route.

- ``{path}`` without its slash: the page's relative URLs (``./assets/…``, ``api/…``) would
  resolve against the parent, so it is redirected to ``{path}/`` (nginx does the same for a
  ``location`` that ends in a slash).
- Root-absolute URLs that the frontend's scripts and styles hold (``/assets/images/….svg``,
  ``url(/assets/…)``) reach the gateway without the prefix. A GET that matches no route, asked by
  a page (``Referer``) of this host under a ``comfyui`` route, is that route's: the page's own
  file, as the node would have served it at its root.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

from aiohttp import web

from kilolined.core.config import RouteConfig
from kilolined.scheduling.routing import Router

PAGE_METHODS = frozenset({"GET", "HEAD"})


def slash_redirect(rcfg: RouteConfig, request: web.BaseRequest) -> web.Response | None:
    """301 ``{path}`` → ``{path}/`` (query kept) for a page request on a comfyui route."""
    if rcfg.kind != "comfyui" or request.method not in PAGE_METHODS or rcfg.path == "/":
        return None
    if request.rel_url.raw_path != rcfg.path:
        return None
    qs = request.rel_url.raw_query_string
    return web.Response(status=301, headers={"Location": rcfg.path + "/" + ("?" + qs if qs else "")})


def referred_route(router: Router, routes: Mapping[str, RouteConfig],
                   request: web.BaseRequest) -> tuple[tuple[str, ...], str] | None:
    """(the comfyui route, the path the node gets) for a root-absolute page file, else None."""
    if request.method not in PAGE_METHODS:
        return None
    referer = request.headers.get("Referer")
    if not referer:
        return None
    try:
        parts = urlsplit(referer)
    except ValueError:
        return None
    if parts.netloc and parts.netloc.lower() != request.host.lower():
        return None  # another site's page: nothing of ours
    found = router.match(parts.path or "/")
    if found is None or routes[found[0][0]].kind != "comfyui" or routes[found[0][0]].path == "/":
        return None
    return found[0], request.rel_url.raw_path

"""A node's redirect seen through the gateway: where ``Location`` must point for the client.

A node behind a route prefix knows nothing of the prefix: its root-relative ``Location: /x``
means ``{prefix}/x`` to a client, as nginx's ``proxy_redirect`` puts the location's prefix back.
"""

from __future__ import annotations


def keep_prefix(location: str, prefix: str) -> str:
    """``location`` with the route's ``prefix`` in front when it is a root-relative path.

    ``//host/x`` (another host), relative paths and absolute URLs are left alone. ``prefix`` is
    ``/`` for a route that forwards the whole path (``strip_path: false``): nothing to put back.
    """
    if not location.startswith("/") or location.startswith("//"):
        return location
    return prefix.rstrip("/") + location

"""The raw-path check every request passes before routing (docs/SECURITY.md, "Paths").

A node, or a proxy in front of it (nginx, Caddy, Cloudflare), normalises ``/a/../b`` to ``/b``
and may decode ``%2e%2e`` and ``%2f`` first. A path that holds a dot part could then escape the
route prefix, a node URL's base path, or an ``unqueued_paths`` glob (``/history/../prompt``). So
any such path is refused outright instead of being normalised here: the gateway's view of a path
and every node's view of it can then never differ. An encoded slash that hides no dot part
(``org%2Fmodel``, a Hugging Face model id) is data and stays as sent.

Pure functions, no I/O.
"""

from __future__ import annotations

import re
from urllib.parse import unquote_to_bytes

_SCHEME_AUTHORITY = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*")
_DOT_PARTS = (b".", b"..")


def path_of_target(target: str) -> str:
    """The path of a request-target as sent: the query and fragment cut, an absolute form's
    ``scheme://authority`` dropped (``GET http://host/a/../b HTTP/1.1`` is checked as ``/a/../b``)."""
    m = _SCHEME_AUTHORITY.match(target)
    if m is not None:
        target = target[m.end():]
    for sep in ("?", "#"):
        cut = target.find(sep)
        if cut >= 0:
            target = target[:cut]
    return target


def path_problem(raw_path: str) -> str | None:
    """Why this raw path is refused, or None when it may be routed.

    Each ``/``-separated segment is percent-decoded once and split again on ``/`` and ``\\``
    (the separators a decoding node or a Windows host would see); a part that is ``.`` or ``..``
    is refused, and so is a NUL byte, raw or ``%00``.
    """
    if "\x00" in raw_path:
        return "the path holds a NUL byte"
    if "." not in raw_path and "%" not in raw_path:
        return None  # nothing that could decode to a dot part or a NUL: most paths stop here
    for segment in raw_path.split("/"):
        if not segment:
            continue
        decoded = unquote_to_bytes(segment) if "%" in segment else segment.encode("utf-8", "surrogateescape")
        if b"\x00" in decoded:
            return "the path holds a NUL byte"
        if b"." not in decoded:
            continue  # the common case: no dot, no dot part
        for part in decoded.replace(b"\\", b"/").split(b"/"):
            if part in _DOT_PARTS:
                return "the path holds a '.' or '..' segment"
    return None

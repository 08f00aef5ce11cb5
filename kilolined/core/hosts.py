"""Host names as the gateway checks them before it connects where a client says: the
``X-Target-Host`` of ``/v1/proxy`` (edge/targets.py) and the input URLs a ComfyUI route may
fetch (``comfy.fetch_inputs``, comfy_inputs.py). A target is allowed only when a glob of the
operator's allows its canonical form; nothing is resolved here."""

from __future__ import annotations

import fnmatch
import ipaddress
import re
from collections.abc import Iterable

# scheme://host[:port]: a name or IPv4 address, or an IPv6 literal in brackets (RFC 3986 §3.2.2)
_TARGET = re.compile(r"(https?)://(?:([A-Za-z0-9.\-]+)|\[([0-9A-Fa-f:.]+)\])(?::([0-9]{1,5}))?")
_V6_GLOB = re.compile(r"\[[^\]]*:[^\]]*\]")  # a bracket group with a ":" in an adhoc_targets glob


def parse_target(raw: str) -> str | None:
    """The canonical ``scheme://host[:port]`` of an ``X-Target-Host`` value, or None if malformed.

    An IPv6 literal is written in its compressed form (``[0:0::1]`` → ``[::1]``), so that a glob
    naming an address matches however the client spells it; zone ids (``%eth0``) are refused."""
    m = _TARGET.fullmatch(raw.strip().rstrip("/"))
    if m is None:
        return None
    scheme, name, v6, port = m.groups()
    if port is not None and not 0 < int(port) < 65536:
        return None
    if v6 is not None:
        try:
            host = f"[{ipaddress.IPv6Address(v6).compressed}]"
        except ValueError:
            return None
    else:
        host = name
    return f"{scheme}://{host}" + (f":{port}" if port is not None else "")


def target_allowed(patterns: Iterable[str], target: str) -> bool:
    """A key's ``adhoc_targets`` glob matches the target.

    In a glob ``[...]`` is a character class, so ``http://[::1]:*`` would never match the IPv6
    literal it plainly names (and would let ``http://1:80`` through). A bracket group holding a
    ``:`` is an IPv6 literal, never a class: in such a pattern brackets are matched as written."""
    return any(fnmatch.fnmatchcase(target, p.replace("[", "[[]") if _V6_GLOB.search(p) else p) for p in patterns)

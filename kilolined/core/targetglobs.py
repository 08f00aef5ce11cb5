"""Which ``keys.<id>.adhoc_targets`` globs let a key reach the gateway's own machine or its private
network through ``/v1/proxy`` (``kilolined check`` warns about them; docs/SECURITY.md).

A glob is matched against ``scheme://host[:port]``. Its host part is tried with its wildcards
filled in a few ways (empty, a digit, a whole private address…): if one filling is a loopback,
private, link-local (the cloud metadata address 169.254.169.254) or unspecified address, or the
name ``localhost``, the key can reach what listens there (a database, the admin socket's
neighbours, another daemon's HTTP port). A warning, not an error: a LAN of GPUs is a private
network by design (``http://10.0.0.*:8188``). Host names are not resolved.
"""

from __future__ import annotations

import ipaddress
import itertools
import re

# What a wildcard may stand for, enough to reach each kind of address from the globs people write
# (``*``, ``127.0.0.*``, ``10.*``, ``192.168.1.?``, ``[fd00::*]``, ``*.localhost``).
_FILLS = ("", "0", "1", "10", "0.0.1", "127.0.0.1", "10.0.0.1", "172.16.0.1", "192.168.0.1",
          "169.254.169.254", "0.0.0.0", "::1", "fd00::1", "fe80::1")
_ONE = ("0", "1", "2", "7", "8", "9")  # what ``?`` (one character) may stand for
_MAX_WILDCARDS = 3  # fillings tried: len(_FILLS) ** 3 at most (a longer glob: the first 3 vary)
# Loopback, "this host" (0.0.0.0 reaches the machine itself), RFC 1918 and unique-local, shared
# (CGNAT, VPN overlays), link-local (cloud metadata). Named, not Python's is_private, which also
# counts the documentation ranges (203.0.113.0/24, 2001:db8::/32) that examples use for GPUs.
_LOCAL = tuple(ipaddress.ip_network(n) for n in (
    "127.0.0.0/8", "0.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
    "169.254.0.0/16", "::1/128", "::/128", "fc00::/7", "fe80::/10"))
_CLASS = re.compile(r"\[!?([^\]]+)\]")


def host_glob(glob: str) -> str:
    """The host part of an ``adhoc_targets`` glob (``http://10.0.0.*:8188`` → ``10.0.0.*``)."""
    rest = glob.partition("://")[2] if "://" in glob else glob
    if rest.startswith("["):
        return rest[1:rest.index("]")] if "]" in rest else rest[1:]
    host, sep, port = rest.rpartition(":")
    if sep and re.fullmatch(r"[0-9*?\[\]!-]*", port):
        return host
    return rest


def _fillings(host: str) -> list[str]:
    host = _CLASS.sub(lambda m: m.group(1)[0], host)  # a character class: its first character
    parts = re.split(r"([*?])", host)
    wild = [i for i, p in enumerate(parts) if p in ("*", "?")]
    options = [_FILLS if parts[i] == "*" else _ONE for i in wild[:_MAX_WILDCARDS]]
    out = []
    for choice in itertools.product(*options):
        filled = list(parts)
        for n, i in enumerate(wild):
            filled[i] = choice[n] if n < len(choice) else "1"
        out.append("".join(filled))
    return out


def _local(host: str) -> bool:
    name = host.strip("[]").lower().rstrip(".")
    if name == "localhost" or (name.endswith(".localhost") and not name.startswith(".")):
        return True
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in net for net in _LOCAL if net.version == ip.version)


def local_host_reached(glob: str) -> str | None:
    """A loopback/private host the glob lets through (the first found), or None."""
    return next((h for h in _fillings(host_glob(glob)) if _local(h)), None)


def adhoc_warnings(globs_by_key: dict[str, list[str]]) -> list[str]:
    """``check``'s warning lines for the keys' ad-hoc globs that reach local addresses."""
    out = []
    for key, globs in globs_by_key.items():
        for i, glob in enumerate(globs):
            host = local_host_reached(glob)
            if host is not None:
                out.append(f"warning: keys.{key}.adhoc_targets.{i}: {glob!r} lets this key reach {host} through "
                           f"/v1/proxy (loopback or private network: local services, cloud metadata); name the "
                           f"GPU hosts themselves")
    return out

"""``kilolined status``: /admin/state as readable tables (routes, nodes, and cards when there are)."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kilolined.core.config import ConfigError, ServerConfig, expand_env, split_listen


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def ramp_text(node: dict[str, Any]) -> str:
    """'ramping 1→2, full in 12s' while slow start holds a recovered node below its slots."""
    if not node.get("ramping"):
        return "-"
    left = node.get("full_in_sec")
    tail = "" if left is None else f", full in {math.ceil(left)}s"
    return f"ramping {node.get('slots', 0)}→{node.get('full_slots', 0)}{tail}"


def render(state: dict[str, Any]) -> str:
    routes = []
    for name, r in sorted(state.get("routes", {}).items()):
        est = r.get("est_wait_sec")
        routes.append([
            name, r.get("path", ""), r.get("kind", ""), r.get("mode", ""), str(r.get("queue_depth", 0)),
            f"{r.get('inflight', 0)}/{r.get('slots', 0)}", "-" if est is None else f"{est:g}s",
            ",".join(r.get("active_nodes", [])) or "-",
        ])
    nodes = []
    for name, n in sorted(state.get("nodes", {}).items()):
        lat = n.get("last_check_ms")
        nodes.append([
            name, n.get("label", ""), n.get("health", ""), n.get("breaker", ""),
            "yes" if n.get("drained") else "no", f"{n.get('inflight', 0)}/{n.get('slots', 0)}",
            ramp_text(n), "-" if lat is None else f"{lat:.0f}ms", (n.get("last_error") or "")[:40],
        ])
    cards = [[name, ",".join(c.get("nodes", [])) or "-",
              f"{c.get('inflight', 0)}/{'-' if c.get('max_concurrency') is None else c['max_concurrency']}",
              "-" if c.get("capacity") is None else f"{c.get('capacity_used', 0):g}/{c['capacity']:g}"]
             for name, c in sorted(state.get("cards", {}).items())]
    cfg = state.get("config", {})
    head = f"config {str(cfg.get('version', ''))[:12]}  uptime {state.get('uptime_sec', 0):.0f}s"
    if cfg.get("last_error"):
        head += "  LAST RELOAD FAILED: " + "; ".join(cfg["last_error"])[:200]
    parts = [
        head,
        table(["ROUTE", "PATH", "KIND", "MODE", "QUEUED", "INFLIGHT", "EST WAIT", "ACTIVE"], routes),
        table(["NODE", "LABEL", "HEALTH", "BREAKER", "DRAINED", "INFLIGHT", "SLOW START", "CHECK", "LAST ERROR"],
              nodes),
        *([table(["CARD", "NODES", "INFLIGHT", "CAPACITY"], cards)] if cards else []),
    ]
    lost = (state.get("cluster") or {}).get("lost") or []
    if lost:
        parts.append(lost_table(lost))
    return "\n\n".join(parts)


def lost_table(lost: list[dict[str, Any]]) -> str:
    """Cluster mode: the gateways whose heartbeat lapsed, and the share Redis keeps reserved for them."""
    rows = []
    for g in lost:
        res = g.get("reserved") or {}
        held = [f"{r} {n}/node" for r, n in sorted((res.get("routes") or {}).items())]
        held += [f"node {n} {k}" for n, k in sorted((res.get("nodes") or {}).items())]
        rows.append([str(g.get("id", "")), f"{g.get('lost_sec', 0):.0f}s", ", ".join(held) or "-"])
    return (table(["LOST GATEWAY", "SINCE", "RESERVED"], rows)
            + "\nGone for good? POST /admin/cluster/forget/<gateway> frees its reserved share.")


def url_for_listen(listen: str, tls: bool) -> str:
    """Where a local client reaches a daemon listening on ``listen``: a wildcard address is
    asked on loopback (as `nginx -s` talks to its own master, not to the world)."""
    host, port = split_listen(listen)
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}"


def listen_of(text: str, env: dict[str, str]) -> tuple[str, bool]:
    """``server.listen`` (its ${VAR} expanded, the default when absent) and whether TLS is on.
    Only these are read: `status` needs no key material from the environment."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError([f"(yaml): {getattr(e, 'problem', None) or e}"])
    server = raw.get("server") if isinstance(raw, dict) else None
    server = server if isinstance(server, dict) else {}
    errors: list[str] = []
    listen = expand_env(server.get("listen", ServerConfig().listen), env, "server.listen", errors)
    if not isinstance(listen, str):
        errors.append("server.listen: expected host:port")
    if errors:
        raise ConfigError(errors)
    try:
        split_listen(listen)
    except ValueError as e:
        raise ConfigError([f"server.listen: {e}"])
    return listen, bool(server.get("tls"))


def config_url(path: str, required: bool) -> str | None:
    """The daemon's URL from the config at ``path``; None when the file is absent and was not
    asked for by name (the built-in default then applies)."""
    try:
        text = Path(path).read_bytes().decode("utf-8", "replace")
    except FileNotFoundError:
        if not required:
            return None
        raise ConfigError([f"{path}: cannot read: no such file"])
    except OSError as e:
        raise ConfigError([f"{path}: cannot read: {e.strerror or e}"])
    try:
        listen, tls = listen_of(text, dict(os.environ))
    except ConfigError as e:
        raise ConfigError([f"{path}: {line}" for line in e.errors])
    return url_for_listen(listen, tls)


async def run_status(url: str, admin_key: str | None) -> int:
    key = admin_key or os.environ.get("KILOLINE_ADMIN_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        async with aiohttp.ClientSession() as s, s.get(url.rstrip("/") + "/admin/state", headers=headers,
                                                       timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status == 401:
                print("kilolined status: admin key refused (use --admin-key or $KILOLINE_ADMIN_KEY)", file=sys.stderr)
                return 1
            if r.status != 200:
                print(f"kilolined status: {url} answered HTTP {r.status}", file=sys.stderr)
                return 1
            state = await r.json()
    except (aiohttp.ClientError, TimeoutError) as e:
        print(f"kilolined status: cannot reach {url}: {type(e).__name__}", file=sys.stderr)
        return 1
    print(render(state))
    return 0

"""Which route takes a request: the longest path prefix, then — among routes sharing that path —
the first whose ``match`` holds (docs/CONFIG.md#routes-that-match-the-request).

Pure: the Router is built from the config; ``choose`` looks only at what it is given (method,
headers, the body's model, the request's units under each route's cost unit).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from kilolined.core.config import MatchConfig, RouteConfig


class Router:
    """Longest path prefix on a segment boundary wins: /comfy matches /comfy and /comfy/x, not /comfyx.

    Routes on one path are candidates in file order, the one without ``match`` (the fallback) last."""

    def __init__(self, routes: Mapping[str, RouteConfig]):
        groups: dict[str, list[str]] = {}
        for name, r in routes.items():
            groups.setdefault(r.path, []).append(name)
        for names in groups.values():
            names.sort(key=lambda n: routes[n].match is None)  # stable: file order, fallback last
        self._by_len = sorted(((p, tuple(ns)) for p, ns in groups.items()), key=lambda kv: -len(kv[0]))
        # strip_path: false (an openai route at .../v1 by default): the node gets the whole path.
        self._keep = frozenset(p for p, ns in groups.items() if not routes[ns[0]].strips_path)

    def match(self, path: str) -> tuple[tuple[str, ...], str] | None:
        """The routes of the longest matching prefix (candidates, in order), and the path the node
        gets: the rest after the prefix, or the whole path when the route keeps it."""
        for prefix, names in self._by_len:
            if prefix == "/":
                return names, path
            if path == prefix or path.startswith(prefix + "/"):
                return names, path if prefix in self._keep else (path[len(prefix):] or "/")
        return None


def body_model(body: bytes) -> str | None:
    """The JSON body's ``model`` when it is a string; None otherwise (no body, not JSON, absent)."""
    if not body:
        return None
    try:
        doc: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    model = doc.get("model") if isinstance(doc, dict) else None
    return model if isinstance(model, str) else None


def _glob_any(value: str, globs: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(value, g) for g in globs)


def head_holds(m: MatchConfig | None, method: str, headers: Mapping[str, str]) -> bool:
    """The conditions that need no body: ``method`` and ``header``."""
    if m is None:
        return True
    if m.method is not None and method.upper() not in m.method:
        return False
    if m.header is not None:
        for name, glob in m.header.items():
            value = headers.get(name)
            if value is None or not fnmatch.fnmatchcase(value, glob):
                return False
    return True


def holds(m: MatchConfig | None, method: str, headers: Mapping[str, str], model: str | None,
          units: Callable[[], float]) -> bool:
    """Every condition given; ``units`` is called only when a bound needs it (it may raise)."""
    if m is None:
        return True
    if not head_holds(m, method, headers):
        return False
    if m.model is not None and (model is None or not _glob_any(model, m.model)):
        return False
    if m.min_units is not None or m.max_units is not None:
        u = units()
        if m.min_units is not None and u < m.min_units:
            return False
        if m.max_units is not None and u > m.max_units:
            return False
    return True


def _only_model(m: MatchConfig | None) -> bool:
    """The match depends on nothing but the model: it takes every request whose model it allows."""
    return m is None or (m.min_units is None and m.max_units is None and m.header is None and m.method is None)


def may_ask(model: str, routes: Sequence[tuple[MatchConfig | None, frozenset[str]]]) -> bool:
    """Whether a client may ask for ``model`` on a path several routes share: some route a request
    naming it can reach (in the routes' order: fallback last) has a node serving it. ``routes``:
    each route's ``match`` and the models its nodes serve. A route whose match depends only on the
    model takes every such request, so the routes after it are never reached (what
    ``/v1/models`` lists is what a client may ask for)."""
    for m, served in routes:
        if m is not None and m.model is not None and not _glob_any(model, m.model):
            continue
        if model in served:
            return True
        if _only_model(m):
            return False
    return False


def routes_serving_elsewhere(model: str, chosen: str,
                             listed: Mapping[str, Sequence[Sequence[str] | None]]) -> list[str]:
    """The routes of the path other than ``chosen`` with a node that lists ``model``, when no node of
    ``chosen`` lists it (``listed``: each route's nodes' model lists, None for a node declaring
    none). Non-empty: the request matched a route whose nodes are not known to serve a model the
    operator placed on another route's node; it is refused (404 ``model_not_found``), never sent
    to a node that would answer with whatever model it holds (docs/CONFIG.md#routes-that-match-the-request)."""
    if any(lst is not None and model in lst for lst in listed.get(chosen, ())):
        return []
    return [r for r, lists in listed.items()
            if r != chosen and any(lst is not None and model in lst for lst in lists)]


def describe(m: MatchConfig) -> str:
    """A match in words, for the 404 that says what did not match."""
    parts = []
    if m.min_units is not None:
        parts.append(f"units ≥ {m.min_units:g}")
    if m.max_units is not None:
        parts.append(f"units ≤ {m.max_units:g}")
    if m.model is not None:
        parts.append("model " + "|".join(m.model))
    if m.header is not None:
        parts += [f"header {k}: {v}" for k, v in m.header.items()]
    if m.method is not None:
        parts.append("method " + "|".join(m.method))
    return ", ".join(parts) or "anything"

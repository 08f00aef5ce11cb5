"""What one request costs on a node's ``capacity`` (docs/CONFIG.md, "Cost and capacity").

Pure functions of the request's method, path, headers and body: no I/O, no clock. The gateway
computes a request's cost once, before it queues; the scheduler only adds and subtracts it.

A request's cost is ``base + per_unit × units``. ``units`` is read by the route's ``unit``:
``megapixels`` (ComfyUI latents), ``tokens`` (an OpenAI prompt estimate plus what it may
generate), ``json:/pointer`` (a number in the body) or ``header:Name`` (a number in a header).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import orjson

from kilolined.config import RequestCostConfig

# Requests that do GPU work and whose body the kind's units describe; the rest through the same
# route (uploads, interrupts, queue edits) carry no units and cost ``base``.
PROMPT_PATHS = ("/prompt", "/api/prompt")
COMPLETION_SUFFIXES = ("/chat/completions", "/completions")
CHARS_PER_TOKEN = 4


class UnitError(ValueError):
    """The unit cannot be read from this request (answered 400 bad_request)."""


def request_cost(cfg: RequestCostConfig | None, kind: str, method: str, path: str, body: bytes,
                 headers: Mapping[str, str]) -> float:
    """The cost of one request on its route (0 without ``cost``); raises UnitError."""
    if cfg is None:
        return 0.0
    u = request_units(cfg, kind, method, path, body, headers)
    return cfg.base + cfg.per_unit * u


def request_units(cfg: RequestCostConfig, kind: str, method: str, path: str, body: bytes,
                  headers: Mapping[str, str]) -> float:
    """``units`` of a request under ``cfg.unit`` (0 when the route has no unit)."""
    unit = cfg.unit
    if unit is None:
        return 0.0
    if unit.startswith("header:"):
        return header_number(headers, unit[len("header:"):])
    path = path.split("?", 1)[0]
    if unit == "megapixels":
        if method != "POST" or path not in PROMPT_PATHS:
            return 0.0
        doc = json_body(body)
        graph = doc.get("prompt", doc) if isinstance(doc, dict) else None
        return megapixels(graph)
    if unit == "tokens":
        if method != "POST" or not path.endswith(COMPLETION_SUFFIXES):
            return 0.0
        return float(token_estimate(json_body(body), cfg.default_max_tokens))
    assert unit.startswith("json:"), unit
    if not body:
        return 0.0  # a GET through the route has no body to hold the number
    return json_number(json_body(body), unit[len("json:"):])


def json_body(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        raise UnitError("body is not JSON, and the route's cost unit is read from it") from None


def _number(v: Any, where: str) -> float:
    """A non-negative finite number, else UnitError (a bool is not a number here)."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise UnitError(f"{where} must be a non-negative number")
    return float(v)


def header_number(headers: Mapping[str, str], name: str) -> float:
    raw = headers.get(name)
    if raw is None:
        return 0.0
    try:
        v = float(raw.strip())
    except ValueError:
        raise UnitError(f"header {name} must be a non-negative number") from None
    return _number(v, f"header {name}")


def json_pointer(doc: Any, pointer: str) -> tuple[bool, Any]:
    """RFC 6901: (found, value)."""
    if pointer == "":
        return True, doc
    cur = doc
    for token in pointer[1:].split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(cur, dict):
            if token not in cur:
                return False, None
            cur = cur[token]
        elif isinstance(cur, list):
            if not token.isdigit() or (token != "0" and token.startswith("0")) or int(token) >= len(cur):
                return False, None
            cur = cur[int(token)]
        else:
            return False, None
    return True, cur


def json_number(doc: Any, pointer: str) -> float:
    found, v = json_pointer(doc, pointer)
    return _number(v, f"the body's {pointer}") if found else 0.0


def _plain_number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)


def megapixels(graph: Any) -> float:
    """Σ width × height × batch_size / 10⁶ over the nodes with numeric ``width`` and ``height``.

    A linked input (``["4", 0]``) is not a number: a linked size skips the node, a linked or
    missing batch_size counts 1.
    """
    if not isinstance(graph, dict):
        return 0.0
    total = 0.0
    for node in graph.values():
        inputs = node.get("inputs") if isinstance(node, dict) else None
        if not isinstance(inputs, dict):
            continue
        w, h, b = inputs.get("width"), inputs.get("height"), inputs.get("batch_size", 1)
        if not (_plain_number(w) and _plain_number(h)) or w < 0 or h < 0:
            continue
        total += w * h * (b if _plain_number(b) and b >= 0 else 1)
    return total / 1e6


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def token_estimate(doc: Any, default_max_tokens: int) -> int:
    """Prompt characters ÷ 4 (rounded up once, on the total) plus what the request may generate."""
    if not isinstance(doc, dict):
        raise UnitError("body must be a JSON object")
    chars = 0
    messages = doc.get("messages")
    if isinstance(messages, list):
        chars += sum(_text_chars(m.get("content")) for m in messages if isinstance(m, dict))
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    elif isinstance(prompt, list):
        chars += sum(len(p) for p in prompt if isinstance(p, str))
    gen = doc.get("max_tokens")
    if gen is None:
        gen = doc.get("max_completion_tokens")
    gen = default_max_tokens if gen is None else _number(gen, "max_tokens")
    return math.ceil(chars / CHARS_PER_TOKEN) + math.ceil(gen)

"""What one request costs on a node's ``capacity`` (docs/CONFIG.md, "Cost and capacity").

Pure functions of the request's method, path, headers and body: no I/O, no clock. The gateway
computes a request's cost once, before it queues; the scheduler only adds and subtracts it.

A request's cost is ``base + per_unit × units``. ``units`` is read by the route's ``unit``:
``megapixels`` (ComfyUI latents and images), ``tokens`` (an OpenAI prompt estimate plus what it
may generate), ``json:/pointer`` (a number in the body), ``json_chars:/pointer`` (the characters of
a string in the body: a TTS request's ``input``) or ``header:Name`` (a number in a header).

A cost is always a finite number ≥ 0, or refused: ``UnitError`` when the request is malformed
(400), ``CostTooLarge`` when it is well formed but asks for more than any GPU could hold (422).
So a request can never hold a queue place with a cost no node will ever fit (NaN, ∞).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import orjson

from kilolined.core.config import RequestCostConfig
from kilolined.core.templates import is_images
from kilolined.scheduling.anthropic_body import chat_view, is_messages_path

# Requests that do GPU work and whose body the kind's units describe; the rest through the same
# route (uploads, interrupts, queue edits) carry no units and cost ``base``.
PROMPT_PATHS = ("/prompt", "/api/prompt")
COMPLETION_SUFFIXES = ("/chat/completions", "/completions")
CHARS_PER_TOKEN = 4
#: Beyond this many units (a trillion megapixels, tokens, …) a request asks for no real GPU's
#: work: refused 422 even on routes whose nodes have no ``capacity``, so float sums of in-flight
#: costs keep their precision.
MAX_UNITS = 1e12
MAX_COST = 1e15
#: A header unit is plain ASCII decimal: no ``1_0``, no non-ASCII digits, no exponent, no inf/nan
#: (all of which Python's float() would take).
HEADER_NUMBER = re.compile(r"[0-9]{1,32}(?:\.[0-9]{1,32})?", re.ASCII)

# ComfyUI nodes whose output size follows from their input's (core nodes; custom nodes with
# numeric ``width``/``height`` are counted like EmptyLatentImage).
SCALE_BY_NODES = frozenset(("LatentUpscaleBy", "ImageScaleBy"))
REPEAT_NODES = frozenset(("RepeatLatentBatch", "RepeatImageBatch"))
TOTAL_PIXELS_NODES = frozenset(("ImageScaleToTotalPixels",))
# The input a node's latent or image comes through, in the order they are looked at.
SOURCE_INPUTS = ("samples", "latent_image", "latent", "image", "images", "pixels")


class UnitError(ValueError):
    """The unit cannot be read from this request (answered 400 bad_request)."""


class CostTooLarge(UnitError):
    """The request is well formed but costs more than any node could hold (422 exceeds_capacity)."""


def request_cost(cfg: RequestCostConfig | None, kind: str, method: str, path: str, body: bytes,
                 headers: Mapping[str, str]) -> float:
    """The cost of one request on its route (0 without ``cost``); raises UnitError or CostTooLarge."""
    if cfg is None:
        return 0.0
    u = request_units(cfg, kind, method, path, body, headers)
    return bounded(cfg.base + cfg.per_unit * u, MAX_COST, "cost")


def bounded(v: float, limit: float, what: str) -> float:
    """``v`` when it is a finite number in [0, limit]; CostTooLarge otherwise (NaN included)."""
    if not 0 <= v <= limit:  # also false for NaN
        raise CostTooLarge(f"the request's {what} ({v:g}) exceed {limit:g}, more than any node could hold")
    return float(v)


def request_units(cfg: RequestCostConfig, kind: str, method: str, path: str, body: bytes,
                  headers: Mapping[str, str]) -> float:
    """``units`` of a request under ``cfg.unit`` (0 when the route has no unit)."""
    return bounded(_units(cfg, method, path, body, headers), MAX_UNITS, "units")


def _units(cfg: RequestCostConfig, method: str, path: str, body: bytes, headers: Mapping[str, str]) -> float:
    unit = cfg.unit
    if unit is None:
        return 0.0
    if unit.startswith("header:"):
        return header_number(headers, unit[len("header:"):])
    path = path.split("?", 1)[0]
    if unit == "megapixels":
        if method != "POST" or (path not in PROMPT_PATHS and not is_images(method, path)):
            return 0.0
        doc = json_body(body)
        graph = doc.get("prompt", doc) if isinstance(doc, dict) else None
        return workflow_megapixels(graph)
    if unit == "tokens":
        if method != "POST":
            return 0.0
        if is_messages_path(path):  # Anthropic Messages: the same estimate over its chat, system first
            doc = json_body(body)
            return float(token_estimate(chat_view(doc) if isinstance(doc, dict) else doc, cfg.default_max_tokens))
        if not path.endswith(COMPLETION_SUFFIXES):
            return 0.0
        return float(token_estimate(json_body(body), cfg.default_max_tokens))
    if not body:
        return 0.0  # a GET through the route has no body to hold the number
    if unit.startswith("json_chars:"):
        return json_chars(json_body(body), unit[len("json_chars:"):])
    assert unit.startswith("json:"), unit
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
    text = raw.strip(" \t")
    if not HEADER_NUMBER.fullmatch(text):
        raise UnitError(f"header {name} must be a non-negative decimal number (ASCII digits, optional .fraction)")
    return float(text)


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


def json_chars(doc: Any, pointer: str) -> float:
    """The characters of the string at ``pointer`` (a TTS request's ``input``: its speech takes
    GPU time in proportion); 0 when absent, UnitError when it holds anything but a string."""
    found, v = json_pointer(doc, pointer)
    if not found:
        return 0.0
    if not isinstance(v, str):
        raise UnitError(f"the body's {pointer} must be a string")
    return float(len(v))


# --- ComfyUI workflows -------------------------------------------------------------------------

Shape = tuple[float, float, float]  # width, height (pixels), batch


def _link(v: Any) -> str | None:
    """The node id of a linked input (``["4", 0]``), else None."""
    if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str | int) and not isinstance(v[0], bool):
        return str(v[0])
    return None


def _size_input(inputs: dict[str, Any], name: str, node_id: str, minimum: float = 0.0) -> float | None:
    """A numeric input (None when missing or linked); anything else is a malformed request."""
    v = inputs.get(name)
    if v is None and name not in inputs:
        return None
    if _link(v) is not None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < minimum:
        raise UnitError(f"node {node_id}: input {name} must be a number ≥ {minimum:g} or a link")
    return float(v)


def _sources(inputs: dict[str, Any]) -> list[str]:
    named = [s for k in SOURCE_INPUTS if (s := _link(inputs.get(k))) is not None]
    return named or [s for v in inputs.values() if (s := _link(v)) is not None]


def _keep_aspect(w: float, h: float, src: Shape) -> tuple[float, float]:
    """A resize with one side 0 keeps the input's aspect ratio; both 0 keep its size."""
    if w == 0 and h == 0:
        return src[0], src[1]
    if w == 0:
        return (src[0] * h / src[1] if src[1] else 0.0), h
    return w, (src[1] * w / src[0] if src[0] else 0.0)


def _node_shape(nid: str, node: Any, src: Shape | None) -> tuple[Shape | None, bool]:
    """(the size of what node ``nid`` outputs, whether the node itself makes it — and so costs)."""
    inputs = node.get("inputs") if isinstance(node, dict) else None
    if not isinstance(inputs, dict):
        return None, False
    cls = node.get("class_type")
    w, h = _size_input(inputs, "width", nid), _size_input(inputs, "height", nid)
    batch = _size_input(inputs, "batch_size", nid, 1.0)
    if w is not None and h is not None:
        if src is not None and (w == 0 or h == 0):  # LatentUpscale/ImageScale: 0 keeps the aspect ratio
            w, h = _keep_aspect(w, h, src)
        b = batch if batch is not None else (src[2] if src is not None else 1.0)
        return (w, h, b), True
    if cls in SCALE_BY_NODES:
        s = _size_input(inputs, "scale_by", nid)
        if s is not None and src is not None:
            return (src[0] * s, src[1] * s, src[2]), True
    elif cls in REPEAT_NODES:
        n = _size_input(inputs, "amount", nid, 1.0)
        if n is not None and src is not None:
            return (src[0], src[1], src[2] * n), True
    elif cls in TOTAL_PIXELS_NODES:
        mp = _size_input(inputs, "megapixels", nid)
        if mp is not None and src is not None:
            side = math.sqrt(mp * 1e6)
            return (side, side, src[2]), True
    return src, False


def workflow_megapixels(graph: Any) -> float:
    """Σ width × height × batch / 10⁶ over the latents and images a workflow makes.

    A node with numeric ``width`` and ``height`` makes one (EmptyLatentImage, LatentUpscale,
    ImageScale, …; its batch is its ``batch_size``, else its input's, else 1); so do the nodes
    that scale or repeat their input (LatentUpscaleBy, ImageScaleBy, ImageScaleToTotalPixels,
    RepeatLatentBatch, RepeatImageBatch), at their input's size times the factor. Other nodes pass
    their input's size on. A linked width/height is not a number: the node is skipped. A size that
    is neither a number nor a link is UnitError; one no GPU could make is CostTooLarge.
    """
    if not isinstance(graph, dict):
        return 0.0
    shapes: dict[str, Shape | None] = {}
    total = 0.0
    for root in graph:
        # Iterative depth-first walk over links (a long chain must not hit the recursion limit;
        # a cycle resolves as "no size known").
        stack = [str(root)]
        visiting: set[str] = set()
        while stack:
            nid = stack[-1]
            if nid in shapes:
                stack.pop()
                continue
            node = graph.get(nid)
            inputs = node.get("inputs") if isinstance(node, dict) else None
            srcs = [s for s in _sources(inputs) if s in graph] if isinstance(inputs, dict) else []
            pending = [s for s in srcs if s not in shapes and s not in visiting]
            if pending and nid not in visiting:
                visiting.add(nid)
                stack.extend(pending)
                continue
            stack.pop()
            visiting.discard(nid)
            src = next((sh for s in srcs if (sh := shapes.get(s)) is not None), None)
            shape, makes = _node_shape(nid, node, src)
            shapes[nid] = shape
            if makes and shape is not None:
                total += shape[0] * shape[1] * shape[2]
    return bounded(total / 1e6, MAX_UNITS, "megapixels")


def megapixels(graph: Any) -> float:
    """``workflow_megapixels`` for a simulated card: a malformed size counts 0, an absurd one ∞
    (the card then runs out of memory, as a real one would)."""
    try:
        return workflow_megapixels(graph)
    except CostTooLarge:
        return math.inf
    except UnitError:
        return 0.0


# --- OpenAI requests ---------------------------------------------------------------------------

def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def _token_ids(prompt: list[Any]) -> int:
    """Tokens of a ``prompt`` given as token ids (a list of ints, or a list of such lists)."""
    n = 0
    for p in prompt:
        if isinstance(p, int) and not isinstance(p, bool):
            n += 1
        elif isinstance(p, list):
            n += sum(1 for t in p if isinstance(t, int) and not isinstance(t, bool))
    return n


def prompt_tokens(doc: dict[str, Any]) -> int:
    """The prompt's tokens, estimated: text characters (message contents, a string or string-list
    ``prompt``) and the JSON of ``tools``/``functions`` (a server renders them into the prompt), ÷ 4
    rounded up once, plus one token per token id of a token-id ``prompt``."""
    chars = 0
    messages = doc.get("messages")
    if isinstance(messages, list):
        chars += sum(_text_chars(m.get("content")) for m in messages if isinstance(m, dict))
    ids = 0
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    elif isinstance(prompt, list):
        chars += sum(len(p) for p in prompt if isinstance(p, str))
        ids = _token_ids(prompt)
    for key in ("tools", "functions"):
        spec = doc.get(key)
        if isinstance(spec, list) and spec:
            chars += len(orjson.dumps(spec))
    return math.ceil(chars / CHARS_PER_TOKEN) + ids


def choices(doc: dict[str, Any], strict: bool = True) -> int:
    """How many completions the request makes the node generate: ``n``, or ``best_of`` when larger
    (a completion server generates best_of and returns n). Not a positive integer: UnitError
    (``strict``) or 1."""
    most = 1
    for key in ("n", "best_of"):
        v = doc.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            if strict:
                raise UnitError(f"{key} must be a positive integer")
            continue
        most = max(most, v)
    return most


def token_estimate(doc: Any, default_max_tokens: int) -> int:
    """The prompt's tokens (``prompt_tokens``) plus what the request may generate: ``max_tokens``
    (or ``max_completion_tokens``, else ``default_max_tokens``) for each of its ``choices``."""
    if not isinstance(doc, dict):
        raise UnitError("body must be a JSON object")
    gen = doc.get("max_tokens")
    if gen is None:
        gen = doc.get("max_completion_tokens")
    gen = default_max_tokens if gen is None else _number(gen, "max_tokens")
    total = prompt_tokens(doc) + math.ceil(gen) * choices(doc)  # an int: never overflows
    if total > MAX_UNITS:
        raise CostTooLarge(f"the request's tokens exceed {MAX_UNITS:g}, more than any node could hold")
    return total

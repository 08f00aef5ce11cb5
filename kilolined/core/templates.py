"""ComfyUI workflow templates behind OpenAI's Images API (docs/API.md "Images over ComfyUI workflows").

A template is a workflow in ComfyUI's API format and a map from the Images API's fields to the
inputs they fill (``prompt: "6.inputs.text"``). Each input is typed by its default in the
workflow: a value of another type, or one out of range, is refused naming the field, before the
request takes a place in the queue. Pure: the workflow's bytes in, a filled graph out.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

#: the Images API fields a template may map (``mask`` and ``image`` come from an edit's form)
FIELDS = ("prompt", "negative_prompt", "seed", "width", "height", "n", "image", "mask")
IMAGES_PATHS = ("/v1/images/generations", "/v1/images/edits")
EDITS_PATH = IMAGES_PATHS[1]
RESPONSE_FORMATS = ("b64_json", "url")
MAX_N = 10  # OpenAI's own bound on n
MAX_SIDE = 16384
#: the key of a filled images request's body that holds how to answer it (never sent to a node)
ANSWER_KEY = "kiloline_images"


class TemplateError(ValueError):
    """A workflow or input map that cannot be used (a config error)."""


class BadValue(ValueError):
    """A request value a template cannot take; ``field`` names it (answered 400)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Slot:
    """One input of the workflow that a field fills: its node, its input name and its type."""

    node: str
    name: str
    type: type


def is_images(method: str, path: str) -> bool:
    return method == "POST" and path.split("?", 1)[0] in IMAGES_PATHS


def load_workflow(data: bytes) -> dict[str, Any]:
    """The graph of a workflow file in API format (``{"6": {"class_type", "inputs"}}``), or the
    ``prompt`` of a saved ``POST /prompt`` body."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise TemplateError(f"not JSON: {e}") from None
    if isinstance(doc, dict) and isinstance(doc.get("prompt"), dict):
        doc = doc["prompt"]
    if not isinstance(doc, dict) or not doc or \
            not all(isinstance(n, dict) and isinstance(n.get("class_type"), str) for n in doc.values()):
        raise TemplateError("not a workflow in API format (export it with \"Save (API)\")")
    return doc


def slots(graph: Mapping[str, Any], inputs: Mapping[str, str]) -> dict[str, Slot]:
    """Each field's input in the graph, typed by its default; TemplateError naming the first
    field whose pointer names no node, no input, or an input that is a link."""
    out: dict[str, Slot] = {}
    for field, pointer in inputs.items():
        if field not in FIELDS:
            raise TemplateError(f"inputs.{field}: unknown field (one of {', '.join(FIELDS)})")
        nid, sep, rest = pointer.partition(".inputs.")
        if not sep or not rest:
            raise TemplateError(f"inputs.{field}: {pointer!r} is not NODE.inputs.NAME")
        node = graph.get(nid)
        if not isinstance(node, dict):
            raise TemplateError(f"inputs.{field}: the workflow has no node {nid!r}")
        node_inputs = node.get("inputs")
        if not isinstance(node_inputs, dict) or rest not in node_inputs:
            raise TemplateError(f"inputs.{field}: node {nid} ({node['class_type']}) has no input {rest!r}")
        default = node_inputs[rest]
        if isinstance(default, list) or not isinstance(default, (str, int, float, bool)):
            raise TemplateError(f"inputs.{field}: {pointer} is a link or has no plain value to type it by")
        out[field] = Slot(nid, rest, type(default))
    return out


def typed(field: str, slot: Slot, value: Any) -> Any:
    """``value`` as the slot's type (a form's text is parsed as that type); BadValue otherwise."""
    want = slot.type
    if want is bool:
        if isinstance(value, bool):
            return value
        if value in ("true", "false"):
            return value == "true"
    elif want is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
    elif want is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif isinstance(value, str):
        return value
    raise BadValue(field, f"{field}: expected {want.__name__}, got {type(value).__name__} {str(value)[:40]!r}")


def parse_size(value: Any) -> tuple[int, int]:
    """``"1024x768"`` as (width, height)."""
    w, sep, h = value.partition("x") if isinstance(value, str) else ("", "", "")
    if not sep or not w.isdigit() or not h.isdigit() or not 0 < int(w) <= MAX_SIDE or not 0 < int(h) <= MAX_SIDE:
        raise BadValue("size", f"size: expected WIDTHxHEIGHT (each 1-{MAX_SIDE}), got {str(value)[:40]!r}")
    return int(w), int(h)


def request_values(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The template fields an Images API request gives (``size`` split into width and height)."""
    values = {f: doc[f] for f in ("prompt", "negative_prompt", "seed", "n", "image", "mask")
              if doc.get(f) is not None}
    if doc.get("size") is not None and doc.get("size") != "auto":
        values["width"], values["height"] = parse_size(doc["size"])
    return values


def _bounded(field: str, value: Any) -> None:
    if field == "n" and not 1 <= value <= MAX_N:
        raise BadValue("n", f"n: must be 1-{MAX_N}, got {value}")
    if field in ("width", "height") and not 0 < value <= MAX_SIDE:
        raise BadValue(field, f"{field}: must be 1-{MAX_SIDE}, got {value}")
    if field == "seed" and value < 0:
        raise BadValue("seed", f"seed: must be at least 0, got {value}")


def fill(graph: Mapping[str, Any], template_slots: Mapping[str, Slot], values: Mapping[str, Any],
         template: str) -> dict[str, Any]:
    """A copy of the graph with each given field's value in its input. A field the template does
    not map is refused (its value would be silently lost), but for ``prompt`` (every client sends
    one; a workflow without text, an upscaler say, has no use for it) and ``n: 1`` (one image
    is what any workflow makes)."""
    filled = copy.deepcopy(dict(graph))
    for field, value in values.items():
        slot = template_slots.get(field)
        if slot is None:
            if field == "prompt" or (field == "n" and value in (1, "1")):
                continue
            asked = "size" if field in ("width", "height") else field  # what the client sent
            raise BadValue(asked, f"{asked}: template {template!r} has no input for it")
        v = typed(field, slot, value)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            _bounded(field, v)
        filled[slot.node]["inputs"][slot.name] = v
    return filled


def data_url(data: bytes, content_type: str | None) -> str:
    """An uploaded file as the ``data:`` URL a prompt may name an input by (held and delivered
    like an upload: comfy_inputs.py)."""
    mime = (content_type or "").split(";", 1)[0].strip() or "image/png"
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"

"""ComfyUI's prompt graph, without I/O: the node classes this fake has, validation as ComfyUI 0.19
answers it, execution order, cache keys, and the PNGs its "models" make."""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import uuid
import zlib
from collections.abc import Callable
from types import MappingProxyType
from typing import Any, NamedTuple

from kilolined.fakegpu.base import is_int


class NodeSpec(NamedTuple):
    category: str
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[str, ...]
    output_node: bool


# The node classes this fake "has installed". FailNode is ours: it raises when it runs.
NODES = MappingProxyType(
    {
        "CheckpointLoaderSimple": NodeSpec("loaders", (("ckpt_name", "COMBO"),), ("MODEL", "CLIP", "VAE"), False),
        "CLIPTextEncode": NodeSpec("conditioning", (("text", "STRING"), ("clip", "CLIP")), ("CONDITIONING",),
                                   False),
        "EmptyLatentImage": NodeSpec(
            "latent", (("width", "INT"), ("height", "INT"), ("batch_size", "INT")), ("LATENT",), False
        ),
        "KSampler": NodeSpec(
            "sampling",
            (("model", "MODEL"), ("seed", "INT"), ("steps", "INT"), ("cfg", "FLOAT"), ("sampler_name", "COMBO"),
             ("scheduler", "COMBO"), ("positive", "CONDITIONING"), ("negative", "CONDITIONING"),
             ("latent_image", "LATENT"), ("denoise", "FLOAT")),
            ("LATENT",),
            False,
        ),
        "VAEDecode": NodeSpec("latent", (("samples", "LATENT"), ("vae", "VAE")), ("IMAGE",), False),
        "SaveImage": NodeSpec("image", (("images", "IMAGE"), ("filename_prefix", "STRING")), (), True),
        "PreviewImage": NodeSpec("image", (("images", "IMAGE"),), (), True),
        "FailNode": NodeSpec("testing", (("message", "STRING"),), ("*",), False),
        # Weight-free image nodes (img2img without a model): LoadImage reads the input directory.
        "LoadImage": NodeSpec("image", (("image", "COMBO"),), ("IMAGE", "MASK"), False),
        "LoadImageMask": NodeSpec("mask", (("image", "COMBO"), ("channel", "COMBO")), ("MASK",), False),
        "ImageInvert": NodeSpec("image", (("image", "IMAGE"),), ("IMAGE",), False),
        "EmptyImage": NodeSpec("image", (("width", "INT"), ("height", "INT"), ("batch_size", "INT"),
                                         ("color", "INT")), ("IMAGE",), False),
    }
)


def make_png(seed: str, size: int = 8) -> bytes:
    """A small valid RGB PNG whose pixels derive from `seed`, so each prompt's image differs."""
    digest = hashlib.sha256(seed.encode()).digest()
    rows = b"".join(
        b"\x00" + bytes(c for x in range(size) for c in (digest[0] ^ x * 29, digest[1] ^ y * 31, digest[2 + x + y]))
        for y in range(size)
    )

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def link(value: Any) -> str | None:
    """The source node id when an input is a link `[node_id, slot]`."""
    if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and is_int(value[1]):
        return value[0]
    return None


def inputs_of(node: dict[str, Any]) -> dict[str, Any]:
    inputs = node.get("inputs")
    return inputs if isinstance(inputs, dict) else {}


def sort_key(node_id: str) -> tuple[int, str]:
    return (int(node_id), node_id) if node_id.isdigit() else (sys.maxsize, node_id)


def _topo_order(graph: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Dependencies first, ties by id; the second list holds nodes caught in a cycle."""
    deps = {nid: {src for v in inputs_of(node).values() if (src := link(v)) in graph} for nid, node in graph.items()}
    order: list[str] = []
    placed: set[str] = set()
    while True:
        ready = sorted((nid for nid in graph if nid not in placed and deps[nid] <= placed), key=sort_key)
        if not ready:
            break
        order.extend(ready)
        placed.update(ready)
    return order, sorted((nid for nid in graph if nid not in placed), key=sort_key)


def _upstream(graph: dict[str, Any], node_id: str) -> set[str]:
    seen: set[str] = set()
    todo = [node_id]
    while todo:
        nid = todo.pop()
        if nid in seen or nid not in graph:
            continue
        seen.add(nid)
        todo.extend(src for v in inputs_of(graph[nid]).values() if (src := link(v)) is not None)
    return seen


#: the LoadImage classes, whose ``image`` names a file of the node's input directory
LOADS_IMAGE = frozenset({"LoadImage", "LoadImageMask"})


def _node_errors(node_id: str, node: dict[str, Any], graph: dict[str, Any],
                 exists: Callable[[str], bool]) -> list[dict[str, Any]]:
    class_type = node["class_type"]

    def err(kind: str, message: str, details: str) -> dict[str, Any]:
        return {"type": kind, "message": message, "details": details,
                "extra_info": {"node_id": node_id, "class_type": class_type}}

    errors = []
    if "inputs" in node and not isinstance(node["inputs"], dict):
        errors.append(err("invalid_input_type", "Node inputs must be an object", "inputs"))
    for name, value in inputs_of(node).items():
        src = link(value)
        if src is not None and src not in graph:
            errors.append(err("bad_linked_input", "Bad linked input, the source node does not exist",
                              f"{name}, node '{src}'"))
    image = inputs_of(node).get("image")
    if class_type in LOADS_IMAGE and isinstance(image, str) and not exists(image):
        # nodes.py LoadImage.VALIDATE_INPUTS, as execution.py reports a custom validation
        errors.append({"type": "custom_validation_failed", "message": "Custom validation failed for node",
                       "details": f"image - Invalid image file: {image}", "extra_info": {"input_name": "image"}})
    steps = inputs_of(node).get("steps")
    if class_type == "KSampler" and steps is not None and link(steps) is None:
        if not is_int(steps):
            errors.append(err("invalid_input_type", "Failed to convert an input value to a INT value",
                              f"steps, {steps!r}"))
        elif steps < 1:
            errors.append(err("value_smaller_than_min", "Value 0 smaller than min of 1", f"steps, {steps}"))
    return errors


def error_body(kind: str, message: str, details: str = "", node_errors: dict[str, Any] | None = None,
               extra_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """The body of ComfyUI's 400 from POST /prompt."""
    return {"error": {"type": kind, "message": message, "details": details, "extra_info": extra_info or {}},
            "node_errors": node_errors or {}}


def _title(node: Any, default: str | None) -> str | None:
    meta = node.get("_meta") if isinstance(node, dict) else None
    title = meta.get("title", default) if isinstance(meta, dict) else default
    return title if isinstance(title, str) else default


def _missing_node(graph: dict[str, Any]) -> dict[str, Any] | None:
    """The first node (in prompt order) without a class_type or with an unknown one; ComfyUI stops there."""
    for node_id, node in graph.items():
        class_type = node.get("class_type") if isinstance(node, dict) else None
        if not isinstance(class_type, str):
            title = _title(node, None)
            message = (f"Node '{title or f'ID #{node_id}'}' has no class_type. The workflow may be corrupted or a "
                       "custom node is missing.")
            class_type = None
        elif class_type not in NODES:
            title = _title(node, class_type)
            message = f"Node '{title}' not found. The custom node may not be installed."
        else:
            continue
        return error_body("missing_node_type", message, f"Node ID '#{node_id}'",
                          extra_info={"node_id": node_id, "class_type": class_type, "node_title": title})
    return None


def validate(graph: Any, exists: Callable[[str], bool] = lambda _name: False,
             ) -> tuple[dict[str, Any] | None, list[str], list[str]]:
    """Returns (the 400 body or None, output node ids, the nodes the outputs need, in execution order).
    ``exists`` says whether a LoadImage value names a file the node has."""
    if not isinstance(graph, dict):
        return error_body("invalid_prompt", "The prompt must be an object of nodes"), [], []
    missing = _missing_node(graph)
    if missing is not None:
        return missing, [], []
    outputs = sorted((nid for nid, node in graph.items() if NODES[node["class_type"]].output_node), key=sort_key)
    if not outputs:
        return error_body("prompt_no_outputs", "Prompt has no outputs"), [], []
    errors = {nid: errs for nid, node in graph.items() if (errs := _node_errors(nid, node, graph, exists))}
    order, cyclic = _topo_order(graph)
    for nid in cyclic:
        errors.setdefault(nid, []).append({"type": "dependency_cycle", "message": "Dependency cycle detected",
                                           "details": f"Node ID '#{nid}'", "extra_info": {}})
    if errors:
        node_errors = {
            nid: {"errors": errs, "dependent_outputs": [o for o in outputs if nid in _upstream(graph, o)],
                  "class_type": graph[nid]["class_type"]}
            for nid, errs in errors.items()
        }
        # execution.py lists only the output nodes' own reasons: an upstream failure leaves it empty.
        details = "\n".join(f"{e['message']}: {e['details']}" for nid, errs in errors.items() if nid in outputs
                            for e in errs)
        return error_body("prompt_outputs_failed_validation", "Prompt outputs failed validation", details,
                          node_errors), [], []
    needed = set().union(*(_upstream(graph, o) for o in outputs))
    return None, outputs, [nid for nid in order if nid in needed]


def signatures(graph: dict[str, Any]) -> dict[str, str]:
    """Each node's cache key: its class and inputs, a link standing for its source's key and slot.

    Two nodes with the same key compute the same thing, so ComfyUI serves the second from its
    cache (its CLASSIC cache keys by input signature, not by node id). `graph` has passed
    `validate`, so it has no cycle and every link leads to a node.
    """
    out: dict[str, str] = {}

    def key(nid: str) -> str:
        if nid not in out:
            inputs = {name: ([key(src), value[1]] if (src := link(value)) is not None else value)
                      for name, value in sorted(inputs_of(graph[nid]).items())}
            out[nid] = json.dumps([graph[nid]["class_type"], inputs], sort_keys=True, default=repr)
        return out[nid]

    for nid in graph:
        key(nid)
    return out


def canonical_uuid(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        return str(uuid.UUID(value)) == value
    except ValueError:
        return False

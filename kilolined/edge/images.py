"""The pipeline stage that turns an Images API request into the ComfyUI prompt it runs as.

``POST {path}/v1/images/generations`` (JSON) and ``/v1/images/edits`` (a multipart form with
``image``) on a ``comfyui`` route name a template by ``model``. Its workflow is filled here, at
admission, so that a bad value is refused before the request queues and the route's cost is
read from the filled workflow. The exchange's body becomes that prompt, with how to answer it
under ``kiloline_images`` (never sent to a node): the request is then one prompt like any other
(comfyui.py runs it; an edit's image is a ``data:`` URL in its LoadImage input, held and
delivered to the node that runs it as an upload is).
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from kilolined.core.forms import FormError, form_parts, is_multipart
from kilolined.core.templates import (
    ANSWER_KEY,
    EDITS_PATH,
    RESPONSE_FORMATS,
    BadValue,
    data_url,
    fill,
    is_images,
    request_values,
)
from kilolined.edge.context import Gateway
from kilolined.modes.call import Call
from kilolined.wire.proxy import Exchange

FILE_FIELDS = ("image", "mask")


def _form_doc(ex: Exchange) -> dict[str, Any]:
    """An edit's form as a request document: text fields as text, files as ``data:`` URLs."""
    ctype = ex.request.headers.get("Content-Type")
    if not is_multipart(ctype):
        raise FormError("an image edit is a multipart/form-data form")
    assert ctype is not None
    doc: dict[str, Any] = {}
    for name, (value, part_type) in form_parts(ex.body, ctype).items():
        if name in FILE_FIELDS:
            doc[name] = data_url(value, part_type)
        else:
            try:
                doc[name] = value.decode("utf-8")
            except UnicodeDecodeError:
                raise FormError(f"form field {name!r} is not UTF-8 text") from None
    return doc


def fill_template(gw: Gateway, call: Call) -> web.StreamResponse | None:
    """Fill the template an Images API request names; 404 ``model_not_found`` for a template the
    route does not have, 400 naming the field for a value it cannot take."""
    ex = call.exchange
    if call.kind != "comfyui" or ex is None or not is_images(ex.method, call.unqueued_path):
        return None
    templates = gw.rt.scheduler.routes[call.route_name].cfg.templates
    edit = call.unqueued_path == EDITS_PATH
    try:
        doc = _form_doc(ex) if edit else ex.body_doc()
    except FormError as e:
        return call.error(400, "bad_request", str(e))
    if not isinstance(doc, dict):
        return call.error(400, "bad_request", "body must be a JSON object (OpenAI's images request)")
    model = doc.get("model")
    if model is None and len(templates) == 1:
        model = next(iter(templates))  # the route's one workflow needs no name
    template = templates.get(model) if isinstance(model, str) else None
    if template is None:
        known = ", ".join(sorted(templates)) or "none"
        return call.error(404, "model_not_found", f"model {model!r}: route {call.route} has no such template "
                                                  f"(its templates: {known})", param="model")
    fmt = doc.get("response_format") or "b64_json"
    if fmt not in RESPONSE_FORMATS:
        return call.error(400, "bad_request", f"response_format: one of {', '.join(RESPONSE_FORMATS)}, not {fmt!r}",
                          param="response_format")
    if not isinstance(doc.get("prompt"), str):
        return call.error(400, "bad_request", "prompt: required, a string", param="prompt")
    if edit and "image" not in doc:
        return call.error(400, "bad_request", "image: required, the image to edit", param="image")
    try:
        graph = fill(template.graph, template.slots, request_values(doc), str(model))
    except BadValue as e:
        return call.error(400, "bad_request", str(e), param=e.field)
    ex.body = orjson.dumps({"prompt": graph, ANSWER_KEY: {"response_format": fmt, "template": model}})
    ex.body_override = None
    return None

"""A ComfyUI prompt's inputs follow it to the node that runs it (docs/API.md "ComfyUI over several GPUs").

``POST {path}/upload/image`` (and ``/upload/mask``) is answered by the gateway as ComfyUI
answers it, and the file is held in the route's directory (comfy_files.py), not sent to any
node: which node runs the prompt that uses it is known only at dispatch. Before a prompt is
sent to a node, every held input it names (a ``LoadImage`` ``image``, or any input whose value
is a held name) is uploaded to that node, once per node and content; a prompt re-queued to
another node (failover) delivers them there too, as each attempt delivers to its own node.

An input may also be given as a ``data:`` URL, or as an ``http(s)`` URL that the route's
``comfy.fetch_inputs`` globs allow (the rules of ``X-Target-Host``: the URL's canonical form
must match a glob; no redirect is followed). Either is held like an upload, under a name made
of its content, and the prompt's value becomes that name.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import mimetypes
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
from aiohttp import web

from kilolined.adapters.comfy_files import (
    INPUT,
    KINDS,
    RouteFile,
    RouteFiles,
    annotated,
    clash_name,
    clean_subfolder,
    valid_filename,
)
from kilolined.adapters.comfy_store import files_state, held, share
from kilolined.core.errors import error_response
from kilolined.core.hosts import parse_target, target_allowed
from kilolined.core.outcome import Failure
from kilolined.core.verdict import Cause, failed_status
from kilolined.ops.runtime import Runtime
from kilolined.scheduling.queue import Lease
from kilolined.wire.proxy import UpstreamFailed, node_lost

log = logging.getLogger("kilolined")

LOADS_IMAGE = frozenset({"LoadImage", "LoadImageMask"})  # their ``image`` names a file of the input directory
UPLOAD_PATHS = ("/upload/image", "/upload/mask", "/api/upload/image", "/api/upload/mask")
DELIVER_SEC = 60.0  # one input's upload to a node
FETCH_SEC = 30.0  # one fetched input, whole


def is_upload(method: str, path: str) -> bool:
    return method == "POST" and path in UPLOAD_PATHS


# --- POST /upload/image ----------------------------------------------------------------------------

async def upload(rt: Runtime, request: web.Request, route: str, subject: str, request_id: str) -> web.Response:
    """Held as ComfyUI's server.py image_upload would write it: the same fields, checks and answer.
    ``/upload/mask`` pastes the mask's alpha onto the ``original_ref`` image, as ComfyUI does: a
    live node of the route does the painting (the gateway reads no image format), with the
    original delivered to it first; the result is held like an upload."""
    headers = {"X-Request-Id": request_id}
    files = files_state(rt).files(route)
    limit = min(files.max_bytes, int(rt.cfg.server.max_body_mb * 1024 * 1024))
    try:
        post, image = await read_form(request, limit)
    except TooLarge:
        resp = error_response(413, "payload_too_large", "upload larger than the route's comfy.max_files_mb "
                              "or server.max_body_mb", request_id=request_id)
        resp.force_close()  # the rest of the body is not read
        return resp
    except (ValueError, AssertionError, aiohttp.ClientError):
        return web.Response(status=400, headers=headers)
    kind = post.get("type") or INPUT
    given_sub = post.get("subfolder", "")
    sub = clean_subfolder(given_sub)
    if image is None or kind not in KINDS or sub is None or not valid_filename(image[0]):
        return web.Response(status=400, headers=headers)
    name, data = image
    if request.path.endswith("/upload/mask"):
        painted = await _paint_mask(rt, route, subject, data, post.get("original_ref", ""), request_id)
        if isinstance(painted, web.Response):
            return painted
        data = painted
        if len(data) > limit:
            return error_response(413, "payload_too_large", "the painted mask is larger than the route's "
                                  "comfy.max_files_mb", request_id=request_id)
    overwrite = post.get("overwrite") in ("true", "1")
    await _known_names(rt, route, kind, sub, name, data)
    f = files.upload(kind, sub, name, data, subject, overwrite, files_state(rt).config(route).shared)
    await share(rt, route, f)
    rt.metrics.comfy_uploads.labels(route).inc()
    return web.json_response({"name": f.name, "subfolder": given_sub, "type": kind}, headers=headers)


class TooLarge(Exception):
    pass


async def read_form(request: web.Request, limit: int) -> tuple[dict[str, str], tuple[str, bytes] | None]:
    """A multipart upload read into memory (aiohttp's ``post()`` spools files over 1 MiB to a
    temporary file, and nothing of a client's goes to the gateway's disk): the text fields, and
    the ``image`` file's (filename, bytes) if there is one. Raises TooLarge past ``limit``."""
    fields: dict[str, str] = {}
    image: tuple[str, bytes] | None = None
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if not isinstance(part, aiohttp.BodyPartReader):
            continue  # a nested multipart: nothing ComfyUI reads
        buf = bytearray()
        while chunk := await part.read_chunk():
            buf += chunk
            if len(buf) > limit:
                raise TooLarge
        if part.name == "image" and part.filename:
            image = (part.filename, bytes(buf))
        elif part.name and part.filename is None:
            fields[part.name] = buf.decode("utf-8", "replace")
    return fields, image


async def _known_names(rt: Runtime, route: str, kind: str, sub: str, name: str, data: bytes) -> None:
    """Cluster mode: the names this upload may clash with, as the other gateways hold them, so it
    is renamed as one ComfyUI would rename it (``cat (1).png``)."""
    digest = hashlib.sha256(data).hexdigest()
    cand, n = name, 1
    while rt.comfy_shared is not None:
        f = await held(rt, route, kind, sub, cand)
        if f is None or f.sha256 == digest:
            return
        cand, n = clash_name(name, n), n + 1


async def _paint_mask(rt: Runtime, route: str, subject: str, mask: bytes, ref: str,
                      request_id: str) -> bytes | web.Response:
    """The ``original_ref`` image with the mask's alpha, painted by a live node of the route;
    ComfyUI's 400 for a ref it cannot use, 404 for an original the key may not read, 502 when no
    node can paint it."""
    st = files_state(rt)
    try:
        original = orjson.loads(ref)
    except orjson.JSONDecodeError:
        return web.Response(status=400, headers={"X-Request-Id": request_id})
    name = original.get("filename") if isinstance(original, dict) else None
    if not isinstance(name, str) or not isinstance(original, dict):
        return web.Response(status=400, headers={"X-Request-Id": request_id})
    kind, sub, name = annotated(name) if name.endswith("]") else (
        str(original.get("type") or "output"), clean_subfolder(str(original.get("subfolder") or "")), name)
    found = await held(rt, route, kind, sub, name) if sub is not None and kind in KINDS and valid_filename(name) \
        else None
    if found is None or found.data is None or not (st.config(route).shared or subject in found.owners):
        return web.Response(status=404, headers={"X-Request-Id": request_id})
    now = rt.clock()
    sched = rt.scheduler
    rq = sched.routes.get(route)
    for node in rq.all_nodes if rq is not None else ():
        ns = sched.nodes.get(node)
        if ns is None or not ns.available(now):
            continue
        try:
            return await _painted_on(rt, node, found.data, mask, request_id)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, TypeError) as e:
            log.info("[%s] painting a mask: %s", node, type(e).__name__)
    return error_response(502, "upstream_error", "no node of the route could paint the mask", request_id=request_id)


async def _painted_on(rt: Runtime, node: str, original: bytes, mask: bytes, request_id: str) -> bytes:
    """ComfyUI's own /upload/mask on ``node``, under names of ours in its input folder."""
    ncfg = rt.scheduler.nodes[node].cfg
    session, headers = rt.session(node), {"X-Request-Id": request_id, **ncfg.headers}
    stem = hashlib.sha256(original + mask).hexdigest()[:32]
    timeout = aiohttp.ClientTimeout(total=DELIVER_SEC, sock_connect=10)
    for path, fields in (
            ("/upload/image", {"image": (original, f"kl_orig_{stem}.png")}),
            ("/upload/mask", {"image": (mask, f"kl_mask_{stem}.png"), "original_ref": orjson.dumps(
                {"filename": f"kl_orig_{stem}.png", "subfolder": "", "type": "input"}).decode()})):
        form = aiohttp.FormData()
        for k, v in fields.items():
            if isinstance(v, tuple):
                form.add_field(k, v[0], filename=v[1], content_type="image/png")
            else:
                form.add_field(k, v)
        form.add_field("type", "input")
        form.add_field("overwrite", "true")
        payload = form()
        async with session.post(ncfg.url + path, data=payload, timeout=timeout,
                                headers={**headers, "Content-Type": payload.content_type}) as r:
            if r.status != 200:
                raise aiohttp.ClientError(f"HTTP {r.status}")
            answer = orjson.loads(await r.read())
    query = {"filename": answer["name"], "subfolder": "", "type": "input"}
    async with session.get(ncfg.url + "/view", params=query, headers=headers, timeout=timeout) as r:
        if r.status != 200:
            raise aiohttp.ClientError(f"HTTP {r.status}")
        return await r.read()


# --- the prompt's inputs ---------------------------------------------------------------------------

def fetch_allowed(globs: list[str], url: str) -> str | None:
    """The URL's canonical form when a ``comfy.fetch_inputs`` glob allows it, else None. A user
    part (``https://good@evil/``) is never allowed: it is how a URL hides its real host."""
    if not globs:
        return None
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if "@" in parts.netloc or parts.fragment:
        return None
    origin = parse_target(f"{parts.scheme}://{parts.netloc}")
    if origin is None:
        return None
    canon = origin + (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return canon if target_allowed(globs, canon) else None


def _ext(mime: str) -> str:
    mime = mime.split(";", 1)[0].strip().lower()
    return {"image/jpeg": ".jpg"}.get(mime) or mimetypes.guess_extension(mime) or ".bin"


def decode_data_url(value: str) -> tuple[bytes, str] | None:
    """(bytes, extension) of a base64 ``data:`` URL; None for any other string."""
    head, comma, payload = value.partition(",")
    if not comma or not head.startswith("data:") or not head.endswith(";base64"):
        return None
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise Failure("bad_request", "an input's data: URL is not valid base64", 400) from None
    return data, _ext(head[5:-7] or "application/octet-stream")


def invalid_images(graph: dict[str, Any], refused: list[tuple[dict[str, Any], str]]) -> Failure:
    """ComfyUI's 400 for LoadImage values that name no file it has (nodes.py VALIDATE_INPUTS as
    execution.py reports it), for the nodes in ``refused``."""
    node_errors: dict[str, Any] = {}
    for nid, node in graph.items():
        for bad, value in refused:
            if node is bad:
                node_errors[nid] = {"errors": [{"type": "custom_validation_failed",
                                                "message": "Custom validation failed for node",
                                                "details": f"image - Invalid image file: {value}",
                                                "extra_info": {"input_name": "image"}}],
                                    "dependent_outputs": _outputs_of(graph, nid), "class_type": node["class_type"]}
    # execution.py's top-level details list the output nodes' own reasons: none here (a LoadImage
    # is never an output), so "" as ComfyUI sends it.
    body = {"error": {"type": "prompt_outputs_failed_validation", "message": "Prompt outputs failed validation",
                      "details": "", "extra_info": {}}, "node_errors": node_errors}
    return Failure("bad_request", "Prompt outputs failed validation", 400, orjson.dumps(body), "application/json")


def _outputs_of(graph: dict[str, Any], nid: str) -> list[str]:
    """The nodes downstream of ``nid`` that feed no other node (its prompt's outputs)."""
    def links_to(node: Any) -> set[str]:
        inputs = node.get("inputs") if isinstance(node, dict) else None
        return {v[0] for v in (inputs.values() if isinstance(inputs, dict) else ())
                if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)}
    feeds = {n: links_to(node) for n, node in graph.items()}
    down, todo = set(), [nid]
    while todo:
        cur = todo.pop()
        for n, srcs in feeds.items():
            if cur in srcs and n not in down:
                down.add(n)
                todo.append(n)
    used = set().union(*feeds.values()) if feeds else set()
    return sorted(n for n in down if n not in used)


class PromptInputs:
    """The held files a prompt names, and its body with inline and fetched inputs renamed."""

    def __init__(self, rt: Runtime, route: str, subject: str):
        self.rt, self.route, self.subject = rt, route, subject
        st = files_state(rt)
        self.files: RouteFiles = st.files(route)
        self.cfg = st.config(route)
        self.needed: list[RouteFile] = []
        self.refused: list[tuple[dict[str, Any], str]] = []  # (LoadImage node, value) naming another key's file
        self.changed = False
        self._body: dict[str, Any] | None = None  # the resolved body, once

    async def for_node(self, lease: Lease, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        """The body to send to the lease's node, its held inputs delivered there. Resolved on the
        first attempt, under its lease: a refusal then ends the request and frees the slot."""
        if self._body is None:
            self._body = await self.resolve(body)
        await deliver(self.rt, lease, self.needed, request_id)
        return self._body

    async def resolve(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body to send (``changed``: inline or fetched inputs renamed); ``needed`` lists the
        held files it names. Raises Failure when it loads another key's input (ComfyUI's answer
        for a file that is not there), and for an input that cannot be fetched or decoded."""
        graph = body.get("prompt")
        if not isinstance(graph, dict):
            return body
        new_graph = {nid: await self._node(node) for nid, node in graph.items()}
        if self.refused:
            raise invalid_images(graph, self.refused)
        return {**body, "prompt": new_graph} if self.changed else body

    async def _node(self, node: Any) -> Any:
        inputs = node.get("inputs") if isinstance(node, dict) else None
        if not isinstance(inputs, dict):
            return node
        new = {k: await self._value(v) if isinstance(v, str) else v for k, v in inputs.items()}
        image = inputs.get("image")
        if node.get("class_type") in LOADS_IMAGE and isinstance(image, str) and await self._others(image):
            self.refused.append((node, image))
        return {**node, "inputs": new} if new != inputs else node

    async def _others(self, value: str) -> bool:
        """The value names a file the route holds for other keys only."""
        kind, sub, name = annotated(value)
        found = await held(self.rt, self.route, kind, sub, name) if valid_filename(name) else None
        return found is not None and not self.cfg.shared and self.subject not in found.owners

    async def _value(self, value: str) -> str:
        inline = decode_data_url(value) if value.startswith("data:") else None
        if inline is None and value.startswith(("http://", "https://")):
            url = fetch_allowed(self.cfg.fetch_inputs, value)
            inline = await self._fetch(url) if url is not None else None
        if inline is not None:
            data, ext = inline
            if len(data) > self.files.max_bytes:
                raise Failure("payload_too_large", "an input is larger than the route's comfy.max_files_mb", 413)
            f = self.files.content(data, ext, self.subject)
            await share(self.rt, self.route, f)
            self._need(f)
            self.changed = True
            return f.name
        kind, sub, name = annotated(value)
        if kind == INPUT and valid_filename(name):
            found = await held(self.rt, self.route, INPUT, sub, name)
            if found is not None and found.data is not None and (self.cfg.shared or self.subject in found.owners):
                self._need(found)
        return value

    def _need(self, f: RouteFile) -> None:
        if all(f is not g for g in self.needed):
            self.needed.append(f)

    async def _fetch(self, url: str) -> tuple[bytes, str]:
        limit = self.files.max_bytes
        try:
            async with self.rt.session("comfy-fetch").get(
                    url, allow_redirects=False, headers={"Accept-Encoding": "identity"},
                    timeout=aiohttp.ClientTimeout(total=FETCH_SEC)) as r:
                if r.status != 200:
                    raise Failure("bad_request", f"an input URL answered HTTP {r.status}", 400)
                data = await r.content.read(limit + 1)
                ctype = r.headers.get("Content-Type", "")
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise Failure("bad_request", f"an input URL could not be fetched ({type(e).__name__})", 400) from None
        if len(data) > limit:
            raise Failure("payload_too_large", "an input is larger than the route's comfy.max_files_mb", 413)
        path = urlsplit(url).path
        ext = _ext(ctype) if ctype else mimetypes.guess_extension(mimetypes.guess_type(path)[0] or "") or ".bin"
        return data, ext


async def _still_there(session: aiohttp.ClientSession, lease: Lease, f: RouteFile, headers: dict[str, str]) -> bool:
    """A delivered input is still on the node, at its size: a node that came back with a fresh
    disk (a rented machine restarted) under the same name is sent it again."""
    query = {"filename": f.name, "subfolder": f.subfolder, "type": f.kind}
    try:
        async with session.head(lease.target.url + "/view", params=query, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=10)) as r:
            return r.status == 200 and r.content_length == f.size
    except aiohttp.ClientConnectorError:
        raise node_lost("connection refused") from None
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False  # sent again: the upload says whether the node is there


async def deliver(rt: Runtime, lease: Lease, needed: list[RouteFile], request_id: str) -> None:
    """Upload to the lease's node each held input it has not had with this content. A node that
    cannot take them fails like one that cannot take the prompt: the request is re-queued."""
    st = files_state(rt)
    files = st.files(lease.route)
    session = rt.session(lease.node)
    headers = {"X-Request-Id": request_id, **lease.target.headers}
    for f in needed:
        data = f.data
        if data is None:
            continue  # dropped since (bounded memory): the node says the input is missing
        if st.was_delivered(lease.node, f) and await _still_there(session, lease, f, headers):
            continue
        form = aiohttp.FormData()
        form.add_field("image", data, filename=f.name,
                       content_type=mimetypes.guess_type(f.name)[0] or "application/octet-stream")
        form.add_field("subfolder", f.subfolder)
        form.add_field("type", f.kind)
        form.add_field("overwrite", "true")  # the route's name is the file: never "name (1)" on the node
        payload = form()
        # The node sessions send no Content-Type of their own (runtime.py): the multipart one is ours.
        sent = {**headers, "Content-Type": payload.content_type}
        try:
            async with session.post(lease.target.url + "/upload/image", data=payload, headers=sent,
                                    timeout=aiohttp.ClientTimeout(total=DELIVER_SEC, sock_connect=10)) as r:
                status = r.status
                await r.read()
        except aiohttp.ClientConnectorError:
            raise node_lost("connection refused") from None
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            log.info("[%s] delivering an input: %s", lease.node, type(e).__name__)
            raise node_lost("connection failed while delivering an input") from None
        if failed_status(status):
            raise UpstreamFailed(f"HTTP {status} from node delivering an input", cause=Cause.STATUS)
        if status != 200:
            raise Failure("upstream_error", f"the node refused an input (HTTP {status})", 502)
        files.use(f)
        st.mark_delivered(lease.node, f)

"""Where a ComfyUI route's files live: the runtime's record of each route's files
(comfy_files.py), the route's bucket, the copy of a finished prompt's outputs, and ``/view``.

When a prompt ends, every output its history lists (``type: output``) is copied from the node's
``/view`` into the route's store, one of three behind one small protocol (``OutputStore``): the
gateway's memory (``comfy.max_files_mb``), the route's bucket, or in cluster mode without a
bucket Redis (``comfy.max_files_mb`` cluster-wide, cluster/comfyfiles.py).
``GET {path}/view`` is answered from the store whether or not the node lives; while a copy is
not done yet (the web UI asks as soon as ``executed`` arrives), and for ``temp`` previews, the
file streams from the node that made it. A key reads only its own files (ComfyUI's 404 for
another key's), the admin key all, and every key on a ``comfy.shared`` route.
"""

from __future__ import annotations

import hashlib
import logging
import mimetypes
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Protocol
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from kilolined.adapters.comfy_files import KINDS, OUTPUT, TEMP, RouteFile, RouteFiles, clean_subfolder, may_read
from kilolined.cluster.comfyfiles import REDIS_ERRORS, SharedFile, SharedInputs
from kilolined.core.config import ComfyConfig
from kilolined.ops.runtime import Runtime
from kilolined.wire.proxy import SERVER, stream_back
from kilolined.wire.s3 import Bucket, BucketError, ObjectExists

log = logging.getLogger("kilolined")

STATE_KEY = "comfyfiles"
VIEW_PATHS = ("/view", "/api/view")
COPY_SEC = 60.0  # one output's copy from its node
CLAIM_TRIES = 1000  # names tried for one output before it is named by this gateway alone
DELIVERED_MAX = 50_000  # (node, file, sha256) deliveries remembered
# ComfyUI's /view forces these to download rather than display (a file a node wrote is not a page of ours).
DOWNLOAD_ONLY = frozenset({"text/html", "text/html-sandboxed", "application/xhtml+xml", "text/javascript", "text/css"})


class FilesState:
    """The ComfyUI files of one runtime: per route, its directory; per node, what was delivered."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.routes: dict[str, RouteFiles] = {}
        #: (node, kind, subfolder, name, sha256) of inputs a node has: delivered once per node and content
        self.delivered: OrderedDict[tuple[str, str, str, str, str], None] = OrderedDict()
        self.copies = 0  # output copies in flight
        rt.metrics.comfy_files_source = self.held

    def config(self, route: str) -> ComfyConfig:
        rcfg = self.rt.cfg.routes.get(route)
        return rcfg.comfy if rcfg is not None else ComfyConfig()

    def files(self, route: str) -> RouteFiles:
        got = self.routes.get(route)
        if got is None:
            for gone in [r for r in self.routes if r not in self.rt.cfg.routes]:
                del self.routes[gone]  # a route removed by a reload takes its files with it
            got = self.routes[route] = RouteFiles(self.rt.clock)
        # A reload may change the bounds: read them at each use.
        got.max_bytes = int(self.config(route).max_files_mb * 1024 * 1024)
        got.ttl = self.rt.cfg.jobs.result_ttl_sec
        return got

    def bucket(self, route: str) -> tuple[Bucket, str] | None:
        """The route's bucket and its key prefix for this route's objects, or None (memory)."""
        s3 = self.config(route).store.s3
        if s3 is None:
            return None
        session = self.rt.session("comfy-bucket:" + route)
        return (Bucket(session, s3.endpoint, s3.bucket, s3.region, s3.access_key, s3.secret_key.get_secret_value()),
                f"{s3.prefix}{route}/")

    def store(self, route: str) -> OutputStore:
        """Where the route's outputs go: its bucket; else (cluster mode) Redis; else memory."""
        bucket = self.bucket(route)
        if bucket is not None:
            return BucketStore(route, *bucket, self.files(route))
        if self.rt.comfy_shared is not None:
            return RedisStore(route, self.rt.comfy_shared, self.files(route))
        return MemoryStore(self.files(route))

    def held(self) -> Iterable[tuple[str, int, int]]:
        """(route, files, bytes in memory) of every configured route with files."""
        for route, files in self.routes.items():
            if route in self.rt.cfg.routes:
                h = files.held()
                yield route, h.files, h.bytes

    def was_delivered(self, node: str, f: RouteFile) -> bool:
        return (node, f.kind, f.subfolder, f.name, f.sha256) in self.delivered

    def mark_delivered(self, node: str, f: RouteFile) -> None:
        self.delivered[(node, f.kind, f.subfolder, f.name, f.sha256)] = None
        while len(self.delivered) > DELIVERED_MAX:
            self.delivered.popitem(last=False)


def files_state(rt: Runtime) -> FilesState:
    st = rt.adapter_state.get(STATE_KEY)
    if not isinstance(st, FilesState):
        st = rt.adapter_state[STATE_KEY] = FilesState(rt)
    return st


async def held(rt: Runtime, route: str, kind: str, subfolder: str, name: str) -> RouteFile | None:
    """A held input (upload) by name: this gateway's, else (cluster mode) one another gateway took."""
    files = files_state(rt).files(route)
    f = files.get(kind, subfolder, name)
    shared = rt.comfy_shared
    if f is not None or shared is None or kind == OUTPUT:
        return f
    got = await shared.get(route, kind, subfolder, name)
    return None if got is None else files.adopt(kind, subfolder, name, got.data, got.sha256, set(got.owners))


async def share(rt: Runtime, route: str, f: RouteFile) -> None:
    """Cluster mode: the held file for the other gateways too."""
    shared = rt.comfy_shared
    if shared is not None and f.data is not None:
        await shared.put(route, f.kind, f.subfolder, f.name, SharedFile(f.data, f.sha256, frozenset(f.owners)),
                         rt.cfg.jobs.result_ttl_sec)


def object_key(prefix: str, kind: str, subfolder: str, name: str) -> str:
    return f"{prefix}{kind}/{subfolder + '/' if subfolder else ''}{name}"


# --- the stores ---------------------------------------------------------------------------------------

class StoreError(Exception):
    """The store did not take or give a file (logged; the file stays on its node)."""


class OutputStore(Protocol):
    async def put(self, f: RouteFile, data: bytes, digest: str, ctype: str) -> None:
        """The output's bytes stored and ``f`` marked so (raises ObjectExists, StoreError)."""

    async def find(self, files: RouteFiles, subfolder: str, name: str) -> RouteFile | None:
        """An output this gateway's record does not have (a restart, another gateway's) but the store does."""

    async def send(self, request: web.Request, f: RouteFile, request_id: str) -> web.StreamResponse:
        """The stored file's bytes to the client."""


class MemoryStore:
    def __init__(self, files: RouteFiles):
        self.files = files

    async def put(self, f: RouteFile, data: bytes, digest: str, ctype: str) -> None:
        self.files.copied(f, data, len(data), digest)

    async def find(self, files: RouteFiles, subfolder: str, name: str) -> RouteFile | None:
        return None  # memory is the record itself

    async def send(self, request: web.Request, f: RouteFile, request_id: str) -> web.StreamResponse:
        if f.data is None:
            return _not_found(request_id)
        return web.Response(body=f.data, headers=_file_headers(f.name, None, request_id))


class RedisStore:
    """Cluster mode without a bucket: outputs in Redis's memory, read by every gateway."""

    def __init__(self, route: str, shared: SharedInputs, files: RouteFiles):
        self.route, self.shared, self.files = route, shared, files

    async def put(self, f: RouteFile, data: bytes, digest: str, ctype: str) -> None:
        try:
            done = await self.shared.put_output(self.route, f.subfolder, f.name, SharedFile(data, digest,
                                                frozenset(f.owners)), ctype, self.files.ttl, self.files.max_bytes)
        except REDIS_ERRORS as e:
            raise StoreError(f"Redis: {type(e).__name__}") from e
        if not done:
            raise StoreError("larger than comfy.max_files_mb")
        self.files.copied(f, None, len(data), digest)

    async def find(self, files: RouteFiles, subfolder: str, name: str) -> RouteFile | None:
        got = await self.shared.output(self.route, subfolder, name, files.ttl, with_data=False)
        return None if got is None else files.known(OUTPUT, subfolder, name, set(got.owners), got.size)

    async def send(self, request: web.Request, f: RouteFile, request_id: str) -> web.StreamResponse:
        got = await self.shared.output(self.route, f.subfolder, f.name, self.files.ttl, with_data=True)
        if got is None or got.data is None:
            return _not_found(request_id)  # dropped by the bound or the TTL, as ComfyUI says of a file not there
        return web.Response(body=got.data, headers=_file_headers(f.name, got.ctype, request_id))


class BucketStore:
    """The route's S3-compatible bucket: objects streamed, never overwritten."""

    def __init__(self, route: str, bucket: Bucket, prefix: str, files: RouteFiles):
        self.route, self.bucket, self.prefix, self.files = route, bucket, prefix, files

    async def put(self, f: RouteFile, data: bytes, digest: str, ctype: str) -> None:
        owners = ",".join(quote(o, safe="") for o in sorted(f.owners))
        try:
            await self.bucket.put(object_key(self.prefix, f.kind, f.subfolder, f.name), data, ctype,
                                  {"owners": owners})
        except ObjectExists:
            raise
        except BucketError as e:
            raise StoreError(str(e)) from e
        self.files.copied(f, None, len(data), digest)

    async def find(self, files: RouteFiles, subfolder: str, name: str) -> RouteFile | None:
        try:
            r = await self.bucket.open(object_key(self.prefix, OUTPUT, subfolder, name), "HEAD")
        except BucketError as e:
            log.warning("[%s] bucket: %s", self.route, e)
            return None
        if r is None:
            return None
        owners = {unquote(o) for o in unquote(r.headers.get("x-amz-meta-owners", "")).split(",") if o}
        size = int(r.headers.get("Content-Length", "0") or 0)
        r.release()
        return files.known(OUTPUT, subfolder, name, owners, size)

    async def send(self, request: web.Request, f: RouteFile, request_id: str) -> web.StreamResponse:
        try:
            r = await self.bucket.open(object_key(self.prefix, f.kind, f.subfolder, f.name), "GET")
        except BucketError as e:
            log.warning("[%s] bucket: %s", self.route, e)
            return web.Response(status=502, headers={"X-Request-Id": request_id})
        if r is None:
            return _not_found(request_id)
        try:
            headers = _file_headers(f.name, r.headers.get("Content-Type"), request_id)
            resp, _ = await stream_back(request, r, headers)
            return resp
        finally:
            r.release()


def reader(rt: Runtime, route: str, subject: str | None) -> Callable[[RouteFile], bool]:
    """Whether the caller may read a file: its owner, the admin key (``subject`` None), anyone on
    a shared route."""
    shared = files_state(rt).config(route).shared
    return lambda f: subject is None or may_read(f, subject, False, shared)


# --- names in what clients see ------------------------------------------------------------------

def rename_outputs(entry: dict[str, Any], files: RouteFiles, node: str, owner: str | None) -> dict[str, Any]:
    """A history entry (or an ``executed`` output) with each file dict of type output or temp
    under the route's name for it: what a client sees is the route's directory, never a node's."""
    outputs = entry.get("outputs")
    if not isinstance(outputs, dict):
        return entry
    return {**entry, "outputs": {nid: rename_ui(out, files, node, owner) for nid, out in outputs.items()}}


def rename_ui(out: Any, files: RouteFiles, node: str, owner: str | None) -> Any:
    """One node's UI output (``{"images": [{filename, subfolder, type}], …}``) under route names."""
    if not isinstance(out, dict):
        return out
    return {k: [_renamed(item, files, node, owner) for item in items] if isinstance(items, list) else items
            for k, items in out.items()}


def _renamed(item: Any, files: RouteFiles, node: str, owner: str | None) -> Any:
    if not isinstance(item, dict) or not isinstance(item.get("filename"), str):
        return item
    kind = item.get("type") or OUTPUT
    sub = clean_subfolder(str(item.get("subfolder") or ""))
    if kind not in (OUTPUT, TEMP) or sub is None:
        return item
    return {**item, "filename": files.route_filename(node, item["filename"], sub, kind, owner)}


def executed_for_client(rt: Runtime, route: str, node: str, owner: str | None, data: dict[str, Any]) -> dict[str, Any]:
    """An ``executed`` event's data from ``node`` as the route's client sees it: its files under
    the route's names (named now: the client asks ``/view`` for them before the prompt ends)."""
    out = data.get("output")
    if out is None:
        return data
    return {**data, "output": rename_ui(out, files_state(rt).files(route), node, owner)}


def history_for_client(rt: Runtime, route: str, node: str, owner: str | None, entry: dict[str, Any]) -> dict[str, Any]:
    """A history entry of a prompt that ran on ``node``, its files under the route's names."""
    return rename_outputs(entry, files_state(rt).files(route), node, owner)


def output_files(entry: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(kind, subfolder, node filename) of every output and preview a history entry lists."""
    found = []
    outputs = entry.get("outputs")
    for out in outputs.values() if isinstance(outputs, dict) else ():
        for items in out.values() if isinstance(out, dict) else ():
            for item in items if isinstance(items, list) else ():
                if isinstance(item, dict) and isinstance(item.get("filename"), str):
                    kind = item.get("type") or OUTPUT
                    sub = clean_subfolder(str(item.get("subfolder") or ""))
                    if kind in (OUTPUT, TEMP) and sub is not None:
                        found.append((kind, sub, item["filename"]))
    return found


async def claim_names(rt: Runtime, route: str, node: str, entry: dict[str, Any]) -> None:
    """Cluster mode: the route names of an entry's outputs (a history entry, or ``{"outputs":
    {id: an executed output}}``) reserved in Redis before any client sees them, so no two
    gateways give one name to two files. Without Redis each gateway names from what it knows."""
    shared = rt.comfy_shared
    if shared is None:
        return
    files = files_state(rt).files(route)
    for kind, sub, node_name in output_files(entry):
        if kind != OUTPUT or files.of_node(node, kind, sub, node_name) is not None:
            continue
        file = "/".join(quote(p, safe="") for p in (node, sub, node_name))
        for _ in range(CLAIM_TRIES):
            cand = files.free_name(kind, sub, node_name)
            try:
                if await shared.reserve(route, kind, sub, cand, file, files.ttl):
                    files.name_output(node, kind, sub, node_name, None, cand)
                    break
            except REDIS_ERRORS as e:
                log.warning("comfy files: Redis did not answer (%s): outputs named by this gateway alone",
                            type(e).__name__)
                return
            files.taken_elsewhere(kind, sub, cand)


# --- the copy at the end of a prompt --------------------------------------------------------------

async def prompt_finished(rt: Runtime, route: str, node: str, entry: dict[str, Any], owner: str) -> dict[str, Any]:
    """Name the finished prompt's files on the route, start copying its outputs off the node,
    and return the entry as clients see it (route names)."""
    await claim_names(rt, route, node, entry)
    st = files_state(rt)
    files = st.files(route)
    for kind, sub, name in output_files(entry):
        f = files.name_output(node, kind, sub, name, owner)
        if kind == OUTPUT and not f.stored:
            st.copies += 1
            rt.spawn(_copy(rt, route, node, f))
    return rename_outputs(entry, files, node, owner)


async def _copy(rt: Runtime, route: str, node: str, f: RouteFile) -> None:
    st = files_state(rt)
    try:
        ns = rt.scheduler.nodes.get(node)
        if ns is None:
            raise aiohttp.ClientError("node gone")
        limit = st.files(route).max_bytes
        query = urlencode({"filename": f.node_name, "subfolder": f.subfolder, "type": f.kind})
        async with rt.session(node).get(f"{ns.cfg.url}/view?{query}", headers=ns.cfg.headers,
                                        timeout=aiohttp.ClientTimeout(total=COPY_SEC)) as r:
            if r.status != 200:
                raise aiohttp.ClientError(f"HTTP {r.status}")
            data = await r.content.read(limit + 1)
            ctype = r.headers.get("Content-Type", "application/octet-stream")
        if len(data) > limit:
            raise aiohttp.ClientError("larger than comfy.max_files_mb")
        await st.store(route).put(f, data, hashlib.sha256(data).hexdigest(), ctype)
    except ObjectExists:
        # Another gateway, or this one before a restart, gave the name to another file (each
        # names outputs from what it knows): that file is never replaced; this one is served
        # from its node while it lives.
        f.failed = True
        log.warning("[%s] the route's bucket already has %s: not overwritten", node, f.name)
    except (aiohttp.ClientError, OSError, TimeoutError, StoreError) as e:
        f.failed = True
        log.warning("[%s] could not copy an output off the node (%s): it is served from the node while it lives",
                    node, e)
    finally:
        st.copies -= 1


# --- /view ------------------------------------------------------------------------------------------

def is_view(method: str, path: str) -> bool:
    return method in ("GET", "HEAD") and path in VIEW_PATHS


async def view(rt: Runtime, request: web.Request, route: str, subject: str | None,
               request_id: str) -> web.StreamResponse | None:
    """``/view`` from the route's files, or None to pass it on (an input the gateway never held:
    one of the node's own, such as ComfyUI's example.png)."""
    q = request.query
    filename = q.get("filename")
    if filename is None:
        return None  # ComfyUI's 404; the node says so
    if not filename or filename.startswith("/") or ".." in filename:
        return web.Response(status=400, headers={"X-Request-Id": request_id})
    kind = q.get("type", OUTPUT)
    sub = clean_subfolder(q.get("subfolder", ""))
    if sub is None:
        return web.Response(status=403, headers={"X-Request-Id": request_id})
    if kind not in KINDS or "/" in filename:
        return None
    st = files_state(rt)
    files = st.files(route)
    may = reader(rt, route, subject)
    store = st.store(route)
    f = await held(rt, route, kind, sub, filename)
    if f is None and kind == OUTPUT:
        f = await store.find(files, sub, filename)
    if f is None:
        # Outputs come only from the route's record (ComfyUI's 404 for what is not there); an
        # input it never held may be one of the node's own files, a preview it was not told of
        # one only a node has.
        return _not_found(request_id) if kind == OUTPUT else None
    if not may(f):
        return _not_found(request_id)
    files.use(f)
    if f.data is not None:
        return web.Response(body=f.data, headers=_file_headers(f.name, None, request_id))
    if f.in_store:
        return await store.send(request, f, request_id)
    if f.node is not None:
        return await _stream_node(rt, request, f, request_id)
    return _not_found(request_id)


async def job_file(rt: Runtime, request: web.Request, route: str, node: str, query: str, request_id: str,
                   named: tuple[str, str] | None = None) -> web.StreamResponse | None:
    """A ComfyUI job's output file (``/v1/jobs/{id}/files/{n}``: the node and its /view query)
    from the store once it was copied there; None while only the node has it. ``named``: the
    (subfolder, route name) the job's result gave it, by which the store holds it for a gateway
    that did not copy it (cluster mode: the job ran through another)."""
    q = parse_qs(query)
    kind, sub = q.get("type", [OUTPUT])[0], clean_subfolder(q.get("subfolder", [""])[0])
    st = files_state(rt)
    f = st.files(route).of_node(node, kind, sub, q.get("filename", [""])[0]) if sub is not None else None
    if (f is None or not f.stored) and named is not None and kind == OUTPUT:
        f = await st.store(route).find(st.files(route), *named)
    if f is None or not f.stored:
        return None
    st.files(route).use(f)
    if f.data is not None:
        return web.Response(body=f.data, headers=_file_headers(f.name, None, request_id))
    return await st.store(route).send(request, f, request_id)


def job_file_name(result: bytes, n: int) -> tuple[str, str] | None:
    """(subfolder, route name) of a ComfyUI job's output file ``n`` as its result names it: the
    output whose ``url`` is the job's ``/files/{n}``."""
    try:
        doc = orjson.loads(result)
    except orjson.JSONDecodeError:
        return None
    outputs = doc.get("outputs") if isinstance(doc, dict) else None
    for out in outputs.values() if isinstance(outputs, dict) else ():
        for items in out.values() if isinstance(out, dict) else ():
            for item in items if isinstance(items, list) else ():
                url = item.get("url") if isinstance(item, dict) else None
                if isinstance(url, str) and urlsplit(url).path.endswith(f"/files/{n}") \
                        and isinstance(item.get("filename"), str) and (item.get("type") or OUTPUT) == OUTPUT:
                    sub = clean_subfolder(str(item.get("subfolder") or ""))
                    return None if sub is None else (sub, item["filename"])
    return None


def _not_found(request_id: str) -> web.Response:
    return web.Response(status=404, headers={"X-Request-Id": request_id})


def _file_headers(name: str, ctype: str | None, request_id: str) -> CIMultiDict[str]:
    ctype = ctype or mimetypes.guess_type(name)[0] or "application/octet-stream"
    if ctype in DOWNLOAD_ONLY:
        ctype = "application/octet-stream"
    return CIMultiDict({"Content-Type": ctype, "Content-Disposition": f'filename="{name}"',
                        "X-Request-Id": request_id, "Server": SERVER})


async def _stream_node(rt: Runtime, request: web.Request, f: RouteFile, request_id: str) -> web.StreamResponse:
    """A file only its node has yet (a copy under way, or a preview): from the node while it lives."""
    assert f.node is not None
    ns = rt.scheduler.nodes.get(f.node)
    if ns is None:
        return _not_found(request_id)
    keep = [(k, v) for k, v in request.query.items() if k not in ("filename", "subfolder", "type")]
    query = urlencode([("filename", f.node_name), ("subfolder", f.subfolder), ("type", f.kind), *keep])
    try:
        async with rt.session(f.node).get(f"{ns.cfg.url}/view?{query}", headers=ns.cfg.headers,
                                          timeout=aiohttp.ClientTimeout(total=COPY_SEC)) as r:
            if r.status != 200:
                return _not_found(request_id)
            resp, _ = await stream_back(request, r, _file_headers(f.name, r.headers.get("Content-Type"),
                                                                  request_id))
            return resp
    except ConnectionResetError:
        raise  # the client left
    except (aiohttp.ClientError, OSError, TimeoutError):
        return _not_found(request_id)  # the node is gone, and so is the file: what ComfyUI would say

"""ComfyUI's user data behind the gateway: each key its own, on every node (docs/API.md "ComfyUI
over several GPUs", user data per key).

ComfyUI keeps the saved workflows and subgraphs, ``user.css``, ``comfy.templates.json`` and the
settings in one user directory on its own disk (app/user_manager.py, app/app_settings.py). Passed
straight through, every key would read and overwrite every other key's, on one node only. So:

- A key (not the admin key, on a route without ``comfy.shared``) has a directory of its own in
  the node's: ``key_dir``. Every name it sends is moved under it and the prefix is taken off
  every path the node answers with, so the client never sees it. A name that would leave the
  directory is refused with ComfyUI's own answer for a bad path. ComfyUI's settings handlers
  take no path (they keep ``comfy.settings.json`` at the top of the user dir), so a key's
  settings are served here from its own ``comfy.settings.json``, read and written through the
  node's userdata API and merged as ComfyUI merges.
- A write (a file's POST, DELETE or move; a settings POST) goes to every node of the route that
  is up, at once: the standby then has a key's workflows when the primary dies. The client gets
  the answer of the node reads come from; a node that fails the write is logged. A node that
  joins later has only what is written after.
- A read goes to the first node that answers (Scheduler.answering, as the page's other files).

Decoding, as the node decodes: aiohttp decodes a path segment or a query value once, and
ComfyUI once more when a ``%`` is left (``/v2/userdata``'s ``path`` once more still). What is
sent is encoded so that the node ends on exactly the name meant (``_segment``, ``_query_value``).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import posixpath
import re
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlencode

import aiohttp
import orjson
from aiohttp import web
from yarl import URL

from kilolined.adapters.comfy_node import node_api
from kilolined.core.errors import error_response
from kilolined.core.verdict import failed_status
from kilolined.ops.runtime import Runtime
from kilolined.wire import expect

log = logging.getLogger("kilolined")

API = "/api"
SETTINGS_FILE = "comfy.settings.json"
ROOTS = ("/userdata", "/v2/userdata", "/settings")
READS = frozenset({"GET", "HEAD"})
PASSED_HEADERS = ("Content-Type", "Last-Modified", "ETag")
FAILED = (aiohttp.ClientError, OSError, TimeoutError)
OTHERS_SEC = 5.0  # a write: how long the client's answer waits for the other nodes to take it too


@dataclass(frozen=True)
class UserCall:
    """A user-data request: ``what`` (list, list_v2, file, move, settings, setting, other), the
    form the client used (``api``: "" or "/api", which the node gets too) and the names it holds
    (the file and the destination, or the setting id), decoded as the node decodes them."""

    what: str
    api: str
    names: tuple[str, ...] = ()


# --- the rules (pure) -----------------------------------------------------------------------------

def is_user_data(path: str) -> bool:
    """Whether a (decoded) path is ComfyUI's user data or settings, in its plain or /api form."""
    p = path[len(API):] if path.startswith(API + "/") else path
    return any(p == root or p.startswith(root + "/") for root in ROOTS)


def node_name(raw: str) -> str:
    """A raw path segment as ComfyUI ends up reading it: aiohttp decodes it, ComfyUI again if a
    ``%`` is left."""
    name = unquote(raw)
    return unquote(name) if "%" in name else name


def user_call(raw_path: str) -> UserCall | None:
    """What the raw path (the node's, without the query) asks, or None when it is no user data."""
    api = API if raw_path.startswith(API + "/") else ""
    parts = raw_path[len(api):].split("/")
    if len(parts) == 2 and parts[1] in ("userdata", "settings"):
        return UserCall("list" if parts[1] == "userdata" else "settings", api)
    if parts[1:] == ["v2", "userdata"]:
        return UserCall("list_v2", api)
    if len(parts) == 3 and parts[1] == "settings" and parts[2]:
        return UserCall("setting", api, (unquote(parts[2]),))
    if len(parts) == 3 and parts[1] == "userdata" and parts[2]:
        return UserCall("file", api, (node_name(parts[2]),))
    if len(parts) == 5 and parts[1] == "userdata" and parts[3] == "move" and parts[2] and parts[4]:
        return UserCall("move", api, (node_name(parts[2]), node_name(parts[4])))
    return UserCall("other", api) if is_user_data(raw_path) else None


def is_write(call: UserCall, method: str) -> bool:
    return (method == "POST" and call.what in ("file", "move", "settings", "setting")) or \
        (method == "DELETE" and call.what == "file")


def key_dir(subject: str) -> str:
    """A key's directory in the node's user dir: its name as any file system takes it, and a hash
    of the whole name, so that two names that read alike there stay apart. Never the secret."""
    readable = re.sub(r"[^A-Za-z0-9_-]+", "-", subject)[:32].strip("-")
    digest = hashlib.sha256(subject.encode()).hexdigest()[:12]
    return f"kl-{readable}-{digest}" if readable else f"kl-{digest}"


def refused(name: str) -> bool:
    """A name that could leave the key's directory: absolute, with a ``..`` part, a backslash (a
    Windows node's separator) or a NUL."""
    return not name or name.startswith("/") or "\\" in name or "\x00" in name or ".." in name.split("/")


def inside(kdir: str, name: str) -> str:
    """The node's name for a key's ``name`` (normalised as ComfyUI normalises: ``a//b/`` is ``a/b``)."""
    norm = posixpath.normpath(name)
    return kdir if norm == "." else f"{kdir}/{norm}"


def outside(kdir: str, path: str) -> str:
    """A path the node answered, as the key sees it."""
    return path[len(kdir) + 1:] if path.startswith(kdir + "/") else "" if path == kdir else path


def _segment(name: str) -> str:
    """A path segment the node decodes to ``name``: aiohttp decodes once, ComfyUI once more since
    the result then holds a ``%`` (a key's name always has a ``/``)."""
    return quote(quote(name, safe=""), safe="")


def _query_value(name: str, decodes: int) -> str:
    """A query value (before urlencode) that ComfyUI decodes ``decodes`` more times to ``name``."""
    for _ in range(decodes):
        name = quote(name, safe="")
    return name


def without_prefix(kdir: str, what: str, answer: Any) -> Any:
    """A node's JSON answer with the key's directory taken off the paths it holds: a file's path
    (a string, or an info object's ``path``) after a write or a move, ``/v2/userdata``'s entries."""
    if isinstance(answer, str):
        return outside(kdir, answer)
    if isinstance(answer, dict) and isinstance(answer.get("path"), str):
        return {**answer, "path": outside(kdir, answer["path"])}
    if what == "list_v2" and isinstance(answer, list):
        return [without_prefix(kdir, what, e) for e in answer]
    return answer


def settings_of(status: int, body: bytes) -> dict[str, Any]:
    """The settings a node's copy of ``comfy.settings.json`` holds: none when there is no file or
    it is not a JSON object (ComfyUI's own reading of a corrupted file)."""
    if status != 200:
        return {}
    try:
        got = json.loads(body)
    except ValueError:
        return {}
    return got if isinstance(got, dict) else {}


# --- the calls -------------------------------------------------------------------------------------

def _report(node: str, method: str, path: str, task: asyncio.Task[Answer]) -> None:
    """A node that did not take a write is logged; the write goes on on the others."""
    if task.cancelled():
        return
    e = task.exception()
    if e is not None:
        log.warning("[%s] user data %s %s not written: %s", node, method, path, type(e).__name__)
    elif failed_status(task.result().status):
        log.warning("[%s] user data %s %s not written: HTTP %d", node, method, path, task.result().status)


@dataclass
class Answer:
    node: str
    status: int
    body: bytes
    headers: dict[str, str]


class UserData:
    """One user-data request of one client, to the route's nodes."""

    def __init__(self, rt: Runtime, request: web.Request, route: str, request_id: str,
                 locks: weakref.WeakValueDictionary[tuple[str, str], asyncio.Lock]):
        self.rt, self.request, self.route, self.rid, self.locks = rt, request, route, request_id, locks
        sched = rt.scheduler
        now, rq = rt.clock(), sched.routes[route]
        #: every node of the route, the ones that answer first: a primary that just died is
        #: still "usable" until its health check fails, and the standby has the same data
        self.reads = sched.answering(rq, now)
        #: every node that is up (all of them when none is: one may be back)
        self.writes = [n for n in self.reads if sched.nodes[n].available(now)] or self.reads
        self.timeout = sched.routes[route].cfg.request_timeout_sec

    async def _ask(self, node: str, method: str, target: str, body: bytes) -> Answer:
        api = node_api(self.rt, node, self.rid)
        headers = {**api.headers, **{h: self.request.headers[h] for h in ("Content-Type", "Comfy-User")
                                     if h in self.request.headers}}
        try:
            async with api.session.request(
                    method, URL(api.url + target, encoded=True), data=body if method == "POST" else None,
                    headers=headers, allow_redirects=False,
                    timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                got = await r.read()
                return Answer(node, r.status, got, {h: r.headers[h] for h in PASSED_HEADERS if h in r.headers})
        except aiohttp.ClientConnectorError:
            self.rt.scheduler.nodes[node].lost(self.rt.clock())  # the next request tries the others first
            raise

    async def read(self, method: str, target: str) -> Answer | None:
        """The first node's answer; the next node's when one cannot be reached."""
        for node in self.reads:
            try:
                return await self._ask(node, method, target, b"")
            except FAILED as e:
                log.info("[%s] user data %s %s: %s; the next node", node, method, target.split("?", 1)[0],
                         type(e).__name__)
        return None

    async def write(self, method: str, target: str, body: bytes) -> Answer | None:
        """Sent to every node that is up at once, each to its end even if the client leaves. The
        answer is the first node's that gave one, in the order reads take; the others are given
        ``OTHERS_SEC`` to be done too (the client's next write then reaches them after this one)."""
        path = target.split("?", 1)[0]
        tasks = [self.rt.spawn(self._ask(n, method, target, body)) for n in self.writes]
        for node, task in zip(self.writes, tasks, strict=True):
            task.add_done_callback(functools.partial(_report, node, method, path))
        chosen: Answer | None = None
        for task in tasks:
            try:
                chosen = await asyncio.shield(task)
                break
            except FAILED:
                continue  # reported
        pending = [t for t in tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=OTHERS_SEC)
        return chosen

    def answer(self, got: Answer | None, body: bytes | None = None) -> web.Response:
        if got is None:
            return error_response(502, "upstream_error", "no node of the route answered", request_id=self.rid)
        return web.Response(status=got.status, body=got.body if body is None else body,
                            headers={**got.headers, "X-Request-Id": self.rid, "X-KiloLine-Node": got.node})

    async def body(self) -> bytes:
        if not self.request.can_read_body:
            return b""
        expect.let_body_come(self.request)
        return await self.request.read()


async def user_data(rt: Runtime, request: web.Request, route: str, raw_path: str, subject: str | None,
                    request_id: str, locks: weakref.WeakValueDictionary[tuple[str, str], asyncio.Lock]
                    ) -> web.StreamResponse | None:
    """The answer to a user-data request, or None to pass it through as any page request (a
    read of the node's own user dir: the admin key's, a ``comfy.shared`` route's)."""
    call = user_call(raw_path)
    if call is None:
        return None
    method = request.method
    ud = UserData(rt, request, route, request_id, locks)
    if subject is None or rt.scheduler.routes[route].cfg.comfy.shared:
        if not is_write(call, method):
            return None
        qs = request.rel_url.raw_query_string
        return ud.answer(await ud.write(method, raw_path + ("?" + qs if qs else ""), await ud.body()))
    return await _own(ud, call, key_dir(subject))


def _plain(status: int, text: str | None = None) -> web.Response:
    """ComfyUI's (aiohttp's) own plain answer."""
    return web.Response(status=status, text=text)


async def _own(ud: UserData, call: UserCall, kdir: str) -> web.StreamResponse:
    """A key's request, in its own directory."""
    handler = _HANDLERS.get((call.what, "GET" if ud.request.method == "HEAD" else ud.request.method))
    if handler is None:
        known = any(what == call.what for what, _ in _HANDLERS)
        return _plain(405, "405: Method Not Allowed") if known else _plain(404, "404: Not Found")
    return await handler(ud, call, kdir)


async def _list(ud: UserData, call: UserCall, kdir: str) -> web.StreamResponse:
    q = ud.request.rel_url.query
    directory = q.get("dir", "")
    if not directory:
        return _plain(400, "Directory not provided")
    name = unquote(directory) if "%" in directory else directory
    if refused(name):
        return _plain(403, "Invalid directory")
    rest = [(k, v) for k, v in q.items() if k != "dir"]
    query = urlencode([("dir", _query_value(inside(kdir, name), 1)), *rest])
    return ud.answer(await ud.read(ud.request.method, f"{call.api}/userdata?{query}"))  # relative to dir


async def _list_v2(ud: UserData, call: UserCall, kdir: str) -> web.StreamResponse:
    q = ud.request.rel_url.query
    name = unquote(q.get("path", ""))
    name = unquote(name) if "%" in name else name
    if name and refused(name):
        return _plain(400, "Invalid path requested")
    rest = [(k, v) for k, v in q.items() if k != "path"]
    query = urlencode([("path", _query_value(inside(kdir, name or "."), 2)), *rest])
    got = await ud.read(ud.request.method, f"{call.api}/v2/userdata?{query}")
    if got is not None and got.status == 404 and not name:
        got = Answer(got.node, 200, b"[]", {"Content-Type": "application/json; charset=utf-8"})  # nothing saved yet
    return _json_answer(ud, got, kdir, call.what)


def _json_answer(ud: UserData, got: Answer | None, kdir: str, what: str) -> web.Response:
    """The node's answer, its paths as the key sees them."""
    if got is None or got.status != 200 or "json" not in got.headers.get("Content-Type", ""):
        return ud.answer(got)
    try:
        doc = orjson.loads(got.body)
    except orjson.JSONDecodeError:
        return ud.answer(got)
    return ud.answer(got, json.dumps(without_prefix(kdir, what, doc)).encode())


def _target(call: UserCall, kdir: str, *names: str) -> str:
    """``/userdata/{file}`` or ``/userdata/{file}/move/{dest}`` in the key's directory."""
    return f"{call.api}/userdata/" + "/move/".join(_segment(inside(kdir, n)) for n in names)


def _with_query(ud: UserData, target: str) -> str:
    qs = ud.request.rel_url.raw_query_string
    return target + ("?" + qs if qs else "")


async def _file_read(ud: UserData, call: UserCall, kdir: str) -> web.StreamResponse:
    if refused(call.names[0]):
        return _plain(403)
    return ud.answer(await ud.read(ud.request.method, _target(call, kdir, call.names[0])))


async def _file_write(ud: UserData, call: UserCall, kdir: str) -> web.StreamResponse:
    if any(refused(n) for n in call.names):
        return _plain(403)
    target = _with_query(ud, _target(call, kdir, *call.names))
    got = await ud.write(ud.request.method, target, await ud.body())
    return _json_answer(ud, got, kdir, call.what)


def _settings_target(call: UserCall, kdir: str) -> str:
    return f"{call.api}/userdata/{_segment(inside(kdir, SETTINGS_FILE))}"


async def _settings(ud: UserData, call: UserCall, kdir: str) -> tuple[dict[str, Any], Answer] | web.Response:
    got = await ud.read("GET", _settings_target(call, kdir))
    if got is None:
        return ud.answer(None)
    return settings_of(got.status, got.body), got


async def _get_settings(ud: UserData, call: UserCall, kdir: str) -> web.StreamResponse:
    read = await _settings(ud, call, kdir)
    if isinstance(read, web.Response):
        return read
    settings, got = read
    value: Any = settings if call.what == "settings" else settings.get(call.names[0])
    return web.json_response(value, headers={"X-Request-Id": ud.rid, "X-KiloLine-Node": got.node})


async def _post_settings(ud: UserData, call: UserCall, kdir: str) -> web.StreamResponse:
    """ComfyUI's read, merge, write, for the key's own file (one at a time per key on this
    gateway: the page stores several settings at once)."""
    try:
        new = orjson.loads(await ud.body())
    except orjson.JSONDecodeError:
        return error_response(400, "bad_request", "the body must be JSON", request_id=ud.rid)
    if call.what == "settings" and not isinstance(new, dict):
        return error_response(400, "bad_request", "the body must be a JSON object of settings", request_id=ud.rid)
    key = (ud.route, kdir)
    lock = ud.locks.get(key)
    if lock is None:
        lock = ud.locks[key] = asyncio.Lock()
    async with lock:
        read = await _settings(ud, call, kdir)
        if isinstance(read, web.Response):
            return read
        settings, _ = read
        settings = {**settings, **new} if call.what == "settings" else {**settings, call.names[0]: new}
        got = await ud.write("POST", _settings_target(call, kdir), json.dumps(settings, indent=4).encode())
    if got is None or got.status != 200:
        return ud.answer(got)
    return web.Response(status=200, headers={"X-Request-Id": ud.rid, "X-KiloLine-Node": got.node})


Handler = Callable[[UserData, UserCall, str], Awaitable[web.StreamResponse]]
_HANDLERS: dict[tuple[str, str], Handler] = {
    ("list", "GET"): _list,
    ("list_v2", "GET"): _list_v2,
    ("file", "GET"): _file_read,
    ("file", "POST"): _file_write,
    ("file", "DELETE"): _file_write,
    ("move", "POST"): _file_write,
    ("settings", "GET"): _get_settings,
    ("setting", "GET"): _get_settings,
    ("settings", "POST"): _post_settings,
    ("setting", "POST"): _post_settings,
}

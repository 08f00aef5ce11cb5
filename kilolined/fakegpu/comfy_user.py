"""The fake ComfyUI's user directory: saved workflows, settings, ``user.css`` (app/user_manager.py
and app/app_settings.py of ComfyUI 0.19.3, single-user: everything in the ``default`` user's dir).

The same routes, the same decoding (aiohttp decodes a path segment or a query value once, and
ComfyUI once more when a ``%`` is left), the same answers: the error texts and statuses, a file
path relative to the user's dir, a listing relative to the listed dir, ``/v2/userdata`` entries
relative to the user's dir and sorted directories first. Kept in memory: like the fake's images,
it outlives a kill() (files on "disk").
"""

from __future__ import annotations

import json
import mimetypes
import posixpath
import time
from dataclasses import dataclass, field
from urllib.parse import unquote

from aiohttp import web

ROOT = "/user/default"


@dataclass
class Stored:
    data: bytes
    modified: float
    created: float


@dataclass
class UserDir:
    files: dict[str, Stored] = field(default_factory=dict)  # path relative to the user's dir → file
    dirs: set[str] = field(default_factory=set)  # "" is the user's dir itself

    # --- app/user_manager.py's path rules ----------------------------------------------------
    def resolve(self, name: str | None, create_dir: bool = True) -> str | None:
        """The path under the user's dir ("" for the dir itself), or None when it leaves it."""
        path = ROOT
        if name is not None:
            if "%" in name:
                name = unquote(name)
            path = posixpath.normpath(posixpath.join(ROOT, name))
            if posixpath.commonpath((ROOT, path)) != ROOT:
                return None
        rel = posixpath.relpath(path, ROOT)
        rel = "" if rel == "." else rel
        if create_dir:
            self.makedirs(posixpath.dirname(rel) if rel else "")
        return rel

    def makedirs(self, rel: str) -> None:
        parts = rel.split("/") if rel else []
        self.dirs.add("")
        for i in range(1, len(parts) + 1):
            self.dirs.add("/".join(parts[:i]))

    def exists(self, rel: str) -> bool:
        return rel in self.files or rel in self.dirs

    def info(self, rel: str, relative_to: str) -> dict[str, object]:
        f = self.files[rel]
        return {"path": posixpath.relpath(rel, relative_to or "."), "size": len(f.data),
                "modified": f.modified, "created": f.created}

    def write(self, rel: str, data: bytes) -> None:
        now = time.time()
        old = self.files.get(rel)
        self.files[rel] = Stored(data, now, old.created if old else now)

    # --- the handlers -----------------------------------------------------------------------
    async def list_dir(self, request: web.Request) -> web.Response:
        directory = request.rel_url.query.get("dir", "")
        if not directory:
            return web.Response(status=400, text="Directory not provided")
        path = self.resolve(directory)
        if path is None:
            return web.Response(status=403, text="Invalid directory")
        if not self.exists(path):
            return web.Response(status=404, text="Directory not found")
        q = request.rel_url.query
        recurse, full_info, split = (q.get(k, "").lower() == "true" for k in ("recurse", "full_info", "split"))
        out: list[object] = []
        for rel in sorted(self.files):
            inner = posixpath.relpath(rel, path or ".")
            if inner.startswith("../") or (not recurse and "/" in inner):
                continue
            if full_info:
                out.append(self.info(rel, path))
            else:
                out.append([inner, *inner.split("/")] if split else inner)
        return web.json_response(out)

    async def list_v2(self, request: web.Request) -> web.Response:
        requested = unquote(request.rel_url.query.get("path", ""))
        target = self.resolve(requested, create_dir=False) if requested else ""
        if target is None:
            return web.Response(status=400, text="Invalid path requested")
        if not self.exists(target):
            if target == "":
                return web.json_response([])
            return web.Response(status=404, text="Requested path not found")
        if target in self.files:
            return web.Response(status=400, text="Requested path is not a directory")
        inside = [p for p in (*self.dirs, *self.files) if p and (not target or p.startswith(target + "/"))]
        out: list[dict[str, object]] = []
        for p in inside:
            entry: dict[str, object] = {"name": posixpath.basename(p), "path": p,
                                        "type": "file" if p in self.files else "directory"}
            if p in self.files:
                entry.update(size=len(self.files[p].data), modified=self.files[p].modified)
            out.append(entry)
        out.sort(key=lambda x: (x["type"] != "directory", str(x["name"]).lower()))
        return web.json_response(out)

    def _path(self, request: web.Request, check_exists: bool = False, param: str = "file") -> str | web.Response:
        name = request.match_info.get(param)
        if not name:
            return web.Response(status=400)
        path = self.resolve(name)
        if path is None:
            return web.Response(status=403)
        if check_exists and not self.exists(path):
            return web.Response(status=404)
        return path

    async def get_file(self, request: web.Request) -> web.Response:
        path = self._path(request, check_exists=True)
        if not isinstance(path, str):
            return path
        ctype = mimetypes.guess_type(path)[0] or "application/octet-stream"
        return web.Response(body=self.files[path].data, content_type=ctype)

    async def post_file(self, request: web.Request) -> web.Response:
        path = self._path(request)
        if not isinstance(path, str):
            return path
        refused = self._refused(request, path)
        if refused is not None:
            return refused
        self.write(path, await request.read())
        return self._written(request, path)

    async def delete_file(self, request: web.Request) -> web.Response:
        path = self._path(request, check_exists=True)
        if not isinstance(path, str):
            return path
        self.files.pop(path, None)
        return web.Response(status=204)

    async def move_file(self, request: web.Request) -> web.Response:
        source = self._path(request, check_exists=True)
        if not isinstance(source, str):
            return source
        dest = self._path(request, param="dest")
        if not isinstance(dest, str):
            return dest
        refused = self._refused(request, dest)
        if refused is not None:
            return refused
        self.files[dest] = self.files.pop(source)
        return self._written(request, dest)

    def _refused(self, request: web.Request, path: str) -> web.Response | None:
        """ComfyUI's 409 for a name taken when the client said ``overwrite=false``."""
        if request.query.get("overwrite", "true") == "false" and self.exists(path):
            return web.Response(status=409, text="File already exists")
        return None

    def _written(self, request: web.Request, path: str) -> web.Response:
        """The answer to a write or move: the path, or its info with ``full_info=true``."""
        full_info = request.query.get("full_info", "false").lower() == "true"
        return web.json_response(self.info(path, "") if full_info else path)

    # --- app/app_settings.py ----------------------------------------------------------------
    def settings(self) -> dict[str, object]:
        path = self.resolve("comfy.settings.json")
        f = self.files.get(path or "")
        if f is None:
            return {}
        try:
            loaded = json.loads(f.data)
        except ValueError:
            return {}
        return loaded if isinstance(loaded, dict) else {}

    def save(self, settings: dict[str, object]) -> None:
        self.write("comfy.settings.json", json.dumps(settings, indent=4).encode())

    async def get_settings(self, _: web.Request) -> web.Response:
        return web.json_response(self.settings())

    async def get_setting(self, request: web.Request) -> web.Response:
        return web.json_response(self.settings().get(request.match_info.get("id", "")))

    async def post_settings(self, request: web.Request) -> web.Response:
        settings = self.settings()
        self.save({**settings, **await request.json()})
        return web.Response(status=200)

    async def post_setting(self, request: web.Request) -> web.Response:
        settings = self.settings()
        settings[request.match_info["id"]] = await request.json()
        self.save(settings)
        return web.Response(status=200)

    async def users(self, _: web.Request) -> web.Response:
        return web.json_response({"storage": "server", "migrated": "" in self.dirs})

    def add_routes(self, app: web.Application) -> None:
        for prefix in ("", "/api"):
            app.router.add_get(prefix + "/users", self.users)
            app.router.add_get(prefix + "/userdata", self.list_dir)
            app.router.add_get(prefix + "/v2/userdata", self.list_v2)
            app.router.add_get(prefix + "/userdata/{file}", self.get_file)
            app.router.add_post(prefix + "/userdata/{file}", self.post_file)
            app.router.add_delete(prefix + "/userdata/{file}", self.delete_file)
            app.router.add_post(prefix + "/userdata/{file}/move/{dest}", self.move_file)
            app.router.add_get(prefix + "/settings", self.get_settings)
            app.router.add_get(prefix + "/settings/{id}", self.get_setting)
            app.router.add_post(prefix + "/settings", self.post_settings)
            app.router.add_post(prefix + "/settings/{id}", self.post_setting)

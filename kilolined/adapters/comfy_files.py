"""The files of one ComfyUI route, as one ComfyUI would have them: pure bookkeeping, clock injected.

ComfyUI keeps a prompt's files on the server that runs it: the uploaded inputs in its ``input``
directory, the outputs in ``output``, previews in ``temp``. Behind the gateway a route has
several such servers, so the route keeps one directory of its own (docs/API.md "ComfyUI over
several GPUs"):
- **inputs** uploaded through the gateway are held here (bytes in memory) and delivered to the
  node a prompt is sent to (comfy_inputs.py);
- **outputs** a node made get the route's name — the node's own while no other file of the
  route has it, else the next free one, numbered as ComfyUI numbers a clash — and their bytes
  once copied (comfy_store.py), or a mark that they are in the route's bucket or Redis;
- **temp** previews are only named: their bytes stay on the node that made them.

Each file records the keys that own it (who uploaded it, whose prompt made it); only they (and
the admin key, or everyone on a ``comfy.shared`` route) may read it. Memory is bounded by
``comfy.max_files_mb`` (the oldest bytes are dropped first) and every file is forgotten
``jobs.result_ttl_sec`` after it was last used.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

INPUT, OUTPUT, TEMP = "input", "output", "temp"
KINDS = (INPUT, OUTPUT, TEMP)
MAX_ENTRIES = 100_000  # files named per route, bytes or not (a name costs ~300 bytes)
# ComfyUI's SaveImage names: {prefix}_{counter:05}_.{ext}, the counter one past the highest in use.
_COUNTED = re.compile(r"^(?P<stem>.*)_(?P<n>\d{5,})_(?P<ext>\.[^./]*)?$")

Key = tuple[str, str, str]  # (kind, subfolder, filename)


@dataclass(eq=False)
class RouteFile:
    kind: str
    subfolder: str
    name: str  # the route's name for it
    owners: set[str]
    used: float  # clock time of the last hold or use: the TTL counts from it
    data: bytes | None = None  # held in memory
    sha256: str = ""
    size: int = 0
    in_store: bool = False  # its bytes are in the route's bucket or (cluster mode) Redis
    node: str | None = None  # outputs and previews: the node that made it, under ``node_name``
    node_name: str = ""
    failed: bool = False  # the copy could not be made: only the node has it (while it lives)

    @property
    def key(self) -> Key:
        return self.kind, self.subfolder, self.name

    @property
    def stored(self) -> bool:
        return self.data is not None or self.in_store


@dataclass
class Held:
    """What one route holds now (``/admin/state``, metrics)."""

    files: int = 0
    bytes: int = 0


def clean_subfolder(subfolder: str) -> str | None:
    """A subfolder as a key, or None when it would leave the directory (ComfyUI answers 400/403)."""
    sub = subfolder.replace("\\", "/").strip("/")
    if subfolder.startswith("/") or any(p in ("..", ".") for p in sub.split("/") if p):
        return None
    return "/".join(p for p in sub.split("/") if p)


def valid_filename(name: str) -> bool:
    """A file's name within its folder, as ComfyUI's upload takes it: it refuses only a name whose
    path leaves the folder, so ``cat..png`` is a name; a / or \\ would name a subfolder.
    (``/view`` and a mask's ``original_ref`` refuse any name holding ``..``: their own check.)"""
    return name not in ("", ".", "..") and "/" not in name and "\\" not in name


def clash_name(name: str, n: int) -> str:
    """ComfyUI's upload renaming: ``cat.png`` → ``cat (1).png``."""
    stem, dot, ext = name.rpartition(".")
    if not dot or not stem:
        return f"{name} ({n})"
    return f"{stem} ({n}).{ext}"


def annotated(value: str) -> tuple[str, str, str]:
    """(kind, subfolder, filename) a LoadImage value names: ``sub/cat.png``, ``cat.png [output]``
    (folder_paths.annotated_filepath; without a suffix the input directory)."""
    kind = INPUT
    for k in KINDS:
        suffix = f" [{k}]"
        if value.endswith(suffix):
            kind, value = k, value[: -len(suffix)]
            break
    sub, _, name = value.replace("\\", "/").rpartition("/")
    return kind, sub.strip("/"), name


def may_read(f: RouteFile, subject: str, admin: bool, shared: bool) -> bool:
    return shared or admin or subject in f.owners


@dataclass
class RouteFiles:
    """One route's directory. ``clock`` is injected; ``max_bytes`` and ``ttl`` are read at each
    call from the route's config (the caller sets them before it)."""

    clock: Callable[[], float]
    max_bytes: int = 1024 * 1024 * 1024
    ttl: float = 600.0
    max_entries: int = MAX_ENTRIES
    _by_key: OrderedDict[Key, RouteFile] = field(default_factory=OrderedDict)  # least recently used first
    _by_node: dict[tuple[str, str, str, str], RouteFile] = field(default_factory=dict)  # (node, kind, sub, name)
    _counters: dict[tuple[str, str, str, str], set[int]] = field(default_factory=dict)  # (kind, sub, stem, ext)
    #: names another gateway of the cluster gave (cluster/comfyfiles.py): never given here
    _elsewhere: OrderedDict[Key, None] = field(default_factory=OrderedDict)
    _bytes: int = 0

    # --- looking up --------------------------------------------------------------------------
    def get(self, kind: str, subfolder: str, name: str) -> RouteFile | None:
        self.sweep()
        return self._by_key.get((kind, subfolder, name))

    def of_node(self, node: str, kind: str, subfolder: str, node_name: str) -> RouteFile | None:
        self.sweep()
        return self._by_node.get((node, kind, subfolder, node_name))

    def use(self, f: RouteFile) -> None:
        """A prompt or a download used it: it lives ``ttl`` from now, and is dropped last."""
        if self._by_key.get(f.key) is f:
            f.used = self.clock()
            self._by_key.move_to_end(f.key)

    def held(self) -> Held:
        self.sweep()
        return Held(len(self._by_key), self._bytes)

    # --- inputs ------------------------------------------------------------------------------
    def upload(self, kind: str, subfolder: str, name: str, data: bytes, owner: str, overwrite: bool,
               shared: bool = False) -> RouteFile:
        """ComfyUI's /upload/image: the same name with other bytes becomes ``name (1)``, unless
        ``overwrite``; the same name with the same bytes is the same file (a new owner joins it).
        A key overwrites only a file it owns (every file on a ``shared`` route): another key's
        upload of the name is renamed instead, never replaced."""
        digest = hashlib.sha256(data).hexdigest()
        final, n = name, 1
        while True:
            found = self.get(kind, subfolder, final)
            if found is None or (overwrite and (shared or owner in found.owners)):
                break
            if found.sha256 == digest and found.data is not None:
                found.owners.add(owner)
                self.use(found)
                return found
            final, n = clash_name(name, n), n + 1
        return self._put(RouteFile(kind, subfolder, final, {owner}, self.clock()), data, digest)

    def content(self, data: bytes, ext: str, owner: str) -> RouteFile:
        """An input given inline (``data:`` URL) or fetched: named by its content, so the same
        bytes are the same file however often a prompt names them."""
        digest = hashlib.sha256(data).hexdigest()
        name = f"kl_{digest[:32]}{ext}"
        found = self.get(INPUT, "", name)
        if found is not None and found.sha256 == digest and found.data is not None:
            found.owners.add(owner)
            self.use(found)
            return found
        return self._put(RouteFile(INPUT, "", name, {owner}, self.clock()), data, digest)

    def adopt(self, kind: str, subfolder: str, name: str, data: bytes, digest: str, owners: set[str]) -> RouteFile:
        """A held file another gateway of the cluster took (cluster/comfyfiles.py)."""
        return self._put(RouteFile(kind, subfolder, name, set(owners), self.clock()), data, digest)

    # --- outputs and previews --------------------------------------------------------------
    def name_output(self, node: str, kind: str, subfolder: str, node_name: str, owner: str | None,
                    name: str | None = None) -> RouteFile:
        """The route's file for a node's output or preview, named on first sight: ``name`` (one
        the cluster reserved for it), else the node's own name while no other file of the route
        has it, else the next free one. The same node file keeps its name (``executed`` and
        history name it again)."""
        found = self.of_node(node, kind, subfolder, node_name)
        if found is not None:
            if owner is not None:
                found.owners.add(owner)
            return found
        name = name or self.free_name(kind, subfolder, node_name)
        f = RouteFile(kind, subfolder, name, {owner} if owner is not None else set(), self.clock(), node=node,
                      node_name=node_name)
        self._add(f)
        return f

    def route_filename(self, node: str, node_name: str, subfolder: str, kind: str = OUTPUT,
                       owner: str | None = None) -> str:
        """What clients see for ``node``'s file (history, ``executed``, ``/view``)."""
        return self.name_output(node, kind, subfolder, node_name, owner).name

    def copied(self, f: RouteFile, data: bytes | None, size: int, digest: str) -> None:
        """The output's bytes are here (``data``) or in the bucket or Redis (``data`` None)."""
        if self._by_key.get(f.key) is not f:
            return  # dropped meanwhile
        f.sha256, f.size = digest, size
        if data is None:
            f.in_store = True
            f.used = self.clock()
            self._by_key.move_to_end(f.key)
            return
        self._set_data(f, data)

    def known(self, kind: str, subfolder: str, name: str, owners: set[str], size: int) -> RouteFile:
        """A file found in the bucket or Redis by name (after a restart, made through another gateway)."""
        f = RouteFile(kind, subfolder, name, set(owners), self.clock(), size=size, in_store=True)
        self._add(f)
        return f

    # --- bounds ------------------------------------------------------------------------------
    def sweep(self) -> None:
        """Forget what was not used for ``ttl``, then the least recently used while over the bounds."""
        now = self.clock()
        while self._by_key:
            f = next(iter(self._by_key.values()))
            if now - f.used < self.ttl and self._bytes <= self.max_bytes and len(self._by_key) <= self.max_entries:
                break
            self._drop(f)

    def _put(self, f: RouteFile, data: bytes, digest: str) -> RouteFile:
        old = self._by_key.get(f.key)
        if old is not None:
            self._drop(old)
        f.sha256 = digest
        self._add(f)
        self._set_data(f, data)
        return f

    def _set_data(self, f: RouteFile, data: bytes) -> None:
        self._bytes += len(data) - (len(f.data) if f.data is not None else 0)
        f.data, f.size, f.used = data, len(data), self.clock()
        self._by_key.move_to_end(f.key)
        self.sweep()

    def _add(self, f: RouteFile) -> None:
        self._by_key[f.key] = f
        if f.node is not None:
            self._by_node[(f.node, f.kind, f.subfolder, f.node_name)] = f
        m = _COUNTED.match(f.name)
        if m is not None:
            self._counters.setdefault((f.kind, f.subfolder, m["stem"], m["ext"] or ""), set()).add(int(m["n"]))
        self.sweep()

    def _drop(self, f: RouteFile) -> None:
        if self._by_key.get(f.key) is f:
            del self._by_key[f.key]
        if f.node is not None and self._by_node.get((f.node, f.kind, f.subfolder, f.node_name)) is f:
            del self._by_node[(f.node, f.kind, f.subfolder, f.node_name)]
        if f.data is not None:
            self._bytes -= len(f.data)
            f.data = None
        m = _COUNTED.match(f.name)
        if m is not None:
            counted = self._counters.get((f.kind, f.subfolder, m["stem"], m["ext"] or ""))
            if counted is not None:
                counted.discard(int(m["n"]))
                if not counted:
                    del self._counters[(f.kind, f.subfolder, m["stem"], m["ext"] or "")]

    def taken_elsewhere(self, kind: str, subfolder: str, name: str) -> None:
        """Another gateway gave this name: the next free one is asked for instead."""
        self._elsewhere[(kind, subfolder, name)] = None
        while len(self._elsewhere) > self.max_entries:
            self._elsewhere.popitem(last=False)

    def _taken(self, key: Key) -> bool:
        return key in self._by_key or key in self._elsewhere

    def free_name(self, kind: str, subfolder: str, name: str) -> str:
        """The node's name while the route has no file of it, else the next free one, as ComfyUI
        numbers a clash."""
        if not self._taken((kind, subfolder, name)):
            return name
        m = _COUNTED.match(name)
        if m is not None:
            # SaveImage's way: one past the highest counter of that prefix in the directory.
            counted = self._counters.get((kind, subfolder, m["stem"], m["ext"] or ""), {0})
            width = len(m["n"])
            n = max(counted) + 1
            while self._taken((kind, subfolder, cand := f"{m['stem']}_{n:0{width}}_{m['ext'] or ''}")):
                n += 1
            return cand
        n = 1
        while self._taken((kind, subfolder, cand := clash_name(name, n))):
            n += 1
        return cand

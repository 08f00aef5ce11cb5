"""`--kind comfyui` of the simulated GPU: ComfyUI's HTTP + WebSocket API, as ComfyUI 0.19 behaves.

Emulated closely enough that a gateway written against it works against the real server, in
what was measured on a running ComfyUI 0.19.3:
- the WebSocket: two `status` broadcasts per prompt (queued, started) and one at its end, the
  event order (`execution_success` → `status` → `executing: null`, history written before),
  `progress_state` at each node's start, on progress and at its finish, who receives what
  (nothing but `progress*` and `execution_interrupted` without a `client_id`, and nothing at all
  for a `client_id` no socket has, such as `""`);
- the cache: a node whose class and inputs match the previous prompt's is not run again, so an
  identical repeat sends only `execution_cached` (every node), `executed`, `execution_success`;
- duplicate `prompt_id`s are accepted; the old history entry stays until the new run ends, and
  every entry carries its submission's queue `number`;
- errors: an unknown class is a top-level `missing_node_type`, a body that is not JSON a bare
  500 from aiohttp, `execution_error` messages end in a newline and carry file paths;
- `/features`, `/upload/image`, `/api/jobs*`, `/interrupt`, `/queue`, the user data and settings
  (comfy_user.py), and every route also under `/api`.
With `parallel=0` every prompt runs at once (the gateway is what limits concurrency); with
`parallel=N` at most N run and the rest wait in this node's own queue. A crash or kill() is a
restart: queue, history, cache and the `number` counter are gone (files on "disk" stay).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import struct
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from aiohttp import WSMsgType, web

from kilolined.core import comfy_jobs
from kilolined.fakegpu.base import GIB, Job, is_int
from kilolined.fakegpu.card import Backend
from kilolined.fakegpu.comfy_graph import (
    LOADS_IMAGE,
    NODES,
    canonical_uuid,
    error_body,
    inputs_of,
    link,
    make_png,
    signatures,
    validate,
)
from kilolined.fakegpu.comfy_page import add_cache_headers, add_page_routes
from kilolined.fakegpu.comfy_user import UserDir
from kilolined.scheduling.costs import megapixels

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from kilolined.fakegpu.card import Card

VERSION = "0.19.3"
# capacity_mode="request": what an SDXL-class job holds (docs/CONFIG.md, "The simulated GPU")
COMFY_BASE_GB, COMFY_GB_PER_MEGAPIXEL = 4.0, 1.5
HISTORY_CAP = 10000  # ComfyUI's own cap
IMAGE_CAP = 10000
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
SENSITIVE_EXTRA_DATA_KEYS = ("auth_token_comfy_org", "api_key_comfy_org")
MAX_UPLOAD_SIZE = 100 * 1024 * 1024
FEATURES = {"supports_preview_metadata": True, "max_upload_size": MAX_UPLOAD_SIZE,
            "extension": {"manager": {"supports_v4": True}}, "node_replacements": True, "assets": False}
# What aiohttp answers when a handler raises (ComfyUI's POST /prompt on a body that is not JSON).
AIOHTTP_500 = "500 Internal Server Error\n\nServer got itself in trouble"
OOM_TIPS = ("This error means you ran out of memory on your GPU.\n\nTIPS: If the workflow worked before you might "
            "have accidentally set the batch_size to a large number.")


def now_ms() -> int:
    return int(time.time() * 1000)


def internal_error() -> web.Response:
    """aiohttp's own 500, connection closed, as a real ComfyUI answers when `request.json()` raises."""
    resp = web.Response(status=500, text=AIOHTTP_500, content_type="text/plain")
    resp.force_close()
    return resp


async def _json_or_none(request: web.Request) -> tuple[bool, Any]:
    """(True, the JSON body) or (False, None) when it is not JSON (an empty body is not JSON)."""
    try:
        return True, json.loads(await request.read())
    except ValueError:
        return False, None


@dataclass(eq=False)
class Prompt:
    number: float
    prompt_id: str
    graph: dict[str, Any]
    extra_data: dict[str, Any]
    outputs_to_execute: list[str]
    order: list[str]
    client_id: str | None
    seq: int
    job: Job | None = None
    node: str | None = None  # the node executing now, for a late-joining socket
    executed: list[str] = field(default_factory=list)
    messages: list[list[Any]] = field(default_factory=list)  # history status.messages
    outputs: dict[str, Any] = field(default_factory=dict)
    progress: dict[str, dict[str, Any]] = field(default_factory=dict)  # progress_state per node

    def queue_item(self) -> list[Any]:
        return [self.number, self.prompt_id, self.graph, self.extra_data, self.outputs_to_execute]


class ComfyBackend(Backend):
    def __init__(self, gpu: Card) -> None:
        super().__init__(gpu)
        self.sockets: dict[str, web.WebSocketResponse] = {}
        self.preview_metadata: set[str] = set()  # client ids that asked for previews with metadata
        self.pending: list[Prompt] = []
        self.running: list[Prompt] = []
        self.history: dict[str, dict[str, Any]] = {}
        self.images: dict[tuple[str, str, str], bytes] = {}
        self.user = UserDir()  # saved workflows and settings: on "disk", as the images
        self.cache: dict[str, dict[str, Any] | None] = {}  # node signature -> its UI output
        self.tasks: set[asyncio.Task[None]] = set()
        # ComfyUI sends every event through one queue and one publisher task: that is its order.
        self.outbox: asyncio.Queue[tuple[str, dict[str, Any] | bytes, str | None]] = asyncio.Queue()
        self.publisher: asyncio.Task[None] | None = None
        self.number = 0
        self.seq = 0
        self.image_counter = 0

    # ----------------------------------------------------------------- Backend hooks

    def add_routes(self, app: web.Application) -> None:
        routes: list[tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]] = [
            ("POST", "/prompt", self.post_prompt),
            ("GET", "/prompt", self.get_prompt),
            ("GET", "/ws", self.websocket),
            ("GET", "/history", self.get_history),
            ("GET", "/history/{prompt_id}", self.get_history_item),
            ("POST", "/history", self.post_history),
            ("GET", "/view", self.view),
            ("POST", "/upload/image", self.upload_image),
            ("POST", "/upload/mask", self.upload_mask),
            ("POST", "/interrupt", self.interrupt),
            ("GET", "/queue", self.get_queue),
            ("POST", "/queue", self.post_queue),
            ("GET", "/system_stats", self.system_stats),
            ("GET", "/features", self.features),
            ("GET", "/object_info", self.object_info),
            ("GET", "/object_info/{node_class}", self.object_info),
            ("GET", "/embeddings", self.empty_list),
            ("GET", "/extensions", self.empty_list),
            ("POST", "/free", self.free),
        ]
        for prefix in ("", "/api"):
            for method, path, handler in routes:
                if method == "GET":
                    app.router.add_get(prefix + path, handler)  # and HEAD, as ComfyUI's routes.get
                else:
                    app.router.add_route(method, prefix + path, handler)
        add_page_routes(app)  # the web UI's files: no /api form
        add_cache_headers(app)  # ComfyUI's cache middleware: no-store on every script and style
        self.user.add_routes(app)
        # The jobs API exists under /api only.
        app.router.add_get("/api/jobs", self.list_jobs)
        app.router.add_post("/api/jobs/cancel", self.cancel_jobs)
        app.router.add_get("/api/jobs/{job_id}", self.get_job)
        app.router.add_post("/api/jobs/{job_id}/cancel", self.cancel_job)

    def error_response(self, status: int, message: str) -> web.Response:
        kind = "server_error" if status >= 500 else "invalid_request"
        return web.json_response(error_body(kind, message), status=status)

    def screen(self, request: web.Request) -> web.Response | None:
        """ComfyUI's origin_only_middleware: 403 when a loopback Host meets a foreign Origin."""
        host, origin = request.headers.get("Host", "").lower(), request.headers.get("Origin", "").lower()
        if not host or not origin:
            return None
        host_parts, origin_parts = urlsplit("//" + host), urlsplit(origin)
        hostname = host_parts.hostname or ""
        if hostname not in LOOPBACK_NAMES and not hostname.startswith("127."):
            return None
        try:
            origin_port = origin_parts.port
        except ValueError:
            origin_port = None
        # An Origin without a port is compared by host name only, as ComfyUI does.
        same = origin_parts.netloc == host if origin_port is not None else origin_parts.hostname == hostname
        if same:
            return None
        self.gpu.count("origin_rejects")
        return web.Response(status=403)

    def extra_stats(self) -> dict[str, Any]:
        return {"pending": len(self.pending), "ws_clients": len(self.sockets), "history": len(self.history),
                "cached_nodes": len(self.cache)}

    async def on_down(self) -> None:
        """The process died: queue, history, cache, counter and sockets are gone; running prompts lost."""
        self.pending.clear()
        current = asyncio.current_task()
        tasks = [task for task in self.tasks if not task.done() and task is not current]
        if self.publisher is not None and self.publisher is not current:
            tasks.append(self.publisher)
        self.publisher = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.outbox = asyncio.Queue()
        self.running.clear()
        self.sockets.clear()
        self.preview_metadata.clear()
        self.history.clear()
        self.cache.clear()
        self.number = 0

    # ----------------------------------------------------------------- messages

    def emit(self, kind: str, data: dict[str, Any] | bytes, sid: str | None) -> None:
        """ComfyUI's send_sync: `sid` None means every socket."""
        self.outbox.put_nowait((kind, data, sid))
        if self.publisher is None or self.publisher.done():
            self.publisher = asyncio.get_running_loop().create_task(self._publish())

    async def _publish(self) -> None:
        while True:
            kind, data, sid = await self.outbox.get()
            targets = list(self.sockets.values()) if sid is None else [self.sockets[sid]] if sid in self.sockets else []
            for ws in targets:
                await self._send(ws, kind, data)

    async def _send(self, ws: web.WebSocketResponse, kind: str, data: dict[str, Any] | bytes) -> None:
        if ws.closed:
            return
        try:
            if isinstance(data, bytes):
                await ws.send_bytes(data)
            else:
                await ws.send_str(json.dumps({"type": kind, "data": data}))
        except (ConnectionError, RuntimeError):
            pass  # the socket went away; ComfyUI just drops the message too

    def queue_remaining(self) -> int:
        return len(self.pending) + len(self.running)

    def queue_updated(self) -> None:
        self.emit("status", {"status": {"exec_info": {"queue_remaining": self.queue_remaining()}}}, None)

    def _to_client(self, prompt: Prompt, kind: str, data: dict[str, Any]) -> None:
        """executing/executed: only to the prompt's client_id, nothing without one."""
        if prompt.client_id is not None:
            self.emit(kind, data, prompt.client_id)

    def _message(self, prompt: Prompt, kind: str, data: dict[str, Any], broadcast: bool = False) -> None:
        """execution_*: stamped and kept for history; sent to the client, or to all when `broadcast`."""
        data = {**data, "timestamp": now_ms()}
        prompt.messages.append([kind, data])
        if prompt.client_id is not None or broadcast:
            self.emit(kind, data, prompt.client_id)

    def _progress_state(self, prompt: Prompt, node_id: str, state: str, value: float, maximum: float) -> None:
        """progress_state lists every node started so far; sid None (no client_id) broadcasts it."""
        prompt.progress[node_id] = {"value": value, "max": maximum, "state": state}
        nodes = {nid: {**entry, "node_id": nid, "prompt_id": prompt.prompt_id, "display_node_id": nid,
                       "parent_node_id": None, "real_node_id": nid} for nid, entry in prompt.progress.items()}
        self.emit("progress_state", {"prompt_id": prompt.prompt_id, "nodes": nodes}, prompt.client_id)

    # ----------------------------------------------------------------- queue and execution

    async def post_prompt(self, request: web.Request) -> web.StreamResponse:
        gated = await self.gpu.gate(request)
        if gated is not None:
            return gated
        ok, body = await _json_or_none(request)
        if not ok:
            return internal_error()
        body = body if isinstance(body, dict) else {}
        if is_int(body.get("number")) or isinstance(body.get("number"), float):
            number: float = float(body["number"])
        else:
            number = -self.number if body.get("front") else self.number
            self.number += 1
        if "prompt" not in body:
            return web.json_response(error_body("no_prompt", "No prompt provided", "No prompt provided"), status=400)
        prompt_id = body.get("prompt_id")
        if prompt_id is None:
            prompt_id = str(uuid.uuid4())
        elif not canonical_uuid(prompt_id):
            return web.json_response(error_body("invalid_prompt_id", "prompt_id must be a valid UUID",
                                                f"prompt_id: {prompt_id!r}"), status=400)
        graph = body["prompt"]
        problem, outputs, order = validate(graph, self.input_exists)
        if problem is not None:
            return web.json_response(problem, status=400)
        extra_data = dict(body["extra_data"]) if isinstance(body.get("extra_data"), dict) else {}
        # ComfyUI targets any client_id but null (absent or null: broadcast). One that is not a
        # string, or empty, names no socket ("" never does: a socket without one gets a uuid).
        raw_id = body.get("client_id")
        client_id = None if raw_id is None else raw_id if isinstance(raw_id, str) else ""
        if "client_id" in body:
            extra_data["client_id"] = body["client_id"]
        extra_data["create_time"] = now_ms()
        for key in SENSITIVE_EXTRA_DATA_KEYS:
            extra_data.pop(key, None)
        self.seq += 1
        self.pending.append(Prompt(number, prompt_id, graph, extra_data, outputs, order, client_id, self.seq))
        self.queue_updated()  # queued
        self._pump()
        return web.json_response({"prompt_id": prompt_id, "number": number, "node_errors": {}})

    def _pump(self) -> None:
        """Start pending prompts while the card has room (always, with parallel=0)."""
        gpu = self.gpu
        while self.pending and gpu.up and not gpu.crashed and (
            gpu.parallel == 0 or len(self.running) < gpu.parallel
        ):
            prompt = min(self.pending, key=lambda p: (p.number, p.seq))
            self.pending.remove(prompt)
            # may trigger the OOM crash; the loop then stops
            prompt.job = gpu.begin_job(COMFY_BASE_GB + COMFY_GB_PER_MEGAPIXEL * megapixels(prompt.graph))
            self.running.append(prompt)
            self.queue_updated()  # started: ComfyUI's second status of a prompt
            task = asyncio.get_running_loop().create_task(self._run(prompt))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _run(self, prompt: Prompt) -> None:
        assert prompt.job is not None
        outcome: str | None = None
        try:
            ok = await self._execute(prompt, prompt.job)
            outcome = "ok" if ok else "error"
            # ComfyUI's task_done: history written, queue status sent; then the final `executing`.
            self._write_history(prompt, ok)
            self._leave(prompt, outcome)
            self.queue_updated()
            self._to_client(prompt, "executing", {"node": None, "prompt_id": prompt.prompt_id})
        finally:
            # Cancelled (kill/stop) leaves outcome None: the job counts as lost, with no history.
            self._leave(prompt, outcome)
        self._pump()

    def _leave(self, prompt: Prompt, outcome: str | None) -> None:
        if prompt in self.running:
            self.running.remove(prompt)
        if prompt.job is not None:
            self.gpu.end_job(prompt.job, outcome)

    def _cached(self, prompt: Prompt, sigs: dict[str, str]) -> set[str]:
        """ComfyUI's CLASSIC cache: what earlier prompts computed, kept only for this prompt's nodes."""
        wanted = set(sigs.values())
        self.cache = {sig: ui for sig, ui in self.cache.items() if sig in wanted}
        return {nid for nid in prompt.graph if sigs[nid] in self.cache}

    async def _execute(self, prompt: Prompt, job: Job) -> bool:
        gpu, pid = self.gpu, prompt.prompt_id
        sigs = signatures(prompt.graph)
        self._message(prompt, "execution_start", {"prompt_id": pid})
        cached = self._cached(prompt, sigs)
        self._message(prompt, "execution_cached", {"nodes": [n for n in prompt.graph if n in cached],
                                                   "prompt_id": pid})
        # ComfyUI stages the output nodes and whatever they need that the cache does not hold.
        staged = [n for n in prompt.order if n not in cached or n in prompt.outputs_to_execute]
        # GPU time is spent in the KSamplers; without one, in the first output node instead.
        work_nodes = {n for n in staged if prompt.graph[n]["class_type"] == "KSampler"} or {staged[0]}
        failure: tuple[str, str] | None = None
        current = staged[0]
        for node_id in staged:
            current = node_id
            class_type = prompt.graph[node_id]["class_type"]
            if job.stop.is_set():
                break
            if node_id in cached:  # an output node served from the cache: no `executing`
                if NODES[class_type].output_node:
                    self._output(prompt, node_id)
                self._progress_state(prompt, node_id, "finished", 1.0, 1.0)
                prompt.executed.append(node_id)
                continue
            prompt.node = node_id
            self._progress_state(prompt, node_id, "running", 0.0, 1.0)
            self._to_client(prompt, "executing", {"node": node_id, "display_node": node_id, "prompt_id": pid})
            if class_type == "FailNode":
                message = inputs_of(prompt.graph[node_id]).get("message")
                failure = (message if isinstance(message, str) else "FailNode failed on purpose", "RuntimeError")
                break
            maximum: float = 1.0
            if node_id in work_nodes:
                steps = inputs_of(prompt.graph[node_id]).get("steps")
                steps = steps if is_int(steps) else gpu.steps
                maximum = max(steps, 1)
                await self._sample(prompt, job, node_id, steps)
                if job.stop.is_set():
                    break
            if NODES[class_type].output_node:
                self._output(prompt, node_id)
            self._progress_state(prompt, node_id, "finished", maximum, maximum)
            self.cache[sigs[node_id]] = prompt.outputs.get(node_id)
            prompt.executed.append(node_id)
        prompt.node = None
        node_type = prompt.graph[current]["class_type"]
        if job.reason == "oom":
            failure = (f"{gpu.oom_message()}\n{OOM_TIPS}", "torch.OutOfMemoryError")
        elif failure is not None:
            failure = (f"{failure[0]}\n", failure[1])  # ComfyUI: "{exception}\n{tips}", tips empty
        if job.reason == "interrupted":
            self._message(prompt, "execution_interrupted", {
                "prompt_id": pid, "node_id": current, "node_type": node_type, "executed": list(prompt.executed),
            }, broadcast=True)
            return False
        if failure is not None:
            self._message(prompt, "execution_error", {
                "prompt_id": pid, "node_id": current, "node_type": node_type, "executed": list(prompt.executed),
                "exception_message": failure[0], "exception_type": failure[1],
                "traceback": ['  File "/opt/ComfyUI/execution.py", line 510, in execute\n'
                              "    output_data, output_ui, has_subgraph = await get_output_data(...)\n",
                              f'  File "/opt/ComfyUI/nodes.py", line 1520, in {node_type.lower()}\n'
                              f"    raise {failure[1]}({failure[0].rstrip()!r})\n"],
                "current_inputs": {k: [v] for k, v in inputs_of(prompt.graph[current]).items() if link(v) is None},
                "current_outputs": [n for n in prompt.graph if n in cached or n in prompt.executed]})
            return False
        self._message(prompt, "execution_success", {"prompt_id": pid})
        return True

    async def _sample(self, prompt: Prompt, job: Job, node_id: str, steps: int) -> None:
        """The GPU work of one node, reporting through ComfyUI's ProgressBar hook.

        With `progress_min_sec` > 0 updates closer than that or 0.5 % apart are dropped, as
        comfy/utils.py does; the first and the last always go.
        """
        gpu, pid = self.gpu, prompt.prompt_id
        loop = asyncio.get_running_loop()
        last_time, last_value = -1e9, 0
        for value in range(1, steps + 1):
            if not await gpu.work(job, gpu.step_ms / 1000):
                return
            now = loop.time()
            if gpu.progress_min_sec > 0 and value not in (1, steps) and (
                    now - last_time < gpu.progress_min_sec or (value - last_value) / steps < 0.005):
                continue
            last_time, last_value = now, value
            self._progress_state(prompt, node_id, "running", value, steps)
            self.emit("progress", {"value": value, "max": steps, "prompt_id": pid, "node": node_id}, prompt.client_id)
            if gpu.previews and prompt.client_id:
                self._preview(prompt, node_id, value)

    def _preview(self, prompt: Prompt, node_id: str, step: int) -> None:
        """A sampler step's preview to the prompt's client only, as ComfyUI sends it: binary type 4
        (metadata naming the prompt) to a socket that asked for it, else type 1 (format, image)."""
        image = make_png(f"preview/{prompt.prompt_id}/{node_id}/{step}")
        if prompt.client_id in self.preview_metadata:
            meta = json.dumps({"node_id": node_id, "prompt_id": prompt.prompt_id, "display_node_id": node_id,
                               "parent_node_id": None, "real_node_id": node_id, "image_type": "image/png"}).encode()
            frame = struct.pack(">II", 4, len(meta)) + meta + image
        else:
            frame = struct.pack(">II", 1, 2) + image  # PREVIEW_IMAGE, PNG
        self.emit("preview", frame, prompt.client_id)

    def _output(self, prompt: Prompt, node_id: str) -> None:
        ui = {"images": self._make_images(prompt, node_id)}
        prompt.outputs[node_id] = ui
        self._to_client(prompt, "executed",
                        {"node": node_id, "display_node": node_id, "output": ui, "prompt_id": prompt.prompt_id})

    def _make_images(self, prompt: Prompt, node_id: str) -> list[dict[str, str]]:
        node = prompt.graph[node_id]
        batch = next((b for n in prompt.graph.values() if n["class_type"] == "EmptyLatentImage"
                      and is_int(b := inputs_of(n).get("batch_size"))), 1)
        subfolder, name, kind = "", "ComfyUI_temp_fake", "temp"
        if node["class_type"] == "SaveImage":
            prefix = inputs_of(node).get("filename_prefix")
            prefix = prefix if isinstance(prefix, str) and prefix and ".." not in prefix else "ComfyUI"
            subfolder, _, name = prefix.strip("/").rpartition("/")
            kind = "output"
        images = []
        name = name or "ComfyUI"
        counter = self._next_counter(kind, subfolder, name) if kind == "output" else self.image_counter + 1
        for index in range(max(1, min(batch, 16))):
            self.image_counter = max(self.image_counter, counter)
            filename = f"{name}_{counter:05}_.png"
            counter += 1
            seed = f"{prompt.seq}/{prompt.prompt_id}/{node_id}/{index}/{self._loaded(prompt)}"
            self._store((kind, subfolder, filename), make_png(seed))
            images.append({"filename": filename, "subfolder": subfolder, "type": kind})
        return images

    def _next_counter(self, kind: str, subfolder: str, prefix: str) -> int:
        """folder_paths.get_save_image_path: one past the highest counter of ``prefix`` in the folder."""
        found = [0]
        for k, sub, filename in self.images:
            head, _, rest = filename.partition(prefix + "_")
            digits = rest.split("_")[0]
            if k == kind and sub == subfolder and not head and digits.isdigit() and rest.endswith("_.png"):
                found.append(int(digits))
        return max(found) + 1

    def input_exists(self, value: str) -> bool:
        """folder_paths.exists_annotated_filepath: ``sub/name``, or ``name [output]`` and the like."""
        kind = "input"
        for k in ("input", "output", "temp"):
            if value.endswith(f" [{k}]"):
                kind, value = k, value[: -len(k) - 3]
                break
        sub, _, name = value.rpartition("/")
        return (kind, sub.strip("/"), name) in self.images

    def _loaded(self, prompt: Prompt) -> str:
        """What the prompt's LoadImage nodes read, so an img2img output depends on its input."""
        found = []
        for node in prompt.graph.values():
            image = inputs_of(node).get("image") if node.get("class_type") in LOADS_IMAGE else None
            if isinstance(image, str):
                sub, _, name = image.rpartition("/")
                found.append(hashlib.sha256(self.images.get(("input", sub, name), b"")).hexdigest()[:16])
        return ",".join(found)

    def _store(self, key: tuple[str, str, str], data: bytes) -> None:
        if key not in self.images and len(self.images) >= IMAGE_CAP:
            self.images.pop(next(iter(self.images)))
        self.images[key] = data

    def _write_history(self, prompt: Prompt, ok: bool) -> None:
        """Under the prompt id, replacing an older run's entry (a reused id) where it stood."""
        if len(self.history) > HISTORY_CAP:
            self.history.pop(next(iter(self.history)))
        self.history[prompt.prompt_id] = {
            "prompt": prompt.queue_item(),
            "outputs": prompt.outputs,
            "status": {"status_str": "success" if ok else "error", "completed": ok, "messages": prompt.messages},
            "meta": {nid: {"node_id": nid, "display_node": nid, "parent_node": None, "real_node_id": nid}
                     for nid in prompt.outputs},
        }

    # ----------------------------------------------------------------- WebSocket

    async def websocket(self, request: web.Request) -> web.StreamResponse:
        client_id = request.query.get("clientId") or uuid.uuid4().hex
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.sockets[client_id] = ws  # a second socket with this id replaces the first
        self.preview_metadata.discard(client_id)  # and starts without feature flags
        try:
            status = {"exec_info": {"queue_remaining": self.queue_remaining()}}
            await self._send(ws, "status", {"status": status, "sid": client_id})
            for prompt in list(self.running):
                if prompt.client_id == client_id and prompt.node is not None:
                    await self._send(ws, "executing", {"node": prompt.node})
            first = True
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    continue
                with contextlib.suppress(ValueError):
                    message = json.loads(msg.data)
                    # Only a first frame negotiates features, as in ComfyUI.
                    if first and isinstance(message, dict) and message.get("type") == "feature_flags":
                        flags = message.get("data")
                        if isinstance(flags, dict) and flags.get("supports_preview_metadata") is True:
                            self.preview_metadata.add(client_id)
                        await self._send(ws, "feature_flags", dict(FEATURES))
                first = False
        finally:
            if self.sockets.get(client_id) is ws:
                del self.sockets[client_id]
                self.preview_metadata.discard(client_id)
        return ws

    # ----------------------------------------------------------------- other endpoints

    async def get_prompt(self, request: web.Request) -> web.Response:
        return web.json_response({"exec_info": {"queue_remaining": self.queue_remaining()}})

    async def get_history(self, request: web.Request) -> web.Response:
        items = list(self.history.items())
        try:
            max_items = int(request.query["max_items"]) if "max_items" in request.query else None
            offset = int(request.query.get("offset", "-1"))
        except ValueError:
            return internal_error()  # ComfyUI's int() raises
        if offset < 0:
            offset = max(len(items) - max_items, 0) if max_items is not None else 0
        end = offset + max_items if max_items is not None else None
        return web.json_response(dict(items[offset:end]))

    async def get_history_item(self, request: web.Request) -> web.Response:
        prompt_id = request.match_info["prompt_id"]
        entry = self.history.get(prompt_id)
        return web.json_response({prompt_id: entry} if entry is not None else {})

    async def post_history(self, request: web.Request) -> web.Response:
        ok, body = await _json_or_none(request)
        if not ok or not isinstance(body, dict):
            return internal_error()
        if body.get("clear"):
            self.history.clear()
        for prompt_id in body.get("delete") or []:
            if isinstance(prompt_id, str):
                self.history.pop(prompt_id, None)
        return web.Response(status=200)

    async def view(self, request: web.Request) -> web.Response:
        filename = request.query.get("filename")
        if filename is None:
            return web.Response(status=404)
        if not filename or filename.startswith("/") or ".." in filename:
            return web.Response(status=400)
        subfolder = request.query.get("subfolder", "")
        if subfolder.startswith("/") or ".." in subfolder.split("/"):
            return web.Response(status=403)
        data = self.images.get((request.query.get("type", "output"), subfolder.strip("/"), filename))
        if data is None:
            return web.Response(status=404)
        return web.Response(body=data, content_type="image/png",
                            headers={"Content-Disposition": f'filename="{filename}"'})

    async def upload_mask(self, request: web.Request) -> web.Response:
        """As /upload/image, the file written being the `original_ref` image with the mask's alpha:
        here a PNG made of both (the fake paints nothing). ComfyUI writes nothing, and still
        answers, when the original is not there."""
        try:
            post = await request.post()
            ref = json.loads(str(post.get("original_ref")))
        except ValueError:
            return web.Response(status=400)
        name = ref.get("filename") if isinstance(ref, dict) else None
        if not isinstance(name, str) or not name or name.startswith("/") or ".." in name:
            return web.Response(status=400)
        original = self.images.get((str(ref.get("type", "output")), str(ref.get("subfolder", "")), name))
        image = post.get("image")
        mask = image.file.read() if isinstance(image, web.FileField) else b""
        painted = None if original is None else make_png(
            "mask:" + hashlib.sha256(original).hexdigest() + hashlib.sha256(mask).hexdigest())
        return await self.upload_image(request, post, painted)

    async def upload_image(self, request: web.Request, post: Any = None, painted: bytes | None = None,
                           ) -> web.Response:
        """Multipart `image` (+ `type`, `subfolder`, `overwrite`); a same-named different file gets " (1)"."""
        try:
            post = post if post is not None else await request.post()
        except ValueError:
            return web.Response(status=400)
        image = post.get("image")
        if not isinstance(image, web.FileField) or not image.filename:
            return web.Response(status=400)
        kind = post.get("type") if post.get("type") in ("input", "temp", "output") else "input"
        subfolder = str(post.get("subfolder", ""))
        # ComfyUI refuses only a path that leaves the folder (``cat..png`` is a name); a / would
        # name a subfolder, which this fake does not make
        if subfolder.startswith("/") or ".." in subfolder.split("/") or "/" in image.filename \
                or image.filename in (".", ".."):
            return web.Response(status=400)
        image.file.seek(0)
        data = image.file.read() if painted is None else painted
        filename = image.filename
        if post.get("overwrite") not in ("true", "1"):
            stem, dot, ext = filename.rpartition(".") if "." in filename else (filename, "", "")
            n = 1
            while (found := self.images.get((str(kind), subfolder, filename))) is not None and found != data:
                filename = f"{stem} ({n}){dot}{ext}"
                n += 1
        if painted is not None or request.path.endswith("/upload/image"):
            self._store((str(kind), subfolder, filename), data)
        return web.json_response({"name": filename, "subfolder": subfolder, "type": kind})

    async def interrupt(self, request: web.Request) -> web.Response:
        """With {"prompt_id"} only if that prompt is running; without (or a broken body), everything."""
        _, body = await _json_or_none(request)
        prompt_id = body.get("prompt_id") if isinstance(body, dict) else None
        targets = [p for p in self.running if p.prompt_id == prompt_id] if prompt_id else list(self.running)
        for prompt in targets:
            if prompt.job is not None:
                self.gpu.interrupt(prompt.job)
        return web.Response(status=200)

    async def get_queue(self, request: web.Request) -> web.Response:
        pending = sorted(self.pending, key=lambda p: (p.number, p.seq))
        return web.json_response({"queue_running": [p.queue_item() for p in self.running],
                                  "queue_pending": [p.queue_item() for p in pending]})

    def _dequeue(self, prompt_id: str) -> bool:
        """Remove the first pending prompt with this id (as ComfyUI's delete_queue_item)."""
        for prompt in self.pending:
            if prompt.prompt_id == prompt_id:
                self.pending.remove(prompt)
                self.gpu.count("queue_deletes")
                self.queue_updated()
                return True
        return False

    async def post_queue(self, request: web.Request) -> web.Response:
        """Removes pending prompts only; running ones need /interrupt, as in ComfyUI."""
        ok, body = await _json_or_none(request)
        if not ok or not isinstance(body, dict):
            return internal_error()
        if body.get("clear"):
            self.gpu.count("queue_deletes", len(self.pending))
            self.pending.clear()
            self.queue_updated()
        for prompt_id in body.get("delete") or []:
            self._dequeue(prompt_id)
        return web.Response(status=200)

    # ----------------------------------------------------------------- the jobs API (/api/jobs)

    def _queues(self) -> tuple[list[list[Any]], list[list[Any]]]:
        pending = sorted(self.pending, key=lambda p: (p.number, p.seq))
        return [p.queue_item() for p in self.running], [p.queue_item() for p in pending]

    async def list_jobs(self, request: web.Request) -> web.Response:
        running, pending = self._queues()
        status, body = comfy_jobs.listing(running, pending, list(self.history.items()), request.query)
        return web.json_response(body, status=status)

    async def get_job(self, request: web.Request) -> web.Response:
        job = comfy_jobs.find(request.match_info["job_id"], *self._queues(), self.history)
        return web.json_response(job if job is not None else {"error": "Job not found"},
                                 status=200 if job is not None else 404)

    def _cancel(self, job_id: Any) -> bool:
        running = [p for p in self.running if p.prompt_id == job_id]
        if running:
            return any(p.job is not None and self.gpu.interrupt(p.job) for p in running)
        return isinstance(job_id, str) and self._dequeue(job_id)

    async def cancel_job(self, request: web.Request) -> web.Response:
        return web.json_response({"cancelled": self._cancel(request.match_info["job_id"])})

    async def cancel_jobs(self, request: web.Request) -> web.Response:
        ok, body = await _json_or_none(request)
        ids = body.get("job_ids") if ok and isinstance(body, dict) else None
        if not isinstance(ids, list):
            return web.json_response({"error": "job_ids must be a list"}, status=400)
        invalid = [i for i in ids if not canonical_uuid(i)]
        if invalid:
            return web.json_response({"error": "job_ids contains invalid id(s)", "invalid_ids": invalid}, status=400)
        return web.json_response({"cancelled": any([self._cancel(i) for i in ids])})

    # ----------------------------------------------------------------- system

    async def system_stats(self, request: web.Request) -> web.Response:
        return await self.gpu.health(request, self._system_stats)

    def _system_stats(self) -> web.Response:
        gpu = self.gpu
        total, used = int(gpu.vram_gb * GIB), int(gpu.vram_used_gb * GIB)
        device = {"name": "cuda:0 NVIDIA GeForce RTX 4090 (fake) : cudaMallocAsync", "type": "cuda", "index": 0,
                  "vram_total": total, "vram_free": max(total - used, 0),
                  "torch_vram_total": used, "torch_vram_free": 0}
        system = {"os": "posix", "ram_total": 64 * GIB, "ram_free": 48 * GIB, "comfyui_version": VERSION,
                  "required_frontend_version": "1.28.7", "installed_templates_version": "0.1.95",
                  "required_templates_version": "0.1.95", "python_version": sys.version,
                  "pytorch_version": "2.5.1+cu124", "embedded_python": False,
                  "argv": ["main.py", "--listen", gpu.host, "--port", str(gpu.port)]}
        return web.json_response({"system": system, "devices": [device]})

    async def features(self, request: web.Request) -> web.Response:
        return web.json_response(dict(FEATURES))

    async def object_info(self, request: web.Request) -> web.Response:
        wanted = request.match_info.get("node_class")
        info = {}
        for name, spec in NODES.items():
            if wanted is not None and name != wanted:
                continue
            info[name] = {
                "input": {"required": {field: [kind, {}] for field, kind in spec.inputs}},
                "input_order": {"required": [field for field, _ in spec.inputs]},
                "output": list(spec.outputs), "output_is_list": [False] * len(spec.outputs),
                "output_name": list(spec.outputs), "name": name, "display_name": name, "description": "",
                "python_module": "nodes", "category": spec.category, "output_node": spec.output_node,
            }
        return web.json_response(info)

    async def empty_list(self, request: web.Request) -> web.Response:
        return web.json_response([])

    async def free(self, request: web.Request) -> web.Response:
        """`free_memory` empties the cache (ComfyUI resets its executor between prompts)."""
        ok, body = await _json_or_none(request)
        if not ok or not isinstance(body, dict):
            return internal_error()
        if body.get("free_memory"):
            self.cache.clear()
        return web.Response(status=200)

"""`--kind comfyui` of the simulated GPU: ComfyUI's HTTP + WebSocket API (PROTOCOLS §1).

Emulated closely enough that a gateway written against it works against the real server:
`/prompt` validation errors, the WebSocket event order and who receives which event, history
that appears only when a prompt is done, `/view` serving real PNGs, `/interrupt` and the queue,
and the Origin check that trips proxies. Every route is also mounted under `/api`.
With `parallel=0` every prompt runs at once (the gateway is what limits concurrency); with
`parallel=N` at most N run and the rest wait in this node's own queue.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
import sys
import time
import uuid
import zlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlsplit

from aiohttp import WSMsgType, web

from kilolined.fakegpu import GIB, Backend, is_int, read_json

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from kilolined.fakegpu import FakeGPU, Job

HISTORY_CAP = 10000  # ComfyUI's own cap
IMAGE_CAP = 10000
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


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


def now_ms() -> int:
    return int(time.time() * 1000)


def prompt_error(kind: str, message: str, details: str = "", node_errors: dict[str, Any] | None = None,
                 status: int = 400) -> web.Response:
    body = {"error": {"type": kind, "message": message, "details": details, "extra_info": {}},
            "node_errors": node_errors or {}}
    return web.json_response(body, status=status)


def _link(value: Any) -> str | None:
    """The source node id when an input is a link `[node_id, slot]`."""
    if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and is_int(value[1]):
        return value[0]
    return None


def _inputs(node: dict[str, Any]) -> dict[str, Any]:
    inputs = node.get("inputs")
    return inputs if isinstance(inputs, dict) else {}


def _sort_key(node_id: str) -> tuple[int, str]:
    return (int(node_id), node_id) if node_id.isdigit() else (sys.maxsize, node_id)


def _topo_order(graph: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Dependencies first, ties by id; the second list holds nodes caught in a cycle."""
    deps = {nid: {src for v in _inputs(node).values() if (src := _link(v)) in graph} for nid, node in graph.items()}
    order: list[str] = []
    placed: set[str] = set()
    while True:
        ready = sorted((nid for nid in graph if nid not in placed and deps[nid] <= placed), key=_sort_key)
        if not ready:
            break
        order.extend(ready)
        placed.update(ready)
    return order, sorted((nid for nid in graph if nid not in placed), key=_sort_key)


def _upstream(graph: dict[str, Any], node_id: str) -> set[str]:
    seen: set[str] = set()
    todo = [node_id]
    while todo:
        nid = todo.pop()
        if nid in seen or nid not in graph:
            continue
        seen.add(nid)
        todo.extend(src for v in _inputs(graph[nid]).values() if (src := _link(v)) is not None)
    return seen


def _node_errors(node_id: str, node: dict[str, Any], graph: dict[str, Any]) -> list[dict[str, Any]]:
    class_type = node["class_type"]

    def err(kind: str, message: str, details: str) -> dict[str, Any]:
        return {"type": kind, "message": message, "details": details,
                "extra_info": {"node_id": node_id, "class_type": class_type}}

    if class_type not in NODES:
        return [err("missing_node_type", f"Node '{class_type}' not found. The custom node may not be installed.",
                    f"Node ID '#{node_id}'")]
    errors = []
    if "inputs" in node and not isinstance(node["inputs"], dict):
        errors.append(err("invalid_input_type", "Node inputs must be an object", "inputs"))
    for name, value in _inputs(node).items():
        src = _link(value)
        if src is not None and src not in graph:
            errors.append(err("bad_linked_input", "Bad linked input, the source node does not exist",
                              f"{name}, node '{src}'"))
    steps = _inputs(node).get("steps")
    if class_type == "KSampler" and steps is not None and _link(steps) is None:
        if not is_int(steps):
            errors.append(err("invalid_input_type", "Failed to convert an input value to a INT value",
                              f"steps, {steps!r}"))
        elif steps < 1:
            errors.append(err("value_smaller_than_min", "Value 0 smaller than min of 1", f"steps, {steps}"))
    return errors


def _validate(graph: Any) -> tuple[web.Response | None, list[str], list[str]]:
    """Returns (the 400 answer or None, output node ids, execution order)."""
    if not isinstance(graph, dict):
        return prompt_error("invalid_prompt", "The prompt must be an object of nodes"), [], []
    for node_id, node in graph.items():
        if not isinstance(node, dict) or not isinstance(node.get("class_type"), str):
            return prompt_error("invalid_prompt", "Cannot execute because a node is missing the class_type property.",
                                f"Node ID '#{node_id}'"), [], []
    outputs = sorted((nid for nid, node in graph.items()
                      if node["class_type"] in NODES and NODES[node["class_type"]].output_node), key=_sort_key)
    if not outputs:
        return prompt_error("prompt_no_outputs", "Prompt has no outputs"), [], []
    errors = {nid: errs for nid, node in graph.items() if (errs := _node_errors(nid, node, graph))}
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
        return prompt_error("prompt_outputs_failed_validation", "Prompt outputs failed validation", "",
                            node_errors), [], []
    return None, outputs, order


def _canonical_uuid(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        return str(uuid.UUID(value)) == value
    except ValueError:
        return False


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

    def queue_item(self) -> list[Any]:
        return [self.number, self.prompt_id, self.graph, self.extra_data, self.outputs_to_execute]


class ComfyBackend(Backend):
    def __init__(self, gpu: FakeGPU) -> None:
        super().__init__(gpu)
        self.sockets: dict[str, web.WebSocketResponse] = {}
        self.pending: list[Prompt] = []
        self.running: dict[str, Prompt] = {}
        self.history: dict[str, dict[str, Any]] = {}
        self.images: dict[tuple[str, str, str], bytes] = {}
        self.tasks: set[asyncio.Task[None]] = set()
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
            ("POST", "/interrupt", self.interrupt),
            ("GET", "/queue", self.get_queue),
            ("POST", "/queue", self.post_queue),
            ("GET", "/system_stats", self.system_stats),
            ("GET", "/object_info", self.object_info),
            ("GET", "/object_info/{node_class}", self.object_info),
            ("GET", "/embeddings", self.empty_list),
            ("GET", "/extensions", self.empty_list),
            ("POST", "/free", self.free),
        ]
        for prefix in ("", "/api"):
            for method, path, handler in routes:
                app.router.add_route(method, prefix + path, handler)

    def error_response(self, status: int, message: str) -> web.Response:
        kind = "server_error" if status >= 500 else "invalid_request"
        return prompt_error(kind, message, status=status)

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
        return {"pending": len(self.pending), "ws_clients": len(self.sockets), "history": len(self.history)}

    async def on_down(self) -> None:
        """The process died: queue and sockets are gone, prompts still running are lost."""
        self.pending.clear()
        current = asyncio.current_task()
        tasks = [task for task in self.tasks if not task.done() and task is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.running.clear()
        self.sockets.clear()

    # ----------------------------------------------------------------- queue and execution

    def queue_remaining(self) -> int:
        return len(self.pending) + len(self.running)

    async def post_prompt(self, request: web.Request) -> web.StreamResponse:
        gated = await self.gpu.gate(request)
        if gated is not None:
            return gated
        try:
            body = await read_json(request)
        except ValueError:
            return prompt_error("invalid_json", "The request body is not valid JSON")
        if not isinstance(body, dict) or "prompt" not in body:
            return prompt_error("no_prompt", "No prompt provided", "No prompt provided")
        graph = body["prompt"]
        answer, outputs, order = _validate(graph)
        if answer is not None:
            return answer
        if is_int(body.get("number")) or isinstance(body.get("number"), float):
            number: float = body["number"]
        else:
            number = -self.number if body.get("front") is True else self.number
            self.number += 1
        prompt_id = body["prompt_id"] if _canonical_uuid(body.get("prompt_id")) else str(uuid.uuid4())
        client_id = body.get("client_id") if isinstance(body.get("client_id"), str) and body["client_id"] else None
        extra_data = dict(body["extra_data"]) if isinstance(body.get("extra_data"), dict) else {}
        if client_id is not None:
            extra_data["client_id"] = client_id
        self.seq += 1
        self.pending.append(Prompt(number, prompt_id, graph, extra_data, outputs, order, client_id, self.seq))
        self._pump()
        await self._broadcast_status()
        return web.json_response({"prompt_id": prompt_id, "number": number, "node_errors": {}})

    def _pump(self) -> None:
        """Start pending prompts while the card has room (always, with parallel=0)."""
        gpu = self.gpu
        while self.pending and gpu.up and not gpu.crashed and (
            gpu.parallel == 0 or len(self.running) < gpu.parallel
        ):
            prompt = min(self.pending, key=lambda p: (p.number, p.seq))
            self.pending.remove(prompt)
            prompt.job = gpu.begin_job()  # may trigger the OOM crash; the loop then stops
            self.running[prompt.prompt_id] = prompt
            task = asyncio.get_running_loop().create_task(self._run(prompt))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _run(self, prompt: Prompt) -> None:
        assert prompt.job is not None
        outcome: str | None = None
        try:
            outcome = await self._execute(prompt, prompt.job)
        finally:
            # Cancelled (kill/stop) leaves outcome None: the job counts as lost, with no history.
            self.running.pop(prompt.prompt_id, None)
            self.gpu.end_job(prompt.job, outcome)
        self._pump()
        await self._broadcast_status()

    async def _execute(self, prompt: Prompt, job: Job) -> str:
        gpu, pid = self.gpu, prompt.prompt_id
        await self._event(prompt, "execution_start", {"prompt_id": pid, "timestamp": now_ms()})
        await self._event(prompt, "execution_cached", {"nodes": [], "prompt_id": pid, "timestamp": now_ms()})
        # GPU time is spent in the KSamplers; without one, in the first output node instead.
        work_nodes = {n for n in prompt.order if prompt.graph[n]["class_type"] == "KSampler"}
        work_nodes = work_nodes or {prompt.outputs_to_execute[0]}
        failure: tuple[str, str] | None = None
        current = prompt.order[0]
        for node_id in prompt.order:
            current = prompt.node = node_id
            class_type = prompt.graph[node_id]["class_type"]
            await self._to_client(prompt, "executing", {"node": node_id, "display_node": node_id, "prompt_id": pid})
            if job.stop.is_set():
                break
            if class_type == "FailNode":
                message = _inputs(prompt.graph[node_id]).get("message")
                failure = (message if isinstance(message, str) else "FailNode failed on purpose", "RuntimeError")
                break
            if node_id in work_nodes:
                steps = _inputs(prompt.graph[node_id]).get("steps")
                steps = steps if is_int(steps) else gpu.steps
                for value in range(1, steps + 1):
                    if not await gpu.work(job, gpu.step_ms / 1000):
                        break
                    await self._progress(prompt, {"value": value, "max": steps, "prompt_id": pid, "node": node_id})
                if job.stop.is_set():
                    break
            if NODES[class_type].output_node:
                ui = {"images": self._make_images(prompt, node_id)}
                prompt.outputs[node_id] = ui
                await self._to_client(prompt, "executed",
                                      {"node": node_id, "display_node": node_id, "output": ui, "prompt_id": pid})
            prompt.executed.append(node_id)
        prompt.node = None
        node_type = prompt.graph[current]["class_type"]
        if job.reason == "oom":
            failure = (gpu.oom_message(), "torch.OutOfMemoryError")
        if job.reason == "interrupted":
            await self._event(prompt, "execution_interrupted",
                              {"prompt_id": pid, "node_id": current, "node_type": node_type,
                               "executed": list(prompt.executed), "timestamp": now_ms()}, broadcast=True)
        elif failure is not None:
            await self._event(prompt, "execution_error", {
                "prompt_id": pid, "node_id": current, "node_type": node_type, "executed": list(prompt.executed),
                "exception_message": failure[0], "exception_type": failure[1],
                "traceback": ['  File "/ComfyUI/execution.py", line 496, in execute\n',
                              f"    raise {failure[1]}({failure[0]!r})\n"],
                "current_inputs": {k: [v] for k, v in _inputs(prompt.graph[current]).items() if _link(v) is None},
                "current_outputs": [], "timestamp": now_ms()})
        else:
            await self._event(prompt, "execution_success", {"prompt_id": pid, "timestamp": now_ms()})
        ok = job.reason is None and failure is None
        # As in ComfyUI (task_done, then the final executing): history is there before "node: null".
        self._write_history(prompt, ok)
        await self._to_client(prompt, "executing", {"node": None, "prompt_id": pid})
        return "ok" if ok else "error"

    def _make_images(self, prompt: Prompt, node_id: str) -> list[dict[str, str]]:
        node = prompt.graph[node_id]
        batch = next((b for n in prompt.graph.values() if n["class_type"] == "EmptyLatentImage"
                      and is_int(b := _inputs(n).get("batch_size"))), 1)
        subfolder, name, kind = "", "ComfyUI_temp_fake", "temp"
        if node["class_type"] == "SaveImage":
            prefix = _inputs(node).get("filename_prefix")
            prefix = prefix if isinstance(prefix, str) and prefix and ".." not in prefix else "ComfyUI"
            subfolder, _, name = prefix.strip("/").rpartition("/")
            kind = "output"
        images = []
        for index in range(max(1, min(batch, 16))):
            self.image_counter += 1
            filename = f"{name or 'ComfyUI'}_{self.image_counter:05}_.png"
            if len(self.images) >= IMAGE_CAP:
                self.images.pop(next(iter(self.images)))
            self.images[(kind, subfolder, filename)] = make_png(f"{prompt.prompt_id}/{node_id}/{index}")
            images.append({"filename": filename, "subfolder": subfolder, "type": kind})
        return images

    def _write_history(self, prompt: Prompt, ok: bool) -> None:
        if len(self.history) >= HISTORY_CAP:
            self.history.pop(next(iter(self.history)))
        self.history[prompt.prompt_id] = {
            "prompt": prompt.queue_item(),
            "outputs": prompt.outputs,
            "status": {"status_str": "success" if ok else "error", "completed": ok, "messages": prompt.messages},
            "meta": {nid: {"node_id": nid, "display_node": nid, "parent_node": None, "real_node_id": nid}
                     for nid in prompt.outputs},
        }

    # ----------------------------------------------------------------- WebSocket

    async def _send(self, ws: web.WebSocketResponse, kind: str, data: dict[str, Any]) -> None:
        if ws.closed:
            return
        try:
            await ws.send_str(json.dumps({"type": kind, "data": data}))
        except (ConnectionError, RuntimeError):
            pass  # the socket went away; ComfyUI just drops the message too

    async def _broadcast(self, kind: str, data: dict[str, Any]) -> None:
        for ws in list(self.sockets.values()):
            await self._send(ws, kind, data)

    async def _to_client(self, prompt: Prompt, kind: str, data: dict[str, Any]) -> None:
        """executing/executed: only to the prompt's client_id, nothing without one."""
        ws = self.sockets.get(prompt.client_id) if prompt.client_id is not None else None
        if ws is not None:
            await self._send(ws, kind, data)

    async def _event(self, prompt: Prompt, kind: str, data: dict[str, Any], broadcast: bool = False) -> None:
        """execution_*: always kept for history; sent to the client, or to all when `broadcast`."""
        prompt.messages.append([kind, data])
        if prompt.client_id is not None:
            await self._to_client(prompt, kind, data)
        elif broadcast:
            await self._broadcast(kind, data)

    async def _progress(self, prompt: Prompt, data: dict[str, Any]) -> None:
        # ComfyUI sends progress with sid=None when there is no client_id, which broadcasts.
        if prompt.client_id is not None:
            await self._to_client(prompt, "progress", data)
        else:
            await self._broadcast("progress", data)

    async def _broadcast_status(self) -> None:
        await self._broadcast("status", {"status": {"exec_info": {"queue_remaining": self.queue_remaining()}}})

    async def websocket(self, request: web.Request) -> web.StreamResponse:
        client_id = request.query.get("clientId") or uuid.uuid4().hex
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.sockets[client_id] = ws  # a second socket with this id replaces the first
        try:
            status = {"exec_info": {"queue_remaining": self.queue_remaining()}}
            await self._send(ws, "status", {"status": status, "sid": client_id})
            for prompt in list(self.running.values()):
                if prompt.client_id == client_id and prompt.node is not None:
                    await self._send(ws, "executing", {"node": prompt.node})
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    continue
                try:
                    message = json.loads(msg.data)
                except ValueError:
                    continue
                if isinstance(message, dict) and message.get("type") == "feature_flags":
                    await self._send(ws, "feature_flags", {"supports_preview_metadata": False})
        finally:
            if self.sockets.get(client_id) is ws:
                del self.sockets[client_id]
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
            return prompt_error("invalid_request", "max_items and offset must be integers")
        if offset < 0:
            offset = max(len(items) - max_items, 0) if max_items is not None else 0
        end = offset + max_items if max_items is not None else None
        return web.json_response(dict(items[offset:end]))

    async def get_history_item(self, request: web.Request) -> web.Response:
        prompt_id = request.match_info["prompt_id"]
        entry = self.history.get(prompt_id)
        return web.json_response({prompt_id: entry} if entry is not None else {})

    async def post_history(self, request: web.Request) -> web.Response:
        body = await _optional_json(request)
        if body.get("clear") is True:
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

    async def interrupt(self, request: web.Request) -> web.Response:
        """With {"prompt_id"} only that prompt if it is running; without, everything running."""
        body = await _optional_json(request)
        prompt_id = body.get("prompt_id")
        if isinstance(prompt_id, str) and prompt_id:
            targets = [self.running[prompt_id]] if prompt_id in self.running else []
        else:
            targets = list(self.running.values())
        for prompt in targets:
            if prompt.job is not None:
                self.gpu.interrupt(prompt.job)
        return web.Response(status=200)

    async def get_queue(self, request: web.Request) -> web.Response:
        pending = sorted(self.pending, key=lambda p: (p.number, p.seq))
        return web.json_response({"queue_running": [p.queue_item() for p in self.running.values()],
                                  "queue_pending": [p.queue_item() for p in pending]})

    async def post_queue(self, request: web.Request) -> web.Response:
        """Removes pending prompts only; running ones need /interrupt, as in ComfyUI."""
        body = await _optional_json(request)
        before = len(self.pending)
        if body.get("clear") is True:
            self.pending.clear()
        delete = body.get("delete")
        if isinstance(delete, list):
            doomed = {d for d in delete if isinstance(d, str)}
            self.pending = [p for p in self.pending if p.prompt_id not in doomed]
        removed = before - len(self.pending)
        if removed:
            self.gpu.count("queue_deletes", removed)
            await self._broadcast_status()
        return web.Response(status=200)

    async def system_stats(self, request: web.Request) -> web.Response:
        return await self.gpu.health(request, self._system_stats)

    def _system_stats(self) -> web.Response:
        gpu = self.gpu
        total, used = int(gpu.vram_gb * GIB), int(gpu.vram_used_gb * GIB)
        device = {"name": "cuda:0 NVIDIA GeForce RTX 4090 (fake) : cudaMallocAsync", "type": "cuda", "index": 0,
                  "vram_total": total, "vram_free": max(total - used, 0),
                  "torch_vram_total": used, "torch_vram_free": 0}
        system = {"os": "posix", "ram_total": 64 * GIB, "ram_free": 48 * GIB, "comfyui_version": "0.3.40-fake",
                  "python_version": sys.version, "pytorch_version": "2.5.1+cu124", "embedded_python": False,
                  "argv": ["main.py", "--listen", gpu.host, "--port", str(gpu.port)]}
        return web.json_response({"system": system, "devices": [device]})

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
        return web.Response(status=200)


async def _optional_json(request: web.Request) -> dict[str, Any]:
    """ComfyUI treats a missing or broken body on these control routes as 'no options'."""
    try:
        body = await read_json(request)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}

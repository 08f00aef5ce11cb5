"""``comfyui``: the gateway speaks ComfyUI's API for sse/async jobs of ``POST /prompt`` (docs/API.md#route-kinds).

ComfyUI answers ``POST /prompt`` at once and works on in the background, so a slot that ended
with the HTTP answer would count HTTP calls, not GPU work. For jobs we submit the prompt with our
own ``client_id`` (one per attempt: a second socket with the same id steals the events), follow
the node's ``/ws`` for that prompt id, hold the lease until the prompt is finished, then read
``/history/{prompt_id}``. Files in the result get gateway URLs that stream ``/view`` from the node
that made them. In sync mode the request passes through as generic, and ``sync_hold`` keeps the
slot until the history shows the prompt done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import aiohttp
import orjson

from kilolined.adapters.base import Adapter, HttpAttempt, Sink
from kilolined.lease import LeaseScope
from kilolined.outcome import Cancelled, Failure, Result
from kilolined.proxy import RETRY_STATUSES, Exchange, UpstreamFailed
from kilolined.queue import Lease, Rejected
from kilolined.runtime import Runtime

log = logging.getLogger("kilolined")
T = TypeVar("T")

PROMPT_PATHS = ("/prompt", "/api/prompt")
CONNECT_SEC = 10.0  # ws handshake; a node that cannot open a socket this fast is not usable
CALL_SEC = 5.0  # one history/queue/interrupt call
STOP_SEC = 2.0  # cancel: interrupt / queue delete, best-effort (DELETE /v1/jobs waits 5 s for us)
DRAIN_SEC = 1.5  # cancel: wait this long for the node to confirm the interrupt
SUCCESS_GRACE_SEC = 2.0  # after execution_success, wait this long for the final `executing: null`
POLL_SEC = 0.5  # job fallback when the socket dropped
SYNC_POLL_SEC = 0.25  # sync hold: the slot is freed this much late at worst
LOST_CHECK_EVERY = 4  # polls between checks that the prompt is still on the node at all
MAX_CALL_FAILURES = 5  # consecutive failed polls before the node counts as gone
WS_MAX_MSG = 64 * 1024 * 1024  # previews arrive on our socket too
ERROR_BODY_MAX = 1024 * 1024


def is_prompt(ex: Exchange) -> bool:
    return ex.method == "POST" and ex.tail.split("?", 1)[0] in PROMPT_PATHS


async def _read_body(up: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """The whole body up to ``limit`` bytes; the flag says it was cut short."""
    buf = bytearray()
    async for chunk in up.content.iter_any():
        buf += chunk
        if len(buf) > limit:
            return bytes(buf[:limit]), True
    return bytes(buf), False


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


class NodeError(Exception):
    """A call to the node failed (connection, timeout, status, or not JSON)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class PromptLost(Exception):
    """The prompt is neither queued, running nor in history: the node restarted or someone removed it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class NodeAPI:
    """The small ComfyUI client we need; errors never carry the node's address."""

    session: aiohttp.ClientSession
    url: str
    headers: dict[str, str]

    async def get_json(self, path: str) -> Any:
        try:
            async with self.session.get(self.url + path, headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=CALL_SEC)) as r:
                if r.status != 200:
                    raise NodeError(f"GET {path.split('/')[1]} answered HTTP {r.status}")
                return orjson.loads(await r.read())
        except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError) as e:
            raise NodeError(f"GET {path.split('/')[1]} failed ({type(e).__name__})")

    async def post_json(self, path: str, body: Any) -> None:
        headers = {**self.headers, "Content-Type": "application/json"}
        try:
            async with self.session.post(self.url + path, data=orjson.dumps(body), headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=CALL_SEC)) as r:
                await r.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise NodeError(f"POST {path} failed ({type(e).__name__})")


def node_api(rt: Runtime, node: str, request_id: str) -> NodeAPI:
    ncfg = rt.scheduler.nodes[node].cfg
    return NodeAPI(rt.session(node), ncfg.url, {"X-Request-Id": request_id, **ncfg.headers})


async def wait_history(node: NodeAPI, prompt_id: str, interval: float) -> dict[str, Any]:
    """Poll ``/history/{id}`` until it holds the entry (it is ``{}`` while queued or running).

    Raises PromptLost when the prompt has vanished from the node, NodeError when the node stops
    answering. Unbounded in time: the caller puts a timeout around it.
    """
    path = "/history/" + quote(prompt_id, safe="")
    polls = failures = 0
    while True:
        try:
            data = await node.get_json(path)
            failures = 0
            entry = data.get(prompt_id) if isinstance(data, dict) else None
            if isinstance(entry, dict):
                return entry
            polls += 1
            if polls % LOST_CHECK_EVERY == 0 and not _on_queue(await node.get_json("/queue"), prompt_id, None):
                # Queue first, history second: ComfyUI writes history before it leaves the queue.
                data = await node.get_json(path)
                entry = data.get(prompt_id) if isinstance(data, dict) else None
                if isinstance(entry, dict):
                    return entry
                raise PromptLost("the prompt vanished from the node (restarted, or removed from its queue)")
        except NodeError:
            failures += 1
            if failures >= MAX_CALL_FAILURES:
                raise
        await asyncio.sleep(interval)


def _queue_ids(items: Any, prompt_id: str | None, client_id: str | None) -> list[str]:
    """Prompt ids in a queue list (``[number, id, prompt, extra_data, outputs]`` items) that are ours."""
    out = []
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, list) or len(item) < 2 or not isinstance(item[1], str):
            continue
        extra = item[3] if len(item) > 3 and isinstance(item[3], dict) else {}
        if item[1] == prompt_id or (client_id is not None and extra.get("client_id") == client_id):
            out.append(item[1])
    return out


def _on_queue(queue: Any, prompt_id: str, client_id: str | None) -> bool:
    if not isinstance(queue, dict):
        return True  # unreadable: do not call it lost
    return bool(_queue_ids(queue.get("queue_running"), prompt_id, client_id)
                or _queue_ids(queue.get("queue_pending"), prompt_id, client_id))


async def stop_prompt(node: NodeAPI, prompt_id: str | None, client_id: str) -> bool:
    """Best effort: interrupt our prompt if it runs, delete it if it still waits in the node's queue.

    Finds it by id, or by our client_id when the POST went out but its answer never came back.
    Returns whether a running prompt was interrupted. Never raises (except CancelledError).
    """
    interrupted = False
    try:
        async with asyncio.timeout(STOP_SEC):
            for _ in range(2):
                try:
                    queue = await node.get_json("/queue")
                except NodeError:
                    if prompt_id is not None:
                        # Without a queue view: newer builds interrupt only this id (a no-op if it
                        # is not running); deleting a prompt that is not pending is a no-op too.
                        await node.post_json("/queue", {"delete": [prompt_id]})
                        await node.post_json("/interrupt", {"prompt_id": prompt_id})
                        interrupted = True
                    return interrupted
                queue = queue if isinstance(queue, dict) else {}
                running = _queue_ids(queue.get("queue_running"), prompt_id, client_id)
                pending = _queue_ids(queue.get("queue_pending"), prompt_id, client_id)
                if pending:
                    await node.post_json("/queue", {"delete": pending})
                for pid in running:
                    await node.post_json("/interrupt", {"prompt_id": pid})
                    interrupted = True
                if not pending:
                    return interrupted
                # A pending prompt may have started between the two calls: look once more.
    except (TimeoutError, NodeError):
        pass
    except Exception:
        log.exception("stopping a ComfyUI prompt")
    return interrupted


async def _shielded(rt: Runtime, coro: Coroutine[Any, Any, T]) -> T:
    """Run cleanup to its end even if our task is cancelled again meanwhile."""
    return await asyncio.shield(rt.spawn(coro))


def _error_message(body: bytes, status: int) -> str:
    """The node's own words for a refused prompt: error.message, plus the first node error."""
    data = _json_object(body)
    if data is None:
        return f"node answered HTTP {status}"
    err = data.get("error")
    msg = err.get("message") if isinstance(err, dict) else err if isinstance(err, str) else None
    msg = msg if isinstance(msg, str) and msg else f"node answered HTTP {status}"
    node_errors = data.get("node_errors")
    if isinstance(node_errors, dict):
        for nid, ne in node_errors.items():
            errs = ne.get("errors") if isinstance(ne, dict) else None
            first = errs[0] if isinstance(errs, list) and errs and isinstance(errs[0], dict) else None
            if first is not None and isinstance(first.get("message"), str):
                msg += f": node {nid} ({ne.get('class_type', '?')}): {first['message']}"
                break
    return msg[:500]


def _event(raw: str) -> tuple[str, dict[str, Any]] | None:
    try:
        msg = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str) or not isinstance(msg.get("data"), dict):
        return None
    return msg["type"], msg["data"]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _execution_failed(data: dict[str, Any]) -> Failure:
    message = data.get("exception_message")
    if not isinstance(message, str) or not message:
        message = f"{data.get('node_type') or 'a node'} failed on the node"
    body = orjson.dumps({"type": "execution_error", "data": data})
    return Failure("upstream_error", message.strip()[:2000], 500, body, "application/json")


def _check_status(entry: dict[str, Any]) -> None:
    """History says how it ended even when we missed the socket events (dropped connection)."""
    status = entry.get("status")
    if not isinstance(status, dict) or status.get("status_str") != "error":
        return  # success, or a very old build without status
    messages = status.get("messages")
    for m in messages if isinstance(messages, list) else []:
        if isinstance(m, list) and len(m) == 2 and isinstance(m[1], dict):
            if m[0] == "execution_interrupted":
                raise Cancelled("interrupted on the node")
            if m[0] == "execution_error":
                raise _execution_failed(m[1])
    raise Failure("upstream_error", "the prompt failed on the node", 500, orjson.dumps(entry), "application/json")


def annotate_files(entry: dict[str, Any], node: str, job: Any) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Give every output file dict (images, gifs, audio…) a gateway URL; list (node, /view query)."""
    files: list[tuple[str, str]] = []
    outputs = entry.get("outputs")
    if not isinstance(outputs, dict):
        return entry, files
    new_outputs: dict[str, Any] = {}
    for nid, out in outputs.items():
        if not isinstance(out, dict):
            new_outputs[nid] = out
            continue
        new_out: dict[str, Any] = {}
        for k, items in out.items():
            if not isinstance(items, list):
                new_out[k] = items
                continue
            new_items = []
            for item in items:
                if isinstance(item, dict) and isinstance(item.get("filename"), str):
                    query = urlencode({"filename": item["filename"], "subfolder": item.get("subfolder") or "",
                                       "type": item.get("type") or "output"})
                    item = {**item, "url": f"/v1/jobs/{job.id}/files/{len(files)}?token={job.access_token}"}
                    files.append((node, query))
                new_items.append(item)
            new_out[k] = new_items
        new_outputs[nid] = new_out
    return {**entry, "outputs": new_outputs}, files


@dataclass
class Submitted:
    """A prompt accepted by a node, with the socket that reports on it."""

    node: NodeAPI
    ws: aiohttp.ClientWebSocketResponse
    client_id: str
    prompt_id: str
    deadline: float  # loop time; request_timeout_sec from the attempt's start
    timeout: float


class ComfyUIAdapter(Adapter):
    kind = "comfyui"

    def prepare(self, ex: Exchange) -> None:
        # ComfyUI answers 403 when a browser's Origin meets a loopback Host (docs/API.md#comfyui).
        ex.drop_headers = ex.drop_headers | {"origin"}
        if is_prompt(ex) and _json_object(ex.body) is None:
            raise Rejected(400, "bad_request", "body must be a JSON object (ComfyUI API prompt)")

    # --- one prompt, in every mode ------------------------------------------------------------
    async def serve(self, rt: Runtime, scope: LeaseScope, ex: Exchange, sink: Sink) -> None:
        if not is_prompt(ex):
            return await super().serve(rt, scope, ex, sink)
        if sink.mode == "sync":
            return await self._serve_sync(rt, scope, ex, sink)
        body = _json_object(ex.body)
        if body is None:
            raise Failure("bad_request", "body must be a JSON object (ComfyUI API prompt)", 400)
        sub = await scope.acquire(self._attempt(rt, ex, body, scope))
        if not isinstance(sub, Submitted):
            # Out of retries and the node said 502/503/504: its answer is the job's (failed) result.
            up = sub
            try:
                err, _ = await _read_body(up, ERROR_BODY_MAX)
            except (aiohttp.ClientError, OSError, TimeoutError):
                err = b""
            finally:
                up.release()
            raise Failure("upstream_error", _error_message(err, up.status), up.status, err,
                          up.headers.get("Content-Type", "application/json"))
        lease = scope.lease
        assert lease is not None
        # Timeout, cancel or error from here on: stop the prompt, and keep the slot until the GPU
        # has really stopped (interrupts land between steps) — the scope runs this before release.
        scope.on_abort(lambda: self._stop(sub, sink))
        try:
            await self._watch(sink, sub)
            entry = await wait_history(sub.node, sub.prompt_id, POLL_SEC)
        except (NodeError, PromptLost) as e:
            rt.node_failure(lease.node, e.reason, lease.trial)
            raise Failure("upstream_error", e.reason, 502)
        scope.done_with_node()
        await sub.ws.close()
        _check_status(entry)
        result, files = annotate_files(entry, lease.node, sink.job)  # type: ignore[attr-defined]
        scope.ok = True
        # /result serves the same view as output_ready.result: the URLs are how clients get files.
        sink.result(Result(200, "application/json", orjson.dumps(result), result=result, files=files))  # type: ignore[attr-defined]

    async def _stop(self, sub: Submitted, sink: Sink) -> None:
        try:
            if await stop_prompt(sub.node, sub.prompt_id, sub.client_id):
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(DRAIN_SEC):
                        await self._watch(sink, sub, draining=True)
        finally:
            await sub.ws.close()

    async def _serve_sync(self, rt: Runtime, scope: LeaseScope, ex: Exchange, sink: Sink) -> None:
        """Pass the POST through as generic; the slot stays until the prompt is done on the node."""
        up = await scope.acquire(HttpAttempt(rt, ex))
        capture = bytearray()
        status = up.status
        await sink.deliver(scope, up, None, capture)
        data = _json_object(bytes(capture)) if status == 200 else None
        prompt_id = data.get("prompt_id") if data else None
        if not isinstance(prompt_id, str) or not prompt_id:
            return
        lease = scope.lease
        assert lease is not None
        node = node_api(rt, lease.node, ex.request_id)
        # Past request_timeout_sec the prompt is interrupted before the slot is freed.
        scope.on_abort(lambda: stop_prompt(node, prompt_id, None))
        scope.hold(self._hold(scope, node, prompt_id))

    async def _hold(self, scope: LeaseScope, node: NodeAPI, prompt_id: str) -> None:
        try:
            await wait_history(node, prompt_id, SYNC_POLL_SEC)
        except (NodeError, PromptLost) as e:
            log.warning("[%s] lost track of a prompt (%s): slot freed", scope.lease.node if scope.lease else "?",
                        e.reason)
        scope.done_with_node()

    def _attempt(self, rt: Runtime, ex: Exchange, body: dict[str, Any],
                 scope: LeaseScope) -> Callable[[Lease], Awaitable[Submitted]]:
        async def attempt(lease: Lease) -> Submitted:
            loop = asyncio.get_running_loop()
            timeout = scope.timeout
            deadline = scope.deadline or loop.time() + timeout
            node = node_api(rt, lease.node, ex.request_id)
            client_id = uuid.uuid4().hex
            # The socket first: events for the prompt start as soon as it is queued.
            try:
                async with asyncio.timeout(min(CONNECT_SEC, timeout)):
                    ws = await node.session.ws_connect(
                        f"{node.url}/ws?clientId={client_id}", headers=node.headers, autoping=True,
                        heartbeat=15, max_msg_size=WS_MAX_MSG,
                        timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=1.0))
            except TimeoutError:
                raise UpstreamFailed("websocket handshake timed out", timeout=True)
            except aiohttp.WSServerHandshakeError as e:
                raise UpstreamFailed(f"websocket refused (HTTP {e.status})")
            except (aiohttp.ClientError, OSError) as e:
                raise UpstreamFailed(f"websocket connect failed ({type(e).__name__})")
            try:
                prompt_id = await self._post(rt, lease, ex, body, node, client_id, deadline - loop.time())
            except BaseException:
                await ws.close()
                raise
            return Submitted(node, ws, client_id, prompt_id, deadline, timeout)

        return attempt

    async def _post(self, rt: Runtime, lease: Lease, ex: Exchange, body: dict[str, Any], node: NodeAPI,
                    client_id: str, timeout: float) -> str:
        """Submit with our client_id; returns the prompt id, or raises UpstreamFailed / JobFailed."""
        ncfg = rt.scheduler.nodes[lease.node].cfg
        headers = ex.upstream_headers(ncfg.headers, ncfg.url)
        for h in ("Content-Type", "Content-Encoding", "Accept-Encoding"):
            headers.popall(h, None)  # we send fresh JSON and must read the answer ourselves
        headers["Content-Type"] = "application/json"
        payload = orjson.dumps({**body, "client_id": client_id})
        timeout = max(timeout, 0.1)
        try:
            up = await node.session.post(
                node.url + ex.tail, data=payload, headers=headers, allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, CONNECT_SEC)))
        except aiohttp.ClientConnectorError:
            raise UpstreamFailed("connection refused (spot interrupted?)")
        except asyncio.CancelledError:
            await _shielded(rt, stop_prompt(node, None, client_id))  # it may have been queued already
            raise
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            await _shielded(rt, stop_prompt(node, None, client_id))  # never run it twice after a re-queue
            if isinstance(e, TimeoutError):
                raise UpstreamFailed(f"no response within {timeout:g}s", timeout=True)
            raise UpstreamFailed(f"upstream error ({type(e).__name__})")
        if up.status in RETRY_STATUSES:
            raise UpstreamFailed(f"HTTP {up.status} from node", response=up)
        try:
            answer, cut = await _read_body(up, ERROR_BODY_MAX)
        except asyncio.CancelledError:
            up.release()
            await _shielded(rt, stop_prompt(node, None, client_id))
            raise
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            up.release()
            await _shielded(rt, stop_prompt(node, None, client_id))
            raise UpstreamFailed(f"connection lost reading the answer ({type(e).__name__})")
        up.release()
        if up.status >= 500:
            rt.node_failure(lease.node, f"HTTP {up.status} from node", lease.trial)
        else:
            rt.node_success(lease.node, lease.trial)
        if up.status != 200:
            # Validation errors (node_errors) reach the client unchanged.
            raise Failure("upstream_error", _error_message(answer, up.status), up.status, answer,
                            up.headers.get("Content-Type", "application/json"))
        data = None if cut else _json_object(answer)
        prompt_id = data.get("prompt_id") if data else None
        if not isinstance(prompt_id, str) or not prompt_id:
            await _shielded(rt, stop_prompt(node, None, client_id))
            raise Failure("upstream_error", "node accepted the prompt without a prompt_id", 502)
        return prompt_id

    async def _watch(self, sink: Sink, sub: Submitted, draining: bool = False) -> None:
        """Follow our prompt on the socket until it is finished, or until the socket drops.

        Raises JobFailed on execution_error and JobCancelled on execution_interrupted (unless
        draining after our own interrupt, where either just means "stopped").
        """
        ws, pid = sub.ws, sub.prompt_id
        success = False
        while True:
            try:
                msg = await ws.receive(timeout=SUCCESS_GRACE_SEC if success else None)
            except TimeoutError:
                return  # success seen but no final `executing`: history will tell
            if msg.type == aiohttp.WSMsgType.BINARY:
                continue  # previews carry no prompt id; nothing for us
            if msg.type != aiohttp.WSMsgType.TEXT:
                return  # closed or broken: the caller falls back to polling history
            ev = _event(msg.data)
            if ev is None:
                continue
            kind, data = ev
            if data.get("prompt_id", pid) != pid:
                continue  # broadcasts about other prompts
            # Events without a prompt id on our socket are ours: the client_id is this job's alone.
            if kind == "progress" and not draining:
                value, total = data.get("value"), data.get("max")
                if _number(value) and _number(total) and total > 0:
                    sink.progress(value, total)
            elif kind == "executing" and "node" in data and data["node"] is None:
                return  # sent after history is written: safe to read it now
            elif kind == "execution_success":
                success = True
            elif kind == "execution_error":
                if draining:
                    return
                raise _execution_failed(data)
            elif kind == "execution_interrupted":
                if draining:
                    return
                raise Cancelled("interrupted on the node")

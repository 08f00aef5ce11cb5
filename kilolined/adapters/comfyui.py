"""``comfyui``: the gateway speaks ComfyUI's API for sse/async jobs of ``POST /prompt`` (docs/API.md#route-kinds).

ComfyUI answers ``POST /prompt`` at once and works on in the background, so a slot that ended
with the HTTP answer would count HTTP calls, not GPU work. For jobs we submit the prompt with our
own ``client_id`` (one per attempt: a second socket with the same id steals the events), follow
the node's ``/ws`` for that prompt id, hold the lease until the prompt is finished, then read
``/history/{prompt_id}``. Files in the result get gateway URLs that stream ``/view`` from the node
that made them. In sync mode the request passes through as generic (under the gateway's own
client id, so that the node's monitor socket hears its events for the client's /ws: comfy_hub.py),
and the lease is held until the history holds *this* submission's entry; the monitor says when to
look. A sync prompt that must wait in the gateway's queue is answered at once instead, as ComfyUI
answers a prompt it queues, and run to its end as a job's prompt is (``answer_early``). A prompt
whose node is lost before any output is re-queued by the lease scope. Control endpoints, the
route's history, queue and jobs views and its websocket are comfy_control.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import aiohttp
import orjson
from aiohttp import web

from kilolined.adapters.base import Adapter, HttpAttempt
from kilolined.adapters.comfy_control import ComfyState, NodeActivity, comfy_state, control
from kilolined.adapters.comfy_hub import refusal_error, ws_event
from kilolined.adapters.comfy_images import images_answer
from kilolined.adapters.comfy_inputs import PromptInputs, is_upload, upload
from kilolined.adapters.comfy_monitor import NodeMonitor
from kilolined.adapters.comfy_node import NodeAPI, NodeError, all_ids, find_entry, lease_api, on_queue, stop_prompt
from kilolined.adapters.comfy_progress import Progress
from kilolined.adapters.comfy_record import (
    ABSENT,
    PromptOwners,
    Queued,
    entry_as_given,
    prompt_id_of,
    queue_item,
    without_traceback,
)
from kilolined.adapters.comfy_store import is_view, prompt_finished, view
from kilolined.adapters.comfy_userdata import is_user_data, user_data
from kilolined.core.errors import error_response
from kilolined.core.outcome import Cancelled, Failure, Result
from kilolined.core.templates import ANSWER_KEY, is_images
from kilolined.core.verdict import Cause, NodeVerdict, failed_status, status_verdict
from kilolined.ops.runtime import Runtime
from kilolined.scheduling.lease import LeaseScope, Sink
from kilolined.scheduling.queue import WAITING, Lease, Rejected, Ticket
from kilolined.scheduling.speed import MS_STEP, Sample
from kilolined.wire.proxy import RETRY_STATUSES, Exchange, Upstream, UpstreamFailed, node_lost
from kilolined.wire.upstream import STALLED, UpstreamResponse
from kilolined.wire.wsproxy import connect_node_ws

log = logging.getLogger("kilolined")
T = TypeVar("T")

PROMPT_PATHS = ("/prompt", "/api/prompt")
CONNECT_SEC = 10.0  # ws handshake; a node that cannot open a socket this fast is not usable
DRAIN_SEC = 1.5  # cancel: wait this long for the node to confirm the interrupt
SUCCESS_GRACE_SEC = 2.0  # after execution_success, wait this long for the final `executing: null`
POLL_SEC = 0.5  # job fallback when the socket dropped
WATCH_SEC = 0.5  # a sync prompt's stall watch looks again this often (the monitor may drop or come back)
SYNC_POLL_SEC = 0.25  # sync hold while the node's monitor socket is down: the slot is freed this much late at worst
MONITOR_FALLBACK_SEC = 2.0  # with the monitor up, look at history this often anyway (a missed frame)
NODE_LOST = "node lost while running the prompt"
LOST_CHECK_EVERY = 4  # polls between checks that the prompt is still on the node at all
MAX_CALL_FAILURES = 5  # consecutive failed polls before the node counts as gone
WS_MAX_MSG = 64 * 1024 * 1024  # previews arrive on our socket too
ERROR_BODY_MAX = 1024 * 1024


def _tell_lost(state: ComfyState, owners: PromptOwners, prompt_id: str, body: dict[str, Any], message: str) -> None:
    """The prompt ended where it was lost: its sockets hear so, as of a prompt that failed."""
    p = owners.get(prompt_id)
    if p is None:
        return
    owners.end(prompt_id, None)
    state.hub.lost(p.node, prompt_id, body.get("prompt"), message, int(time.time() * 1000))


def is_prompt(ex: Exchange) -> bool:
    return ex.method == "POST" and ex.tail.split("?", 1)[0] in PROMPT_PATHS


async def _read_body(up: Upstream, limit: int) -> tuple[bytes, bool]:
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


class PromptStalled(Exception):
    """No frame from the node for ``stall_sec`` while our prompt ran on it (docs/CONFIG.md "Slow nodes")."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class PromptLost(Exception):
    """The prompt is neither queued, running nor in history: the node restarted or someone removed it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


async def wait_history(node: NodeAPI, prompt_id: str, number: float | None, interval: float,
                       monitor: NodeMonitor | None = None, look_first: bool = False) -> dict[str, Any]:
    """Wait for this submission's history entry (``{}`` while queued or running; an older run's
    entry under a reused id does not count).

    With a connected ``monitor`` it looks again at each queue change the node broadcasts (history
    is written before it), else every ``interval``. Raises PromptLost when the prompt has vanished
    from the node (``look_first``: check that at once, the socket just dropped; and at each queue
    change: a client may have deleted it from the node's queue), NodeError when the node stops
    answering or refuses connections. Unbounded in time: the caller bounds it.
    """
    path = "/history/" + quote(prompt_id, safe="")
    polls = failures = 0
    woke = False
    while True:
        version = monitor.version if monitor is not None else 0
        try:
            entry = find_entry(await node.get_json(path), prompt_id, number)
            failures = 0
            if entry is not None:
                return entry
            polls += 1
            look = (look_first and polls == 1) or woke or polls % LOST_CHECK_EVERY == 0
            # Queue first, history second: ComfyUI writes history before it leaves the queue.
            if look and not on_queue(await node.get_json("/queue"), prompt_id, None):
                entry = find_entry(await node.get_json(path), prompt_id, number)
                if entry is not None:
                    return entry
                raise PromptLost("the prompt vanished from the node (restarted, or removed from its queue)")
        except NodeError as e:
            failures += 1
            if e.refused or failures >= MAX_CALL_FAILURES:
                raise
        if monitor is not None and monitor.connected:
            woke = await monitor.changed(version, MONITOR_FALLBACK_SEC)
        else:
            woke = False
            await asyncio.sleep(interval)


async def _shielded(rt: Runtime, coro: Coroutine[Any, Any, T]) -> T:
    """Run cleanup to its end even if our task is cancelled again meanwhile."""
    return await asyncio.shield(rt.spawn(coro))


def _unqueue(rt: Runtime, ticket: Ticket) -> bool:
    """Take a prompt that waits in the gateway's queue (never dispatched yet) out of it: its wait
    ends in a refusal, which ``serve`` turns into the end of a deleted prompt."""
    if ticket.state != WAITING or ticket.requeues or not rt.leases.cancel(ticket):
        return False
    ticket.wake()
    return True


def _waits(ticket: Ticket) -> bool:
    return ticket.state == WAITING


async def _refused(state: ComfyState, scope: LeaseScope, prompt_id: str, number: float, body: dict[str, Any],
                   item: list[Any] | None, f: Failure) -> None:
    """A prompt whose POST the gateway answered, that no node then ran (its node refused it —
    validation, node_errors — or none took it): it ends as ComfyUI ends a prompt that failed.
    Its history entry holds the error (``status_str`` error, not completed), and the client's
    sockets hear the ``execution_error`` (the node and message the node's refusal names), the
    route's ``status``, and the end of its execution."""
    lease, route = scope.lease, scope.ticket.route
    now = int(time.time() * 1000)
    owners = state.owners(route)
    owners.add(prompt_id, scope.ticket.key, lease.node if lease is not None else "-", number,
               body.get("client_id", ABSENT))
    error = refusal_error(prompt_id, body.get("prompt"), _json_object(f.body) if f.body else None, f.message, now)
    owners.end(prompt_id, {"prompt": item or queue_item(number, prompt_id, body, now), "outputs": {},
                           "status": {"status_str": "error", "completed": False,
                                      "messages": [["execution_error", error]]},
                           "meta": {}})
    state.hub.refused(route, prompt_id, error)
    await state.share_failed(route, prompt_id)  # in every gateway's history too


async def _nothing() -> None:
    return None


async def _still_queued(node: NodeAPI, prompt_id: str) -> bool:
    """The node's queue still holds the prompt (a node that does not answer: no verdict, True)."""
    try:
        return on_queue(await node.get_json("/queue"), prompt_id, None)
    except NodeError:
        return True


async def _record_end(state: ComfyState, lease: Lease, sub: Submitted) -> None:
    """A job's prompt failed or was interrupted: its history entry, written by the node right
    after the event, goes into the route's record (and, in cluster mode, every gateway's) as
    ComfyUI lists such a prompt. None within SUCCESS_GRACE_SEC: it is left out."""
    try:
        async with asyncio.timeout(SUCCESS_GRACE_SEC):
            entry = await wait_history(sub.node, sub.prompt_id, sub.number, POLL_SEC, state.monitor(lease.node))
    except (TimeoutError, NodeError, PromptLost):
        return
    state.owners(lease.route).end(sub.prompt_id, entry)
    await state.share_failed(lease.route, sub.prompt_id)


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
                details = first.get("details")
                msg += f": node {nid} ({ne.get('class_type', '?')}): {first['message']}" + \
                    (f": {details}" if isinstance(details, str) and details else "")  # which input, why
                break
    return msg[:500]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _execution_failed(data: dict[str, Any]) -> Failure:
    message = data.get("exception_message")
    if not isinstance(message, str) or not message:
        message = f"{data.get('node_type') or 'a node'} failed on the node"
    body = orjson.dumps({"type": "execution_error", "data": without_traceback(data)})
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
    raise Failure("upstream_error", "the prompt failed on the node", 500, orjson.dumps(entry_as_given(entry, None)),
                  "application/json")


def annotate_files(entry: dict[str, Any], node: str,
                   file_url: Callable[[int], str]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
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
                    item = {**item, "url": file_url(len(files))}
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
    number: float | None  # the queue number the POST answered: which history entry is this run's
    deadline: float  # loop time; request_timeout_sec from the attempt's start
    timeout: float
    stall_sec: float | None = None  # the node's slow.stall_sec: this long without a frame is a stall
    output_seen: bool = False  # an output node ran: the prompt cannot be re-run elsewhere for free
    tell: Callable[[aiohttp.WSMessage], Awaitable[None]] | None = None  # each frame to the key's own sockets
    lost: str | None = None  # why its node was lost under it (None: it was not)


@dataclass
class Finished:
    sub: Submitted
    entry: dict[str, Any]


def _quiet_left(activity: NodeActivity | None, node: str, stall: float | None, now: float) -> float | None:
    """How much longer the node may stay silent before it is a stall (None: never; 0.001: now)."""
    if stall is None or activity is None:
        return None
    # never 0: aiohttp reads a receive timeout of 0 as "no timeout"
    last = activity.last(node)
    return max(0.001, (now if last is None else last) + stall - now)


async def _runs(node: NodeAPI, prompt_id: str) -> bool:
    """The node says it is running the prompt now (not queued behind another, not ended)."""
    try:
        queue = await node.get_json("/queue")
    except NodeError:
        return False  # no verdict from a node that does not answer: wait_history judges that
    return isinstance(queue, dict) and prompt_id in all_ids(queue.get("queue_running"))


def _prompt_number(data: dict[str, Any] | None) -> float | None:
    n = data.get("number") if data else None
    return n if _number(n) else None


class SyncWatch:
    """The stall watch of a sync-mode prompt (docs/CONFIG.md "Slow nodes"). The prompt was sent
    under the gateway's client id, so its progress frames reach the node's monitor socket. While
    that socket is connected, the node's activity (any frame from it, ``NodeActivity``) is the
    clock; while it is not, the silence does not count. Silent for ``stall_sec`` while the node
    says the prompt runs (``GET /queue``): a stall."""

    __slots__ = ("api", "monitor", "node", "prompt_id", "stall", "state")

    def __init__(self, state: ComfyState, node: str, api: NodeAPI, monitor: NodeMonitor, prompt_id: str,
                 stall: float):
        self.state, self.node, self.api, self.monitor = state, node, api, monitor
        self.prompt_id, self.stall = prompt_id, stall

    def sees(self) -> bool:
        """Whether the prompt's progress frames reach the gateway now."""
        return self.monitor.connected

    async def until(self, history: Coroutine[Any, Any, T], scope: LeaseScope) -> T:
        """Await ``history`` (the prompt's end); raise Failure on a stall, with the node's
        verdict given (breaker open) and the prompt left to the scope's abort (interrupt)."""
        loop = asyncio.get_running_loop()
        activity = self.state.activity
        activity.watch(self.node, loop.time())
        done = asyncio.ensure_future(history)
        blind = loop.time()  # the last moment the gateway could not see the prompt's progress
        try:
            while not done.done():
                now = loop.time()
                if not self.sees():
                    blind = now
                last = activity.last(self.node)
                left = max(now if last is None else last, blind) + self.stall - now
                if left > 0:
                    await asyncio.wait({done}, timeout=min(left, WATCH_SEC))
                elif await _runs(self.api, self.prompt_id):
                    cut = NodeVerdict(Cause.STALL, f"{STALLED}: no progress from the node for {self.stall:g}s "
                                      "while the prompt ran", mid_body=True)
                    log.warning("🐢 [%s] %s", self.node, cut.reason)
                    scope.node_failed(cut)
                    # The client had its answer (the prompt id): it sees the interrupt on its socket.
                    raise Failure.mid_response(self.node, cut)
                else:
                    blind = loop.time()  # still queued behind another prompt there: not ours to judge yet
            return done.result()
        finally:
            activity.unwatch(self.node)
            if not done.done():
                done.cancel()
                with contextlib.suppress(BaseException):
                    await done


class InputsFirst(HttpAttempt):
    """A sync prompt's attempt: the held inputs it names go to the lease's node first."""

    __slots__ = ("body", "inputs")

    def __init__(self, scope: LeaseScope, ex: Exchange, body: dict[str, Any], inputs: PromptInputs):
        super().__init__(scope, ex)
        self.body, self.inputs = body, inputs

    async def __call__(self, lease: Lease) -> UpstreamResponse:
        ex = self.ex
        sent = await self.inputs.for_node(lease, self.body, ex.request_id)
        if self.inputs.changed:
            # Only the graph is ours to change: whatever else the node is sent stays.
            current = _json_object(ex.body_override if ex.body_override is not None else ex.body) or {}
            ex.body_override = orjson.dumps({**current, "prompt": sent.get("prompt")})
        return await super().__call__(lease)


class ComfyUIAdapter(Adapter):
    kind = "comfyui"

    def prepare(self, ex: Exchange) -> None:
        # ComfyUI answers 403 when a browser's Origin meets a loopback Host (docs/API.md#comfyui).
        ex.drop_headers = ex.drop_headers | {"origin"}
        if is_prompt(ex) and _json_object(ex.body) is None:
            raise Rejected(400, "bad_request", "body must be a JSON object (ComfyUI API prompt)")

    def answer_early(self, rt: Runtime, ex: Exchange, ticket: Ticket) -> Result | None:
        """A ``POST /prompt`` that must wait in the gateway's queue is answered now, as ComfyUI
        answers one it queues: the client's ``prompt_id`` (or one the gateway makes), the route's
        next number, no node errors. From then on it is the gateway's to run, as an async job
        (modes/jobs.py: it outlives the client's connection), sent to its node under that id.

        A prompt that gets a slot at once is not answered here: its node's own answer reaches the
        client, and with it a refusal's ``node_errors``, which the web UI shows on the graph.
        One answered early that its node refuses ends in an ``execution_error`` instead
        (``_refused``): on the client's /ws and in /history, where ComfyUI reports a failed prompt."""
        if not is_prompt(ex):
            return None
        body = _json_object(ex.body)
        if body is None:
            return None
        given = body.get("prompt_id")
        prompt_id = str(given) if given is not None and given != "" else str(uuid.uuid4())
        state = comfy_state(rt)
        number = state.next_number(ticket.route)
        state.early[(ticket.route, prompt_id)] = number
        ex.body = orjson.dumps({**body, "prompt_id": prompt_id})  # every node it is sent to, and a handover
        answer = {"prompt_id": prompt_id, "number": number, "node_errors": {}}
        return Result(200, "application/json", orjson.dumps(answer), result=answer)

    has_control = True

    async def control(self, rt: Runtime, request: web.Request, route: str, path: str, subject: str | None,
                      request_id: str) -> web.StreamResponse | None:
        # The route's files (comfy_inputs.py, comfy_store.py): held and served by the gateway.
        # ``subject`` None is the admin key: it reads every key's files but owns none (it sends
        # no prompt an upload could serve).
        if is_upload(request.method, path):
            if subject is None:
                return error_response(403, "forbidden", "the admin key reads and stops prompts here; it sends none",
                                      request_id=request_id)
            return await upload(rt, request, route, subject, request_id)
        if is_view(request.method, path):
            answer = await view(rt, request, route, subject, request_id)
            if answer is not None:
                return answer
        if is_user_data(path):  # saved workflows and settings: the key's own, on every node
            found = rt.router.match(request.rel_url.raw_path)
            return await user_data(rt, request, route, found[1] if found else request.rel_url.raw_path, subject,
                                   request_id, comfy_state(rt).user_locks)
        return await control(rt, request, route, path, subject, request_id)

    # --- one prompt, in every mode ------------------------------------------------------------
    async def serve(self, rt: Runtime, scope: LeaseScope, ex: Exchange, sink: Sink) -> None:
        if not is_prompt(ex):
            if is_images(ex.method, ex.tail):
                return await self._serve_images(rt, scope, ex, sink)
            return await super().serve(rt, scope, ex, sink)
        body = _json_object(ex.body)
        if body is None:
            raise Failure("bad_request", "body must be a JSON object (ComfyUI API prompt)", 400)
        state, ticket = comfy_state(rt), scope.ticket
        route = ticket.route
        # Inline and fetched inputs become held files; every held input goes with each attempt.
        inputs = PromptInputs(rt, route, ticket.key)
        prompt_id = given if isinstance(given := body.get("prompt_id"), str) else None
        # A POST answered early (``answer_early``) was given its id and number already.
        number = state.early.pop((route, prompt_id), None) if prompt_id is not None else None
        early = number is not None
        item = None
        if sink.mode != "sync" and ticket.state == WAITING:
            # Waiting in the gateway's queue, it is listed there as ComfyUI lists a queued prompt
            # (GET /queue), and removable by its id: its node is sent that id, and the route's
            # record keeps that number for it.
            if prompt_id is None:
                prompt_id = str(uuid.uuid4())
                body = {**body, "prompt_id": prompt_id}
            number = state.next_number(route) if number is None else number
            item = queue_item(number, prompt_id, body, int(time.time() * 1000))
        queued = Queued(ticket.key, prompt_id, functools.partial(_unqueue, rt, ticket), item=item, seq=ticket.seq,
                        waiting=functools.partial(_waits, ticket))
        left = state.queue_in(route, queued)
        if item is not None:
            state.hub.status_of(route)  # the route's queue grew
        try:
            if sink.mode == "sync":
                return await self._serve_sync(rt, scope, ex, sink, body, inputs)
            lease, entry = await self._run_to_end(rt, scope, ex, body, sink, inputs, number, item is not None)
        except Failure as f:
            if queued.removed:
                # Removed from the gateway's queue by its client: it never ran, as ComfyUI drops a
                # deleted prompt (a sync POST that had to wait was answered early: a job too).
                raise Cancelled("deleted from the queue before it ran") from None
            if early and prompt_id is not None and number is not None and state.owners(route).get(prompt_id) is None:
                await _refused(state, scope, prompt_id, number, body, queued.item, f)
            raise
        finally:
            left()
        result, files = annotate_files(entry, lease.node, sink.file_url)
        # Outputs leave the node (comfy_store.py); the result names them as the route does.
        result = await prompt_finished(rt, lease.route, lease.node, result, scope.ticket.key)
        await comfy_state(rt).share_entry(lease.route, prompt_id_of(entry))
        scope.ok = True
        # /result serves the same view as output_ready.result: the URLs are how clients get files.
        sink.result(Result(200, "application/json", orjson.dumps(result), result=result, files=files))

    async def _serve_images(self, rt: Runtime, scope: LeaseScope, ex: Exchange, sink: Sink) -> None:
        """OpenAI's Images API, its workflow filled from the template at admission
        (edge/images.py): run to its end as a job's prompt is, in every client mode, and answered
        in OpenAI's shape with the outputs' bytes or their /view URLs (comfy_images.py)."""
        doc = ex.body_doc()
        answer = doc.get(ANSWER_KEY) if isinstance(doc, dict) else None
        if not isinstance(answer, dict) or not isinstance(doc.get("prompt"), dict):
            raise Failure("bad_request", "the request was not filled from a template", 400)
        body = {"prompt": doc["prompt"]}
        inputs = PromptInputs(rt, scope.ticket.route, scope.ticket.key)
        # The node is sent a prompt: its path is ComfyUI's, whatever the client asked.
        lease, entry = await self._run_to_end(rt, scope, dataclasses.replace(ex, tail=PROMPT_PATHS[0]), body,
                                              sink, inputs)
        shown = await prompt_finished(rt, lease.route, lease.node, entry, scope.ticket.key)
        await comfy_state(rt).share_entry(lease.route, prompt_id_of(entry))
        images = await images_answer(rt, lease, entry, shown, answer.get("response_format"), ex)
        scope.ok = True
        sink.result(Result(200, "application/json", orjson.dumps(images), result=images))

    async def _run_to_end(self, rt: Runtime, scope: LeaseScope, ex: Exchange, body: dict[str, Any], sink: Sink,
                          inputs: PromptInputs, number: float | None = None,
                          listed: bool = False) -> tuple[Lease, dict[str, Any]]:
        """Submit the prompt and follow it to its end under the scope (queue, failover, stalls);
        its lease and history entry (the node's names), the slot freed. ``number``: the one its
        client was given while it waited in the gateway's queue (else its node's); ``listed``:
        it was in the queue's list, where a client may have deleted it (through another gateway)."""
        progress = Progress(body.get("prompt"))
        last: list[Submitted] = []  # the last attempt's prompt on its node
        try:
            done = await scope.acquire(self._attempt(rt, ex, body, scope, sink, progress, inputs, last, number,
                                                     listed))
        except Failure:
            if last and last[0].lost is not None:  # its node was lost, and it runs nowhere else now
                state = comfy_state(rt)
                _tell_lost(state, state.owners(scope.route), last[0].prompt_id, body, f"{NODE_LOST}: {last[0].lost}")
            raise
        if not isinstance(done, Finished):
            # Out of retries and the node said 502/503: its answer is the job's (failed) result.
            up = done
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
        scope.done_with_node()
        await done.sub.ws.close()
        state = comfy_state(rt)
        state.owners(lease.route).end(done.sub.prompt_id, done.entry)
        try:
            _check_status(done.entry)
        except (Failure, Cancelled):
            await state.share_failed(lease.route, done.sub.prompt_id)  # in every gateway's history too
            raise
        steps = progress.steps_ran()
        if steps > 0:
            # Speed per sampler step: prompts of different step counts compare (speed.py).
            scope.samples = [Sample(MS_STEP, (rt.clock() - scope.dispatched_at) * 1000 / steps)]
        return lease, done.entry

    async def _stop(self, sub: Submitted, sink: Sink, record: Callable[[], Awaitable[None]]) -> None:
        """Stop the prompt on its node, wait (briefly) until it has, then ``record`` its end."""
        try:
            if await stop_prompt(sub.node, sub.prompt_id, sub.client_id):
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(DRAIN_SEC):
                        await self._watch(sink, sub, None, draining=True)
                await record()  # interrupted: in the route's history, as ComfyUI lists it
        finally:
            await sub.ws.close()

    async def _serve_sync(self, rt: Runtime, scope: LeaseScope, ex: Exchange, sink: Sink,
                          body: dict[str, Any], inputs: PromptInputs) -> None:
        """Pass the POST through as generic; the slot stays until the prompt is done on the node.

        The node is sent the gateway's own client id (comfy_hub.py): the prompt's events reach
        the node's monitor, and from there the client's socket on the gateway, whichever node
        runs it; the client's own client_id is kept in the route's record. The held inputs the
        prompt names go to the node first (``InputsFirst``), on every attempt."""
        state = comfy_state(rt)
        current = _json_object(ex.body_override) if ex.body_override is not None else body
        given = body.get("client_id", ABSENT)
        ex.body_override = orjson.dumps({**(current or body), "client_id": state.hub_id})
        await state.ready(scope.route)
        again = InputsFirst(scope, ex, body, inputs)
        up = await scope.acquire(again)
        capture = bytearray()
        status = up.status
        await sink.deliver(scope, up, None, capture)
        data = _json_object(bytes(capture)) if status == 200 else None
        prompt_id = data.get("prompt_id") if data else None
        if not isinstance(prompt_id, str) or not prompt_id:
            return
        lease = scope.lease
        assert lease is not None
        owners = state.owners(lease.route)
        owners.add(prompt_id, scope.ticket.key, lease.node, _prompt_number(data), given)
        state.hub.claim(lease.node, prompt_id)  # what the node said of it before its answer came
        state.hub.status(lease.node)  # the route's queue grew
        scope.hold(self._hold(scope, ex, state, owners, prompt_id, _prompt_number(data), again))

    @staticmethod
    async def _stop_sync(node: NodeAPI, monitor: NodeMonitor, prompt_id: str, number: float | None) -> None:
        """Interrupt, then keep the slot until the node says the prompt ended: an interrupt lands
        only at the node's next progress update, and the next prompt must not overlap it."""
        if await stop_prompt(node, prompt_id, None):
            with contextlib.suppress(TimeoutError, NodeError, PromptLost):
                async with asyncio.timeout(DRAIN_SEC):
                    await wait_history(node, prompt_id, number, SYNC_POLL_SEC, monitor)

    async def _hold(self, scope: LeaseScope, ex: Exchange, state: ComfyState, owners: PromptOwners,
                    prompt_id: str, number: float | None, again: InputsFirst) -> None:
        """Keep the slot until the prompt's history entry is on its node. A node lost before the
        prompt's first output did no work anyone saw: the prompt is re-queued (docs/API.md "Nodes
        and failover"), sent to the next node under the same prompt id with its inputs, and held
        there — the client, which has its answer already, follows it by that id on /ws and
        /history."""
        rt = scope.rt
        entry = None
        try:
            while True:
                lease = scope.lease
                assert lease is not None
                node, monitor = lease_api(rt, lease, ex.request_id), state.monitor(lease.node)
                # Past request_timeout_sec (or on a stall) the prompt is interrupted before the slot is freed.
                scope.on_abort(functools.partial(self._stop_sync, node, monitor, prompt_id, number))
                slow = lease.target.node.slow
                watch = SyncWatch(state, lease.node, node, monitor, prompt_id, slow.stall_sec) \
                    if slow is not None else None
                history = wait_history(node, prompt_id, number, SYNC_POLL_SEC, monitor)
                try:
                    entry = await (history if watch is None else watch.until(history, scope))
                    break
                except (NodeError, PromptLost) as e:
                    scope.done_with_node()  # nothing left there to stop
                    if isinstance(e, PromptLost) and await state.dropped(lease.route, prompt_id):
                        # Deleted from the node's queue by a client: it ends there, as in ComfyUI
                        # (no history entry; its POST was answered long ago).
                        log.info("[%s] prompt %s deleted from the node's queue: slot freed", lease.node, prompt_id)
                        owners.end(prompt_id, None)
                        state.hub.status(lease.node)
                        return
                    p = owners.get(prompt_id)
                    if p is None or p.output_seen or p.stopped or not scope.requeue_held(
                            NodeVerdict(Cause.LOST, NODE_LOST), lost=not isinstance(e, PromptLost)):
                        log.warning("[%s] %s (%s): slot freed", lease.node, NODE_LOST, e.reason)
                        _tell_lost(state, owners, prompt_id, again.body, f"{NODE_LOST}: {e.reason}")
                        return
                    log.warning("[%s] %s (%s): re-queued", lease.node, NODE_LOST, e.reason)
                try:
                    number = await self._resubmit(scope, ex, again, prompt_id, owners)
                except Exception as e:  # no node took it again: it runs nowhere
                    _tell_lost(state, owners, prompt_id, again.body, f"{NODE_LOST}, and not re-queued: {e}")
                    raise
                moved = scope.lease
                assert moved is not None
                owners.moved(prompt_id, moved.node, number)
                state.hub.status(moved.node)
        finally:
            owners.end(prompt_id, entry)
        scope.done_with_node()
        if entry is not None:
            await prompt_finished(rt, lease.route, lease.node, entry, scope.ticket.key)  # outputs leave the node
            await state.share_entry(lease.route, prompt_id)  # /history/{id} on every gateway

    @staticmethod
    async def _resubmit(scope: LeaseScope, ex: Exchange, again: InputsFirst, prompt_id: str,
                        owners: PromptOwners) -> float | None:
        """Send a re-queued sync prompt to the node the scope leases next, under its prompt id;
        returns the queue number that node gave it (which history entry is this run's)."""
        current = _json_object(ex.body_override) if ex.body_override is not None else None
        ex.body_override = orjson.dumps({**(current or {}), "prompt_id": prompt_id})

        async def attempt(lease: Lease) -> UpstreamResponse:
            # Its node in the record before the POST: the node's first events reach the client.
            owners.moved(prompt_id, lease.node, None)
            return await again(lease)

        up = await scope.acquire(attempt)
        scope.detach()
        try:
            answer, cut = await _read_body(up, ERROR_BODY_MAX)
        except (aiohttp.ClientError, OSError, TimeoutError):
            answer, cut = b"", True
        finally:
            up.release()
        data = _json_object(answer) if up.status == 200 and not cut else None
        if data is None or data.get("prompt_id") != prompt_id:
            lease = scope.lease
            raise Failure.upstream(f"node {lease.node if lease else '-'} did not take the re-queued prompt "
                                   f"(HTTP {up.status}): {_error_message(answer, up.status)}", False)
        return _prompt_number(data)

    def _attempt(self, rt: Runtime, ex: Exchange, body: dict[str, Any], scope: LeaseScope, sink: Sink,
                 progress: Progress, inputs: PromptInputs, last: list[Submitted],
                 number: float | None, listed: bool) -> Callable[[Lease], Awaitable[Finished]]:
        """Submit and follow the prompt to its end, all inside the lease scope's retry loop: a node
        lost before any output re-queues the prompt like a node that never answered."""
        first: list[str] = []  # the prompt id of the first attempt: a re-queued prompt keeps it

        async def attempt(lease: Lease) -> Finished:
            pid = body.get("prompt_id")
            if listed and not first and isinstance(pid, str) and await comfy_state(rt).dropped(lease.route, pid):
                # Deleted from the queue through another gateway while it waited here: it never runs.
                raise Cancelled("deleted from the queue before it ran")
            progress.attempt()
            sent = await inputs.for_node(lease, body, ex.request_id)  # this node's copy of the prompt's inputs
            if first:
                sent = {**sent, "prompt_id": first[0]}
            sub = await self._submit(rt, lease, ex, sent, scope)
            first[:1] = [sub.prompt_id]
            last[:] = [sub]
            state = comfy_state(rt)
            owners = state.owners(lease.route)
            owners.add(sub.prompt_id, scope.ticket.key, lease.node, sub.number if number is None else number,
                       body.get("client_id", ABSENT), node_number=sub.number)
            state.hub.status(lease.node)  # the route's queue grew (the node's own status may have come first)
            sub.tell = functools.partial(state.tell, lease.route, lease.node, sub.prompt_id)  # the /ws hears it
            # Timeout, cancel or error from here on: stop the prompt, and keep the slot until the
            # GPU has really stopped (interrupts land between steps); the scope runs this first.
            scope.on_abort(lambda: self._stop(sub, sink, functools.partial(_record_end, state, lease, sub)))
            try:
                return await self._follow_to_end(state, lease, scope, sub, sink, progress)
            except BaseException:
                owners.end(sub.prompt_id, None)  # no entry: it failed, was stopped or moves on
                raise

        return attempt

    async def _follow_to_end(self, state: ComfyState, lease: Lease, scope: LeaseScope, sub: Submitted, sink: Sink,
                             progress: Progress) -> Finished:
        try:
            async with asyncio.timeout_at(sub.deadline):
                await self._watch(sink, sub, progress, activity=state.activity, node=lease.node)
                entry = await wait_history(sub.node, sub.prompt_id, sub.number, POLL_SEC,
                                           state.monitor(lease.node), look_first=True)
        except (Failure, Cancelled):  # it failed or was interrupted on the node (its socket said so)
            await _record_end(state, lease, sub)
            raise
        except PromptStalled as e:
            await self._stalled(scope, sub, sink, e.reason)
        except TimeoutError:
            raise Failure.upstream(f"node {lease.node} did not finish within {sub.timeout:g}s", True) from None
        except (NodeError, PromptLost) as e:
            if isinstance(e, PromptLost) and await state.dropped(lease.route, sub.prompt_id):
                # Deleted from the node's queue by a client: the job ends cancelled, as the
                # prompt does in ComfyUI (no history entry), and is never run elsewhere.
                scope.done_with_node()
                await sub.ws.close()
                state.owners(lease.route).end(sub.prompt_id, None)
                state.hub.status(lease.node)
                raise Cancelled("deleted from the node's queue") from None
            log.warning("[%s] %s: %s", lease.node, NODE_LOST, e.reason)
            sub.lost = e.reason
            if sub.output_seen:
                scope.node_failed(NodeVerdict(Cause.LOST, e.reason, mid_body=True))
                raise Failure.mid_response(lease.node, NodeVerdict(Cause.LOST, f"{NODE_LOST} (after its first output)",
                                                                   mid_body=True)) from None
            scope.done_with_node()  # nothing left there to stop
            await sub.ws.close()
            p = state.owners(lease.route).get(sub.prompt_id)
            if p is not None and p.stopped:
                raise Cancelled("interrupted, and its node was lost before it stopped") from None
            # A node that answered without the prompt restarted and is back; one that does
            # not answer is lost, and gets the prompt again only once seen alive.
            raise UpstreamFailed(NODE_LOST, answered=isinstance(e, PromptLost)) from None
        return Finished(sub, entry)

    async def _stalled(self, scope: LeaseScope, sub: Submitted, sink: Sink, reason: str) -> None:
        """The node stopped moving on our prompt: interrupt it, then re-queue the request (the
        client has seen only gateway events, no byte of the answer) unless an output node already
        ran there. The scope's verdict on a stall (``Cause.STALL``) opens the breaker."""
        lease = scope.lease
        assert lease is not None
        log.warning("🐢 [%s] %s", lease.node, reason)
        if sub.output_seen:
            scope.node_failed(NodeVerdict(Cause.STALL, reason, mid_body=True))
            raise Failure.mid_response(lease.node, NodeVerdict(Cause.STALL, f"{reason} (after its first output)",
                                                               mid_body=True))
        scope.done_with_node()
        await _shielded(scope.rt, self._stop(sub, sink, _nothing))  # the GPU must be free before the slot is
        raise UpstreamFailed(reason, answered=True, cause=Cause.STALL)

    async def _submit(self, rt: Runtime, lease: Lease, ex: Exchange, body: dict[str, Any],
                      scope: LeaseScope) -> Submitted:
        loop = asyncio.get_running_loop()
        timeout = scope.timeout
        deadline = scope.deadline or loop.time() + timeout
        node = lease_api(rt, lease, ex.request_id)
        client_id = uuid.uuid4().hex
        # The socket first: events for the prompt start as soon as it is queued.
        ws = await connect_node_ws(node.session, f"{node.url}/ws?clientId={client_id}", node.headers,
                                   connect_sec=min(CONNECT_SEC, timeout), heartbeat=15, max_msg_size=WS_MAX_MSG,
                                   close_sec=1.0)
        try:
            prompt_id, number = await self._post(scope, ex, body, node, client_id, deadline - loop.time())
        except BaseException:
            await ws.close()
            raise
        slow = lease.target.node.slow
        return Submitted(node, ws, client_id, prompt_id, number, deadline, timeout,
                         slow.stall_sec if slow is not None else None)

    async def _post(self, scope: LeaseScope, ex: Exchange, body: dict[str, Any], node: NodeAPI,
                    client_id: str, timeout: float) -> tuple[str, float | None]:
        """Submit with our client_id; returns (prompt id, queue number), or raises UpstreamFailed / Failure."""
        rt, lease = scope.rt, scope.lease
        assert lease is not None
        headers = ex.upstream_headers(lease.target.headers, lease.target.url)
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
            raise node_lost("connection refused")
        except asyncio.CancelledError:
            await _shielded(rt, stop_prompt(node, None, client_id))  # it may have been queued already
            raise
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            await _shielded(rt, stop_prompt(node, None, client_id))  # never run it twice after a re-queue
            if isinstance(e, TimeoutError):
                raise UpstreamFailed(f"no response within {timeout:g}s", timeout=True)
            log.info("[%s] submitting: %s", lease.node, type(e).__name__)
            raise node_lost("connection failed")
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
            log.info("[%s] reading the answer: %s", lease.node, type(e).__name__)
            raise node_lost("connection dropped before its answer was read")
        up.release()
        if failed_status(up.status):
            scope.node_failed(status_verdict(up.status))
        else:
            scope.node_ok()
        if up.status != 200:
            # Validation errors (node_errors) reach the client unchanged.
            raise Failure("upstream_error", _error_message(answer, up.status), up.status, answer,
                            up.headers.get("Content-Type", "application/json"))
        data = None if cut else _json_object(answer)
        prompt_id = data.get("prompt_id") if data else None
        if not isinstance(prompt_id, str) or not prompt_id:
            await _shielded(rt, stop_prompt(node, None, client_id))
            raise Failure.upstream("node accepted the prompt without a prompt_id", False)
        return prompt_id, _prompt_number(data)

    async def _watch(self, sink: Sink, sub: Submitted, progress: Progress | None, draining: bool = False,
                     activity: NodeActivity | None = None, node: str = "") -> None:
        """Follow our prompt on the socket until it is finished, or until the socket drops.

        Raises Failure on execution_error and Cancelled on execution_interrupted (unless
        draining after our own interrupt, where either just means "stopped"). With ``activity``
        (the loop time of the node's last frame on any of our sockets) and the node's ``stall_sec``, raises
        PromptStalled when the node sent nothing for that long.
        """
        if activity is None:
            return await self._follow(sink, sub, progress, draining, None, node)
        activity.watch(node, asyncio.get_running_loop().time())  # submitted: given stall_sec from now
        try:
            await self._follow(sink, sub, progress, draining, activity, node)
        finally:
            activity.unwatch(node)

    async def _follow(self, sink: Sink, sub: Submitted, progress: Progress | None, draining: bool,
                      activity: NodeActivity | None, node: str) -> None:
        ws, pid = sub.ws, sub.prompt_id
        stall = sub.stall_sec if activity is not None and not draining else None
        loop = asyncio.get_running_loop()
        success = started = False
        while True:
            wait = SUCCESS_GRACE_SEC if success else _quiet_left(activity, node, stall, loop.time())
            try:
                msg = await ws.receive(timeout=wait)
            except TimeoutError:
                if success:
                    return  # success seen but no final `executing`: history will tell
                left = _quiet_left(activity, node, stall, loop.time())
                if left is not None and left <= 0.001:
                    raise PromptStalled(f"{STALLED}: no progress from the node for {stall:g}s "
                                        "while the prompt ran") from None
                continue  # another of our prompts on this node moved meanwhile
            if activity is not None:
                activity.seen(node, loop.time())
            if sub.tell is not None and msg.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                await sub.tell(msg)
            if msg.type == aiohttp.WSMsgType.BINARY:
                continue  # previews carry no prompt id; nothing for us
            if msg.type != aiohttp.WSMsgType.TEXT:
                return  # closed or broken: the caller falls back to polling history
            ev = ws_event(msg.data)
            if ev is None:
                continue
            kind, data = ev
            if kind == "status" and not started and not draining and not await _still_queued(sub.node, pid):
                return  # gone from the node's queue before it ran (deleted?): history and the queue tell
            if data.get("prompt_id", pid) != pid:
                continue  # broadcasts about other prompts
            # Events without a prompt id on our socket are ours: the client_id is this job's alone.
            if kind == "executing" and "node" in data and data["node"] is None:
                return  # sent after history is written: safe to read it now
            if kind == "execution_start":
                started = True
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
            elif kind == "executed":
                sub.output_seen = True
            elif progress is not None and not draining:
                self._progress(sink, progress, kind, data)

    @staticmethod
    def _progress(sink: Sink, progress: Progress, kind: str, data: dict[str, Any]) -> None:
        if kind == "progress":
            progress.step(data.get("node"), data.get("value"), data.get("max"))
        elif kind == "progress_state":
            progress.state(data.get("nodes"))
        elif kind == "executing":
            progress.started(data.get("node"))
        elif kind == "execution_cached":
            progress.cached(data.get("nodes"))
        else:
            return
        moved = progress.report()
        if moved is not None:
            sink.progress(*moved)

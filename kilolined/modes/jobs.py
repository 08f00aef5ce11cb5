"""sse and async jobs: state machine, event log with replay, live fan-out, results with a TTL.

A job is a queued request that outlives its HTTP connection: the client may watch it over SSE,
disconnect and come back with ``Last-Event-ID``, or hand it over and get a signed webhook.
Results live in memory only, under ``jobs.max_results_mb``. A ``JobStore`` mirrors jobs beyond this
process: nowhere on one gateway (``LocalStore``), into Redis in cluster mode (kilolined/cluster/jobs.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import orjson
from aiohttp import web

from kilolined.adapters import continuation
from kilolined.adapters.base import Adapter
from kilolined.adapters.openai import UsageStripper, gateway_added_usage
from kilolined.core.auth import Principal, presented_key
from kilolined.core.config import JobsConfig
from kilolined.core.continuation import StreamKeeper
from kilolined.core.outcome import Cancelled, Failure, Result
from kilolined.core.rewrite import ModelRename, aliased
from kilolined.core.verdict import Cause, NodeVerdict, failed_status
from kilolined.modes.call import Call
from kilolined.modes.runner import run
from kilolined.ops.runtime import Runtime
from kilolined.ops.webhooks import WebhookDeliverer, check_callback_url
from kilolined.scheduling.lease import LeaseScope, Sink
from kilolined.scheduling.queue import WAITING, Lease, Ticket
from kilolined.wire.proxy import SERVER, Exchange, Observer, Upstream, UpstreamFailed, mid_response
from kilolined.wire.upstream import Stalled

log = logging.getLogger("kilolined.modes.jobs")

TERMINAL = ("completed", "failed", "cancelled")
EPHEMERAL = ("heartbeat", "queue_status", "step_progress")
REPLAY_KEEP = 256  # events kept per job; ephemeral ones are evicted first
INLINE_RESULT_MAX = 1024 * 1024
TICK_SEC = 0.25  # queue_status / heartbeat tick


Event = tuple[int, str, bytes]  # (id, event name, the rendered SSE frame)


@dataclass(frozen=True, slots=True)
class Hook:
    """A job's webhook: where it goes, what it says, its webhook-id (the same for every copy)."""

    url: str
    payload: dict[str, Any]
    msg_id: str


class JobStore(Protocol):
    """Where a job is mirrored beyond this process: nowhere on one gateway (``LocalStore``),
    Redis in cluster mode (kilolined/cluster/jobs.py), so every gateway can serve it."""

    def created(self, job: Job, call: Call, ex: Exchange, priority: int) -> None:
        """A new job: what it needs to run again elsewhere is kept with it."""
        ...

    def emitted(self, job: Job, ev: Event, evicted: int | None) -> None:
        """An event of ``job`` (``evicted``: the id the replay log dropped for it, if any)."""
        ...

    async def synced(self) -> None:
        """What was handed over so far is stored (another gateway can read it)."""
        ...

    def send_once(self, job: Job, hook: Hook, webhooks: WebhookDeliverer) -> None:
        """Send the job's webhook through ``webhooks`` unless another gateway does."""
        ...

    async def load(self, job_id: str) -> Job | None:
        """A job this gateway does not run, as it was stored (``remote``), or None."""
        ...

    def follow(self, job: Job, after: int) -> AsyncIterator[list[Event]]:
        """A remote job's events after ``after``: the stored ones, then live ones, to its end."""
        ...

    async def cancel(self, job: Job) -> Job | None:
        """Ask the gateway running a remote job to cancel it; the job as stored afterwards."""
        ...


class LocalStore:
    """One gateway: jobs live in this process only; nothing to mirror, nothing to find elsewhere."""

    __slots__ = ()

    def created(self, job: Job, call: Call, ex: Exchange, priority: int) -> None:
        pass

    def emitted(self, job: Job, ev: Event, evicted: int | None) -> None:
        pass

    async def synced(self) -> None:
        pass

    def send_once(self, job: Job, hook: Hook, webhooks: WebhookDeliverer) -> None:
        webhooks.submit(hook.url, hook.payload, msg_id=hook.msg_id)

    async def load(self, job_id: str) -> Job | None:
        return None

    async def follow(self, job: Job, after: int) -> AsyncIterator[list[Event]]:
        return
        yield  # an async generator that yields nothing

    async def cancel(self, job: Job) -> Job | None:
        return None


LOCAL = LocalStore()  # stateless: shared by every job of a single gateway


class Subscriber:
    """One live SSE stream of a job: events pile up here between two writes.

    Not an asyncio.Queue: the stream wakes once per batch and writes the batch in one go, so a
    waiting job's heartbeat and queue_status of one tick cost one wake-up and one write.
    """

    __slots__ = ("closed", "pending", "waiter")

    def __init__(self) -> None:
        self.pending: list[tuple[int, str, bytes]] = []
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False

    def push(self, ev: tuple[int, str, bytes] | None) -> None:
        if ev is None:
            self.closed = True
        else:
            self.pending.append(ev)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def batch(self) -> list[tuple[int, str, bytes]] | None:
        """The events since the last call (waiting for one), or None once the job ended."""
        while not self.pending:
            if self.closed:
                return None
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        out, self.pending = self.pending, []
        return out


@dataclass(eq=False)
class Job:
    id: str
    access_token: str
    route: str
    route_label: str
    kind: str
    key: str | None
    mode: str
    ticket: Ticket
    callback: str | None
    base_url: str = ""  # server.public_url: the URLs handed out are absolute when it is set
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    status: str = "queued"
    node: str | None = None
    swap: bool | None = None  # its last dispatch made the node load the model (None: no model state)
    asked_model: str | None = None  # the model the client named, when a rewrite may rename it
    http_status: int | None = None
    error: dict[str, str] | None = None
    queue_wait: float | None = None
    duration: float | None = None
    result: Result | None = None
    events: list[tuple[int, str, bytes]] = field(default_factory=list)
    next_id: int = 1
    subscribers: set[Subscriber] = field(default_factory=set)
    last_event_at: float = field(default_factory=time.monotonic)
    last_position: int | None = None
    last_queue_status_at: float = 0.0
    task: asyncio.Task[None] | None = None
    cancel_requested: bool = False
    started_mono: float | None = None
    last_est: float | None = None
    store: JobStore = LOCAL
    #: read from another gateway's store (cluster mode): a snapshot, not this process's job
    remote: bool = False
    #: bytes of jobs.max_results_mb this job's result holds while it is still being read
    reading: int = 0
    #: called once when the job ends (the async request's access-log line of its outcome)
    on_end: Callable[[Job], None] | None = None

    def emit(self, event: str, data: dict[str, Any]) -> None:
        # Keep the rendered frame: built once for every subscriber and every replay, and
        # right-sized (orjson's own bytes object carries a ~4 KB allocation, which a log of
        # hundreds of events per waiting job would pin).
        ev = (self.next_id, event, b"id: %d\nevent: %s\ndata: %s\n\n" % (self.next_id, event.encode(),
                                                                           _json(data)))
        self.next_id += 1
        self.events.append(ev)
        evicted = None
        if len(self.events) > REPLAY_KEEP:
            for i, (eid, name, _) in enumerate(self.events):
                if name in EPHEMERAL:
                    evicted = eid
                    del self.events[i]
                    break
            else:
                evicted = self.events.pop(0)[0]
        self.last_event_at = time.monotonic()
        self.store.emitted(self, ev, evicted)
        terminal = event in ("output_ready", "failed")
        for sub in self.subscribers:
            sub.push(ev)
            if terminal:
                sub.push(None)

    def urls(self) -> dict[str, str]:
        base = f"{self.base_url}/v1/jobs/{self.id}"
        return {"status_url": base, "events_url": f"{base}/events?token={self.access_token}",
                "result_url": f"{base}/result?token={self.access_token}"}

    def view(self, position: int | None, est: float | None) -> dict[str, Any]:
        return {
            "job_id": self.id, "route": self.route_label, "status": self.status, "position": position,
            "est_wait_sec": est, "node": self.node, "created_at": self.created_at, "started_at": self.started_at,
            "finished_at": self.finished_at, "http_status": self.http_status, "error": self.error,
        }


class JobSink(Sink):
    """The sse/async client modes: the request's moves become job events, its answer the result."""

    __slots__ = ("adapter", "answer", "ex", "failure", "job", "keeper", "lost", "memory", "mode", "res", "rt")
    reports_progress = True
    reads_answer = True
    gone = "cancelled"

    def __init__(self, rt: Runtime, job: Job, ex: Exchange | None = None, lost: tuple[str, str] | None = None,
                 memory: ResultMemory | None = None, adapter: Adapter | None = None):
        self.rt, self.job, self.ex = rt, job, ex
        #: makes the observer of an answer read under the attempt (``received``)
        self.adapter = adapter
        #: (the node's answer, its body) once ``received`` read it, until ``deliver`` takes it
        self.answer: tuple[Upstream, bytes] | None = None
        self.mode = job.mode
        #: what results may hold (jobs.max_results_mb); the result is reserved in it as it arrives
        self.memory = memory
        self.res: Result | None = None
        self.failure: Failure | None = None
        #: (from node, reason) of a job carried on from a lost gateway: said at its next dispatch
        self.lost = lost
        #: the answer so far of a stream that may be continued on another node (continuation.py)
        self.keeper: StreamKeeper | None = None

    def dispatched(self, lease: Lease, queue_wait: float) -> None:
        job, rt = self.job, self.rt
        if self.lost is not None:
            (from_node, reason), self.lost = self.lost, None
            self.rerouted(from_node, lease.node, reason)
        job.node = lease.node
        job.swap = lease.swap
        job.status = "running"
        continuation.seam_at(self.keeper, lease)
        if job.started_at is None:
            job.started_at = time.time()
            job.started_mono = rt.clock()
            job.queue_wait = queue_wait
            rt.metrics.queue_wait.labels(job.route_label).observe(queue_wait)
        job.emit("dispatched", {"node": lease.node, "queue_wait_sec": round(queue_wait, 3), "swap": lease.swap is True})

    def rerouted(self, from_node: str, to_node: str, reason: str) -> None:
        self.job.emit("rerouted", {"from_node": from_node, "to_node": to_node, "reason": reason})

    def requeued(self) -> None:
        # Waiting again: status, queue_status and heartbeats say so until the next dispatch.
        self.job.status = "queued"
        self.job.last_position = None

    def progress(self, step: int | float, total: int | float) -> None:
        seam = self.keeper.seam if self.keeper is not None else None
        if seam is not None:
            step += seam.before.tokens  # a continued stream counts on from what came before its seam
        pct = max(0, min(100, int(step * 100 // total)))
        self.job.emit("step_progress", {"step": step, "total": total, "pct": pct})

    async def received(self, scope: LeaseScope, up: Upstream) -> None:
        """The node's whole answer, read under the attempt. None of it reaches the client before
        the job ends (events carry only gateway facts: ``step_progress`` counts chunks, never
        their bytes), so a node that stalls mid-answer is re-queued here like one that never
        answered; the adapter's observer hears the answer as it arrives (usage, progress)."""
        adapter, ex = self.adapter, self.ex
        obs = adapter.observer(self.rt, ex, scope, self) if adapter is not None and ex is not None else None
        if self.keeper is None and ex is not None and continuation.wanted(scope, ex):
            self.keeper = StreamKeeper()
        self.answer = None
        self.answer = (up, await self._read(scope, up, obs, under_attempt=True))

    async def deliver(self, scope: LeaseScope, up: Upstream, obs: Observer | None,
                      capture: bytearray | None = None) -> None:
        """The answer becomes the job's result. Read by ``received`` already (then ``obs`` is
        not used: the attempt's observer heard it), or now: a node's 5xx passed on when no retry
        was left."""
        got, self.answer = self.answer, None
        body = got[1] if got is not None and got[0] is up else await self._read(scope, up, obs, under_attempt=False)
        ctype = up.headers.get("Content-Type", "application/octet-stream")
        if up.status >= 400:
            raise Failure("upstream_error", f"node answered HTTP {up.status}", up.status, body, ctype)
        asked = self.job.asked_model
        if asked is not None and scope.lease is not None and \
                aliased(scope.lease.target.node.rewrite, self.job.ticket.model) != asked:
            # The answer carries the name the client asked for (docs/CONFIG.md#rewriting-requests).
            rename = ModelRename(asked, sse="text/event-stream" in ctype)
            body = rename.feed(body) + rename.flush()
        self.res = Result(up.status, ctype, body)

    async def _read(self, scope: LeaseScope, up: Upstream, obs: Observer | None, under_attempt: bool) -> bytes:
        """Read the whole answer into memory, reserved against jobs.max_results_mb as its bytes
        arrive (the reservation ends with the job)."""
        memory = self.memory or ResultMemory(self.rt.cfg.jobs.max_results_mb)  # outside a store: its own result only
        job = self.job
        memory.release(job)  # an earlier attempt's bytes are gone (a continued stream's are held again)
        ok = False
        keeper = self.keeper if under_attempt else None
        try:
            if keeper is not None and keeper.seam is not None and not continuation.is_stream(up):
                # The node would not continue the stream (a server that knows no continue_final_message).
                raise Failure.upstream(f"node {job.node or '-'} could not continue the stream "
                                       f"(HTTP {up.status})", False)
            # The usage chunk the gateway asked for on the client's behalf is not part of its result.
            strip = UsageStripper() if self.ex is not None and gateway_added_usage(self.ex) else None
            declared = _content_length(up)
            if declared is not None and not memory.hold(job, declared):
                raise ResultTooLarge(memory.refusal(declared))
            body = await _read_result(up, lambda size: memory.hold(job, size), obs, strip, keeper)
            scope.size = len(body)
            ok = not failed_status(up.status)
            scope.ok = ok
            return body
        except ResultTooLarge as e:
            # The gateway's memory cap, not the node's fault: no breaker, the job fails.
            memory.release(job)
            raise Failure.upstream(str(e), False) from None
        except (aiohttp.ClientError, TimeoutError, UpstreamFailed) as e:
            memory.release(job)
            if keeper is not None and self.ex is not None and (isinstance(e, Stalled) or not isinstance(
                    e, TimeoutError | UpstreamFailed)):
                cut = mid_response(e)
                if continuation.plan(scope, self.ex, keeper, cut, judged=False):
                    # The scope's verdict and re-queue, as for a node that never answered; the next
                    # attempt sends the continuation, and its answer is read on after the seam.
                    raise UpstreamFailed(cut.reason, answered=isinstance(e, Stalled), cause=cut.cause) from None
                self.keeper = StreamKeeper()  # a stream started over (if at all) keeps nothing of this one
            if under_attempt and isinstance(e, Stalled):
                # The scope's verdict on a stall ejects the node, and it re-queues the job.
                raise UpstreamFailed(str(e), answered=True, cause=Cause.STALL) from None
            if under_attempt and isinstance(e, TimeoutError):
                # The request's deadline (the exchange has the scope's): the verdict and words the
                # scope gives a lease that outlives it.
                scope.node_failed(NodeVerdict(Cause.TIMEOUT, f"timed out after {scope.timeout:g}s", mid_body=True))
                raise Failure.upstream(f"node {job.node or '-'} did not finish within {scope.timeout:g}s",
                                       True) from None
            # A node lost mid-answer is not replayed: the job fails (docs/API.md "Re-queue").
            cut = mid_response(e)
            scope.node_failed(cut)
            raise Failure.mid_response(job.node or "-", cut) from None
        finally:
            up.release()
            if obs is not None:
                obs.done(ok)

    def result(self, res: Result) -> None:
        self.res = res

    def file_url(self, index: int) -> str:
        job = self.job
        return f"{job.base_url}/v1/jobs/{job.id}/files/{index}?token={job.access_token}"

    async def fail(self, f: Failure) -> None:
        self.failure = f


class ResultTooLarge(Exception):
    """A job's result does not fit in what jobs.max_results_mb has left."""


def _content_length(up: Upstream) -> int | None:
    raw = up.headers.get("Content-Length", "")
    return int(raw) if raw.isascii() and raw.isdigit() else None


async def _read_result(up: Upstream, hold: Callable[[int], bool], obs: Observer | None,
                       strip: UsageStripper | None, keeper: StreamKeeper | None = None) -> bytes:
    """The answer's bytes; ``hold(size)`` reserves room for ``size`` bytes before they are kept
    (ResultTooLarge when it cannot). With a ``keeper`` (a stream that may be continued) the bytes
    go through it and the answer is all it kept: the text before a seam, then the continuation."""
    buf = keeper.sent if keeper is not None else bytearray()
    async for chunk in up.content.iter_any():
        if obs is not None:
            obs.feed(chunk)
        kept = strip.feed(chunk) if strip is not None else chunk
        if keeper is not None:
            kept = keeper.feed(kept)
            if not hold(len(buf)):
                raise ResultTooLarge("result larger than what jobs.max_results_mb has left")
            continue
        if not hold(len(buf) + len(kept)):
            raise ResultTooLarge("result larger than what jobs.max_results_mb has left")
        buf += kept
    rest = strip.flush() if strip is not None else b""
    if keeper is not None:
        keeper.feed(rest)
        keeper.flush()
    else:
        buf += rest
    if not hold(len(buf)):
        raise ResultTooLarge("result larger than what jobs.max_results_mb has left")
    return bytes(buf)


class ResultMemory:
    """The bytes of job results in memory, against ``jobs.max_results_mb``: finished results
    (``held``, oldest first in ``results``) plus those still being read (``reading``, each job's
    share in ``Job.reading``). ``held + reading`` never exceeds the cap: a read that needs room
    drops the oldest finished results first, and fails when in-flight reads alone fill it.
    Pure bookkeeping: no I/O, no clock."""

    __slots__ = ("cap", "held", "reading", "results")

    def __init__(self, cap_mb: float) -> None:
        self.cap = int(cap_mb * 1024 * 1024)
        self.held = 0
        self.reading = 0
        self.results: OrderedDict[str, Job] = OrderedDict()  # jobs holding a result, oldest first

    @property
    def accounted(self) -> int:
        return self.held + self.reading

    def configure(self, cap_mb: float) -> None:
        """A reload: the new cap holds for finished results at once (``trim``), and for reads
        from their next bytes."""
        self.cap = int(cap_mb * 1024 * 1024)
        self.trim()

    def hold(self, job: Job, size: int) -> bool:
        """Reserve room for ``job``'s result to be ``size`` bytes; False when it cannot fit."""
        need = size - job.reading
        if need <= 0:
            return True
        while self.held + self.reading + need > self.cap and self.results:
            self.drop(next(iter(self.results.values())))
        if self.held + self.reading + need > self.cap:
            return False
        job.reading += need
        self.reading += need
        return True

    def refusal(self, size: int) -> str:
        other = self.reading
        return (f"result of {size} bytes larger than what jobs.max_results_mb has left "
                f"({max(0, self.cap - other)} of {self.cap} bytes; {other} held by results still being read)")

    def release(self, job: Job) -> None:
        """``job``'s read is over (finished, failed, cancelled, retried): its reservation ends."""
        self.reading -= job.reading
        job.reading = 0

    def keep(self, job: Job, res: Result) -> None:
        """``job`` finished with ``res``: its reservation becomes a held result (never larger: the
        bytes were reserved as they came)."""
        self.release(job)
        job.result = res
        self.held += len(res.body)
        self.results[job.id] = job
        self.trim()

    def trim(self) -> None:
        while self.held + self.reading > self.cap and self.results:
            self.drop(next(iter(self.results.values())))

    def drop(self, job: Job) -> None:
        if self.results.pop(job.id, None) is not None and job.result is not None:
            self.held -= len(job.result.body)
            job.result = None


class Jobs:
    def __init__(self, rt: Runtime, cfg: JobsConfig, webhooks: WebhookDeliverer, store: JobStore = LOCAL):
        self.rt = rt
        self.cfg = cfg
        self.webhooks = webhooks
        #: where jobs are mirrored for the other gateways (cluster mode); nowhere by default
        self.store = store
        self.jobs: dict[str, Job] = {}
        self.active: set[Job] = set()  # not yet terminal: what the ticker looks at
        self.finished: OrderedDict[str, Job] = OrderedDict()  # finish order, for the TTL
        #: results held and being read, within max_results_mb
        self.memory = ResultMemory(cfg.max_results_mb)
        self._ticker: asyncio.Task[None] | None = None
        self._route_view: dict[str, tuple[int, float | None]] = {}  # per tick: live slots, mean service

    def configure(self, cfg: JobsConfig) -> None:
        self.cfg = cfg
        self.memory.configure(cfg.max_results_mb)
        self._evict()

    @property
    def result_bytes(self) -> int:
        """Bytes of finished results held."""
        return self.memory.held

    @property
    def reading_bytes(self) -> int:
        """Bytes reserved by results still being read."""
        return self.memory.reading

    def start(self) -> None:
        self._ticker = asyncio.create_task(self._tick_loop(), name="kiloline-jobs")

    async def close(self) -> None:
        if self._ticker:
            self._ticker.cancel()
        tasks = [j.task for j in self.jobs.values() if j.task and not j.task.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- submission ---------------------------------------------------------------------
    async def check_callback(self, call: Call, principal: Principal | None) -> tuple[str | None, str | None]:
        """(callback URL or None, refusal reason or None) — checked before the request is admitted."""
        if call.mode != "async":
            return None, None
        callback = call.request.headers.get("X-KiloLine-Callback") or (principal.cfg.webhook_url if principal else None)
        if not callback:
            return None, None
        why = await check_callback_url(callback, self.cfg.webhook_allow_private)
        return (None, why) if why else (callback, None)

    async def submit(self, call: Call, ticket: Ticket, ex: Exchange, principal: Principal | None,
                     callback: str | None, adapter: Adapter, early: Result | None = None) -> web.StreamResponse:
        """Start the job; the client's answer: the 202 of an async job (``early``: the answer its
        backend would have given, for a sync request run as a job, Adapter.answer_early), or its
        SSE stream."""
        rt = self.rt
        request = call.request
        job = Job(
            id=secrets.token_urlsafe(16),  # 128 random bits
            access_token=secrets.token_urlsafe(24),
            route=ticket.route, route_label=rt.route_label(ticket.route), kind=call.kind,
            key=principal.key_id if principal else None, mode=call.mode, ticket=ticket, callback=callback,
            asked_model=call.asked_model,
            base_url=(rt.cfg.server.public_url or "").rstrip("/"), store=self.store,
        )
        self.jobs[job.id] = job
        self.active.add(job)
        position = rt.scheduler.position(ticket, rt.clock())
        est = self.est(job, position)
        rq = rt.scheduler.routes[ticket.route]
        job.last_position, job.last_est = position, est
        self.store.created(job, call, ex, principal.cfg.priority if principal else 0)
        urls = job.urls()
        cost = {"cost": ticket.cost} if rq.cfg.cost is not None else {}  # docs/CONFIG.md#cost-and-capacity
        job.emit("queued", {"job_id": job.id, "route": job.route_label, "position": position,
                            "queue_depth": rt.scheduler.depth(rq), "est_wait_sec": est, **cost,
                            "events_url": urls["events_url"], "result_url": urls["result_url"]})
        job.task = rt.spawn(self._run(job, ex, adapter))
        call.headers["X-KiloLine-Job"] = job.id
        await self.store.synced()  # another gateway asked about it right after the answer knows it
        if call.mode == "async":
            call.queue_wait = None  # its line is written at the 202, before any wait: job_ended logs the outcome
            if early is not None:
                return web.Response(status=early.http_status, body=early.body, content_type=early.content_type,
                                    headers={**call.headers, "X-Request-Id": call.request_id})
            body = {"job_id": job.id, "status": job.status, "position": position, "est_wait_sec": est,
                    **cost, **job.urls()}
            return web.Response(status=202, body=orjson.dumps(body), content_type="application/json",
                                headers={**call.headers, "Location": job.urls()["status_url"],
                                         "X-Request-Id": call.request_id})
        try:
            resp = await self.stream(request, job, 0, call.headers | {"X-Request-Id": call.request_id})
            call.bytes_out = resp.body_length
            return resp
        finally:
            call.node = job.node or "-"  # the access-log line of an sse request names its node
            call.swap = job.swap  # and whether it was a swap
            call.queue_wait = job.queue_wait  # and how long it waited (None: it never reached a node)

    def est(self, job: Job, position: int | None) -> float | None:
        return self.rt.est_wait(job.route, position, self.rt.clock())

    # --- running ------------------------------------------------------------------------
    def resume(self, job: Job, ex: Exchange, adapter: Adapter, lost: tuple[str, str] | None) -> None:
        """Carry on a job another gateway ran (cluster mode: that gateway was lost)."""
        job.store = self.store
        self.jobs[job.id] = job
        self.active.add(job)
        if job.cancel_requested:
            self._cancelled(job)
            return
        job.task = self.rt.spawn(self._run(job, ex, adapter, lost))

    def fail_carried(self, job: Job, message: str) -> None:
        """A job carried on from a lost gateway that cannot run again here: it fails, once."""
        job.store = self.store
        self.jobs[job.id] = job
        self.active.add(job)
        self._finish_failed(job, "upstream_error", message, 502)

    async def _run(self, job: Job, ex: Exchange, adapter: Adapter, lost: tuple[str, str] | None = None) -> None:
        """Run the job to its end; whatever happens, it ends terminal (events, webhook)."""
        sink = JobSink(self.rt, job, ex, lost, self.memory, adapter)
        try:
            await run(self.rt, job.ticket, ex, adapter, sink, job.key, job.route_label)
        except (Cancelled, asyncio.CancelledError):
            self._cancelled(job)
        except Exception as e:  # a bug must fail one job, not the gateway
            log.exception("job %s", job.id)
            sink.failure = Failure("internal_error", f"internal error ({type(e).__name__})", 500)
        finally:
            job.task = None  # a finished job is kept for result_ttl_sec; its task need not be
            if job.status not in TERMINAL:
                self._conclude(job, sink)

    def _conclude(self, job: Job, sink: JobSink) -> None:
        try:
            f = sink.failure
            if f is not None:
                self._finish_failed(job, f.type, f.message, f.http_status, f.body, f.content_type)
            elif sink.res is not None:
                self._finish_completed(job, sink.res)
            else:
                self._finish_failed(job, "internal_error", "the job ended without a result", 500)
        except Exception:
            # Rendering the ending itself failed: the job still ends, and its watchers are told.
            log.exception("job %s: finishing", job.id)
            if job.status not in TERMINAL:
                self._finish(job, "failed")
            job.error = {"type": "internal_error", "message": "the job's result could not be rendered"}
            job.emit("failed", {"status": "failed", "error": job.error, "http_status": 500})
            self._webhook(job, "job.failed", None)

    def _cancelled(self, job: Job) -> None:
        self.rt.leases.cancel(job.ticket)  # the store that holds it (Redis in cluster mode)
        if job.status not in TERMINAL:
            self._finish(job, "cancelled")
            job.error = {"type": "cancelled", "message": "cancelled"}
            job.emit("failed", {"status": "cancelled", "error": job.error, "http_status": None})

    def _finish(self, job: Job, status: str) -> None:
        self.memory.release(job)  # every ending: a result not kept gives its reservation back
        self.active.discard(job)
        job.status = status
        job.finished_at = time.time()
        if job.started_mono is not None:
            job.duration = round(self.rt.clock() - job.started_mono, 3)
        self.finished[job.id] = job
        self.rt.stats.record(job.route_label, status, job.queue_wait, job.duration, ran=job.started_mono is not None)
        if job.on_end is not None:
            end, job.on_end = job.on_end, None
            end(job)

    def _finish_completed(self, job: Job, res: Result) -> None:
        job.http_status = res.http_status
        self.memory.keep(job, res)
        self._finish(job, "completed")
        inline = res.result
        if inline is None and len(res.body) <= INLINE_RESULT_MAX and "json" in res.content_type:
            with contextlib.suppress(ValueError):
                inline = orjson.loads(res.body)
        data = {"status": "completed", "duration_sec": job.duration, "queue_wait_sec": _r(job.queue_wait),
                "http_status": res.http_status, "content_type": res.content_type,
                "result_url": job.urls()["result_url"], "result": inline}
        job.emit("output_ready", data)
        self._webhook(job, "job.completed", inline)
        self._evict()

    def _finish_failed(self, job: Job, type_: str, message: str, http_status: int | None,
                       body: bytes | None = None, content_type: str | None = None) -> None:
        job.http_status = http_status
        job.error = {"type": type_, "message": message}
        if body is not None:
            self.memory.keep(job, Result(http_status or 502, content_type or "application/json", body))
        self._finish(job, "failed")
        job.emit("failed", {"status": "failed", "error": job.error, "http_status": http_status})
        self._webhook(job, "job.failed", None)
        self._evict()

    def _webhook(self, job: Job, type_: str, result: Any) -> None:
        if not job.callback:
            return
        payload = {"type": type_, "job_id": job.id, "route": job.route_label, "status": job.status,
                   "http_status": job.http_status, "duration_sec": job.duration,
                   "queue_wait_sec": _r(job.queue_wait), "result_url": job.urls()["result_url"], "result": result}
        if job.error:
            payload["error"] = job.error
        self.store.send_once(job, Hook(job.callback, payload, f"msg_{job.id}"), self.webhooks)

    def _evict(self) -> None:
        """Forget jobs past result_ttl_sec; drop the oldest results while over max_results_mb."""
        now = time.time()
        while self.finished:
            jid, job = next(iter(self.finished.items()))
            if (job.finished_at or now) + self.cfg.result_ttl_sec > now:
                break
            self.finished.popitem(last=False)
            self.jobs.pop(jid, None)
            self.memory.drop(job)
        self.memory.trim()

    async def cancel_any(self, job: Job) -> Job:
        """DELETE: cancel it here, or have the gateway that runs it cancel it; the job afterwards."""
        if job.remote:
            return await self.store.cancel(job) or job
        self.cancel(job)
        task = job.task
        if task is not None and not task.done():
            # Let the runner record the cancellation (and interrupt ComfyUI) before answering.
            await asyncio.wait({task}, timeout=5)
        return job

    def cancel(self, job: Job) -> None:
        if job.status in TERMINAL:
            return
        job.cancel_requested = True
        if job.ticket.state == WAITING:
            self.rt.leases.cancel(job.ticket)
        if job.task is not None and not job.task.done():
            job.task.cancel()

    async def flush_webhooks(self, timeout: float) -> None:
        """Give queued-job failure webhooks a moment to go out before the process exits."""
        await asyncio.sleep(0)
        tasks = [j.task for j in self.jobs.values() if j.task and not j.task.done() and j.status == "queued"]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    # --- periodic queue_status / heartbeat ----------------------------------------------
    async def _tick_loop(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            # Absolute deadlines: the period does not stretch by the tick's own duration.
            deadline = max(deadline + TICK_SEC, loop.time())
            await asyncio.sleep(deadline - loop.time())
            try:
                self.tick()
            except Exception:
                log.exception("jobs tick")

    def tick(self) -> None:
        rt = self.rt
        now = rt.clock()
        mono = time.monotonic()
        wall = time.time()
        hb = rt.cfg.server.heartbeat_sec
        positions: dict[str, dict[int, int]] = {}
        self._route_view.clear()
        for job in list(self.active):
            beat = mono - job.last_event_at >= hb - TICK_SEC / 2  # due within this tick: send it now
            if job.status == "queued" and job.ticket.state == WAITING:
                route_pos = positions.get(job.route)
                if route_pos is None:
                    route_pos = positions[job.route] = rt.scheduler.positions(job.route, now)
                pos = route_pos.get(job.ticket.seq)
                changed = pos != job.last_position and mono - job.last_queue_status_at >= 1.0
                if beat:
                    job.emit("heartbeat", {"state": "queued", "elapsed_sec": round(wall - job.created_at, 1)})
                if changed or beat:
                    self._queue_status(job, pos, now, mono)
            elif beat:
                job.emit("heartbeat", {"state": "running", "elapsed_sec": round(wall - job.created_at, 1)})
        if self.finished:
            self._evict()

    def _queue_status(self, job: Job, pos: int | None, now: float, mono: float) -> None:
        rq = self.rt.scheduler.routes.get(job.route)
        if rq is None:
            return
        job.last_position = pos
        job.last_queue_status_at = mono
        sched = self.rt.scheduler
        # Per route and tick, not per job: thousands of jobs may wait on one route.
        slots, mean = self._route_view.get(job.route) or self._view_route(job.route, now)
        est = None if mean is None or not slots or pos is None else round(pos * mean / slots, 2)
        waiting_for_node = not sched.usable(rq, now) if not slots else False
        if waiting_for_node and pos is not None and self.rt.node_eta is not None:
            est = self.rt.node_eta(job.route)  # a pool scaled to zero: when its node will serve
        job.last_est = est
        job.emit("queue_status", {
            "position": pos, "queue_depth": sched.depth(rq), "est_wait_sec": est,
            "waiting_for_node": waiting_for_node,
        })

    def _view_route(self, route: str, now: float) -> tuple[int, float | None]:
        rq = self.rt.scheduler.routes[route]
        view = (self.rt.scheduler.live_slots(rq, now), rq.mean_service)
        self._route_view[route] = view
        return view

    # --- reading ------------------------------------------------------------------------
    def find(self, request: web.Request, job_id: str) -> Job | None:
        """The job if the caller may see it: its access token, or the key that created it."""
        job = self.jobs.get(job_id)
        if job is None:
            return None
        return self._visible(request, job)

    async def find_any(self, request: web.Request, job_id: str) -> Job | None:
        """``find``, then — for a job this gateway does not hold — the store (cluster mode), with
        the same rule of who may see it."""
        job = self.jobs.get(job_id)
        if job is None:
            job = await self.store.load(job_id)
            if job is None:
                return None
        return self._visible(request, job)

    def view(self, job: Job) -> dict[str, Any]:
        """``GET /v1/jobs/{id}``: position and estimate live while queued here, as stored if remote."""
        if job.remote:
            return job.view(job.last_position, job.last_est) if job.status == "queued" else job.view(None, None)
        pos = self.rt.scheduler.position(job.ticket, self.rt.clock()) if job.status == "queued" else None
        return job.view(pos, self.est(job, pos))

    def _visible(self, request: web.Request, job: Job) -> Job | None:
        token = request.query.get("token")
        if token is not None:
            return job if hmac.compare_digest(token.encode(), job.access_token.encode()) else None  # bytes: any token
        p = self.rt.keys.lookup(presented_key(request))
        if p is not None and job.key is not None and p.key_id == job.key:
            return job
        return None

    async def subscribe(self, job: Job, after: int) -> AsyncIterator[list[tuple[int, str, bytes]]]:
        """Batches of events after ``after``: the replay first, then live ones as they come."""
        if job.remote:
            async for batch in self.store.follow(job, after):
                yield batch
            return
        sub = Subscriber()
        backlog = [ev for ev in job.events if ev[0] > after]
        job.subscribers.add(sub)
        try:
            if backlog:
                yield backlog
            if job.status in TERMINAL:
                return
            while (live := await sub.batch()) is not None:
                if fresh := [ev for ev in live if ev[0] > after]:
                    yield fresh
        finally:
            job.subscribers.discard(sub)

    async def stream(self, request: web.Request, job: Job, after: int, headers: dict[str, str]) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={
            **headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no", "X-KiloLine-Job": job.id, "Server": SERVER,
        })
        await resp.prepare(request)
        await resp.write(b"retry: 3000\n\n")
        async for batch in self.subscribe(job, after):
            await resp.write(b"".join([ev[2] for ev in batch]))
        await resp.write_eof()
        return resp


def _json(data: dict[str, Any]) -> bytes:
    """orjson, or — for a string it refuses (a lone surrogate from a node's odd bytes) — escaped JSON."""
    try:
        return orjson.dumps(data)
    except TypeError:
        return json.dumps(data).encode()


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)

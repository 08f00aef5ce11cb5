"""The adapter interface, and the plain HTTP exchange that generic and openai routes use.

An adapter says what differs per backend kind: how to check a request before it queues
(``prepare``), how to submit it and know when the GPU work is done (``serve``), what to read on
the way (``observer``: usage, time to first token, progress). It never takes or frees a slot
itself: it asks the lease scope for a lease (``scope.acquire``) and hands the answer to the sink.
"""

from __future__ import annotations

import logging

from aiohttp import web

from kilolined.core.config import RewriteConfig
from kilolined.core.forms import FormError
from kilolined.core.outcome import Result
from kilolined.core.rewrite import rewrite_body
from kilolined.core.verdict import Cause, failed_status, status_verdict
from kilolined.ops.runtime import Runtime
from kilolined.scheduling.lease import LeaseScope, Sink
from kilolined.scheduling.queue import Lease, Ticket
from kilolined.wire.proxy import RETRY_STATUSES, Exchange, Observer, UpstreamFailed, open_upstream, parse_body
from kilolined.wire.upstream import Stalled, UpstreamResponse

log = logging.getLogger("kilolined")


class Adapter:
    kind = "generic"
    #: whether ``control`` can answer anything (spares every other kind's request a coroutine)
    has_control = False

    def prepare(self, ex: Exchange) -> None:
        """Validate or rewrite the request before it is queued; raise Rejected(400) to refuse it."""

    async def control(self, rt: Runtime, request: web.Request, route: str, path: str, subject: str | None,
                      request_id: str) -> web.StreamResponse | None:
        """Answer at once, without a slot, a request that must never queue (ComfyUI's /interrupt,
        its history and its websocket); None lets it go on through the pipeline. ``subject``
        None is the admin key."""
        return None

    def answer_early(self, rt: Runtime, ex: Exchange, ticket: Ticket) -> Result | None:
        """The answer to a sync request that must wait in the gateway's queue, when its backend
        answers such a request before doing the work (ComfyUI's ``POST /prompt``): the request is
        then the gateway's to run, as an async job is. None (every other kind): the client waits."""
        return None

    def observer(self, rt: Runtime, ex: Exchange, scope: LeaseScope, sink: Sink) -> Observer | None:
        return None

    def named_model(self, ex: Exchange) -> str | None:
        """The model the request names (its line of the bill); None for a kind whose requests name none."""
        return None

    async def serve(self, rt: Runtime, scope: LeaseScope, ex: Exchange, sink: Sink) -> None:
        """The request's whole life on a node, inside its lease scope."""
        up = await scope.acquire(HttpAttempt(scope, ex))
        await sink.deliver(scope, up, self.observer(rt, ex, scope, sink))


class HttpAttempt:
    """Send the request, wait for headers; 502/503 count as node failures (re-queued), a 500 or 504
    as a node failure passed to the client (never re-sent: the work may have run).

    A class with two slots rather than a closure: one is held by every waiting request, and a
    closure's function object and cells cost ~4× as much.
    """

    __slots__ = ("ex", "rt", "scope")
    #: statuses that mean the node refused the *gateway's* credentials (a node failure, not the
    #: client's): none for a generic node, whose 401 may well be meant for the client
    credential_statuses: frozenset[int] = frozenset()

    def __init__(self, scope: LeaseScope, ex: Exchange):
        self.scope, self.rt, self.ex = scope, scope.rt, ex

    async def __call__(self, lease: Lease) -> UpstreamResponse:
        rt = self.rt
        target = lease.target
        rw = target.node.rewrite
        up = await open_upstream(rt.pool(lease.node), self.ex, target.url, target.headers, target.request_timeout_sec,
                                 None if rw is None else node_body(self.ex, rw), lease.sent)
        if up.status in self.credential_statuses:
            up.release()
            log.error("✗ [%s] refused the gateway's credentials (HTTP %d): check nodes.%s.headers; "
                      "counted as a node failure, the client gets 502", lease.node, up.status, lease.node)
            raise UpstreamFailed(f"HTTP {up.status} from node (the gateway's credentials for it were refused)",
                                 answered=True, cause=Cause.STATUS)
        if up.status in RETRY_STATUSES:
            raise UpstreamFailed(f"HTTP {up.status} from node", response=up)
        if failed_status(up.status):
            self.scope.node_failed(status_verdict(up.status))
        else:
            self.scope.node_ok()
            slow = target.node.slow
            if slow is not None and "text/event-stream" in up.content_type:
                up.idle_sec = slow.stall_sec  # a stream silent this long is a stall
                try:
                    # Silent before its first byte: nothing reached the client, so re-queue it.
                    await up.ready()
                except Stalled as e:
                    up.release()
                    raise UpstreamFailed(str(e), answered=True, cause=Cause.STALL) from None
        sink = self.scope.listener
        if sink.reads_answer:
            await sink.received(self.scope, up)  # a job's answer, read whole while it can still be re-queued
        return up


def node_body(ex: Exchange, rw: RewriteConfig) -> bytes | None:
    """What a node with its own rewrite is sent (docs/CONFIG.md#rewriting-requests): the route's
    body with the node's rules applied after; None when they change nothing."""
    sent = ex.body if ex.body_override is None else ex.body_override
    doc = ex.body_doc() if ex.body_override is None else parse_body(sent)
    try:
        return rewrite_body(sent, doc, ex.request.headers.get("Content-Type"), rw)
    except FormError:
        return None  # the route's stage read this form already: it is one


class Tee(Observer):
    __slots__ = ("obs",)

    def __init__(self, *obs: Observer | None):
        self.obs = [o for o in obs if o is not None]

    def feed(self, chunk: bytes) -> None:
        for o in self.obs:
            o.feed(chunk)

    def done(self, ok: bool) -> None:
        for o in self.obs:
            o.done(ok)

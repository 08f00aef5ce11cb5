"""Streams that survive their node: when to continue, and the sync stream's loop (docs/API.md
"Streams that survive their node"; the pure part is kilolined/core/continuation.py, and
messages_continuation.py for Anthropic's shape).

An OpenAI or Anthropic Messages stream (``"stream": true`` on an ``openai`` route with
``continue_streams`` on, the default) whose node fails after the client got bytes — the
connection lost, a stall — is sent again to another node as a continuation of the text so far,
within ``retry_on_failover`` re-queues (a continuation counts as one). A stream that stalled on
two nodes fails as any other (the request's doing). A continuing node that does not answer with
a stream (a server that knows no ``continue_final_message``) ends the client's stream with the
first node's failure.

The sync stream continues here (``deliver``); an sse/async job reads its node's answer under the
attempt, so it continues through the lease scope's own re-queue (modes/jobs.py asks ``plan``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from kilolined.core.continuation import Seam, Seamed, StreamKeeper, Transcript, continuation_body
from kilolined.core.messages_continuation import MessagesSeam, MessagesTranscript, messages_continuation_body
from kilolined.core.outcome import Failure
from kilolined.core.verdict import NodeVerdict
from kilolined.ops.runtime import Runtime
from kilolined.scheduling.anthropic_body import is_messages_path
from kilolined.scheduling.lease import STALLS_MAX, LeaseScope, Sink
from kilolined.scheduling.queue import Lease
from kilolined.wire.proxy import Exchange, Observer, Upstream

log = logging.getLogger("kilolined")
_CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
_COMPLETION_PATHS = (*_CHAT_PATHS, "/v1/completions", "/completions")


def _body(ex: Exchange) -> dict[str, Any] | None:
    """The client's JSON body of a completion request (chat, legacy or Anthropic's Messages), else None."""
    path = ex.tail.split("?", 1)[0]
    if ex.method != "POST" or not (path.endswith(_COMPLETION_PATHS) or is_messages_path(path)):
        return None
    data = ex.body_doc()
    return data if isinstance(data, dict) else None


def wanted(scope: LeaseScope, ex: Exchange) -> bool:
    """The request is a stream its route would continue on another node."""
    route = scope.rt.scheduler.routes.get(scope.route)
    if route is None or not route.cfg.continue_streams or route.cfg.kind != "openai":
        return False
    data = _body(ex)
    return data is not None and data.get("stream") is True


def _retries_left(scope: LeaseScope, cut: NodeVerdict, judged: bool) -> bool:
    """Within ``retry_on_failover`` re-queues, and not a stream that stalled on two nodes
    (``judged``: the scope already counted this failure's stall)."""
    route = scope.rt.scheduler.routes.get(scope.route)
    if route is None or scope.retries_spent >= route.cfg.retry_on_failover:
        return False
    return not (cut.stalled and scope.stalls + (0 if judged else 1) >= STALLS_MAX)


def plan(scope: LeaseScope, ex: Exchange, keeper: StreamKeeper, cut: NodeVerdict, judged: bool = True) -> bool:
    """Decide whether the stream cut by ``cut`` goes on on another node. If so, the node's
    body becomes the continuation (``ex.body_override``) and ``keeper`` passes the next node's
    events through the seam; False: the stream ends as it would without continuations.
    ``judged``: the scope has given its verdict on the failure already (the sync stream's)."""
    sent = keeper.cut()
    data = _body(ex)
    if data is None or not _retries_left(scope, cut, judged):
        return False
    continued = _continuation(data, sent, ex.tail.split("?", 1)[0])
    if continued is None:
        return False
    body, seam = continued
    ex.body_override = orjson.dumps(body)
    keeper.continue_through(seam)
    rt = scope.rt
    scope.ticket.continued += 1
    rt.metrics.continuations.labels(rt.route_label(scope.route)).inc()
    return True


def _continuation(data: dict[str, Any], sent: bytes, path: str) -> tuple[dict[str, Any], Seamed] | None:
    """The body that continues the answer the client got (``sent``) and the seam its stream goes
    on through, in the request's API shape; None when it cannot be continued."""
    if is_messages_path(path):
        m = MessagesTranscript.read(sent)
        body = messages_continuation_body(data, m)
        return None if body is None else (body, MessagesSeam(m))
    t = Transcript.read(sent)
    body = continuation_body(data, t, path.endswith(_CHAT_PATHS))
    return None if body is None else (body, Seam(t))


def seam_at(keeper: StreamKeeper | None, lease: Lease) -> None:
    """The continuation was dispatched: its note names the node that goes on."""
    if keeper is not None and keeper.seam is not None and not keeper.seam.node:
        keeper.seam.node = lease.node


def is_stream(up: Upstream) -> bool:
    return up.status == 200 and "text/event-stream" in up.headers.get("Content-Type", "")


async def deliver(rt: Runtime, scope: LeaseScope, ex: Exchange, sink: Sink, up: Upstream,
                  observer: Callable[[], Observer | None],
                  attempt: Callable[[Lease], Awaitable[Upstream]]) -> None:
    """``sink.deliver`` of a stream that may be continued: each time its node fails mid-answer
    and ``plan`` says it goes on, re-queued and continued under the same scope."""
    keeper = sink.keep_stream() if not sink.reads_answer and wanted(scope, ex) else None
    if keeper is None:
        await sink.deliver(scope, up, observer())
        return
    while True:
        try:
            await sink.deliver(scope, up, observer())
            return
        except Failure as f:
            if f.cut is None or not plan(scope, ex, keeper, f.cut):
                raise
            cut = f
        assert cut.cut is not None
        scope.continue_elsewhere(cut.cut)
        up = await scope.acquire(attempt)
        assert scope.lease is not None
        seam_at(keeper, scope.lease)
        if not is_stream(up):
            # The next node would not continue it (a server that knows no continue_final_message):
            # the stream ends as it would have without continuations.
            log.warning("✗ [%s] HTTP %d to a continuation: the stream ends (%s)", scope.lease.node, up.status,
                        scope.route)
            up.release()
            scope.ok = False
            raise cut

"""The one post-admission runner: every admitted request, whatever its mode, lives here.

    admitted ticket ─▶ LeaseScope (wait, retry, deadline, release) ─▶ adapter.serve ─▶ sink

The adapter says what differs per kind (submit, when the GPU work is done, progress, usage);
the sink says what differs per client mode (sync response, OpenAI stream, job events). How a
request ended is counted once, here.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from kilolined.adapters.base import Adapter
from kilolined.core.outcome import Failure
from kilolined.ops.runtime import Runtime
from kilolined.scheduling.lease import LeaseScope, Sink
from kilolined.scheduling.queue import Ticket
from kilolined.wire.proxy import Exchange


async def run(rt: Runtime, ticket: Ticket, ex: Exchange, adapter: Adapter, sink: Sink, key: str | None,
              label: str) -> web.StreamResponse | None:
    """Run one admitted request to its end; returns the sink's response (sync modes)."""
    outcome: str | None = "ok"
    try:
        scope = LeaseScope(rt, ticket, sink, key)
        if ticket.model is None:
            ticket.named_model = adapter.named_model(ex)  # the bill's model where the route does not route by it
        try:
            if sink.tick_sec is not None:
                await sink.begin(scope)  # a stream that must queue says so at once
            await adapter.serve(rt, scope, ex, sink)
        except BaseException as e:
            if not scope.exit_now(e):
                await scope.exit(type(e), e)
            raise
        if not scope.exit_now(None):
            await scope.exit(None, None)
        elif scope.handed_over:
            # The slot went to a waiting request: let it reach the node first (one loop turn), and
            # do this request's tail (writing its answer, logs, metrics) while the node works.
            await asyncio.sleep(0)
        outcome = sink.outcome
        return sink.response
    except Failure as f:
        # Refusals of the queue itself (timeout, shutdown, dropped) are counted as rejections.
        outcome = None if f.type in ("queue_timeout", "queue_full", "shutting_down") else f.outcome
        return await sink.fail(f)
    except ConnectionResetError:
        outcome = "client_gone"
        raise
    except BaseException:
        outcome = sink.outcome if sink.outcome != "ok" else sink.gone
        raise
    finally:
        if outcome is not None:
            rt.metrics.requests.labels(label, outcome).inc()

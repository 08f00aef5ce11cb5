"""The one post-admission runner: every admitted request, whatever its mode, lives here.

    admitted ticket ─▶ LeaseScope (wait, retry, deadline, release) ─▶ adapter.serve ─▶ sink

The adapter says what differs per kind (submit, when the GPU work is done, progress, usage);
the sink says what differs per client mode (sync response, OpenAI stream, job events). How a
request ended is counted once, here.
"""

from __future__ import annotations

from aiohttp import web

from kilolined.adapters.base import Adapter
from kilolined.lease import LeaseScope, Listener
from kilolined.outcome import Failure, Result
from kilolined.proxy import Exchange, Observer, Upstream
from kilolined.queue import Ticket
from kilolined.runtime import Runtime


class ModeSink(Listener):
    """The sink interface of the runner: a Listener that takes answers and failures."""

    __slots__ = ()
    mode = "sync"
    reports_progress = False
    outcome = "ok"
    gone = "client_gone"  # how a cancelled run counts: the client left (sync) or the job was cancelled
    response: web.StreamResponse | None = None

    async def begin(self, scope: LeaseScope) -> None:
        pass

    async def deliver(self, scope: LeaseScope, up: Upstream, obs: Observer | None,
                      capture: bytearray | None = None) -> None:
        raise NotImplementedError

    def result(self, res: Result) -> None:
        raise NotImplementedError

    def progress(self, step: int | float, total: int | float) -> None:
        pass

    async def fail(self, f: Failure) -> web.StreamResponse | None:
        raise NotImplementedError


async def run(rt: Runtime, ticket: Ticket, ex: Exchange, adapter: Adapter, sink: ModeSink, key: str | None,
              label: str) -> web.StreamResponse | None:
    """Run one admitted request to its end; returns the sink's response (sync modes)."""
    outcome: str | None = "ok"
    try:
        scope = LeaseScope(rt, ticket, sink, key)
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

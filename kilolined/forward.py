"""One queued request against the nodes: wait for a lease, try, re-queue on a node failure.

This is HAProxy's ``redispatch`` for GPU work: a node that fails *before any byte reached the
client* (connect error, reset, timeout before headers, 502/503/504) costs the request nothing
but time — it goes back to the head of its queue and onto another node, ``retry_on_failover``
times at most. The attempt itself is a callable, so sync proxying, jobs and the ComfyUI adapter
share this loop.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kilolined.proxy import RETRY_STATUSES, Exchange, UpstreamFailed, open_upstream
from kilolined.queue import Lease, Ticket
from kilolined.runtime import Runtime
from kilolined.upstream import UpstreamResponse

log = logging.getLogger("kilolined")
T = TypeVar("T")


class Hooks:
    """What a caller wants to hear about while its request moves (jobs turn these into events)."""

    __slots__ = ()

    def dispatched(self, lease: Lease, queue_wait: float) -> None:
        pass

    def rerouted(self, from_node: str, to_node: str, reason: str) -> None:
        pass


async def with_retries(
    rt: Runtime, ticket: Ticket, attempt: Callable[[Lease], Awaitable[T]], hooks: Hooks | None = None
) -> tuple[Lease, T]:
    """Run ``attempt`` under a lease until it succeeds or retries run out.

    On success the lease is still held (the caller releases it when the work is done). On a
    final UpstreamFailed the lease is released and the error raised. Rejected (queue timeout,
    shutdown) propagates from the wait.
    """
    hooks = hooks or Hooks()
    lease = await rt.wait(ticket)
    hooks.dispatched(lease, rt.clock() - ticket.enqueued_at)
    while True:
        try:
            result = await attempt(lease)
        except UpstreamFailed as e:
            failure = e
        except BaseException:
            rt.release(lease, ok=None)
            raise
        else:
            return lease, result
        rcfg = rt.scheduler.routes[lease.route].cfg
        rt.node_failure(lease.node, failure.reason, lease.trial)
        if ticket.requeues >= rcfg.retry_on_failover:
            if failure.response is not None:
                # Out of retries, but the node did answer: its own status passes through.
                return lease, failure.response  # type: ignore[return-value]
            rt.release(lease, ok=False)
            raise failure
        if failure.response is not None:
            failure.response.release()
        from_node = lease.node
        log.warning("⚡ [%s] %s — re-queued (%s)", from_node, failure.reason, lease.route)
        rt.requeue(lease)
        lease = await rt.wait(ticket)
        hooks.rerouted(from_node, lease.node, failure.reason)
        hooks.dispatched(lease, rt.clock() - ticket.enqueued_at)


class HttpAttempt:
    """The plain attempt: send the request, wait for headers; 502/503/504 count as node failures.

    A class with two slots rather than a closure: one is held by every waiting request, and a
    closure's function object and cells cost ~4× as much.
    """

    __slots__ = ("ex", "rt")

    def __init__(self, rt: Runtime, ex: Exchange):
        self.rt, self.ex = rt, ex

    async def __call__(self, lease: Lease) -> UpstreamResponse:
        rt = self.rt
        ns = rt.scheduler.nodes[lease.node]
        rcfg = rt.scheduler.routes[lease.route].cfg
        up = await open_upstream(rt.pool(lease.node), self.ex, ns.cfg.url, ns.cfg.headers, rcfg.request_timeout_sec)
        if up.status in RETRY_STATUSES:
            raise UpstreamFailed(f"HTTP {up.status} from node", response=up)
        if up.status >= 500:
            rt.node_failure(lease.node, f"HTTP {up.status} from node", lease.trial)
        else:
            rt.node_success(lease.node, lease.trial)
        return up

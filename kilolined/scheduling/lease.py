"""The lease scope: the one owner of "exactly N on the GPU" for one admitted request.

Every admitted request lives inside one ``LeaseScope``. The scope is the only code that waits
for a lease, re-queues the request after a node failure (HAProxy's ``redispatch``: a node that
fails before any byte reached the client costs the request nothing but time), and gives the
slot back. Its exit — success, error, cancellation, a bug — is the only release (arq's one
done-callback), so no runner can forget it.

It is also the one place a node's answer is judged: ``node_ok`` and ``node_failed`` are the
only calls that feed a node's health and breaker, with the time since dispatch and the answer's
size at hand.

``request_timeout_sec`` is a deadline of the scope, from dispatch to release: it fires whatever
is holding the lease — the node, a client that does not read, a ComfyUI prompt still running —
and the per-kind cleanups registered with ``on_abort`` (interrupt the prompt) run *before* the
slot is freed. A client that is slow to read is never counted against the node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

from aiohttp import web

from kilolined.core.continuation import StreamKeeper
from kilolined.core.outcome import Failure, Result
from kilolined.core.verdict import Cause, NodeVerdict
from kilolined.ops.runtime import Runtime
from kilolined.scheduling.bill import gpu_cost
from kilolined.scheduling.queue import LEASED, WAITING, Lease, Rejected, Target, Ticket
from kilolined.scheduling.speed import Sample
from kilolined.wire.proxy import Observer, Upstream, UpstreamFailed

log = logging.getLogger("kilolined")
T = TypeVar("T")
CLEANUP_SEC = 5.0
STALLS_MAX = 2  # nodes a request may stall on: one that stalled on two fails, it ejects no third
ATTEMPT_GRACE_SEC = 1.0  # an abort cleanup (interrupt a prompt) may take this long before the slot is freed


class Sink(Protocol):
    """Where one admitted request's answer goes: its client mode (sinks.py: sync and OpenAI
    stream; jobs.py: sse and async).

    A sink hears the request's moves (``dispatched``, ``rerouted``, ``requeued``, ``tick``),
    takes the node's answer (``deliver``), a computed result (``result``) or the failure
    (``fail``), and owns how each looks to its client. The scope, the adapters and the runner
    know sinks only by this protocol; the implementations inherit its defaults.
    """

    __slots__ = ()
    mode: str = "sync"
    #: whether the adapter should read progress for it (job events)
    reports_progress: bool = False
    #: when set, ``tick`` is awaited this often while the request waits for a lease or for the
    #: node's first answer (the OpenAI stream's keep-alive comments)
    tick_sec: float | None = None
    #: how the request ended, for kiloline_requests_total (set by ``deliver``)
    outcome: str = "ok"
    #: how a cancelled run counts: the client left (sync) or the job was cancelled
    gone: str = "client_gone"
    #: what the sync handler answers with (None for jobs)
    response: web.StreamResponse | None = None
    #: the sink keeps the node's whole answer before its client sees any of it (the job modes):
    #: the attempt hands it to ``received``, so a node that fails while it is read can be re-queued
    reads_answer: bool = False

    def dispatched(self, lease: Lease, queue_wait: float) -> None:
        return None

    def rerouted(self, from_node: str, to_node: str, reason: str) -> None:
        return None

    def requeued(self) -> None:
        """Back in the queue after its node failed: waiting again until the next ``dispatched``."""
        return None

    async def tick(self, queued: bool) -> None:
        return None

    async def begin(self, scope: LeaseScope) -> None:
        """Before the wait (a stream that must queue says so at once)."""
        return None

    async def received(self, scope: LeaseScope, up: Upstream) -> None:
        """(``reads_answer``) Read the node's answer under the attempt, before the lease is held;
        UpstreamFailed re-queues the request like a node that never answered."""
        return None

    async def deliver(self, scope: LeaseScope, up: Upstream, obs: Observer | None,
                      capture: bytearray | None = None) -> None:
        """Pass the node's answer on; the slot is freed when the scope ends."""

    def result(self, res: Result) -> None:
        """A result the adapter computed (a ComfyUI job's outputs)."""

    def file_url(self, index: int) -> str:
        """The gateway URL of the result's ``index``-th output file (the job modes keep files)."""
        raise TypeError(f"{type(self).__name__} keeps no result files")

    def progress(self, step: int | float, total: int | float) -> None:
        return None

    def keep_stream(self) -> StreamKeeper | None:
        """Keep what goes out of the answer from now on, so that a stream cut by its node can be
        continued on another (core/continuation.py); None: this sink cannot (plain sync)."""
        return None

    async def fail(self, f: Failure) -> web.StreamResponse | None:
        """Tell the client the request failed; the sync modes return the response."""


class _Ended(Sink):
    """An exited scope's sink: hears nothing (no state, so it holds no request alive)."""

    __slots__ = ()

    async def deliver(self, scope: LeaseScope, up: Upstream, obs: Observer | None,
                      capture: bytearray | None = None) -> None:
        up.release()

    def result(self, res: Result) -> None:
        return None

    async def fail(self, f: Failure) -> web.StreamResponse | None:
        return None


ENDED = _Ended()

# The scope's states (``LeaseScope.state``); the transition table is in LeaseScope's docstring.
S_WAITING = "waiting"
S_ATTEMPTING = "attempting"
S_HELD = "held"
S_DETACHED = "detached"
S_EXPIRED = "expired"
S_RELEASED = "released"
TRANSITIONS: dict[str, frozenset[str]] = {
    S_WAITING: frozenset((S_ATTEMPTING, S_RELEASED)),
    S_ATTEMPTING: frozenset((S_HELD, S_WAITING, S_EXPIRED, S_RELEASED)),
    S_HELD: frozenset((S_WAITING, S_DETACHED, S_EXPIRED, S_RELEASED)),
    S_DETACHED: frozenset((S_WAITING, S_EXPIRED, S_RELEASED)),
    S_EXPIRED: frozenset((S_RELEASED,)),
    S_RELEASED: frozenset(),
}


class Hold:
    """The lease kept after the HTTP answer went out (ComfyUI answers ``/prompt`` at once and
    the GPU works on): a task the scope owns waits for the node's work, and the scope's deadline
    cancels this task — never the handler's, which has already answered."""

    __slots__ = ("task",)

    def __init__(self, task: asyncio.Task[None]):
        self.task = task


class LeaseScope:
    """``async with LeaseScope(...) as scope: work = await scope.acquire(attempt); …``

    One ``state``, changed only by ``_to``, which asserts the move is in this table::

        waiting    ─▶ attempting   a lease arrived; the attempt on the node runs
        waiting    ─▶ released     left the queue without a lease (refused, cancelled)
        attempting ─▶ held         the node answered: the answer is passed on under the lease
        attempting ─▶ waiting      the node failed before any byte: re-queued
        attempting ─▶ expired      the deadline (plus the attempt's grace) passed
        attempting ─▶ released     the attempt raised (a bug, a cancel, out of retries)
        held       ─▶ waiting      the node failed mid-stream: re-queued to continue it (``continue_elsewhere``)
        held       ─▶ detached     the lease outlives the handler (``hold``)
        held       ─▶ expired      the deadline passed while the answer was passed on
        held       ─▶ released     the scope ended: the slot is given back
        detached   ─▶ waiting      the held work's node failed before it did visible work: re-queued
        detached   ─▶ expired      the deadline passed while the hold waited
        detached   ─▶ released     the hold ended
        expired    ─▶ released     the cleanups ran; the slot is given back

    The deadline fires by cancelling the task that holds the lease — the request's own task (the
    handler's or the job's, which ends with this request), or the ``Hold``'s — after setting the
    state to expired: the scope then reads that cancel as the timeout, and a second cancel on the
    task (``cancelling() > 1``) as the client leaving as well. Nothing takes a cancel back.

    The runner spells the exit out (``exit_now``, else ``await exit``) so that the common exit —
    no deadline fired, nothing to clean up on the node — costs no coroutine.
    """

    __slots__ = ("_aborts", "_armed", "_deadline", "_due", "_hold", "_lost_seen", "_rerouted", "_revoked", "_target",
                 "_task", "dispatched_at", "forgiven", "handed_over", "key", "lease", "listener", "ok", "rt", "samples",
                 "size", "stalls", "started", "state", "ticket", "writing")

    def __init__(self, rt: Runtime, ticket: Ticket, listener: Sink, key: str | None):
        self.rt, self.ticket, self.listener, self.key = rt, ticket, listener, key
        self.state = S_WAITING
        self.lease: Lease | None = None
        #: the verdict: True feeds the route's service-time average; False/None do not
        self.ok: bool | None = None
        #: loop clock (rt.clock) of the current lease's dispatch: node_ok/node_failed measure from it
        self.dispatched_at = 0.0
        #: bytes of the node's answer passed on so far (the sinks count them)
        self.size = 0
        #: the answer's speed as its adapter read it (LLM: ms per token from llama.cpp's timings
        #: or usage, speed.llm_samples); None: measured per cost unit or per request at release
        self.samples: list[Sample] | None = None
        #: set while a sink writes to the client: a deadline that fires then is the client's fault
        self.writing = False
        #: set once a response head went to the client (a failure after it cuts the connection)
        self.started = False
        #: set when this scope's release handed its slot straight to a waiting request
        self.handed_over = False
        #: how many nodes this request stalled on (a second stall is the request's doing: it fails)
        self.stalls = 0
        #: re-queues not charged to ``retry_on_failover`` (``uncharged``)
        self.forgiven = 0
        #: when the current lease's node was last seen gone, if it had not been seen alive since
        #: when the lease was granted (None: it was not known lost)
        self._lost_seen: float | None = None
        self._aborts: list[Callable[[], Coroutine[Any, Any, Any]]] = []
        self._deadline: float | None = None  # the current lease's expiry (loop time)
        self._due: float | None = None  # when the armed expiry fires: past _deadline by the attempt's grace
        self._armed: int | None = None  # the deadline's key in rt.deadlines
        self._rerouted: tuple[str, str] | None = None  # (from node, reason) until the next dispatch
        self._task: asyncio.Task[Any] | None = asyncio.current_task()  # the task the deadline cancels
        self._hold: Hold | None = None
        self._revoked: str | None = None  # why the lease was taken back (revoke), else None
        self._target: Target | None = None  # the last lease's, as of its grant (kept past its release)

    def _to(self, new: str) -> None:
        assert new in TRANSITIONS[self.state], f"lease scope: {self.state} → {new}"
        self.state = new

    @property
    def route(self) -> str:
        return self.ticket.route

    @property
    def timeout(self) -> float:
        if self._target is not None:
            return self._target.request_timeout_sec  # as of the grant: a reload does not move it
        return self.rt.scheduler.routes[self.ticket.route].cfg.request_timeout_sec

    @property
    def retries_spent(self) -> int:
        """The re-queues charged to the route's ``retry_on_failover``: all but the forgiven."""
        return self.ticket.requeues - self.forgiven

    @property
    def deadline(self) -> float | None:
        """The loop time at which the current lease expires (None while waiting)."""
        return self._deadline

    # --- the verdict: the one hook that judges a node's answer ---------------------------------
    def node_ok(self) -> None:
        """The node answered well. The only call (with ``node_failed``) that feeds a node's
        health and breaker; ``rt.clock() - dispatched_at`` and ``size`` say how fast and how much."""
        lease = self.lease
        if lease is not None:
            self.rt.node_success(lease.node, lease.trial)

    def node_failed(self, verdict: NodeVerdict) -> None:
        """The node failed this request: ``verdict`` says how (core/verdict.py). ``mid_body``:
        after its answer had begun, so nothing can be retried and the request fails."""
        lease = self.lease
        if lease is None:
            return
        if verdict.mid_body:
            self.ok = False
        if verdict.stalled:
            # The speed watch judges a stall, under the caps of a slow verdict; it is not one of
            # the breaker's consecutive failures, or a request that stalls everywhere (a long
            # prefill) would open every breaker it met.
            self.stalls += 1
            judged = self.rt.speed.stall(lease.node, lease.route, verdict.reason, again=self.stalls > 1)
            if judged and not lease.trial:
                return
            # Not watched (`slow: off` since it began), or the node's half-open trial: a failure
            # as any other too (a failed trial opens the breaker again).
        self.rt.node_failure(lease.node, verdict.reason, lease.trial)

    # --- entering ---------------------------------------------------------------------------
    async def __aenter__(self) -> LeaseScope:
        return self

    def expire(self) -> None:
        """The deadline passed (called by rt.deadlines): cancel whatever holds the lease now."""
        self._armed = None
        state = self.state
        if state == S_ATTEMPTING and self._due == self._deadline and self._deadline is not None:
            # While the attempt waits for the node's answer, the attempt's own timeout (the same
            # request_timeout_sec) decides: a node silent before any byte is re-queued, not
            # failed. The grace only bounds an attempt that would not bound itself.
            self._arm(self._deadline + ATTEMPT_GRACE_SEC)
            return
        if state not in (S_ATTEMPTING, S_HELD, S_DETACHED):
            return
        self._cancel_holder()

    def revoke(self, why: str) -> None:
        """The lease is no longer ours (the cluster reaped it while this gateway could not renew
        it, and its slot went to another request): stop now, as the deadline would, with ``why``."""
        if self.state in (S_ATTEMPTING, S_HELD, S_DETACHED):
            self._revoked = why
            self._cancel_holder()

    def _cancel_holder(self) -> None:
        task = self._hold.task if self._hold is not None else self._task
        if task is not None and not task.done():
            self._to(S_EXPIRED)
            task.cancel()

    def on_abort(self, cleanup: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        """Run ``cleanup`` before the slot is freed if the scope ends by timeout, cancellation or
        error (ComfyUI: interrupt the prompt, so the GPU is really free when the slot is)."""
        self._aborts.append(cleanup)

    def done_with_node(self) -> None:
        """The node's work for this request is over: nothing to clean up on the node any more."""
        self._aborts.clear()

    # --- waiting and retrying ---------------------------------------------------------------
    async def acquire(self, attempt: Callable[[Lease], Awaitable[T]]) -> T | Upstream:
        """Wait for a lease and run ``attempt`` on it, re-queued after each node failure.

        Returns the attempt's result with the lease held. Out of retries: raises Failure, or — when
        the node did answer (502/503) — returns that answer, which passes through. Raises
        Failure for a queue refusal (timeout, shutdown, dropped) too.
        """
        ticket = self.ticket
        if ticket.state == LEASED and ticket.lease is not None:
            lease = ticket.lease  # leased at admission (the common case): _wait's shortcut, no coroutine
            self._got(lease)
        else:
            lease = await self._wait()
        while True:
            try:
                if self.listener.tick_sec is None:
                    result = await attempt(lease)
                else:
                    result = await self._with_ticks(attempt(lease), queued=False)
            except UpstreamFailed as e:
                failure = e
            except BaseException:
                if self.state == S_ATTEMPTING:
                    self._to(S_HELD)
                raise
            else:
                if self.state == S_ATTEMPTING:
                    self._to(S_HELD)
                if self._due != self._deadline:
                    self._arm(self._deadline)  # graced: past the deadline already, it fires at the next tick
                return result
            free = uncharged(self._still_lost(lease.node), lease.node in ticket.avoid, failure)
            self.node_failed(failure.verdict)
            if not (failure.answered or failure.timeout):
                self._seen_lost(lease.node)
            if self.state != S_ATTEMPTING:  # expired meanwhile: the exit turns this into the timeout
                raise Failure.upstream(f"node {lease.node} did not answer in time", True)
            if self.stalls >= STALLS_MAX and failure.cause is Cause.STALL:
                # Stalled on two nodes: the request's doing (a prefill longer than stall_sec), not
                # theirs; it fails rather than stall a third (docs/CONFIG.md "Slow nodes").
                self._to(S_HELD)
                raise Failure.upstream(f"{failure.reason} on node {lease.node}, as on another node before: "
                                       "the request, not the nodes (not re-queued)", False)
            if not free and self.retries_spent >= lease.target.route.retry_on_failover:
                self._to(S_HELD)
                if failure.response is not None:
                    self.ok = False
                    return failure.response
                raise Failure.upstream(f"node {lease.node} failed: {failure.reason}" if not failure.timeout
                                       else f"node {lease.node} did not answer in time", failure.timeout)
            if failure.response is not None:
                failure.response.release()
            log.warning("⚡ [%s] %s — re-queued%s (%s)", lease.node, failure.reason,
                        " (not counted: the node was known lost)" if free else "", lease.route)
            self._rerouted = (lease.node, failure.reason)
            # A node known lost that answers 503 is still restarting: kept from this request until
            # seen alive, as one that refused the connection.
            self._requeue(lease, lost=not failure.answered or free)
            self.forgiven += free
            lease = await self._wait()

    def continue_elsewhere(self, cut: NodeVerdict) -> None:
        """The node failed after its answer began (the verdict is given: ``node_failed`` with
        ``mid_body``), and the answer is to go on on another node (a stream continued, docs/API.md
        "Streams that survive their node"): back to the head of the queue, as a re-queue, which
        it counts as; the next ``acquire`` runs the continuation."""
        lease = self.lease
        assert lease is not None and self.state == S_HELD
        reason = cut.reason
        log.warning("⚡ [%s] %s — stream continued elsewhere (%s)", lease.node, reason, lease.route)
        if not cut.stalled:
            self._seen_lost(lease.node)
        self._rerouted = (lease.node, reason)
        self._requeue(lease, lost=True)

    def requeue_held(self, verdict: NodeVerdict, lost: bool) -> bool:
        """(In a ``hold``) the node failed the work the lease was kept for, before the work did
        anything its client can see (a ComfyUI prompt lost before any output, after the HTTP
        answer that named it): the verdict on the node, then back to the head of the queue as a
        re-queue, which it counts as. False when the re-queues are spent (the hold ends as it
        is). After True, ``acquire`` runs the work's next attempt and ``detach`` keeps it held."""
        lease = self.lease
        assert lease is not None and self.state == S_DETACHED
        self.node_failed(verdict)
        reason = verdict.reason
        if self.retries_spent >= lease.target.route.retry_on_failover:
            return False
        log.warning("⚡ [%s] %s — re-queued (%s)", lease.node, reason, lease.route)
        self._rerouted = (lease.node, reason)
        self._requeue(lease, lost=lost)
        return True

    def _seen_lost(self, node: str) -> None:
        """A request was lost on ``node`` (refused, reset, dropped mid-answer): it is gone until
        seen alive again, for every request (``uncharged``)."""
        ns = self.rt.scheduler.nodes.get(node)
        if ns is not None:
            ns.lost(self.rt.clock())

    def _still_lost(self, node: str) -> bool:
        """``node`` was known lost when this lease was granted, and has not been seen alive since."""
        seen = self._lost_seen
        ns = self.rt.scheduler.nodes.get(node)
        return seen is not None and ns is not None and ns.alive_at < seen

    def detach(self) -> None:
        """(In a ``hold``) the re-queued work's new lease is held by the same hold."""
        self._to(S_DETACHED)

    async def _wait(self) -> Lease:
        t = self.ticket
        if t.state == LEASED and t.lease is not None:
            self._got(t.lease)  # straight through: the common case costs no coroutine
            return t.lease
        if self.listener.tick_sec is not None and t.state == WAITING:
            return await self._with_ticks(self._wait_plain(), queued=True)
        return await self._wait_plain()

    async def _wait_plain(self) -> Lease:
        t = self.ticket
        if t.state == WAITING:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

            def wake(_: Ticket) -> None:
                if not fut.done():
                    fut.set_result(None)

            t.on_wake = wake
            try:
                await fut
            except asyncio.CancelledError:
                # Gone while waiting: leave the queue. If the lease came in the same moment, it is
                # ours now and the exit gives it back.
                if not self.rt.leases.cancel(t) and t.state == LEASED and t.lease is not None:
                    self._got(t.lease)
                raise
            finally:
                t.on_wake = None
        if t.state == LEASED and t.lease is not None:
            self._got(t.lease)
            return t.lease
        if t.error is not None:
            raise Failure.rejected(t.error)
        raise Failure.rejected(Rejected(503, "shutting_down", "request was cancelled"))

    def _got(self, lease: Lease) -> None:
        if self.lease is lease:
            return
        self._to(S_ATTEMPTING)
        self.lease = lease
        self._target = lease.target
        lease.revoke = self.revoke
        rt = self.rt
        now = rt.clock()
        ns = rt.scheduler.nodes.get(lease.node)
        self._lost_seen = ns.lost_at if ns is not None and ns.lost_at > ns.alive_at else None
        self.dispatched_at = now
        self._deadline = asyncio.get_running_loop().time() + self.timeout
        self._arm(self._deadline)  # moved by the grace if it fires while an attempt waits (expire)
        if self._rerouted is not None:
            (from_node, reason), self._rerouted = self._rerouted, None
            self.listener.rerouted(from_node, lease.node, reason)
        self.listener.dispatched(lease, now - self.ticket.enqueued_at)

    def _arm(self, when: float | None) -> None:
        deadlines = self.rt.deadlines
        if self._armed is not None:
            deadlines.discard(self, self._armed)
            self._armed = None
        self._due = when
        if when is not None and self.state != S_EXPIRED:
            self._armed = deadlines.add(self, when)

    async def _with_ticks(self, aw: Awaitable[T], queued: bool) -> T:
        """Await ``aw`` while the listener ticks every ``tick_sec`` (keep-alive comments)."""
        fut = asyncio.ensure_future(aw)
        tick = self.listener.tick_sec or 1.0
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=tick)
                if done:
                    return fut.result()
                await self.listener.tick(queued and self.ticket.state == WAITING)
        except BaseException:
            # The listener failed (the client left) or we were cancelled: the attempt's answer,
            # even one that arrived in this very moment, must not be left holding a socket.
            if not fut.done():
                fut.cancel()
                try:
                    await fut
                except BaseException:
                    pass
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                _discard(fut.result())
            raise

    def _requeue(self, lease: Lease, lost: bool) -> None:
        rt = self.rt
        self._to(S_WAITING)
        self.lease = None
        self._deadline = None
        self._arm(None)
        rt.leases.requeue(lease, rt.clock(), lost=lost)
        self.listener.requeued()
        rt.metrics.failovers.labels(rt.route_label(lease.route)).inc()
        rt.wake()

    # --- holding past the handler -------------------------------------------------------------
    def hold(self, work: Coroutine[Any, Any, Any]) -> None:
        """Keep the lease after the HTTP answer went out, until ``work`` ends (ComfyUI answers
        ``/prompt`` at once and the GPU works on). Same deadline; the scope still releases."""
        self._to(S_DETACHED)
        self._hold = Hold(self.rt.spawn(self._held(work)))  # the deadline now cancels the hold

    async def _held(self, work: Coroutine[Any, Any, Any]) -> None:
        timed_out = False
        exc: BaseException | None = None
        try:
            await work
            self.ok = True
        except asyncio.CancelledError as e:
            task = asyncio.current_task()
            if self.state == S_EXPIRED and (task is None or task.cancelling() <= 1):
                timed_out = True  # our deadline's cancel, and nobody else's (shutdown)
            else:
                exc = e
        except BaseException as e:
            exc = e
            if not isinstance(e, Failure):
                log.exception("holding a lease on %s", self._node())
        finally:
            work.close()
            self._arm(None)
            await self._finish(exc, timed_out)

    # --- leaving ------------------------------------------------------------------------------
    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if not self.exit_now(exc):
            await self.exit(et, exc)
        return False

    def exit_now(self, exc: BaseException | None) -> bool:
        """Leave without waiting when nothing needs it; False: ``await exit`` must do it."""
        if self._hold is not None:
            self.listener = ENDED
            return True  # the hold's task owns the lease (and the deadline) now
        if self.state == S_EXPIRED or (exc is not None and self._aborts and self.lease is not None):
            return False  # a deadline to answer for, or cleanups to run on the node
        # The sink keeps the scope (its ``started``): without the listener the two are no cycle,
        # and a request's whole object graph is freed by refcount, not by the collector.
        self.listener = ENDED
        self._arm(None)
        lease = self.lease
        if lease is not None:
            self._release(lease, self.ok if exc is None else (None if isinstance(exc, asyncio.CancelledError)
                                                              else False))
        else:
            self._to(S_RELEASED)
        return True

    async def exit(self, et: type[BaseException] | None, exc: BaseException | None) -> None:
        """The exit that waits: a deadline fired (raises Failure, or CancelledError when the
        client left as well), or abort cleanups run before the release."""
        self.listener = ENDED
        self._arm(None)
        timed_out = self.state == S_EXPIRED
        if timed_out and et is asyncio.CancelledError:
            exc = None  # the deadline's own cancel: a timeout, not a client that left
        await self._finish(exc, timed_out)
        if timed_out:
            task = self._task
            if task is not None and task.cancelling() > 1:
                raise asyncio.CancelledError  # cancelled from outside as well (the client left)
            if self._revoked is not None:
                raise Failure.upstream(f"node {self._node()}: {self._revoked}", False) from None
            raise Failure.upstream(f"node {self._node()} did not finish within {self.timeout:g}s", True) from None

    def _node(self) -> str:
        return self.lease.node if self.lease is not None else "-"

    async def _finish(self, exc: BaseException | None, timed_out: bool) -> None:
        lease = self.lease
        if lease is None:
            self._to(S_RELEASED)
            return
        try:
            if self._aborts and (timed_out or exc is not None):
                await self._run_aborts()
        finally:
            if timed_out and not self.writing:
                self.node_failed(NodeVerdict(Cause.TIMEOUT, f"timed out after {self.timeout:g}s"))
            ok = self.ok if exc is None and not timed_out else (None if isinstance(exc, asyncio.CancelledError)
                                                                 else False)
            self._release(lease, ok)

    async def _run_aborts(self) -> None:
        """Each cleanup runs to its end (bounded) even if we are cancelled again meanwhile."""
        cleanups, self._aborts = self._aborts, []
        for make in cleanups:
            task = self.rt.spawn(_bounded(make()))
            cancelled = False
            while not task.done():
                try:
                    await asyncio.shield(task)
                except asyncio.CancelledError:
                    cancelled = True
                except Exception:
                    break
            if cancelled:
                raise asyncio.CancelledError

    def _release(self, lease: Lease, ok: bool | None) -> None:
        """The one place a slot is given back."""
        self._to(S_RELEASED)
        self.lease = None
        if lease.released:
            return
        rt = self.rt
        now = rt.clock()
        held = now - lease.started_at
        rt.leases.release(lease, now, service_time=held if ok else None)
        if ok:
            # The answer ended well: how fast the node served it, against its peers (speed.py).
            t = self.ticket
            rt.speed.measured(lease.node, lease.route, t.model, held, t.cost, self.samples, t.key)
        rt.stats.gpu_seconds += held
        rt.metrics.upstream.labels(rt.route_label(lease.route), lease.node).observe(held)
        if self.key is not None:
            rt.limits.add(self.key, time.time(), gpu_seconds=held)
        self._bill(lease, held)
        # A freed slot changes no node state, hence no route mode: dispatching is all there is to
        # do (node events and the pump call wake() for the rest).
        self.handed_over = bool(rt.leases.dispatch(now))


    def _bill(self, lease: Lease, held: float) -> None:
        """The request on the bill, once, however often it was re-queued: its tokens, and the time
        this lease held the node at the node's price (kilolined/scheduling/bill.py)."""
        rt, t = self.rt, self.ticket
        route = rt.route_label(lease.route)
        rt.metrics.gpu_seconds.labels(route, self.key or "-").inc(held)
        prompt, completion = t.tokens
        # GPU time at the node's hourly price, plus what an overflow node's price_per_mtok made of
        # the tokens (ticket.usd, set where its usage was read)
        cost = gpu_cost(held, rt.price_per_hour(lease.node)) + (t.usd or 0.0)
        rt.bill.add(time.time(), self.key, route, t.model or t.named_model, requests=1, prompt_tokens=prompt,
                    completion_tokens=completion, gpu_seconds=held, cost_usd=cost)


def uncharged(known_lost: bool, tried: bool, failure: UpstreamFailed) -> bool:
    """A re-queue that costs the request none of its ``retry_on_failover``: its node was already
    known lost when the request was sent there (another request was lost on it, or a health check
    failed, and it has not been seen alive since: a spot GPU restarting, refusing connections or
    answering 503 while it loads its model), the request had not tried that node before, and the
    node did no work (connection refused or reset, a 502 or 503). Sending it there was the
    gateway's stale view of the node, not the request's doing; the retries are kept for the failures
    that are (a continuation after a node died mid-answer among them). Once per node, so the
    re-queues it forgives are bounded by the route's nodes."""
    no_work = failure.response is not None or not (failure.answered or failure.timeout)
    return known_lost and not tried and no_work


async def _bounded(coro: Coroutine[Any, Any, Any]) -> None:
    try:
        async with asyncio.timeout(CLEANUP_SEC):
            await coro
    except TimeoutError:
        log.warning("cleanup on the node took over %gs; slot freed anyway", CLEANUP_SEC)
    except Exception:
        log.exception("cleanup on the node")


def _discard(res: object) -> None:
    release = getattr(res, "release", None)
    if callable(release):
        release()

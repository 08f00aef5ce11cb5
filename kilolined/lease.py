"""The lease scope: the one owner of "exactly N on the GPU" for one admitted request.

Every admitted request lives inside one ``LeaseScope``. The scope is the only code that waits
for a lease, re-queues the request after a node failure (HAProxy's ``redispatch``: a node that
fails before any byte reached the client costs the request nothing but time), and gives the
slot back. Its exit — success, error, cancellation, a bug — is the only release (arq's one
done-callback), so no runner can forget it.

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
from typing import Any, TypeVar

from kilolined.outcome import Failure
from kilolined.proxy import UpstreamFailed
from kilolined.queue import LEASED, WAITING, Lease, Rejected, Ticket
from kilolined.runtime import Runtime

log = logging.getLogger("kilolined")
T = TypeVar("T")
CLEANUP_SEC = 5.0
ATTEMPT_GRACE_SEC = 1.0  # an abort cleanup (interrupt a prompt) may take this long before the slot is freed


class Listener:
    """What a client mode wants to hear while its request moves (jobs turn these into events)."""

    __slots__ = ()
    #: when set, ``tick`` is awaited this often while the request waits for a lease or for the
    #: node's first answer (the OpenAI stream's keep-alive comments)
    tick_sec: float | None = None

    def dispatched(self, lease: Lease, queue_wait: float) -> None:
        pass

    def rerouted(self, from_node: str, to_node: str, reason: str) -> None:
        pass

    def requeued(self) -> None:
        """Back in the queue after its node failed: waiting again until the next ``dispatched``."""

    async def tick(self, queued: bool) -> None:
        pass


ENDED = Listener()  # an exited scope's listener (no state: __slots__ is empty)


class LeaseScope:
    """``async with LeaseScope(...) as scope: work = await scope.acquire(attempt); …``

    The runner spells the exit out (``exit_now``, else ``await exit``) so that the common exit —
    no deadline fired, nothing to clean up on the node — costs no coroutine.
    """

    __slots__ = ("_aborts", "_armed", "_attempting", "_deadline", "_detached", "_expired", "_graced", "_rerouted",
                 "_task", "dispatched_at", "key", "lease", "listener", "ok", "rt", "started", "ticket", "writing")

    def __init__(self, rt: Runtime, ticket: Ticket, listener: Listener, key: str | None):
        self.rt, self.ticket, self.listener, self.key = rt, ticket, listener, key
        self.lease: Lease | None = None
        #: the verdict: True feeds the route's service-time average; False/None do not
        self.ok: bool | None = None
        self.dispatched_at = 0.0
        #: set while a sink writes to the client: a deadline that fires then is the client's fault
        self.writing = False
        #: set once a response head went to the client (a failure after it cuts the connection)
        self.started = False
        self._aborts: list[Callable[[], Coroutine[Any, Any, Any]]] = []
        self._deadline: float | None = None
        self._detached = False
        self._rerouted: tuple[str, str] | None = None  # (from node, reason) until the next dispatch
        self._task: asyncio.Task[Any] | None = asyncio.current_task()  # the task the deadline cancels
        self._armed: int | None = None  # the deadline's key in rt.deadlines
        self._expired = False
        self._attempting = False  # an attempt is waiting for the node's answer
        self._graced = False  # the deadline fired during the attempt and was moved by the grace

    @property
    def route(self) -> str:
        return self.ticket.route

    @property
    def timeout(self) -> float:
        return self.rt.scheduler.routes[self.ticket.route].cfg.request_timeout_sec

    @property
    def deadline(self) -> float | None:
        """The loop time at which the current lease expires (None while waiting)."""
        return self._deadline

    # --- entering ---------------------------------------------------------------------------
    async def __aenter__(self) -> LeaseScope:
        return self

    def expire(self) -> None:
        """The deadline passed (called by rt.deadlines): cancel whatever holds the lease now."""
        self._armed = None
        if self._attempting and not self._graced and self._deadline is not None:
            # While the attempt waits for the node's answer, the attempt's own timeout (the same
            # request_timeout_sec) decides: a node silent before any byte is re-queued, not
            # failed. The grace only bounds an attempt that would not bound itself.
            self._graced = True
            self._arm(self._deadline + ATTEMPT_GRACE_SEC)
            return
        task = self._task
        if task is not None and not task.done() and not self._expired:
            self._expired = True
            task.cancel()

    def on_abort(self, cleanup: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        """Run ``cleanup`` before the slot is freed if the scope ends by timeout, cancellation or
        error (ComfyUI: interrupt the prompt, so the GPU is really free when the slot is)."""
        self._aborts.append(cleanup)

    def done_with_node(self) -> None:
        """The node's work for this request is over: nothing to clean up on the node any more."""
        self._aborts.clear()

    # --- waiting and retrying ---------------------------------------------------------------
    async def acquire(self, attempt: Callable[[Lease], Awaitable[T]]) -> T:
        """Wait for a lease and run ``attempt`` on it, re-queued after each node failure.

        Returns the attempt's result with the lease held. Out of retries: raises Failure, or — when
        the node did answer (502/503/504) — returns that answer, which passes through. Raises
        Failure for a queue refusal (timeout, shutdown, dropped) too.
        """
        rt, ticket = self.rt, self.ticket
        lease = await self._wait()
        while True:
            self._attempting = True
            try:
                if self.listener.tick_sec is None:
                    result = await attempt(lease)
                else:
                    result = await self._with_ticks(attempt(lease), queued=False)
            except UpstreamFailed as e:
                failure = e
            else:
                if self._graced:
                    self._arm(self._deadline)  # past the deadline already: it fires at the next tick
                return result
            finally:
                self._attempting = False
            rcfg = rt.scheduler.routes[lease.route].cfg
            rt.node_failure(lease.node, failure.reason, lease.trial)
            if ticket.requeues >= rcfg.retry_on_failover:
                if failure.response is not None:
                    self.ok = False
                    return failure.response  # type: ignore[return-value]
                raise Failure.upstream(f"node {lease.node} failed: {failure.reason}" if not failure.timeout
                                       else f"node {lease.node} did not answer in time", failure.timeout)
            if failure.response is not None:
                failure.response.release()
            log.warning("⚡ [%s] %s — re-queued (%s)", lease.node, failure.reason, lease.route)
            self._rerouted = (lease.node, failure.reason)
            self._requeue(lease, lost=not failure.answered)
            lease = await self._wait()

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
        self.lease = lease
        rt = self.rt
        now = rt.clock()
        self.dispatched_at = now
        self._deadline = asyncio.get_running_loop().time() + self.timeout
        self._graced = False
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
        if when is not None and not self._expired:
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
        self._detached = True
        self._task = self.rt.spawn(self._hold(work))  # the deadline now cancels the hold

    async def _hold(self, work: Coroutine[Any, Any, Any]) -> None:
        timed_out = False
        exc: BaseException | None = None
        try:
            await work
            self.ok = True
        except asyncio.CancelledError as e:
            if self._expired and not await self._take_back_cancel(delivered=True):
                timed_out = True
            else:
                exc = e
        except BaseException as e:
            exc = e
            if not isinstance(e, asyncio.CancelledError | Failure):
                log.exception("holding a lease on %s", self.lease.node if self.lease else "?")
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
        if self._detached:
            self.listener = ENDED
            return True  # the hold's task owns the lease (and the deadline) now
        if self._expired or (exc is not None and self._aborts and self.lease is not None):
            return False  # the deadline's cancel to take back, or cleanups to run on the node
        # The sink keeps the scope (its ``started``): without the listener the two are no cycle,
        # and a request's whole object graph is freed by refcount, not by the collector.
        self.listener = ENDED
        self._arm(None)
        lease = self.lease
        if lease is not None:
            self._release(lease, self.ok if exc is None else (None if isinstance(exc, asyncio.CancelledError)
                                                              else False))
        return True

    async def exit(self, et: type[BaseException] | None, exc: BaseException | None) -> None:
        """The exit that waits: a deadline fired (raises Failure, or CancelledError when the
        client left as well), or abort cleanups run before the release."""
        self.listener = ENDED
        self._arm(None)
        timed_out = self._expired
        outside = False
        if timed_out:
            outside = await self._take_back_cancel(delivered=et is asyncio.CancelledError)
            if et is asyncio.CancelledError:
                exc = None
        await self._finish(exc, timed_out)
        if timed_out:
            if outside:
                raise asyncio.CancelledError  # cancelled from outside as well (the client left)
            raise Failure.upstream(f"node {self._node()} did not finish within {self.timeout:g}s", True) from None

    async def _take_back_cancel(self, delivered: bool) -> bool:
        """Undo the cancel our deadline made; True if the task is cancelled from outside too.

        If the body ended just before the deadline fired, our cancel is still pending: take it
        here, where it harms nothing, rather than at the caller's next await."""
        task = self._task
        if task is None:
            return False
        if not delivered:
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                pass
        if task.cancelling():
            task.uncancel()
        return task.cancelling() > 0

    def _node(self) -> str:
        return self.lease.node if self.lease is not None else "-"

    async def _finish(self, exc: BaseException | None, timed_out: bool) -> None:
        lease = self.lease
        if lease is None:
            return
        try:
            if self._aborts and (timed_out or exc is not None):
                await self._run_aborts()
        finally:
            if timed_out and not self.writing:
                self.rt.node_failure(lease.node, f"timed out after {self.timeout:g}s", lease.trial)
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
        self.lease = None
        if lease.released:
            return
        rt = self.rt
        now = rt.clock()
        held = now - lease.started_at
        rt.leases.release(lease, now, service_time=held if ok else None)
        rt.stats.gpu_seconds += held
        rt.metrics.upstream.labels(rt.route_label(lease.route), lease.node).observe(held)
        if self.key is not None:
            (rt.shared_limits or rt.budgets).add(self.key, time.time(), gpu_seconds=held)
        # A freed slot changes no node state, hence no route mode: dispatching is all there is to
        # do (node events and the pump call wake() for the rest).
        rt.leases.dispatch(now)


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

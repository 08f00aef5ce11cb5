"""The adapter interface and the plain HTTP job runner that generic and openai share."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import aiohttp

from kilolined.proxy import Exchange, UpstreamFailed
from kilolined.upstream import UpstreamResponse

if TYPE_CHECKING:
    from kilolined.forward import Hooks
    from kilolined.jobs import Job, JobResult
    from kilolined.queue import Lease
    from kilolined.runtime import Runtime


class Observer:
    """Sees each chunk of a response on its way to the client; must be cheap."""

    def feed(self, chunk: bytes) -> None:
        pass

    def done(self, ok: bool) -> None:
        pass


class Adapter:
    kind = "generic"

    def prepare(self, ex: Exchange) -> None:
        """Validate or rewrite the request before it is queued; raise Rejected(400) to refuse it."""

    def observer(self, rt: Runtime, ex: Exchange, route: str, key: str | None, dispatched: float) -> Observer | None:
        return None

    def sync_hold(self, rt: Runtime, lease: Lease, ex: Exchange, status: int,
                  body: bytes) -> Coroutine[Any, Any, None] | None:
        """After a sync response: a coroutine that ends when the node's work for it ends, or None."""
        return None

    def captures_sync_body(self, ex: Exchange) -> bool:
        """Whether sync_hold needs a copy of the (small) response body."""
        return False

    async def run_job(self, rt: Runtime, job: Job, ex: Exchange, hooks: Hooks) -> JobResult:
        return await run_http_job(rt, job, ex, hooks, self)

    def job_progress(self, job: Job, ex: Exchange) -> Observer | None:
        """An observer that turns body chunks into step_progress events (openai counts tokens)."""
        return None


async def read_result(up: UpstreamResponse, limit: int, obs: Observer | None) -> bytes:
    buf = bytearray()
    async for chunk in up.content.iter_any():
        buf += chunk
        if obs is not None:
            obs.feed(chunk)
        if len(buf) > limit:
            raise UpstreamFailed("result larger than jobs.max_results_mb")
    return bytes(buf)


async def run_http_job(rt: Runtime, job: Job, ex: Exchange, hooks: Hooks, adapter: Adapter) -> JobResult:
    """Forward, read the whole answer into memory (the job's result), free the slot."""
    from kilolined.forward import HttpAttempt, with_retries
    from kilolined.jobs import JobFailed, JobResult

    try:
        lease, up = await with_retries(rt, job.ticket, HttpAttempt(rt, ex), hooks)
    except UpstreamFailed as e:
        raise JobFailed("upstream_timeout" if e.timeout else "upstream_error", e.reason,
                        504 if e.timeout else 502)
    dispatched = rt.clock()
    limit = int(rt.cfg.jobs.max_results_mb * 1024 * 1024)
    obs = adapter.job_progress(job, ex)
    sync_obs = adapter.observer(rt, ex, job.route_label, job.key, dispatched)
    both = _Tee(obs, sync_obs)
    ok: bool | None = None
    try:
        body = await read_result(up, limit, both)
        ok = up.status < 500
    except (aiohttp.ClientError, TimeoutError, UpstreamFailed) as e:
        # Bytes had arrived from the node: this attempt cannot be replayed, the job fails.
        ok = False
        reason = e.reason if isinstance(e, UpstreamFailed) else "connection lost mid-response"
        rt.node_failure(lease.node, reason, lease.trial)
        raise JobFailed("upstream_error", reason, 502)
    finally:
        up.release()
        both.done(bool(ok))
        rt.metrics.upstream.labels(job.route_label, lease.node).observe(rt.clock() - dispatched)
        rt.release(lease, ok=ok, key=job.key)
    ctype = up.headers.get("Content-Type", "application/octet-stream")
    if up.status >= 400:
        raise JobFailed("upstream_error", f"node answered HTTP {up.status}", up.status, body, ctype)
    return JobResult(up.status, ctype, body)


class _Tee(Observer):
    def __init__(self, *obs: Observer | None):
        self.obs = [o for o in obs if o is not None]

    def feed(self, chunk: bytes) -> None:
        for o in self.obs:
            o.feed(chunk)

    def done(self, ok: bool) -> None:
        for o in self.obs:
            o.done(ok)

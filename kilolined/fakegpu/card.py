"""The simulated card behind `kilolined fakegpu` (docs/BACKENDS.md, "The simulated GPU").

It behaves like a rented 24 GB card: every running job holds `job_vram_gb` (with
`capacity_mode="request"`: what its request implies, from the kind's backend), and the job that
would push the total past `vram_gb` makes every running job fail with "CUDA out of memory";
then the "process" dies (listener closed, every connection reset) for `crash_sec` and comes back
on the same port. That is what an unprotected GPU does under a burst, and what the gateway must
prevent. This module holds the card (VRAM, jobs, crashes), the `/_fake/*` test endpoints and the
`Backend` interface; each kind's API is a `Backend` in its own module (`generic.py`, `comfy.py`,
`openai.py`), which imports this one and never the reverse.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from kilolined.fakegpu.base import Job, Knobs, is_int, is_number, read_json

log = logging.getLogger("kilolined.fakegpu")

SERVERS = ("llama.cpp", "vllm")  # what an openai card plays (its own status endpoints)
REQUEST_LOG_SIZE = 100
# How long a crash waits for the failing jobs to tell their clients before the process "dies".
CRASH_FLUSH_SEC = 1.0
COUNTERS = (
    "served",  # jobs that finished normally
    "oom_count",  # jobs that failed with CUDA out of memory (the trigger included)
    "crashes",  # OOM crash cycles
    "failed",  # jobs that failed for another reason (ComfyUI FailNode)
    "aborted",  # jobs whose client went away mid-job
    "killed_jobs",  # jobs lost to kill()/stop()
    "interrupts",  # ComfyUI prompts stopped by /interrupt
    "queue_deletes",  # ComfyUI pending prompts removed by POST /queue
    "rejected",  # job requests answered by the `fail_status` knob
    "health_checks",  # requests to the health endpoint
    "origin_rejects",  # ComfyUI 403s for a foreign Origin on a loopback Host
    "auth_rejects",  # OpenAI requests without the node's API key
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Backend:
    """What differs per `kind`: routes, the shape of error bodies, extra state. Defaults here."""

    def __init__(self, gpu: Card) -> None:
        self.gpu = gpu

    def add_routes(self, app: web.Application) -> None:
        raise NotImplementedError

    def error_response(self, status: int, message: str) -> web.Response:
        return web.json_response({"error": message}, status=status)

    def screen(self, request: web.Request) -> web.Response | None:
        """A chance to refuse any request before routing (ComfyUI's Origin check)."""
        return None

    def extra_stats(self) -> dict[str, Any]:
        return {}

    async def on_down(self) -> None:
        """The process died: forget what it held in memory."""



class Card:
    """One simulated card listening on loopback; see the module docstring."""

    def __init__(
        self,
        kind: str,
        make_backend: Callable[[Card], Backend],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        vram_gb: float = 24,
        job_vram_gb: float = 10,
        steps: int = 25,
        step_ms: float = 200,
        crash_sec: float = 5,
        parallel: int = 0,
        api_key: str | None = None,
        ctx_size: int = 4096,
        progress_min_sec: float = 0.0,
        capacity_mode: str = "fixed",
        models: list[str] | None = None,
        swap_ms: float = 0.0,
        warm_models: int = 1,
        slowdown: float = 1.0,
        slowdown_after_sec: float = 0.0,
        drift_pct_per_hour: float = 0.0,
        prefill_ms_per_1k: float = 0.0,
        prompt_cache_tokens: int = 32768,
        previews: bool = False,
        server: str = "llama.cpp",
    ) -> None:
        if not (is_number(vram_gb) and vram_gb > 0 and is_number(job_vram_gb) and job_vram_gb >= 0):
            raise ValueError("vram_gb must be > 0 and job_vram_gb >= 0")
        if not (is_int(steps) and steps >= 0 and is_number(step_ms) and step_ms >= 0):
            raise ValueError("steps must be an int >= 0 and step_ms a number >= 0")
        if not (is_number(crash_sec) and crash_sec >= 0 and is_int(parallel) and parallel >= 0):
            raise ValueError("crash_sec must be >= 0 and parallel an int >= 0")
        if not (is_int(ctx_size) and ctx_size >= 1 and is_number(progress_min_sec) and progress_min_sec >= 0):
            raise ValueError("ctx_size must be an int >= 1 and progress_min_sec a number >= 0")
        if capacity_mode not in ("fixed", "request"):
            raise ValueError("capacity_mode must be fixed or request")
        if server not in SERVERS:
            raise ValueError(f"server must be one of {', '.join(SERVERS)}")
        if not (is_number(swap_ms) and swap_ms >= 0 and is_int(warm_models) and warm_models >= 1):
            raise ValueError("swap_ms must be a number >= 0 and warm_models an int >= 1")
        if not (is_number(slowdown) and slowdown > 0 and is_number(slowdown_after_sec) and slowdown_after_sec >= 0
                and is_number(drift_pct_per_hour) and drift_pct_per_hour >= 0):
            raise ValueError("slowdown must be > 0, slowdown_after_sec and drift_pct_per_hour >= 0")
        # A card going slow, for the slow-node watch (docs/CONFIG.md "Slow nodes"): every step costs ``slowdown`` ×
        # once ``slowdown_after_sec`` have passed, and a little more each hour with a drift.
        self.slowdown = float(slowdown)
        self.slowdown_after_sec = float(slowdown_after_sec)
        self.drift_pct_per_hour = float(drift_pct_per_hour)
        self._born = time.monotonic()
        if not (is_number(prefill_ms_per_1k) and prefill_ms_per_1k >= 0
                and is_int(prompt_cache_tokens) and prompt_cache_tokens >= 0):
            raise ValueError("prefill_ms_per_1k must be a number >= 0 and prompt_cache_tokens an int >= 0")
        self.kind = kind
        self.capacity_mode = capacity_mode
        self.models = list(models) if models else None  # openai: the model ids it lists (default: one)
        self.swap_ms = float(swap_ms)  # openai with models: time to load a model that is not warm
        self.warm_models = warm_models  # openai with models: how many stay loaded at once
        self.host = host
        self.port = port
        self.vram_gb = float(vram_gb)
        self.job_vram_gb = float(job_vram_gb)
        self.steps = steps
        self.step_ms = float(step_ms)
        self.crash_sec = float(crash_sec)
        self.parallel = parallel
        # Kind-specific settings, read by the backend that needs them.
        self.api_key = api_key or None  # openai: the key the node requires (llama.cpp --api-key)
        self.ctx_size = ctx_size  # openai: context window in tokens (llama.cpp -c)
        self.progress_min_sec = float(progress_min_sec)  # comfyui: ProgressBar throttle
        self.previews = bool(previews)  # comfyui: a preview per sampler step (--preview-method auto)
        self.prefill_ms_per_1k = float(prefill_ms_per_1k)  # openai: GPU time per 1000 uncached prompt tokens
        self.prompt_cache_tokens = prompt_cache_tokens  # openai: prompt cache bound, in tokens (0: none)
        self.server = server  # openai: which server it plays, llama.cpp (GET /slots) or vLLM (GET /metrics)
        self.knobs = Knobs()
        self.started_at = int(time.time())
        self._running: set[Job] = set()
        self._counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._max_concurrent = 0
        self._peak_vram = 0.0
        self._oom_alloc = self.job_vram_gb  # what the job that overflowed tried to allocate
        self._hanging = 0
        self._next_job_id = 0
        self._requests: deque[dict[str, Any]] = deque(maxlen=REQUEST_LOG_SIZE)
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._up = False
        self._crashed = False
        self._killed = False
        self._stopped = False
        self._crash_task: asyncio.Task[None] | None = None
        self.backend: Backend = make_backend(self)

    # ----------------------------------------------------------------- public surface

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def up(self) -> bool:
        return self._up

    @property
    def crashed(self) -> bool:
        return self._crashed

    @property
    def vram_used_gb(self) -> float:
        return sum((job.vram_gb for job in self._running), 0.0)

    @property
    def stats(self) -> dict[str, Any]:
        """Same as GET /_fake/stats, readable in-process even while the card is down."""
        return {
            "running": len(self._running),
            "max_concurrent": self._max_concurrent,
            "served": self._counters["served"],
            "oom_count": self._counters["oom_count"],
            "crashed": self._crashed,
            **{name: self._counters[name] for name in COUNTERS},
            "hanging": self._hanging,
            "up": self._up,
            "kind": self.kind,
            "port": self.port,
            "vram_gb": self.vram_gb,
            "vram_used_gb": round(self.vram_used_gb, 3),
            "peak_vram_gb": round(self._peak_vram, 3),
            "capacity_mode": self.capacity_mode,
            # Every kind reports swaps, so one stats reader fits all; only an openai card with --models swaps.
            "swaps": 0,
            **self.backend.extra_stats(),
        }

    @property
    def requests(self) -> list[dict[str, Any]]:
        """The last 100 requests seen (not counting /_fake/*), oldest first."""
        return list(self._requests)

    def set_control(self, **knobs: Any) -> None:
        """In-process twin of POST /_fake/control."""
        problems = self.knobs.update(knobs)
        if problems:
            raise ValueError("; ".join(problems))

    def reset(self) -> None:
        """Zero the counters; max_concurrent restarts from what is running now."""
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._max_concurrent = len(self._running)
        self._peak_vram = self.vram_used_gb
        self._requests.clear()

    async def start(self) -> None:
        if self._runner is not None:
            raise RuntimeError("the fake GPU is already started")
        # handler_cancellation: a client hanging up cancels its handler, so we can see aborts.
        runner = web.AppRunner(self._build_app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        self._runner = runner
        try:
            await self._listen()
        except BaseException:
            self._runner = None
            await runner.cleanup()
            raise
        self._born = time.monotonic()  # --slowdown-after-sec counts from when it listens

    async def stop(self) -> None:
        """Close for good."""
        if self._stopped:
            return
        self._stopped = True
        await self._cancel_crash()
        await self._go_down()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def kill(self) -> None:
        """A spot machine vanishing: no listener, every connection reset, stays down."""
        self._killed = True
        await self._cancel_crash()
        self._crashed = False
        await self._go_down()

    async def revive(self) -> None:
        """Listen again on the same port (after kill(), or to cut a crash short)."""
        if self._stopped or self._runner is None:
            raise RuntimeError("the fake GPU is not started or already stopped")
        self._killed = False
        await self._cancel_crash()
        self._crashed = False
        await self._listen()

    # ----------------------------------------------------------------- the card: jobs and VRAM

    def begin_job(self, vram_gb: float | None = None) -> Job:
        """Allocate VRAM for a job. On overflow the job comes back already failed ("oom").

        ``vram_gb`` is what the request implies; it counts only with ``capacity_mode="request"``."""
        self._next_job_id += 1
        need = vram_gb if vram_gb is not None and self.capacity_mode == "request" else self.job_vram_gb
        job = Job(self._next_job_id, need)
        if self._crashed:
            job.reason = "oom"
            job.stop.set()
            return job
        if self.vram_used_gb + job.vram_gb > self.vram_gb + 1e-9:
            self._oom_alloc = job.vram_gb
            victims = [*self._running, job]
            for victim in victims:
                victim.reason = "oom"
                victim.stop.set()
            self._running.clear()
            self._counters["oom_count"] += len(victims)
            self._crash(victims)
            return job
        self._running.add(job)
        self._max_concurrent = max(self._max_concurrent, len(self._running))
        self._peak_vram = max(self._peak_vram, self.vram_used_gb)
        return job

    def pace(self) -> float:
        """How much longer a step takes now than ``step_ms`` (1: as configured)."""
        age = time.monotonic() - self._born
        f = self.slowdown if age >= self.slowdown_after_sec else 1.0
        return f * (1 + self.drift_pct_per_hour / 100 * age / 3600)

    async def work(self, job: Job, seconds: float) -> bool:
        """Spend one step on the GPU; False when the job was stopped meanwhile."""
        if job.stop.is_set():
            return False
        seconds *= self.pace()
        try:
            async with asyncio.timeout(seconds):
                await job.stop.wait()
        except TimeoutError:
            return True
        return False

    def interrupt(self, job: Job) -> bool:
        """Stop a running job on request (ComfyUI /interrupt)."""
        if job.ended or job.stop.is_set():
            return False
        job.reason = "interrupted"
        job.stop.set()
        self._running.discard(job)
        self._counters["interrupts"] += 1
        return True

    def end_job(self, job: Job, outcome: str | None) -> None:
        """Free the job's VRAM. outcome: "ok", "error", or None when its client went away."""
        if job.ended:
            return
        job.ended = True
        self._running.discard(job)
        if job.reason is None:
            if outcome is None:
                outcome = "aborted" if self._up else "killed"
            counter = {"ok": "served", "error": "failed", "aborted": "aborted", "killed": "killed_jobs"}
            self._counters[counter[outcome]] += 1
        job.finished.set()

    def count(self, name: str, n: int = 1) -> None:
        self._counters[name] += n

    def oom_message(self) -> str:
        free = max(self.vram_gb - self.vram_used_gb, 0.0)
        return (
            f"CUDA out of memory. Tried to allocate {self._oom_alloc:.2f} GiB. GPU 0 has a total "
            f"capacity of {self.vram_gb:.2f} GiB of which {free:.2f} GiB is free."
        )

    # ----------------------------------------------------------------- helpers for the kinds

    async def respond(self, request: web.Request, resp: web.StreamResponse) -> bool:
        """Write the whole answer now, so a crash right after cannot swallow it.

        Returns False when the client was already gone.
        """
        try:
            await resp.prepare(request)
            await resp.write_eof()
        except ConnectionResetError:
            return False
        return True

    async def gate(self, request: web.Request) -> web.StreamResponse | None:
        """Apply the `fail_status` and `hang` knobs to a job request."""
        status = self.knobs.fail_status
        if status is not None:
            self._counters["rejected"] += 1
            resp = self.backend.error_response(status, f"simulated failure (fail_status={status})")
            await self.respond(request, resp)
            return resp
        if self.knobs.hang:
            await self.hang_forever()
        return None

    async def health(self, request: web.Request, ok: Callable[[], web.Response]) -> web.Response:
        """Apply the `health_status` and `health_hang` knobs to a health endpoint."""
        self._counters["health_checks"] += 1
        if self.knobs.health_hang:
            await self.hang_forever()
        status = self.knobs.health_status
        if 200 <= status < 300:
            resp = ok()
            resp.set_status(status)
            return resp
        return self.backend.error_response(status, f"simulated health failure (health_status={status})")

    async def hang_forever(self) -> None:
        self._hanging += 1
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            self._hanging -= 1

    async def drip(self) -> None:
        """The `drip_ms` knob: an extra pause before each piece of a streamed answer."""
        if self.knobs.drip_ms > 0:
            await asyncio.sleep(self.knobs.drip_ms / 1000)

    # ----------------------------------------------------------------- server plumbing

    def _build_app(self) -> web.Application:
        @web.middleware
        async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
            test_route = request.path.startswith("/_fake/")
            if not test_route:
                self._requests.append(
                    {
                        "method": request.method,
                        "path": request.path,
                        "query": request.query_string,
                        "headers": _headers_dict(request),
                    }
                )
            if self._crashed or not self._up:
                # A dying process does not answer: reset the connection instead.
                if request.transport is not None:
                    request.transport.abort()
                raise web.HTTPServiceUnavailable()
            if not test_route:
                screened = self.backend.screen(request)
                if screened is not None:
                    return screened
            try:
                return await handler(request)
            except web.HTTPNotFound:
                return self.backend.error_response(404, f"no route for {request.method} {request.path}")
            except web.HTTPMethodNotAllowed:
                return self.backend.error_response(405, f"method {request.method} not allowed here")

        app = web.Application(middlewares=[middleware], client_max_size=64 * 1024 * 1024)
        app.router.add_get("/_fake/stats", self._h_stats)
        app.router.add_post("/_fake/reset", self._h_reset)
        app.router.add_get("/_fake/control", self._h_control)
        app.router.add_post("/_fake/control", self._h_control)
        app.router.add_get("/_fake/requests", self._h_requests)
        self.backend.add_routes(app)
        return app

    async def _h_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats)

    async def _h_reset(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response(self.stats)

    async def _h_control(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            try:
                data = await read_json(request)
            except ValueError:
                return web.json_response({"error": "body is not valid JSON"}, status=400)
            problems = self.knobs.update(data if data is not None else {})
            if problems:
                return web.json_response({"error": "; ".join(problems)}, status=400)
        return web.json_response(dataclasses.asdict(self.knobs))

    async def _h_requests(self, request: web.Request) -> web.Response:
        return web.json_response(self.requests)

    async def _listen(self) -> None:
        if self._site is not None or self._runner is None:
            return
        # After a crash the port may be briefly taken; a real restart would retry too.
        for attempt in range(20):
            site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
            try:
                await site.start()
            except OSError:
                await site.stop()  # unregister it from the runner
                if self.port == 0 or attempt == 19:
                    raise
                await asyncio.sleep(0.1)
                continue
            self._site = site
            break
        if self.port == 0:
            self.port = int(self._runner.addresses[-1][1])
        self._up = True
        log.debug("fakegpu %s listening on %s", self.kind, self.url)

    async def _go_down(self) -> None:
        """The process dies: close the listener, drop backend state, reset every connection."""
        self._up = False
        site, self._site = self._site, None
        if site is not None:
            await site.stop()
        await self.backend.on_down()
        server = self._runner.server if self._runner is not None else None
        for conn in server.connections if server is not None else []:
            if conn.transport is not None:
                conn.transport.abort()

    def _crash(self, victims: list[Job]) -> None:
        self._crashed = True
        self._counters["crashes"] += 1
        log.warning("fakegpu %s: CUDA out of memory, %d jobs failed; down for %.1fs",
                    self.url, len(victims), self.crash_sec)
        self._crash_task = asyncio.get_running_loop().create_task(self._crash_cycle(victims))

    async def _crash_cycle(self, victims: list[Job]) -> None:
        try:
            async with asyncio.timeout(CRASH_FLUSH_SEC):
                for victim in victims:
                    await victim.finished.wait()
        except TimeoutError:
            pass
        await asyncio.sleep(0.05)  # let the last error bytes leave before the sockets die
        await self._go_down()
        await asyncio.sleep(self.crash_sec)
        self._crashed = False
        if not self._killed and not self._stopped:
            await self._listen()
            log.info("fakegpu %s is back after the crash", self.url)

    async def _cancel_crash(self) -> None:
        task, self._crash_task = self._crash_task, None
        if task is None or task.done() or task is asyncio.current_task():
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _headers_dict(request: web.Request) -> dict[str, str]:
    """Lower-cased names; repeated headers are joined with ", "."""
    out: dict[str, str] = {}
    for name, value in request.headers.items():
        key = name.lower()
        out[key] = f"{out[key]}, {value}" if key in out else value
    return out

"""Running the daemon: listen, signals (TERM/INT graceful, HUP reload), graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import ssl

from aiohttp import web

from kilolined.cluster.build import Cluster
from kilolined.cluster.build import build as build_cluster
from kilolined.core.config import Config, split_listen
from kilolined.edge.app import build_app
from kilolined.edge.connection import EdgeHandler
from kilolined.edge.context import Gateway
from kilolined.edge.listener import ConnectionGate, FdPlan, Listener, listen_sockets, raise_fd_limit
from kilolined.fleet.loop import Fleet
from kilolined.modes.jobs import Jobs
from kilolined.ops import systemd
from kilolined.ops.notify import Notifier
from kilolined.ops.reload import reload_from_file, watch_config
from kilolined.ops.runtime import Component, Runtime, Wiring
from kilolined.ops.webhooks import WebhookDeliverer, WebhookSettings
from kilolined.scheduling.queue import Rejected

log = logging.getLogger("kilolined")
BACKLOG = 4096  # connections over server.max_connections wait here (the kernel caps it at somaxconn)


class Server:
    """Owns the Runtime, the aiohttp runner and the background triggers of one daemon."""

    def __init__(self, cfg: Config, version: str, config_path: str | None, *, watch: bool = True):
        notifier = Notifier(cfg.notify)
        webhooks = WebhookDeliverer(**_webhook_settings(cfg))
        #: cluster mode (docs/CLUSTER.md): leases, limits, jobs and node state shared through Redis
        self.cluster: Cluster | None = None

        def wire(rt: Runtime) -> Wiring:
            """The Runtime's parts from up here, made once its own exist."""
            #: rented spot GPUs kept at their pools' sizes (docs/FLEET.md); idle without ``fleet:``
            self.fleet = Fleet(rt)
            local = Wiring(
                alert=lambda event, text, node: notifier.emit(event, text, node=node),
                components=(
                    Component("notify", lambda c: notifier.configure(c.notify)),
                    Component("fleet", self.fleet.configure),
                    Component("webhooks", lambda c: webhooks.configure(**_webhook_settings(c))),
                    Component("jobs", lambda c: self.gateway.jobs.configure(c.jobs)),
                    Component("fd-limit", lambda c: self._plan_fds(c.server.max_connections)),
                ),
                fleet=self.fleet)
            if cfg.cluster is None:
                return local
            self.cluster = build_cluster(rt)
            return self.cluster.wiring(local)

        self.rt = rt = Runtime(cfg, version, config_path=config_path, wire=wire)
        self.gateway = Gateway(rt, Jobs(rt, cfg.jobs, webhooks), webhooks, notifier)
        if self.cluster is not None:
            self.cluster.attach(self.gateway.jobs)
        self.app = build_app(self.gateway)
        self.runner: web.AppRunner | None = None
        self.listeners: list[Listener] = []
        self.gate: ConnectionGate | None = None
        self._paused_logged = -60.0
        self.watch = watch and config_path is not None
        self._stop_watch = asyncio.Event()
        self._bg: list[asyncio.Task[None]] = []
        self.port: int | None = None
        #: client connections the open-files limit allows (server.max_connections or fewer)
        self.fd_cap = cfg.server.max_connections

    def _plan_fds(self, max_connections: int) -> None:
        """Raise the open-files limit for ``server.max_connections`` (at start and on a reload), or
        accept fewer connections: past the limit accept() fails and not even /healthz is served."""
        plan: FdPlan = raise_fd_limit(max_connections)
        self.fd_cap = plan.max_connections
        if plan.raised:
            log.info("raised the open-files limit (RLIMIT_NOFILE) from %d to %d for server.max_connections %d",
                     plan.old_soft, plan.soft, max_connections)
        if plan.clamped:
            log.warning("⚠ server.max_connections %d does not fit the open-files limit (RLIMIT_NOFILE, hard %d): "
                        "at most %d client connections are accepted (raise LimitNOFILE= or ulimit -n)",
                        max_connections, plan.hard, plan.max_connections)

    async def start(self) -> None:
        rt = self.rt
        await self.gateway.notifier.start()
        self.gateway.jobs.start()
        await rt.start()
        if self.cluster is not None:
            await self.cluster.start()
        self.fleet.start()
        # handler_cancellation: a client that goes away while queued must leave the queue at once.
        # shutdown_timeout is short: shutdown() waits out the grace for in-flight leases itself,
        # and aiohttp would otherwise wait it again, twice, per stuck connection.
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self.runner.setup()
        host, port = split_listen(rt.cfg.server.listen)
        ctx = None
        if rt.cfg.server.tls:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(rt.cfg.server.tls.cert, rt.cfg.server.tls.key)
        self._plan_fds(rt.cfg.server.max_connections)
        self.gate = ConnectionGate(lambda: min(self.rt.cfg.server.max_connections, self.fd_cap),
                                   self._pause_accepting, self._resume_accepting)
        self.listeners = [Listener(s, self._new_connection, ctx, BACKLOG) for s in listen_sockets(host, port, BACKLOG)]
        for listener in self.listeners:
            await listener.start()
        self.port = self.listeners[0].port
        if self.watch:
            self._bg.append(asyncio.create_task(watch_config(rt, self._stop_watch)))
        self._bg.append(asyncio.create_task(systemd.watchdog_loop(rt)))
        log.info("✓ kilolined listening on %s (%d routes, %d nodes)", rt.cfg.server.listen,
                 len(rt.cfg.routes), len(rt.cfg.nodes))
        systemd.ready(rt)

    def _new_connection(self) -> EdgeHandler:
        """The protocol of one client connection; the limits are read here, so that a reload's
        new values apply to every new connection."""
        assert self.runner is not None and self.runner.server is not None
        scfg = self.rt.cfg.server
        return EdgeHandler(self.runner.server, loop=asyncio.get_running_loop(), gate=self.gate,
                           header_timeout=scfg.header_timeout_sec, keepalive_timeout=scfg.idle_timeout_sec,
                           access_log=None)

    def _pause_accepting(self) -> None:
        now = asyncio.get_running_loop().time()
        if now - self._paused_logged >= 60:  # a box at the limit pauses and resumes per connection
            self._paused_logged = now
            log.warning("⚠ %d client connections (server.max_connections): new ones wait in the backlog",
                        self.gate.count if self.gate else 0)
        for listener in self.listeners:
            listener.pause()

    def _resume_accepting(self) -> None:
        if self.rt.shutting_down:
            return
        log.debug("client connections below server.max_connections: accepting again")
        for listener in self.listeners:
            listener.resume()

    async def shutdown(self) -> None:
        """Stop accepting, fail the waiting, let in-flight finish within shutdown_grace_sec."""
        rt = self.rt
        if rt.shutting_down:
            return
        rt.begin_shutdown()
        systemd.stopping()
        log.info("stopping: refusing new work, %d in flight", sum(rt.scheduler.node_inflight.values()))
        self._stop_watch.set()
        for listener in self.listeners:
            # Close the listener only; open connections (in-flight responses) keep going.
            listener.close()
        failed = rt.scheduler.fail_all_waiting(
            lambda: Rejected(503, "shutting_down", "the gateway is shutting down", 5)
        )
        if self.cluster is not None:
            failed += self.cluster.fail_all_waiting(
                lambda: Rejected(503, "shutting_down", "the gateway is shutting down", 5))
        if failed:
            log.info("stopping: %d waiting requests answered 503 shutting_down", len(failed))
        grace = rt.cfg.server.shutdown_grace_sec
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while sum(rt.scheduler.node_inflight.values()) > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await self.gateway.jobs.flush_webhooks(max(0.5, deadline - loop.time()))
        for t in self._bg:
            t.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
        if self.runner is not None:
            with contextlib.suppress(Exception):
                await self.runner.cleanup()
        await self.fleet.close()  # rented instances keep running: a restart finds them again by label
        if self.cluster is not None:
            await self.cluster.stop()  # limits, node sync, leader, jobs, then leases
        await rt.stop()
        await self.gateway.jobs.close()
        await self.gateway.webhooks.close()
        await self.gateway.notifier.close()


def _webhook_settings(cfg: Config) -> WebhookSettings:
    j = cfg.jobs
    return {"secret": j.webhook_secret, "backoff_sec": list(j.webhook_backoff_sec),
            "timeout_sec": j.webhook_timeout_sec, "allow_private": j.webhook_allow_private}


async def serve(cfg: Config, version: str, config_path: str | None, log_json: bool = False) -> int:
    srv = Server(cfg, version, config_path)
    srv.gateway.log_json = log_json
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_term() -> None:
        if stop.is_set():
            # A second SIGTERM/Ctrl-C means "now": skip the grace period.
            log.warning("second signal: exiting at once")
            os._exit(1)
        stop.set()

    def on_hup() -> None:
        srv.rt.spawn(reload_from_file(srv.rt, reason="SIGHUP"))

    await srv.start()
    # Start-up objects (modules, config, app) never become garbage: move them out of the cyclic
    # collector's sight, which halves its worst pauses when thousands of requests wait.
    gc.collect()
    gc.freeze()
    # Young generation 2000 (CPython 3.13's default), and a full collection only after 100
    # middle-generation ones (default 10): a 10,000-client burst then costs 1 full pass instead
    # of 8 (0.9 s of stop-the-world), and steady traffic spends half as long in the collector.
    # The "25 % growth" rule still bounds what cyclic garbage can pile up between full passes.
    # Measured in docs/BENCHMARKS.md §2.
    gc.set_threshold(2000, 10, 100)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_term)
    loop.add_signal_handler(signal.SIGHUP, on_hup)
    await stop.wait()
    await srv.shutdown()
    log.info("stopped")
    return 0

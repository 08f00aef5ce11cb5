"""The Runtime: the current config and every live object. ``apply`` diffs a new config in.

Nothing in the package keeps module-level state; handlers reach everything through the
Runtime stored on the aiohttp app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from kilolined.cluster.comfyfiles import SharedInputs
from kilolined.cluster.comfylists import SharedLists
from kilolined.cluster.comfyws import SocketBus
from kilolined.cluster.nodes import NodeSync
from kilolined.cluster.view import ClusterView
from kilolined.core.auth import KeyStore
from kilolined.core.config import Config, ConfigError, NodeConfig, RouteConfig
from kilolined.core.page_assets import PageAssets
from kilolined.ops.adhoc import AdhocTargets, is_adhoc
from kilolined.ops.feed import Feed
from kilolined.ops.health import health_loop, refresh_models
from kilolined.ops.metrics import Metrics
from kilolined.ops.speedwatch import SpeedWatch
from kilolined.ops.stats import Stats
from kilolined.scheduling.affinity import Affinity
from kilolined.scheduling.bill import Bill
from kilolined.scheduling.leasestore import LeaseStore
from kilolined.scheduling.limits import Budgets, LimitStore, LocalLimits, RateLimiter
from kilolined.scheduling.nodes import CHANGED, SPEED_HARD, SPEED_STALLED, NodeState
from kilolined.scheduling.queue import RouteQueue, Scheduler, Ticket
from kilolined.scheduling.routing import Router
from kilolined.wire.deadlines import Deadlines
from kilolined.wire.tasks import cancel_all
from kilolined.wire.upstream import NodePool

log = logging.getLogger("kilolined")

PUMP_SEC = 0.05


class ConfigRefused(ConfigError):
    """A component refused a new config: the reload changes nothing."""


@dataclass(frozen=True)
class Component:
    """A live part that takes each new config: ``prepare`` may refuse it (errors), ``commit``
    applies it. A reload prepares every component first and commits only if none refused
    (mitmproxy's configure + rollback), so a config is live everywhere or nowhere."""

    name: str
    commit: Callable[[Config], None]
    prepare: Callable[[Config], list[str]] = lambda _cfg: []


@dataclass(frozen=True)
class PoolNode:
    """A node the fleet rented (docs/FLEET.md): an ordinary node, plus where it comes from."""

    pool: str
    cfg: NodeConfig
    routes: tuple[str, ...]
    provider: str
    instance_id: str
    price_per_hour: float


def _no_alert(event: str, text: str, node: str | None) -> None:
    pass


def _here() -> bool:
    return True


class FleetHooks(Protocol):
    """What the Runtime asks of the fleet (kilolined/fleet/loop.py), which runs above it."""

    def view(self) -> dict[str, Any]:
        """The fleet's ``fleet`` of /admin/state and metrics."""

    def node_eta(self, route: str) -> float | None:
        """Seconds until a node serves ``route``, which has none (a pool resuming or renting one)."""

    def scales_to_zero(self, route: str) -> bool:
        """The route is served only by pools that may scale to zero (min 0): no node is no outage."""


@dataclass(frozen=True)
class Wiring:
    """The Runtime's parts that come from above it: the server's (alerts, components, the fleet)
    and, in cluster mode, the Redis-backed ones cluster/build.py makes. Each has a local default,
    so ``Wiring()`` is one gateway on its own. The Runtime takes it at construction and is not
    rewired after: whoever reads ``rt.leases`` reads what it was built with."""

    #: the notifier's emit (event, text, node); in cluster mode only the leader's words go out
    alert: Callable[[str, str, str | None], None] = _no_alert
    #: parts that take every new config (jobs, webhooks, notifier, the cluster), in order
    components: tuple[Component, ...] = ()
    fleet: FleetHooks | None = None
    #: where leases live: None is this gateway's scheduler
    leases: LeaseStore | None = None
    #: a shared store's verdict on an admitted ticket; None: admit decided at once
    settle: Callable[[Ticket], Awaitable[Ticket]] | None = None
    cluster: ClusterView | None = None  # what /admin/state shows of the cluster
    #: where limits are decided and usage charged; None: this gateway's own buckets and counters
    limits: LimitStore | None = None
    node_sync: NodeSync | None = None  # node transitions shared with the other gateways
    comfy_shared: SharedInputs | None = None  # ComfyUI inputs held for every gateway
    comfy_lists: SharedLists | None = None  # ComfyUI's history, queue and jobs lists of every gateway
    comfy_ws: SocketBus | None = None  # ComfyUI /ws frames to and from the other gateways
    #: whether this gateway runs the active health checks (cluster mode: the leader's job)
    checks_here: Callable[[], bool] = _here
    #: whether this gateway rents and destroys fleet instances (cluster mode: the leader alone,
    #: and nobody while Redis is down, so two gateways never rent for one loss)
    rents_here: Callable[[], bool] = _here


NAMED_SECTIONS = ("routes", "nodes", "keys")


def config_changes(old: Config, new: Config) -> dict[str, Any]:
    """What a reload changes: for routes, nodes and keys the names added, removed and changed;
    and which other top-level sections changed. Names only: a key by its id, never its hash."""
    out: dict[str, Any] = {}
    for section in NAMED_SECTIONS:
        before, after = getattr(old, section), getattr(new, section)
        out[section] = {
            "added": [n for n in after if n not in before],
            "removed": [n for n in before if n not in after],
            # model_dump, not ==: a value written out that equals its default is no change
            "changed": [n for n in after if n in before and before[n].model_dump() != after[n].model_dump()],
        }
    dump_old, dump_new = old.model_dump(exclude=set(NAMED_SECTIONS)), new.model_dump(exclude=set(NAMED_SECTIONS))
    out["sections"] = [f for f in dump_new if dump_old.get(f) != dump_new[f]]
    return out


def describe_changes(changes: dict[str, Any] | None) -> str:
    """``routes +tts ~comfy; nodes -gpu2; keys +carol; ~notify`` (+ added, - removed, ~ changed)."""
    if changes is None:
        return "no setting changed"
    parts = []
    for section in NAMED_SECTIONS:
        c = changes[section]
        marks = [f"+{n}" for n in c["added"]] + [f"-{n}" for n in c["removed"]] + [f"~{n}" for n in c["changed"]]
        if marks:
            parts.append(f"{section} {' '.join(marks)}")
    if changes["sections"]:
        parts.append(" ".join(f"~{s}" for s in changes["sections"]))
    return "; ".join(parts) or "no setting changed (comments or layout only)"


class Runtime:
    """``wire`` makes the parts from above (a ``Wiring``) once this runtime's own exist: the
    server's, with cluster/build.py's in cluster mode; None: ``Wiring()``. Nothing is assigned
    onto a Runtime from outside after (tests/test_one_writer.py)."""

    def __init__(self, cfg: Config, version: str, *, clock: Callable[[], float] = time.monotonic,
                 config_path: str | None = None, wire: Callable[[Runtime], Wiring] | None = None):
        self.clock = clock
        self.config_path = config_path
        self.started_at = clock()
        self.cfg = cfg
        self.version = version
        self.loaded_at = time.time()
        self.last_error: list[str] | None = None
        #: the config watcher's view (docs/CONFIG.md "Hot reload"): the Unix time it last saw the
        #: file change, and whether that change still waits to be applied or refused. A pending
        #: change far older than the quiet period is a reload that is stuck.
        self.file_changed_at: float | None = None
        self.reload_pending = False
        #: what the last reload applied changed (config_changes); None until a reload
        self.last_changes: dict[str, Any] | None = None
        #: the parts from above (the server's, the cluster's): a gateway on its own until ``wire``
        #: made them, at the end of this constructor; read through the seams below
        self.wiring = Wiring()
        self.scheduler = Scheduler()
        self.scheduler.checks_here = lambda: self.checks_here()  # the wiring's: the cluster's leader
        #: request_timeout_sec of every held lease, on one coarse timer (lease.py)
        self.deadlines = Deadlines()
        self.limiter = RateLimiter()
        self.budgets = Budgets(cfg.server.state_dir)  # this gateway's own counters (saved to disk)
        self._local_limits = LocalLimits(self.limiter, self.budgets, clock)
        #: what each key spent per route, model and day (/admin/usage, /v1/usage), saved beside the budgets
        self.bill = Bill(cfg.server.state_dir)
        self.keys = KeyStore(cfg)
        self.router = Router({})
        self.feed = Feed()
        #: how fast each node serves, against its peers (speed.py, speedwatch.py)
        self.speed = SpeedWatch(self)
        self.metrics = Metrics(lambda: self)
        self.stats = Stats()
        self.sessions: dict[str, aiohttp.ClientSession] = {}
        self._retired_sessions: list[aiohttp.ClientSession] = []
        self.pools: dict[str, NodePool] = {}  # the forwarding hot path's keep-alive pools (upstream.py)
        self._health_tasks: dict[str, asyncio.Task[None]] = {}
        self._models_asked: dict[str, object] = {}  # node -> the ``models`` it was last asked for
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pump: asyncio.Task[None] | None = None
        self.shutting_down = False
        self.started = False
        self.admin_sessions: dict[str, float] = {}  # dashboard session token -> expiry
        #: what an adapter keeps across requests, by kind (ComfyUI: monitor sockets, prompt owners);
        #: made on first use, its tasks are spawned here and end at stop
        self.adapter_state: dict[str, object] = {}
        #: the ComfyUI web UI's content-hashed files, held for every comfyui route (page_assets.py)
        self.page_assets = PageAssets()
        #: /v1/proxy's ad-hoc targets: their routes and nodes, bounded and dropped when idle (adhoc.py)
        self.adhoc = AdhocTargets(self.scheduler, lambda route, node: self.leases.forget_route(route, node),
                                  self._forget_node)
        #: the fleet's healthy rented nodes (kilolined/fleet/loop.py), added to the config's own
        self.pool_nodes: dict[str, PoolNode] = {}
        #: called with (node, event) on every node event (the fleet wakes on a pool node's node_down)
        self.node_watchers: list[Callable[[str, str], None]] = []
        self._apply_state(cfg)
        # The parts from above, made now that this runtime's own exist; fixed from here on.
        if wire is not None:
            self.wiring = wire(self)

    # --- the seams: what the wiring gave, else this gateway's own ----------------------
    @property
    def leases(self) -> LeaseStore:
        """Where leases live (docs/ARCHITECTURE.md): this gateway's scheduler, or the shared store."""
        w = self.wiring.leases
        return w if w is not None else self.scheduler

    @property
    def limits(self) -> LimitStore:
        """Where limits are decided and usage charged: this gateway's buckets and counters, or
        (cluster mode) the Redis store every gateway shares, which keeps them as its local view."""
        w = self.wiring.limits
        return w if w is not None else self._local_limits

    @property
    def settle(self) -> Callable[[Ticket], Awaitable[Ticket]] | None:
        """A shared store's verdict on an admitted ticket; None: admit decided at once."""
        return self.wiring.settle

    @property
    def cluster(self) -> ClusterView | None:
        return self.wiring.cluster

    @property
    def node_sync(self) -> NodeSync | None:
        return self.wiring.node_sync

    @property
    def comfy_shared(self) -> SharedInputs | None:
        return self.wiring.comfy_shared

    @property
    def comfy_lists(self) -> SharedLists | None:
        return self.wiring.comfy_lists

    @property
    def comfy_ws(self) -> SocketBus | None:
        return self.wiring.comfy_ws

    @property
    def checks_here(self) -> Callable[[], bool]:
        return self.wiring.checks_here

    @property
    def rents_here(self) -> Callable[[], bool]:
        return self.wiring.rents_here

    @property
    def alert(self) -> Callable[[str, str, str | None], None]:
        return self.wiring.alert

    @property
    def components(self) -> tuple[Component, ...]:
        """Parts above the core that take every new config (jobs, webhooks, notifier, cluster)."""
        return self.wiring.components

    @property
    def fleet_view(self) -> Callable[[], dict[str, Any]] | None:
        """The fleet's ``fleet`` of /admin/state and metrics; None while no fleet runs."""
        f = self.wiring.fleet
        return f.view if f is not None else None

    @property
    def node_eta(self) -> Callable[[str], float | None] | None:
        """The fleet's seconds until a node serves a route that has none; None while no fleet runs."""
        f = self.wiring.fleet
        return f.node_eta if f is not None else None

    def scales_to_zero(self, route: str) -> bool:
        """Whether a route is served only by fleet pools that may scale to zero (min 0): its having
        no node is the fleet's choice, not an outage to alert on."""
        f = self.wiring.fleet
        return f is not None and f.scales_to_zero(route)

    # --- config -------------------------------------------------------------------------
    def _apply_state(self, cfg: Config) -> None:
        """Swap config into the scheduler and stores. Pure bookkeeping: cannot fail half-way."""
        now = self.clock()
        sched = self.scheduler
        sched.bodies.configure(cfg.server.max_queued_body_mb, cfg.server.max_queued_body_mb_per_key)
        sched.cards.cfg = dict(cfg.cards)  # leases already counted stay counted on their card
        old_nodes = sched.nodes
        all_nodes = {**cfg.nodes, **{n: p.cfg for n, p in self.pool_nodes.items()}}
        for name, ncfg in all_nodes.items():
            ns = old_nodes.get(name)
            if ns is not None and not ns.retired and ns.cfg.url == ncfg.url:
                ns.configure(ncfg)
            else:
                if ns is not None and name in self.sessions:
                    # Same name, new URL: a new node. Old in-flight finish on the old session.
                    self._retired_sessions.append(self.sessions.pop(name))
                old_pool = self.pools.pop(name, None)
                if old_pool is not None:
                    old_pool.close_idle()  # in-flight exchanges finish on their own sockets
                sched.nodes[name] = NodeState(name, ncfg)
        for name, ns in list(old_nodes.items()):
            if name not in all_nodes and not name.startswith("adhoc:"):
                ns.retire()
        for name, rcfg in cfg.routes.items():
            rcfg = self._with_pool_nodes(name, rcfg)
            rq = sched.routes.get(name)
            if rq is None or rq.retired:
                if rq is not None and (rq.waiting or rq.inflight):
                    rq.retired = False
                    rq.configure(rcfg, now)
                else:
                    sched.routes[name] = RouteQueue(name, rcfg)
            else:
                rq.configure(rcfg, now)
        for name, rq in sched.routes.items():
            if name not in cfg.routes and not name.startswith("adhoc:"):
                rq.retired = True
        self.router = Router(cfg.routes)
        for name in cfg.routes:
            # Counters exist at 0 from the start, so dashboards and alerts see "none yet", not "absent".
            self.metrics.failovers.labels(name)
            self.metrics.continuations.labels(name)
            self.metrics.queue_wait.labels(name)
        self.keys = KeyStore(cfg)
        self.limiter.forget_except(set(cfg.keys))
        self.budgets.periods = {k: c.budget.period for k, c in cfg.keys.items()
                                if c.budget is not None and c.budget.period != "day"}
        self.cfg = cfg
        self.speed.lift_unwatched()
        self._gc(now)

    def _with_pool_nodes(self, route: str, rcfg: RouteConfig) -> RouteConfig:
        joined = [n for n, p in self.pool_nodes.items() if route in p.routes and n not in rcfg.nodes]
        return rcfg.model_copy(update={"nodes": [*rcfg.nodes, *joined]}) if joined else rcfg

    def set_pool_node(self, name: str, node: PoolNode | None) -> None:
        """Add a healthy rented node to its routes, or (None) take it out: it gets no new work and
        what runs on it ends as on any lost node (re-queued, §3.4). Static nodes are not touched."""
        if node is None:
            if self.pool_nodes.pop(name, None) is None:
                return
        else:
            self.pool_nodes[name] = node
        self._apply_state(self.cfg)
        if self.started:
            self._sync_health_loops()
            self.wake()

    def apply(self, cfg: Config, version: str) -> list[str]:
        """Apply a validated config live (docs/CONFIG.md "Hot reload"); returns warnings.

        Every component prepares first; if one refuses, nothing changes and the errors are raised
        as a ConfigRefused (the reload fails whole, like an invalid file)."""
        refusals = [f"{c.name}: {e}" for c in self.components for e in c.prepare(cfg)]
        if refusals:
            raise ConfigRefused(refusals)
        warnings = []
        old = self.cfg
        if (old.server.listen, old.server.tls) != (cfg.server.listen, cfg.server.tls):
            warnings.append("server.listen/tls changed: needs a restart; the rest is applied")
        if old.admin.digest() != cfg.admin.digest():
            self.admin_sessions.clear()  # dashboard sessions were granted by the old admin key
        self.last_changes = config_changes(old, cfg)
        self._apply_state(cfg)
        self.version = version
        self.loaded_at = time.time()
        self.last_error = None
        self.reload_pending = False
        for c in self.components:
            c.commit(cfg)
        if self.started:
            self._sync_health_loops()
            self._ask_models()
            self.wake()
        self.metrics.reloads.labels("ok").inc()
        self.feed.publish("reload", version=version, ok=True, changes=describe_changes(self.last_changes))
        return warnings

    def reload_failed(self, errors: list[str]) -> None:
        self.last_error = errors
        self.reload_pending = False
        self.metrics.reloads.labels("error").inc()
        for e in errors:
            log.error("✗ [reload] %s", e)
        self.feed.publish("reload", ok=False, errors=errors)
        self.notify("reload_failed", "✗ config reload failed: " + "; ".join(errors[:5]), node=None)

    def config_changed(self) -> None:
        """The watcher saw the file change; it is pending until applied, refused or found unchanged."""
        self.file_changed_at = time.time()
        self.reload_pending = True

    def config_settled(self) -> None:
        """The watcher found nothing new to apply in the change it saw."""
        self.reload_pending = False

    def config_state(self) -> dict[str, Any]:
        """``config`` of /admin/state (docs/API.md)."""
        return {"version": self.version, "loaded_at": self.loaded_at, "last_error": self.last_error,
                "file_changed_at": self.file_changed_at, "pending": self.reload_pending,
                "changes": self.last_changes}

    def _gc(self, now: float) -> None:
        """Forget retired routes and nodes once nothing waits on or runs through them."""
        sched = self.scheduler
        for name, rq in list(sched.routes.items()):
            if rq.retired and not rq.waiting and not rq.inflight:
                del sched.routes[name]
        for name, ns in list(sched.nodes.items()):
            if ns.retired and not sched.node_inflight.get(name):
                del sched.nodes[name]
                self._forget_node(name)
        self.adhoc.sweep(now)

    def _forget_node(self, name: str) -> None:
        """Free what is held for a node that is gone from the scheduler: its session and pool."""
        s = self.sessions.pop(name, None)
        if s is not None:
            self.spawn(s.close())
        p = self.pools.pop(name, None)
        if p is not None:
            p.close_idle()
        self._models_asked.pop(name, None)
        self.speed.forget(name)

    def _ask_models(self) -> None:
        """Ask each multi-model node without a health check for its models once: at start, and
        after a reload that added it or changed its ``models`` (those with a health check are
        asked after each one, health.py)."""
        for name, ns in self.scheduler.nodes.items():
            if ns.cfg.models is None or ns.cfg.health is not None:
                self._models_asked.pop(name, None)
                continue
            if self._models_asked.get(name) != ns.cfg.models:
                self._models_asked[name] = ns.cfg.models
                self.spawn(refresh_models(self.session(name), ns))

    # --- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        self.started = True
        self._sync_health_loops()
        self._ask_models()
        self._pump = asyncio.create_task(self._pump_loop(), name="kiloline-pump")

    def begin_shutdown(self) -> None:
        """Refuse new work from now on (the server's shutdown)."""
        self.shutting_down = True

    async def stop(self) -> None:
        self.started = False
        # Cancelled until they end (kilolined/wire/tasks.py: one cancel can be swallowed).
        await cancel_all([*([self._pump] if self._pump else []), *self._health_tasks.values(), *self._tasks])
        self._health_tasks.clear()
        for s in [*self.sessions.values(), *self._retired_sessions]:
            await s.close()
        self.sessions.clear()
        self._retired_sessions.clear()
        for p in self.pools.values():
            p.close()
        self.pools.clear()
        self.deadlines.close()
        with contextlib.suppress(OSError):
            self.budgets.save()
        with contextlib.suppress(OSError):
            self.bill.save()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Background task owned by the Runtime (cancelled at stop, never garbage-collected early)."""
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _pump_loop(self) -> None:
        """Time-driven work: queue timeouts, breaker half-open, slow start, modes, budget saves."""
        last_save = self.clock()
        while True:
            await asyncio.sleep(PUMP_SEC)
            try:
                now = self.clock()
                for t in self.scheduler.expire(now):
                    self.metrics.rejections.labels(self.route_label(t.route), "queue_timeout").inc()
                self.speed.tick(now)
                self.wake()
                self._gc(now)
                if now - last_save > 5:
                    last_save = now
                    try:
                        self.budgets.save()
                        self.bill.save()
                    except OSError as e:
                        log.warning("could not save budgets or usage: %s", e)
            except Exception:  # the pump must never die: it is what makes time pass for the queue
                log.exception("pump")

    def _sync_health_loops(self) -> None:
        want = {n: ns for n, ns in self.scheduler.nodes.items() if not ns.retired and ns.cfg.health}
        for n, t in list(self._health_tasks.items()):
            cur = want.get(n)
            if cur is None or getattr(t, "kl_cfg", None) != cur.cfg:
                t.cancel()
                del self._health_tasks[n]
        for n, ns in want.items():
            if n not in self._health_tasks:
                t = asyncio.create_task(health_loop(self.session, ns, self.clock, self.node_events,
                                                    active=lambda: self.checks_here()), name=f"health-{n}")
                t.kl_cfg = ns.cfg  # type: ignore[attr-defined]
                self._health_tasks[n] = t

    # --- upstream sessions --------------------------------------------------------------
    def session(self, node: str) -> aiohttp.ClientSession:
        s = self.sessions.get(node)
        if s is None or s.closed:
            conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=True)
            s = aiohttp.ClientSession(
                connector=conn, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
            )
            self.sessions[node] = s
        return s

    def pool(self, node: str) -> NodePool:
        p = self.pools.get(node)
        if p is None:
            p = self.pools[node] = NodePool(self.scheduler.nodes[node].cfg.url)
        return p

    # --- queue --------------------------------------------------------------------------
    def wake(self) -> None:
        """Something may have freed capacity or changed node state: hand out slots."""
        now = self.clock()
        self.scheduler.dispatch(now)
        for route, old, new in self.scheduler.update_modes(now):
            self._mode_changed(route, old, new)
        # A mode change can make standbys usable.
        self.scheduler.dispatch(now)

    def admit(self, route: str, key: str, priority: int, *, pinned_node: str | None = None,
              cost: float = 0.0, model: str | None = None, affinity: Affinity | None = None,
              body: int = 0) -> Ticket:
        return self.leases.admit(route, key, priority, self.clock(), pinned_node=pinned_node, cost=cost,
                                 model=model, affinity=affinity, body=body)

    # --- node results -------------------------------------------------------------------
    def node_success(self, node: str, trial: bool) -> None:
        ns = self.scheduler.nodes.get(node)
        if ns is not None:
            had_failures = ns.failures > 0
            events = ns.record_success(self.clock(), trial)
            if self.node_sync is not None and had_failures:
                self.node_sync.succeeded(ns)
            self.node_events(ns, events)

    def node_failure(self, node: str, reason: str, trial: bool) -> None:
        ns = self.scheduler.nodes.get(node)
        if ns is None:
            return
        log.warning("✗ [%s] %s", node, reason)
        events = ns.record_failure(self.clock(), reason, trial)
        if self.node_sync is not None:
            self.node_sync.failed(ns)
        self.node_events(ns, events)

    def node_events(self, ns: NodeState, events: list[str], texts: dict[str, str] | None = None) -> None:
        """The one subscriber of node transitions: every ``NodeState`` method that changes the node
        returns its events, and its caller hands them here. Shares the change with the cluster,
        then alerts and feeds each event but the quiet ``CHANGED`` (``texts``: the speed watch's
        own words), and wakes the queue."""
        if not events:
            return
        if self.node_sync is not None:
            self.node_sync.changed(ns)  # the other gateways apply the same transition
        for ev in events:
            if ev == CHANGED:
                continue
            text = texts[ev] if texts and ev in texts else self._node_text(ns, ev)
            if ev in ("node_down", "breaker_open"):
                self.scheduler.forget(ns.name)  # what it held is gone, or cannot be trusted (docs/CONFIG.md#affinity)
            log.warning("%s", text) if ev in ("node_down", "breaker_open", "node_slow") else log.info("%s", text)
            self.feed.publish(ev, node=ns.name, label=ns.label, text=text)
            self.notify(ev, text, node=ns.name)
            for watch in self.node_watchers:
                watch(ns.name, ev)
        self.wake()

    def _node_text(self, ns: NodeState, ev: str) -> str:
        who = f"{ns.name} ({ns.label})" if ns.label != ns.name else ns.name
        if ev == "node_down":
            return f"✗ {who} DOWN — {ns.last_error or 'health check failing'}"
        if ev == "node_up":
            return f"✓ {who} UP — health checks passing"
        if ev in ("node_slow", "node_recovered") and ns.slow_note:
            return ns.slow_note  # the speed watch's words, from whichever gateway decided (cluster mode)
        if ev == "breaker_open" and ns.slow_state in (SPEED_HARD, SPEED_STALLED):
            why = "for being slow" if ns.slow_state == SPEED_HARD else "after a stall"
            return f"⚡ {who} breaker OPEN {why}, retry in {ns.open_period:g}s"
        if ev == "breaker_open":
            why = ("its half-open trial failed" if ns.open_period > ns.breaker_cfg.open_sec
                   else f"{ns.breaker_cfg.consecutive_failures} failures")
            return f"⚡ {who} breaker OPEN after {why} ({ns.last_error or 'errors'}), retry in {ns.open_period:g}s"

        return f"✓ {who} breaker closed — taking work again"

    def _mode_changed(self, route: str, old: str, new: str) -> None:
        rq = self.scheduler.routes[route]
        queued = self.scheduler.depth(rq)
        if new == "failover":
            targets = ", ".join(n for n in rq.cfg.standby if self.scheduler.nodes[n].available(self.clock()))
            events = [("failover", f"⚡ {route} failing over to {targets} ({queued} queued)")]
        elif new == "primary":
            events = [("failback", f"✓ {route} back on primary {', '.join(rq.cfg.nodes)}")]
        else:
            events = [("route_down", f"✗ {route} DOWN — no node can take work ({queued} queued, waiting)")]
        if old == "down":
            events.insert(0, ("route_up", f"✓ {route} UP — queue resumed"))
            if new == "primary":
                events = events[:1]  # back from down straight to primary: route_up says it all
        if "down" in (old, new) and self.scales_to_zero(route):
            # A pool at zero by design: its requests wait for the node it resumes or rents.
            log.info("[fleet] %s has no node now (%s → %s): scaled to zero", route, old, new)
            events = [e for e in events if e[0] not in ("route_down", "route_up")]
        for ev, text in events:
            log.warning("%s", text)
            self.feed.publish(ev, route=route, text=text, mode=new)
            self.notify(ev, text, node=route)

    def est_wait(self, route: str, position: int | None, now: float) -> float | None:
        """The queue's estimate for ``position`` on ``route``; when the route has no node to
        serve it, the fleet's estimate of when one will (its measured resume or boot time)."""
        rq = self.scheduler.routes.get(route)
        if rq is None or position is None:
            return None
        est = self.scheduler.est_wait(rq, position, now)
        if est is None and self.node_eta is not None and not self.scheduler.usable(rq, now):
            return self.node_eta(route)
        return est

    def notify(self, event: str, text: str, node: str | None) -> None:
        self.alert(event, text, node)

    def price_per_hour(self, node: str) -> float | None:
        """What the node costs an hour: a rented node's own price, else ``cost.gpu_hourly_usd``."""
        pn = self.pool_nodes.get(node)
        return pn.price_per_hour if pn is not None else self.cfg.cost.gpu_hourly_usd

    @staticmethod
    def route_label(route: str) -> str:
        return "adhoc" if is_adhoc(route) else route

"""The fleet's I/O: ask the providers, probe new instances, measure the queue of each pool's
routes, apply ``decide``'s actions to the Runtime and the providers, and tell the operator
(docs/FLEET.md).

One task per gateway, ticking about once per health interval. In cluster mode only the gateway
that runs the health checks (the leader) rents and destroys. Before a provider's pools may rent,
its instances labelled ``kiloline:<pool>`` are listed and taken back: a restarted gateway finds
what it rented, so it never rents twice and never leaves one paying.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import aiohttp

from kilolined.core.config import Config, FleetConfig, FleetOfferConfig, FleetPoolConfig, FleetProviderConfig
from kilolined.fleet.decide import (
    AskStatus,
    Demand,
    Destroy,
    PoolRuntime,
    PoolSpec,
    Ready,
    Rent,
    RentRefused,
    Resume,
    Stop,
    Tracked,
    backoff_delay,
    choose_offer,
    decide,
    offer_failed,
    remember_lost,
    rent_failed,
    rent_ok,
    retry_in,
    spend,
)
from kilolined.fleet.provider import (
    GONE,
    RUNNING,
    STOPPED,
    Instance,
    Provider,
    ProviderError,
    label_of,
    pool_of,
)
from kilolined.fleet.runpod import RunPod
from kilolined.fleet.vastai import VastAI
from kilolined.ops.runtime import PoolNode, Runtime
from kilolined.scheduling.queue import RouteQueue

log = logging.getLogger("kilolined")
MIN_TICK_SEC = 0.1
MAX_TICK_SEC = 5.0
#: while an instance boots, its health is probed this often (a fraction of the tick, so that a
#: replacement joins its routes soon after it answers); the provider is still asked once a tick
BOOT_PROBES_PER_TICK = 5
MIN_PROBE_SEC = 0.05
RECONCILE_SEC = 60.0  # how often the providers' lists are compared with what the gateway tracks


def make_provider(cfg: FleetProviderConfig) -> Provider:
    key = cfg.api_key.get_secret_value()
    return VastAI(key, cfg.api_base) if cfg.kind == "vastai" else RunPod(key, cfg.api_base)


def node_name(pool: str, instance_id: str) -> str:
    return f"{pool}-{instance_id}"


class Fleet:
    def __init__(self, rt: Runtime, make: Callable[[FleetProviderConfig], Provider] = make_provider):
        self.rt = rt
        self._make = make
        self.cfg: FleetConfig | None = None
        self.providers: dict[str, Provider] = {}
        self._provider_cfgs: dict[str, FleetProviderConfig] = {}
        self.listed: set[str] = set()  # providers whose own instances were listed since start
        self.instances: dict[str, Tracked] = {}
        self.doomed: dict[str, Tracked] = {}  # destroy asked, not yet confirmed (still paid)
        #: serving nodes let go by a shrink: no new leases, destroyed once idle or at the deadline
        self.draining: dict[str, tuple[Tracked, float]] = {}
        self.pools: dict[str, PoolRuntime] = {}
        #: per pool, the last measured seconds from rent to ready ("boot") and resume to ready
        #: ("resume"): what a request waiting for a node is told
        self.measured: dict[str, dict[str, float]] = {}
        self._last_reconcile = -RECONCILE_SEC
        self._task: asyncio.Task[None] | None = None
        self._probe: aiohttp.ClientSession | None = None
        self._wake = asyncio.Event()
        self._closing = False  # set at shutdown: a rent still running opens no new session
        self._last_status = -MAX_TICK_SEC  # when the booting instances' provider status was last asked
        # view, node_eta and scales_to_zero reach the Runtime through its Wiring (the server's)
        rt.node_watchers.append(self._node_event)
        self.configure(rt.cfg)

    # --- config -------------------------------------------------------------------------
    def configure(self, cfg: Config) -> None:
        """Take a new config (a reload): pools may change size or go; a gone pool's instances are
        destroyed by the next tick (only those labelled with it). A provider whose settings change
        gets a new client; the old one is kept while instances still need it."""
        self.cfg = cfg.fleet
        want = dict(cfg.fleet.providers) if cfg.fleet else {}
        for name, pcfg in want.items():
            if self._provider_cfgs.get(name) != pcfg:
                old = self.providers.get(name)
                if old is not None:
                    self.rt.spawn(old.close())
                self.providers[name] = self._make(pcfg)
                self._provider_cfgs[name] = pcfg
                self.listed.discard(name)
        for name in set(cfg.fleet.pools if cfg.fleet else ()) - set(self.pools):
            self.pools[name] = PoolRuntime()
        self._wake.set()

    def _pool(self, name: str) -> FleetPoolConfig | None:
        return self.cfg.pools.get(name) if self.cfg else None

    def _specs(self) -> dict[str, PoolSpec]:
        if self.cfg is None:
            return {}
        return {n: PoolSpec(p.min_size, p.max_size, p.boot_timeout_sec, tuple(o.max_dph for o in p.offer_list),
                            p.scale_up_wait_sec, p.idle_stop_sec, p.stopped_destroy_sec)
                for n, p in self.cfg.pools.items() if p.provider in self.listed}

    def tick_sec(self) -> float:
        if self.cfg is None or not self.cfg.pools:
            return MAX_TICK_SEC
        return max(MIN_TICK_SEC, min(MAX_TICK_SEC, *(p.node.health.interval_sec for p in self.cfg.pools.values())))

    # --- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._task = self.rt.spawn(self._run())

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for p in self.providers.values():
            await p.close()
        if self._probe is not None:
            await self._probe.close()

    def _node_event(self, node: str, event: str) -> None:
        """A pool node just went down: decide now, not at the next tick."""
        if event == "node_down" and node in self.rt.pool_nodes:
            self._wake.set()

    def _wait_sec(self) -> float:
        tick = self.tick_sec()
        if any(t.phase == "booting" for t in self.instances.values()):
            return max(MIN_PROBE_SEC, tick / BOOT_PROBES_PER_TICK)
        return tick

    async def _run(self) -> None:
        while True:
            try:
                if self.rt.rents_here():  # cluster mode: the leader's job
                    await self.tick()
                else:
                    await self.follow()
            except Exception:  # the loop must outlive any one bad answer
                log.exception("✗ [fleet] tick")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._wait_sec()):
                    await self._wake.wait()

    # --- a gateway that does not rent (cluster mode, not the leader) ---------------------
    async def follow(self) -> None:
        """Route to what the leader rented: each provider's labelled instances that run and
        answer their health path join their pool's routes here too; gone ones leave. Nothing is
        rented, destroyed or alerted (the leader's voice)."""
        self.instances.clear()  # the leader's record; a gateway that becomes leader lists afresh
        self.listed.clear()
        now = self.rt.clock()
        if now - self._last_status < self.tick_sec():
            return
        self._last_status = now
        seen: set[str] = set()
        for pname, prov in self.providers.items():
            try:
                found = await prov.list_own(self._port_for(pname))
            except ProviderError as e:
                log.debug("[fleet] %s: cannot list instances: %s", pname, e)
                seen |= {n for n, p in self.rt.pool_nodes.items() if p.provider == pname}  # keep what we have
                continue
            for inst in found:
                pool = pool_of(inst.label)
                pcfg = self._pool(pool) if pool else None
                if pool is None or pcfg is None or pcfg.provider != pname or inst.status != RUNNING or not inst.url:
                    continue
                if pcfg.template.port != self._port_for(pname):  # the list mapped another pool's port
                    with contextlib.suppress(ProviderError):
                        inst = await prov.status(inst.id, pcfg.template.port) or inst
                url = inst.url
                if not url:
                    continue
                name = node_name(pool, inst.id)
                if name in self.rt.pool_nodes or await self._probe_health(url, pcfg):
                    seen.add(name)
                if name in seen and name not in self.rt.pool_nodes:
                    self.rt.set_pool_node(name, PoolNode(pool=pool, cfg=pcfg.node.node(url, inst.id),
                                                         routes=tuple(pcfg.routes), provider=pname,
                                                         instance_id=inst.id, price_per_hour=inst.price))
        for name in [n for n in self.rt.pool_nodes if n not in seen]:
            self.rt.set_pool_node(name, None)

    # --- one round ----------------------------------------------------------------------
    async def tick(self) -> None:
        now = self.rt.clock()
        await self._list_providers(now)
        await self._retry_doomed()
        await self._finish_drains(now)
        demand = self.demand(now)
        await self._observe(demand, now)
        actions = decide(self._specs(), self.pools, self._managed(), self._cap(), now, self._held(), demand)
        if any(isinstance(a, AskStatus) for a in actions):
            await asyncio.gather(*(self._ask(a.id) for a in actions if isinstance(a, AskStatus)))
            demand = self.demand(now)
            actions = decide(self._specs(), self.pools, self._managed(), self._cap(), now, self._held(), demand)
        for a in actions:
            if isinstance(a, Stop):
                self._stopping(a)  # off its routes before any await: nothing can be leased on it after
        for a in actions:
            if isinstance(a, Destroy):
                await self._destroy(a)
            elif isinstance(a, Stop):
                await self._stop(a)
        for a in actions:
            if isinstance(a, Ready):
                if a.id in self.instances:  # not if destroyed above (a shrink as it turned healthy)
                    self._ready(self.instances[a.id])
            elif isinstance(a, RentRefused):
                self._failed(a.pool, a.reason, now)
            elif isinstance(a, Rent | Resume) and not self.doomed:  # a destroy not confirmed: still paid
                self.pools.setdefault(a.pool, PoolRuntime()).renting = True
                self.rt.spawn(self._rent(a) if isinstance(a, Rent) else self._resume(a))

    def demand(self, now: float) -> dict[str, Demand]:
        """Per pool, what the queue of its routes asks: how many wait, how long the oldest has
        waited, and the wait a request arriving now would get (None: no slot at all)."""
        sched = self.rt.scheduler
        out: dict[str, Demand] = {}
        for name, p in (self.cfg.pools.items() if self.cfg else ()):
            queues = [sched.routes[r] for r in p.routes if r in sched.routes]
            waiting = sum(sched.depth(rq) for rq in queues)
            if waiting == 0:
                out[name] = Demand()
                continue
            since = [t.enqueued_at for rq in queues for t in rq.waiting.order()]
            out[name] = Demand(waiting, now - min(since) if since else 0.0, self._est(queues, now))
        return out

    def _est(self, queues: list[RouteQueue], now: float) -> float | None:
        """The longest wait the queue estimates for a request arriving now on one of ``queues``;
        None when one with requests waiting has no slot at all (they would wait forever)."""
        sched = self.rt.scheduler
        worst = 0.0
        for rq in queues:
            depth = sched.depth(rq)
            if depth == 0:
                continue
            if sched.live_slots(rq, now) == 0:
                return None
            worst = max(worst, sched.est_wait(rq, depth + 1, now) or 0.0)
        return worst

    def scales_to_zero(self, route: str) -> bool:
        """The route has no node of its own and a pool joining it may go to zero (min 0)."""
        rcfg = self.rt.cfg.routes.get(route)
        if rcfg is None or rcfg.nodes or rcfg.standby or self.cfg is None:
            return False
        return any(route in p.routes and p.min_size == 0 for p in self.cfg.pools.values())

    def node_eta(self, route: str) -> float | None:
        """Seconds until a pool joining ``route`` has a node serving, when none serves it now: what
        is left of the measured boot (or resume) of one on its way, else the measured resume
        time of a stopped one, else its boot time. None: no pool joins the route, or nothing
        measured yet."""
        now = self.rt.clock()
        etas: list[float] = []
        for name, p in (self.cfg.pools.items() if self.cfg else ()):
            if route not in p.routes:
                continue
            m = self.measured.get(name, {})
            mine = [t for t in self.instances.values() if t.pool == name]
            coming = [max(0.0, took - (now - t.phase_start())) for t in mine if t.phase == "booting"
                      and (took := m.get("resume" if t.resuming else "boot")) is not None]
            if coming:  # one is on its way: nothing else starts before it serves
                etas.append(min(coming))
                continue
            stopped = any(t.phase == "stopped" for t in mine)
            took = m.get("resume") if stopped else None
            took = took if took is not None else m.get("boot")
            if took is not None:
                etas.append(took)
        return round(min(etas), 1) if etas else None

    def _held(self) -> float:
        """$/hour still paid for instances no longer counted in their pool: draining or destroying."""
        return spend(self.doomed) + sum(t.price for t, _ in self.draining.values())

    def _cap(self) -> float:
        return self.cfg.max_spend_per_hour if self.cfg else 0.0

    def _managed(self) -> dict[str, Tracked]:
        """Instances whose provider is listed (one not yet listed is neither rented for nor destroyed)."""
        return {k: t for k, t in self.instances.items() if t.provider in self.listed}

    async def _list_providers(self, now: float) -> None:
        """List each provider's own instances: at start (before any rent) and every RECONCILE_SEC
        (an instance a create made although its answer was lost is found and taken or destroyed)."""
        due = now - self._last_reconcile >= RECONCILE_SEC
        if any(ps.renting for ps in self.pools.values()):
            due = False  # a create in flight would look like an orphan
        for name, prov in self.providers.items():
            if name in self.listed and not due:
                continue
            if name not in self.listed and not self._may_list(name, now):
                continue
            try:
                found = await prov.list_own(self._port_for(name))
            except ProviderError as e:
                log.warning("⚠ [fleet] %s: cannot list instances: %s", name, e)
                if name not in self.listed:
                    self._unlisted(name, f"cannot list {name}'s instances: {e.kind}: {e}", now, e.retry_after)
                continue
            self._take_back(name, found, now)
            self.listed.add(name)
        if due:
            self._last_reconcile = now

    def _may_list(self, provider: str, now: float) -> bool:
        """An unlisted provider is asked again once its pools' backoff has passed."""
        waits = [self.pools.get(n, PoolRuntime()).retry_at for n, p in (self.cfg.pools.items() if self.cfg else ())
                 if p.provider == provider]
        return not waits or now >= min(waits)

    def _unlisted(self, provider: str, why: str, now: float, retry_after: float | None) -> None:
        """A provider not yet listed cannot rent (it might hold our instances): its pools wait,
        backed off and alerted like a failed rent."""
        for name, p in (self.cfg.pools.items() if self.cfg else ()):
            ps = self.pools.setdefault(name, PoolRuntime())
            if p.provider == provider and p.max_size > 0 and now >= ps.retry_at:
                self._failed(name, why, now, retry_after)

    def _port_for(self, provider: str) -> int:
        ports = {p.template.port for p in (self.cfg.pools.values() if self.cfg else ()) if p.provider == provider}
        return min(ports) if ports else 0

    def _take_back(self, provider: str, found: list[Instance], now: float) -> None:
        held = [*self.instances.values(), *self.doomed.values(), *(t for t, _ in self.draining.values())]
        known = {(t.provider, t.instance_id) for t in held}
        for inst in found:
            pool = pool_of(inst.label)
            if pool is None or (provider, inst.id) in known:
                continue
            key = f"{provider}/{inst.id}"
            # A pool no longer configured is destroyed by the next decision (pool_removed);
            # one past its size loses the surplus.
            # A stopped one is resumed before anything is rented; the rest boot (again) until healthy.
            self.instances[key] = Tracked(key, pool, inst.price, inst.machine, now, provider=provider,
                                          instance_id=inst.id,  # its address: from status, by its own port
                                          phase="stopped" if inst.status == STOPPED else "booting",
                                          provider_running=False if inst.status == GONE else None)
            log.info("[fleet] %s: found instance %s of pool %s again (%s)", provider, inst.id, pool, inst.status)

    async def _observe(self, demand: dict[str, Demand], now: float) -> None:
        """Booting instances: their address and status, then a health probe. Serving ones: the
        node's own health (a pool node's health loop is the gateway's ordinary one), and whether
        anything runs on it or waits for its routes (else it is idle since then)."""
        booting = [t for t in self._managed().values() if t.phase == "booting" and t.provider_running is not False]
        ask = now - self._last_status >= self.tick_sec()
        if ask:
            self._last_status = now
        await asyncio.gather(*(self._boot_step(t, ask or t.url is None) for t in booting))
        for t in self._managed().values():
            if t.phase != "serving":
                continue
            name = node_name(t.pool, t.instance_id)
            ns = self.rt.scheduler.nodes.get(name)
            t.healthy = ns is not None and ns.healthy
            if t.healthy or t.provider_running:
                t.provider_running = None  # asked afresh while it stays down: a reclaim may come later
            # Cluster mode: another gateway's requests on the node are not in this one's leases,
            # so nothing there is judged idle (a stop could cut them off).
            busy = (self.rt.cluster is not None or self.rt.scheduler.node_inflight.get(name, 0) > 0
                    or demand.get(t.pool, Demand()).waiting > 0)
            if busy or t.idle_since is None:
                t.idle_since = now

    async def _boot_step(self, t: Tracked, ask: bool) -> None:
        """Ask the provider (once a tick, or until the address is known), then probe the health
        path once the instance runs; between ticks only the probe runs."""
        pcfg = self._pool(t.pool)
        prov = self.providers.get(t.provider)
        if pcfg is None or prov is None:
            return
        if ask:
            try:
                inst = await prov.status(t.instance_id, pcfg.template.port)
            except ProviderError as e:
                log.debug("[fleet] status of %s: %s", t.id, e)
                return
            # A resumed one may still read stopped a moment; one booting from its create was reclaimed.
            if inst is None or inst.status == GONE or (inst.status == STOPPED and not t.resuming):
                t.provider_running = False
                return
            if inst.status != RUNNING:
                return
            t.url = inst.url or t.url
            if inst.price:
                t.price = inst.price
        if t.url:
            t.healthy = await self._probe_health(t.url, pcfg)

    async def _probe_health(self, url: str, pcfg: FleetPoolConfig) -> bool:
        h = pcfg.node.health
        if self._closing:
            return False
        if self._probe is None or self._probe.closed:
            self._probe = aiohttp.ClientSession()
        try:
            async with self._probe.get(url + h.path, headers=pcfg.node.headers,
                                       timeout=aiohttp.ClientTimeout(total=h.timeout_sec)) as r:
                return r.status in h.expect_status
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _ask(self, key: str) -> None:
        t = self.instances.get(key)
        prov = self.providers.get(t.provider) if t else None
        pcfg = self._pool(t.pool) if t else None
        if t is None or prov is None:
            return
        try:
            inst = await prov.status(t.instance_id, pcfg.template.port if pcfg else 0)
        except ProviderError as e:
            log.warning("⚠ [fleet] %s is down; its provider cannot say why: %s", t.id, e)
            return  # asked again next tick: no replacement without the provider's word
        t.provider_running = inst is not None and inst.status not in (GONE, STOPPED)

    # --- actions ------------------------------------------------------------------------
    async def _destroy(self, a: Destroy) -> None:
        t = self.instances.pop(a.id, None)
        if t is None:
            return
        name = node_name(t.pool, t.instance_id)
        now = self.rt.clock()
        if a.reason == "surplus" and self._drain(t, name, now):
            return
        self.rt.set_pool_node(name, None)  # no new work; what ran there is re-queued as from any lost node
        ps = self.pools.setdefault(t.pool, PoolRuntime())
        if a.reason == "reclaimed":
            remember_lost(ps, t.machine)
            self._event("fleet_node_lost", f"✗ {name} reclaimed by {t.provider} (health down, provider says not "
                        f"running): destroying it and renting a replacement", name)
        elif a.reason == "boot_timeout":
            pcfg = self._pool(t.pool)
            self._offer_failed(t.pool, t.offer, f"{name} not healthy within boot_timeout_sec "
                               f"{pcfg.boot_timeout_sec if pcfg else '?'}", now)
        else:
            log.info("[fleet] destroying %s (%s)", name, {"pool_removed": "pool removed", "surplus": "over max",
                                                          "stopped_expired": "stopped past stopped_destroy_sec",
                                                          "stop_failed": "its stop failed"}.get(a.reason, a.reason))
        self.doomed[a.id] = t
        await self._destroy_now(t)

    def _drain(self, t: Tracked, name: str, now: float) -> bool:
        """A serving node its pool no longer needs finishes what it runs before it is destroyed
        (a shrink should not re-queue work): drained like a static node, it gets no new lease."""
        ns = self.rt.scheduler.nodes.get(name)
        if t.phase != "serving" or name not in self.rt.pool_nodes or ns is None:
            return False
        self.rt.node_events(ns, ns.drain(True))  # cluster mode: drained on every gateway
        self.draining[t.id] = (t, now + self._drain_timeout(t.pool))
        log.info("[fleet] draining %s (over size): destroyed once its %d running request(s) end", name,
                 self.rt.scheduler.node_inflight.get(name, 0))
        self.rt.wake()
        return True

    def _drain_timeout(self, pool: str) -> float:
        """The longest request_timeout_sec of the pool's routes: no request it runs lasts longer."""
        pcfg = self._pool(pool)
        routes = self.rt.cfg.routes
        return max((routes[r].request_timeout_sec for r in (pcfg.routes if pcfg else ()) if r in routes),
                   default=600.0)

    async def _finish_drains(self, now: float) -> None:
        for key, (t, deadline) in list(self.draining.items()):
            name = node_name(t.pool, t.instance_id)
            if self.rt.scheduler.node_inflight.get(name, 0) > 0 and now < deadline and name in self.rt.pool_nodes:
                continue
            del self.draining[key]
            self.rt.set_pool_node(name, None)  # past the deadline, what still runs is re-queued
            log.info("[fleet] destroying %s (drained)", name)
            self.doomed[key] = t
            await self._destroy_now(t)

    async def _destroy_now(self, t: Tracked) -> None:
        prov = self.providers.get(t.provider)
        if prov is None:
            log.warning("⚠ [fleet] %s: provider %s is no longer configured; destroy it by hand", t.id, t.provider)
            self.doomed.pop(t.id, None)
            return
        try:
            await prov.destroy(t.instance_id)
        except ProviderError as e:
            log.warning("⚠ [fleet] destroy %s failed (%s): retried", t.id, e)
            return
        self.doomed.pop(t.id, None)

    async def _retry_doomed(self) -> None:
        for t in list(self.doomed.values()):
            await self._destroy_now(t)

    def _ready(self, t: Tracked) -> None:
        pcfg = self._pool(t.pool)
        if pcfg is None or t.url is None:
            return
        name = node_name(t.pool, t.instance_id)
        node = PoolNode(pool=t.pool, cfg=pcfg.node.node(t.url, t.instance_id), routes=tuple(pcfg.routes),
                        provider=t.provider, instance_id=t.instance_id, price_per_hour=t.price)
        self.rt.set_pool_node(name, node)
        now = self.rt.clock()
        if t.rented_here:  # one found again after a restart has no start this gateway saw
            self.measured.setdefault(t.pool, {})["resume" if t.resuming else "boot"] = now - t.phase_start()
        t.phase, t.since, t.idle_since, t.resuming = "serving", now, now, False
        rent_ok(self.pools.setdefault(t.pool, PoolRuntime()))
        self._event("fleet_node_ready", f"✓ {name} serving on {', '.join(pcfg.routes)} "
                    f"({t.provider}, ${t.price:.3f}/h)", name)

    async def _rent(self, a: Rent) -> None:
        ps = self.pools.setdefault(a.pool, PoolRuntime())
        try:
            pcfg = self._pool(a.pool)
            prov = self.providers.get(pcfg.provider) if pcfg else None
            entries = pcfg.offer_list if pcfg else []
            if pcfg is None or prov is None or a.offer >= len(entries):
                return
            want = entries[a.offer]
            try:
                offers = await prov.search(want, a.exclude, a.max_price)
                offer = choose_offer(offers, want, a.exclude, a.max_price)
                if offer is None and len(a.exclude) > 1:
                    # Every fitting machine was lost recently: avoid only the one lost last,
                    # rather than leave the pool short until an old loss is forgotten.
                    last = frozenset(ps.lost_machines[-1:])
                    offers = await prov.search(want, last, a.max_price)
                    offer = choose_offer(offers, want, last, a.max_price)
                if offer is None:
                    raise ProviderError("no_offer", f"no offer fits (≤ ${a.max_price:.3f}/h{self._capped(want, a)}, "
                                        f"{len(offers)} offered)")
                iid = await prov.create(offer, want, pcfg.template, label_of(a.pool))
            except ProviderError as e:
                why = f"{self._entry(pcfg, a.offer)}{e.kind}: {e}"
                if e.kind == "rate_limited":  # the whole API said slow down, not just this entry
                    self._failed(a.pool, why, self.rt.clock(), e.retry_after)
                else:
                    self._offer_failed(a.pool, a.offer, why, self.rt.clock())
                return
            key = f"{pcfg.provider}/{iid}"
            now = self.rt.clock()
            self.instances[key] = Tracked(key, a.pool, offer.price, offer.machine, now, provider=pcfg.provider,
                                          instance_id=iid, offer=a.offer, rented_here=True)
            self._event("fleet_node_rented", f"⏳ {node_name(a.pool, iid)} rented from {pcfg.provider} "
                        f"({self._entry(pcfg, a.offer)}offer {offer.id}, ${offer.price:.3f}/h): booting",
                        node_name(a.pool, iid))
        finally:
            ps.renting = False
            self._wake.set()

    @staticmethod
    def _entry(pcfg: FleetPoolConfig, i: int) -> str:
        """Which ``offers`` entry, when the pool has several."""
        if len(pcfg.offer_list) < 2:
            return ""
        o = pcfg.offer_list[i]
        return f"offers.{i} {o.gpu_name} {'spot' if o.interruptible else 'on-demand'}: "

    async def _resume(self, a: Resume) -> None:
        """Start a stopped instance again; it boots (without its model download) until healthy."""
        ps = self.pools.setdefault(a.pool, PoolRuntime())
        try:
            t = self.instances.get(a.id)
            pcfg = self._pool(a.pool)
            prov = self.providers.get(t.provider) if t else None
            if t is None or pcfg is None or prov is None or t.phase != "stopped":
                return
            name = node_name(t.pool, t.instance_id)
            num_gpus = pcfg.offer_list[min(t.offer, len(pcfg.offer_list) - 1)].num_gpus
            try:
                await prov.resume(t.instance_id, num_gpus)
            except ProviderError as e:
                now = self.rt.clock()
                if e.kind == "client" and "404" in str(e):
                    self.instances.pop(a.id, None)  # gone at the provider: nothing to pay, nothing to resume
                    log.warning("⚠ [fleet] %s is gone at %s; no longer tracked", name, t.provider)
                    return
                t.retry_at = now + max(backoff_delay(pcfg.backoff_base_sec, 1), e.retry_after or 0.0)
                self._event("fleet_rent_failed", f"✗ pool {a.pool}: resume of {name} failed ({e.kind}: {e}); "
                            f"it is tried again in {t.retry_at - now:g}s, another is rented meanwhile", a.pool)
                return
            now = self.rt.clock()
            t.phase, t.since, t.resuming, t.rented_here = "booting", now, True, True
            t.healthy, t.url, t.provider_running, t.idle_since = False, None, None, None
            self._event("fleet_node_resumed", f"⏳ {name} resumed ({t.provider}, ${t.price:.3f}/h): "
                        "serving again once healthy", name)
        finally:
            ps.renting = False
            self._wake.set()

    def _stopping(self, a: Stop) -> None:
        """Idle for idle_stop_sec: off its routes at once (nothing runs on it, nothing waits for
        its routes), then stopped through the provider."""
        t = self.instances.get(a.id)
        if t is None:
            return
        self.rt.set_pool_node(node_name(t.pool, t.instance_id), None)
        t.phase, t.healthy = "stopping", False

    async def _stop(self, a: Stop) -> None:
        t = self.instances.get(a.id)
        prov = self.providers.get(t.provider) if t else None
        if t is None or prov is None:
            return
        name = node_name(t.pool, t.instance_id)
        pcfg = self._pool(t.pool)
        try:
            await prov.stop(t.instance_id)
        except ProviderError as e:
            # It serves nothing now: destroyed rather than paid for (its disk is lost with it).
            log.warning("⚠ [fleet] stop %s failed (%s): destroying it instead", name, e)
            await self._destroy(Destroy(t.id, t.pool, "stop_failed"))
            return
        now = self.rt.clock()
        t.phase, t.since, t.url, t.provider_running, t.idle_since = "stopped", now, None, None, None
        keep = f", destroyed after {pcfg.stopped_destroy_sec:g}s" if pcfg and pcfg.stopped_destroy_sec else ""
        self._event("fleet_node_stopped", f"⏸ {name} stopped after {pcfg.idle_stop_sec if pcfg else '?'}s idle "
                    f"(disk kept, resumed first when the queue grows{keep})", name)

    def _capped(self, want: FleetOfferConfig, a: Rent) -> str:
        """Say so when the price limit is what max_spend_per_hour leaves, not the entry's max_dph:
        the operator must know the cap, not the market, kept the pool short."""
        if a.max_price >= want.max_dph:
            return ""
        return f": what max_spend_per_hour {self._cap():g} leaves"

    def _failed(self, pool: str, why: str, now: float, retry_after: float | None = None) -> None:
        pcfg = self._pool(pool)
        ps = self.pools.setdefault(pool, PoolRuntime())
        delay = rent_failed(ps, pcfg.backoff_base_sec if pcfg else 60.0, now, retry_after)
        self._event("fleet_rent_failed", f"✗ pool {pool}: rent failed ({why}); next try in {delay:g}s", pool)

    def _offer_failed(self, pool: str, entry: int, why: str, now: float) -> None:
        """One ``offers`` entry failed: it backs off; the next entry is tried at the next tick."""
        pcfg = self._pool(pool)
        ps = self.pools.setdefault(pool, PoolRuntime())
        delay = offer_failed(ps, entry, pcfg.backoff_base_sec if pcfg else 60.0, now)
        n = len(pcfg.offer_list) if pcfg else 1
        nxt = retry_in(ps, n, now)
        then = "next entry now" if nxt is None else f"next try in {nxt:g}s"
        self._event("fleet_rent_failed", f"✗ pool {pool}: rent failed ({why}); "
                    f"{'this entry waits ' + format(delay, 'g') + 's, ' if n > 1 else ''}{then}", pool)

    def _event(self, event: str, text: str, node: str) -> None:
        log.warning("%s", text) if event in ("fleet_node_lost", "fleet_rent_failed") else log.info("%s", text)
        self.rt.feed.publish(event, node=node, text=text)
        self.rt.metrics.fleet_events.labels(event).inc()
        self.rt.notify(event, text, node=node)

    # --- views --------------------------------------------------------------------------
    def view(self) -> dict[str, Any]:
        """``fleet`` of /admin/state (docs/API.md): pools, instances and spend. No key, ever."""
        now = self.rt.clock()
        pools: dict[str, Any] = {}
        for name, p in (self.cfg.pools.items() if self.cfg else ()):
            ps = self.pools.get(name) or PoolRuntime()
            mine = [t for t in self.instances.values() if t.pool == name]
            wait = retry_in(ps, len(p.offer_list), now)
            pools[name] = {
                "provider": p.provider, "size": p.max_size, "min": p.min_size, "max": p.max_size,
                "routes": list(p.routes),
                **{phase: sum(1 for t in mine if t.phase == phase)
                   for phase in ("booting", "serving", "stopping", "stopped")},
                "renting": ps.renting, "failures": ps.failures,
                "retry_in_sec": round(wait, 1) if ps.failures and wait is not None else None,
                "measured_boot_sec": _rounded(self.measured.get(name, {}).get("boot")),
                "measured_resume_sec": _rounded(self.measured.get(name, {}).get("resume")),
            }
        instances = [self._row(t, t.phase, now) for t in self.instances.values()]
        instances += [self._row(t, "draining", now) for t, _ in self.draining.values()]
        return {"pools": pools, "instances": instances,
                "spend_per_hour": round(spend(self.instances) + self._held(), 4),
                "max_spend_per_hour": self._cap(), "destroying": len(self.doomed), "draining": len(self.draining)}

    def _row(self, t: Tracked, phase: str, now: float) -> dict[str, Any]:
        """One instance of the view. ``state``: booting, serving, idle (serving, nothing running
        on it), stopping, stopped or draining; ``billed``: whether its GPU is paid for now."""
        name = node_name(t.pool, t.instance_id)
        state = phase
        if phase == "serving" and self.rt.scheduler.node_inflight.get(name, 0) == 0:
            state = "idle"
        idle = now - t.idle_since if phase == "serving" and t.idle_since is not None and state == "idle" else None
        return {"node": name, "pool": t.pool, "provider": t.provider, "instance_id": t.instance_id,
                "phase": phase, "state": state, "price_per_hour": t.price, "billed": phase != "stopped",
                "idle_sec": _rounded(idle), "since_sec": _rounded(now - t.phase_start())}


def _rounded(v: float | None) -> float | None:
    return None if v is None else round(v, 1)

"""The fleet's I/O: ask the providers, probe new instances, apply ``decide``'s actions to the
Runtime and the providers, and tell the operator (docs/FLEET.md).

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

from kilolined.core.config import Config, FleetConfig, FleetPoolConfig, FleetProviderConfig
from kilolined.fleet.decide import (
    AskStatus,
    Destroy,
    PoolRuntime,
    PoolSpec,
    Ready,
    Rent,
    RentRefused,
    Tracked,
    choose_offer,
    decide,
    remember_lost,
    rent_failed,
    rent_ok,
    spend,
)
from kilolined.fleet.provider import GONE, RUNNING, Instance, Provider, ProviderError, label_of, pool_of
from kilolined.fleet.runpod import RunPod
from kilolined.fleet.vastai import VastAI
from kilolined.ops.runtime import PoolNode, Runtime

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
        self._last_reconcile = -RECONCILE_SEC
        self._task: asyncio.Task[None] | None = None
        self._probe: aiohttp.ClientSession | None = None
        self._wake = asyncio.Event()
        self._closing = False  # set at shutdown: a rent still running opens no new session
        self._last_status = -MAX_TICK_SEC  # when the booting instances' provider status was last asked
        rt.fleet_view = self.view
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
        return {n: PoolSpec(p.size, p.boot_timeout_sec, p.offer.max_dph) for n, p in self.cfg.pools.items()
                if p.provider in self.listed}

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
        await self._observe()
        actions = decide(self._specs(), self.pools, self._managed(), self._cap(), now, self._held())
        if any(isinstance(a, AskStatus) for a in actions):
            await asyncio.gather(*(self._ask(a.id) for a in actions if isinstance(a, AskStatus)))
            actions = decide(self._specs(), self.pools, self._managed(), self._cap(), now, self._held())
        for a in actions:
            if isinstance(a, Destroy):
                await self._destroy(a)
        for a in actions:
            if isinstance(a, Ready):
                if a.id in self.instances:  # not if destroyed above (a shrink as it turned healthy)
                    self._ready(self.instances[a.id])
            elif isinstance(a, RentRefused):
                self._failed(a.pool, a.reason, now)
            elif isinstance(a, Rent) and not self.doomed:  # a destroy not confirmed: its price is still paid
                self.pools.setdefault(a.pool, PoolRuntime()).renting = True
                self.rt.spawn(self._rent(a))

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
            if p.provider == provider and p.size > 0 and now >= ps.retry_at:
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
            self.instances[key] = Tracked(key, pool, inst.price, inst.machine, now, provider=provider,
                                          instance_id=inst.id,  # its address: from status, by its own port
                                          provider_running=False if inst.status == GONE else None)
            log.info("[fleet] %s: found instance %s of pool %s again (%s)", provider, inst.id, pool, inst.status)

    async def _observe(self) -> None:
        """Booting instances: their address and status, then a health probe. Serving ones: the
        node's own health (a pool node's health loop is the gateway's ordinary one)."""
        booting = [t for t in self._managed().values() if t.phase == "booting" and t.provider_running is not False]
        now = self.rt.clock()
        ask = now - self._last_status >= self.tick_sec()
        if ask:
            self._last_status = now
        await asyncio.gather(*(self._boot_step(t, ask or t.url is None) for t in booting))
        for t in self._managed().values():
            if t.phase != "serving":
                continue
            ns = self.rt.scheduler.nodes.get(node_name(t.pool, t.instance_id))
            t.healthy = ns is not None and ns.healthy
            if t.healthy or t.provider_running:
                t.provider_running = None  # asked afresh while it stays down: a reclaim may come later

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
            if inst is None or inst.status == GONE:
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
        t.provider_running = inst is not None and inst.status != GONE

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
            self._failed(t.pool, f"{name} not healthy within boot_timeout_sec "
                         f"{pcfg.boot_timeout_sec if pcfg else '?'}", now)
        else:
            log.info("[fleet] destroying %s (%s)", name, "pool removed" if a.reason == "pool_removed" else "over size")
        self.doomed[a.id] = t
        await self._destroy_now(t)

    def _drain(self, t: Tracked, name: str, now: float) -> bool:
        """A serving node its pool no longer needs finishes what it runs before it is destroyed
        (a shrink should not re-queue work): drained like a static node, it gets no new lease."""
        ns = self.rt.scheduler.nodes.get(name)
        if t.phase != "serving" or name not in self.rt.pool_nodes or ns is None:
            return False
        ns.drained = True
        if self.rt.node_sync is not None:
            self.rt.node_sync.changed(ns)  # cluster mode: drained on every gateway
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
        t.phase = "serving"
        rent_ok(self.pools.setdefault(t.pool, PoolRuntime()))
        self._event("fleet_node_ready", f"✓ {name} serving on {', '.join(pcfg.routes)} "
                    f"({t.provider}, ${t.price:.3f}/h)", name)

    async def _rent(self, a: Rent) -> None:
        ps = self.pools.setdefault(a.pool, PoolRuntime())
        try:
            pcfg = self._pool(a.pool)
            prov = self.providers.get(pcfg.provider) if pcfg else None
            if pcfg is None or prov is None:
                return
            try:
                offers = await prov.search(pcfg.offer, a.exclude, a.max_price)
                offer = choose_offer(offers, pcfg.offer, a.exclude, a.max_price)
                if offer is None and len(a.exclude) > 1:
                    # Every fitting machine was lost recently: avoid only the one lost last,
                    # rather than leave the pool short until an old loss is forgotten.
                    last = frozenset(ps.lost_machines[-1:])
                    offers = await prov.search(pcfg.offer, last, a.max_price)
                    offer = choose_offer(offers, pcfg.offer, last, a.max_price)
                if offer is None:
                    raise ProviderError("no_offer", f"no offer fits (≤ ${a.max_price:.3f}/h{self._capped(pcfg, a)}, "
                                        f"{len(offers)} offered)")
                iid = await prov.create(offer, pcfg.offer, pcfg.template, label_of(a.pool))
            except ProviderError as e:
                self._failed(a.pool, f"{e.kind}: {e}", self.rt.clock(), e.retry_after)
                return
            key = f"{pcfg.provider}/{iid}"
            self.instances[key] = Tracked(key, a.pool, offer.price, offer.machine, self.rt.clock(),
                                          provider=pcfg.provider, instance_id=iid)
            self._event("fleet_node_rented", f"⏳ {node_name(a.pool, iid)} rented from {pcfg.provider} "
                        f"(offer {offer.id}, ${offer.price:.3f}/h): booting", node_name(a.pool, iid))
        finally:
            ps.renting = False
            self._wake.set()

    def _capped(self, pcfg: FleetPoolConfig, a: Rent) -> str:
        """Say so when the price limit is what max_spend_per_hour leaves, not the pool's max_dph:
        the operator must know the cap, not the market, kept the pool short."""
        if a.max_price >= pcfg.offer.max_dph:
            return ""
        return f": what max_spend_per_hour {self._cap():g} leaves"

    def _failed(self, pool: str, why: str, now: float, retry_after: float | None = None) -> None:
        pcfg = self._pool(pool)
        ps = self.pools.setdefault(pool, PoolRuntime())
        delay = rent_failed(ps, pcfg.backoff_base_sec if pcfg else 60.0, now, retry_after)
        self._event("fleet_rent_failed", f"✗ pool {pool}: rent failed ({why}); next try in {delay:g}s", pool)

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
            pools[name] = {
                "provider": p.provider, "size": p.size, "routes": list(p.routes),
                "serving": sum(1 for t in mine if t.phase == "serving"),
                "booting": sum(1 for t in mine if t.phase == "booting"),
                "renting": ps.renting, "failures": ps.failures,
                "retry_in_sec": round(max(0.0, ps.retry_at - now), 1) if ps.failures else None,
            }
        instances = [{"node": node_name(t.pool, t.instance_id), "pool": t.pool, "provider": t.provider,
                      "instance_id": t.instance_id, "phase": t.phase, "price_per_hour": t.price}
                     for t in self.instances.values()]
        instances += [{"node": node_name(t.pool, t.instance_id), "pool": t.pool, "provider": t.provider,
                       "instance_id": t.instance_id, "phase": "draining", "price_per_hour": t.price}
                      for t, _ in self.draining.values()]
        return {"pools": pools, "instances": instances,
                "spend_per_hour": round(spend(self.instances) + self._held(), 4),
                "max_spend_per_hour": self._cap(), "destroying": len(self.doomed), "draining": len(self.draining)}

"""Prometheus metrics (docs/API.md#admin-endpoints). One registry per Runtime; gauges are read from live state at
scrape time, so the request path only bumps counters and histograms.

Label values come from config names (routes, nodes, keys) and fixed outcome/reason words, never
from anything a client sends, so cardinality is bounded by the config.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kilolined import __version__
from kilolined.nodes import BREAKER_GAUGE
from kilolined.queue import Scheduler


class LiveState(Protocol):
    """What the scrape-time gauges read (the Runtime has it)."""

    scheduler: Scheduler
    last_error: list[str] | None
    loaded_at: float

    def clock(self) -> float: ...

WAIT_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
UPSTREAM_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TTFT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


class _LiveGauges(Collector):
    def __init__(self, rt: Callable[[], LiveState]):
        self._rt = rt

    def collect(self) -> Iterable[GaugeMetricFamily]:
        rt = self._rt()
        now = rt.clock()
        sched = rt.scheduler
        depth = GaugeMetricFamily("kiloline_queue_depth", "Requests waiting per route", labels=["route"])
        infl = GaugeMetricFamily("kiloline_inflight", "Leases held per route and node", labels=["route", "node"])
        slots = GaugeMetricFamily(
            "kiloline_slots", "Usable slots per route and node right now", labels=["route", "node"]
        )
        up = GaugeMetricFamily("kiloline_node_up", "1 if the node's active health is up", labels=["node"])
        br = GaugeMetricFamily(
            "kiloline_breaker_state", "0 closed, 1 half-open, 2 open", labels=["node"]
        )
        cap = GaugeMetricFamily("kiloline_capacity", "A node's configured capacity (nodes that have one)",
                                labels=["node"])
        used = GaugeMetricFamily("kiloline_capacity_used", "The costs of a node's leases in flight", labels=["node"])
        for name, rq in sched.routes.items():
            if rq.name.startswith("adhoc:"):
                continue
            depth.add_metric([name], sched.depth(rq))
            for n in rq.all_nodes:
                ns = sched.nodes.get(n)
                if ns is None:
                    continue
                infl.add_metric([name, n], rq.inflight.get(n, 0))
                slots.add_metric([name, n], ns.effective(rq.cfg.max_concurrency, now) if ns.available(now) else 0)
        for n, ns in sched.nodes.items():
            if ns.name.startswith("adhoc:"):
                continue
            up.add_metric([n], 1 if ns.healthy else 0)
            br.add_metric([n], BREAKER_GAUGE[ns.breaker_state(now)])
            if ns.cfg.capacity is not None:
                cap.add_metric([n], ns.cfg.capacity)
                used.add_metric([n], sched.capacity_used.get(n, 0.0))
        # Prometheus' own idiom for "is the running config the file": 0 while a reload was refused
        # (the previous config still runs), and when the running one was loaded.
        ok = GaugeMetricFamily("kiloline_config_last_reload_successful",
                               "1 if the last config load or reload succeeded, 0 if it was refused")
        ok.add_metric([], 0 if rt.last_error else 1)
        at = GaugeMetricFamily("kiloline_config_last_reload_success_timestamp_seconds",
                               "Unix time the running config was loaded")
        at.add_metric([], rt.loaded_at)
        yield from (depth, infl, slots, up, br, cap, used, ok, at)


class _Children:
    """A labelled metric whose ``labels()`` children are memoised.

    prometheus_client validates and re-looks-up the labels on every ``labels()`` call (2–3 % of
    the gateway's CPU at thousands of requests per second); the label sets here are bounded by
    the config, so the children are kept in a dict. Label sets are never removed.
    """

    __slots__ = ("_children", "metric")

    def __init__(self, metric: Any):
        self.metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


class Metrics:
    def __init__(self, rt: Callable[[], LiveState]):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = _Children(Counter(
            "kiloline_requests", "Finished requests by outcome", ["route", "outcome"], registry=r
        ))
        self.queue_wait = _Children(Histogram(
            "kiloline_queue_wait_seconds", "Time from admission to lease", ["route"], buckets=WAIT_BUCKETS,
            registry=r,
        ))
        self.upstream = _Children(Histogram(
            "kiloline_upstream_seconds", "Time from dispatch to the last byte", ["route", "node"],
            buckets=UPSTREAM_BUCKETS, registry=r,
        ))
        self.ttft = _Children(Histogram(
            "kiloline_ttft_seconds", "Time to first token (openai routes)", ["route"], buckets=TTFT_BUCKETS,
            registry=r,
        ))
        self.rejections = _Children(Counter(
            "kiloline_rejections", "Requests refused before the upstream", ["route", "reason"], registry=r
        ))
        self.failovers = _Children(Counter(
            "kiloline_failovers", "Requests re-queued or sent to a standby after a node failure", ["route"],
            registry=r,
        ))
        self.reloads = Counter("kiloline_reloads", "Config reloads", ["result"], registry=r)
        for result in ("ok", "error"):
            self.reloads.labels(result)
        self.tokens = _Children(Counter("kiloline_tokens", "LLM tokens by route and key", ["route", "key"], registry=r))
        r.register(_LiveGauges(rt))
        # The daemon's own process (CPU, memory, fds, start time), Python and its collector.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        Gauge("kiloline_build_info", "The running kilolined's version (always 1)", ["version"],
              registry=r).labels(__version__).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""Prometheus metrics (docs/API.md#admin-endpoints). One registry per Runtime; gauges are read from live state at
scrape time, so the request path only bumps counters and histograms.

Label values come from config names (routes, nodes, keys) and fixed outcome/reason words, never
from anything a client sends, so cardinality is bounded by the config.
"""

from __future__ import annotations

import math
import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kilolined import __version__
from kilolined.scheduling.nodes import BREAKER_GAUGE
from kilolined.scheduling.queue import Scheduler
from kilolined.scheduling.speed import SpeedBook


class SpeedView(Protocol):
    """What the gauges read of the speed watch (kilolined/ops/speedwatch.py)."""

    book: SpeedBook

    def is_slow(self, node: str) -> bool: ...


class LiveState(Protocol):
    """What the scrape-time gauges read (the Runtime has it)."""

    scheduler: Scheduler

    @property
    def speed(self) -> SpeedView: ...

    last_error: list[str] | None
    loaded_at: float
    file_changed_at: float | None
    reload_pending: bool

    @property
    def fleet_view(self) -> Callable[[], dict[str, Any]] | None: ...

    def clock(self) -> float: ...

WAIT_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
UPSTREAM_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TTFT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


class _LiveGauges(Collector):
    def __init__(self, rt: Callable[[], LiveState]):
        self._rt = rt

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
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
        # Cards (docs/CONFIG.md#cards): the leases on all of a card's nodes, and their costs.
        card_infl = GaugeMetricFamily("kiloline_card_inflight", "Leases held on the nodes of a card",
                                      labels=["card"])
        card_used = GaugeMetricFamily("kiloline_card_capacity_used", "The costs of the leases on a card's nodes",
                                      labels=["card"])
        for c in sched.cards.cfg:
            card_infl.add_metric([c], sched.cards.inflight.get(c, 0))
            card_used.add_metric([c], sched.cards.used.get(c, 0.0))
        # Slow nodes (docs/CONFIG.md "nodes.<n>.slow"): each series' level, and whether it is out.
        speed = GaugeMetricFamily("kiloline_node_speed", "A node's peak-EWMA speed per route, in ms per unit",
                                  labels=["node", "route", "unit"])
        slow = GaugeMetricFamily("kiloline_node_slow", "1 while the node is ejected or held for being slow",
                                 labels=["node"])
        for node, route, unit, level in rt.speed.book.levels():
            if node in sched.nodes and not node.startswith("adhoc:"):
                speed.add_metric([node, route, unit], level)
        # Counted by the scheduler as it leases (queue.py): read here, so the lease path bumps nothing.
        swaps = CounterMetricFamily("kiloline_model_swaps", "Dispatches that made a multi-model node load a model",
                                    labels=["node"])
        decisions = CounterMetricFamily("kiloline_affinity_decisions",
                                        "Affinity node choices: hit, miss, or load (an affine node was passed over)",
                                        labels=["route", "outcome"])
        for (route, outcome), count in sched.affinity_decisions.items():
            if route in sched.routes:
                decisions.add_metric([route, outcome], count)
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
            slow.add_metric([n], 1 if ns.slowed or rt.speed.is_slow(n) else 0)
            br.add_metric([n], BREAKER_GAUGE[ns.breaker_state(now)])
            if ns.cfg.capacity is not None:
                cap.add_metric([n], ns.cfg.capacity)
                used.add_metric([n], sched.capacity_used.get(n, 0.0))
            if ns.cfg.models is not None:
                swaps.add_metric([n], sched.swaps.get(n, 0))
        # Prometheus' own idiom for "is the running config the file": 0 while a reload was refused
        # (the previous config still runs), and when the running one was loaded.
        ok = GaugeMetricFamily("kiloline_config_last_reload_successful",
                               "1 if the last config load or reload succeeded, 0 if it was refused")
        ok.add_metric([], 0 if rt.last_error else 1)
        at = GaugeMetricFamily("kiloline_config_last_reload_success_timestamp_seconds",
                               "Unix time the running config was loaded")
        at.add_metric([], rt.loaded_at)
        # A change the watcher saw but has not applied: 1 for longer than a second or so is a
        # reload that is stuck (docs/CONFIG.md "Hot reload").
        pending = GaugeMetricFamily("kiloline_config_reload_pending",
                                    "1 while a change of the config file seen by the watcher is not yet applied")
        pending.add_metric([], 1 if rt.reload_pending else 0)
        changed = GaugeMetricFamily("kiloline_config_file_changed_timestamp_seconds",
                                    "Unix time the watcher last saw the config file change (absent: not since start)")
        if rt.file_changed_at is not None:
            changed.add_metric([], rt.file_changed_at)
        yield from (depth, infl, slots, up, br, cap, used, card_infl, card_used, swaps, decisions, speed, slow, ok, at,
                    pending, changed)
        if rt.fleet_view is not None:
            yield from _fleet_gauges(rt.fleet_view())


def _fleet_gauges(view: dict[str, Any]) -> Iterable[GaugeMetricFamily]:
    """docs/FLEET.md: what the rented pools cost and hold (names and numbers only, never a key)."""
    spend = GaugeMetricFamily("kiloline_fleet_spend_per_hour", "Sum of the rented instances' $/hour")
    spend.add_metric([], view["spend_per_hour"])
    cap = GaugeMetricFamily("kiloline_fleet_max_spend_per_hour", "fleet.max_spend_per_hour")
    cap.add_metric([], view["max_spend_per_hour"])
    inst = GaugeMetricFamily("kiloline_fleet_instances", "Rented instances per pool and phase",
                             labels=["pool", "phase"])
    size = GaugeMetricFamily("kiloline_fleet_pool_size", "A pool's max (its size, for a fixed pool)", labels=["pool"])
    least = GaugeMetricFamily("kiloline_fleet_pool_min", "A pool's min (its size, for a fixed pool)", labels=["pool"])
    price = GaugeMetricFamily("kiloline_fleet_node_price_per_hour", "A rented node's $/hour",
                              labels=["node", "provider", "instance_id"])
    for name, p in view["pools"].items():
        size.add_metric([name], p["max"])
        least.add_metric([name], p["min"])
        for phase in ("booting", "serving", "stopping", "stopped"):
            inst.add_metric([name, phase], p[phase])
    for i in view["instances"]:
        price.add_metric([i["node"], i["provider"], i["instance_id"]], i["price_per_hour"])
    yield from (spend, cap, inst, size, least, price)


class CounterChild:
    __slots__ = ("created", "value")

    def __init__(self, created: float):
        self.value = 0.0
        self.created = created

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class HistogramChild:
    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...], created: float):
        self.bounds = bounds  # upper bounds, +Inf last
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.created = created

    def observe(self, value: float) -> None:
        # le buckets: the first bound >= value (Prometheus' "less than or equal")
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class Recorded:
    """A counter or histogram the request path bumps: plain numbers in a dict of children.

    prometheus_client's own Counter/Histogram take a lock, re-validate labels and, for a
    histogram, walk every bucket on each observation — 5 % of the gateway's whole cost per
    request. The gateway is one thread on one event loop, so a float per child is enough; the
    registry reads them at scrape time (``collect``), in prometheus_client's exposition format
    (``*_created`` series included). Label sets are bounded by the config and never removed.
    """

    __slots__ = ("_buckets", "_children", "_clock", "_created", "doc", "kind", "labelnames", "name")

    def __init__(self, kind: str, name: str, doc: str, labelnames: Sequence[str],
                 buckets: Sequence[float] = (), clock: Callable[[], float] = time.time):
        self.kind, self.name, self.doc, self.labelnames = kind, name, doc, tuple(labelnames)
        self._buckets = (*buckets, math.inf)
        self._children: dict[tuple[str, ...], Any] = {}
        self._clock = clock
        # prometheus-client's own switch for the *_created series (docs/METRICS.md), honoured the same way
        self._created = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in ("true", "1", "t")

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            child = self._children[values] = (CounterChild(self._clock()) if self.kind == "counter"
                                              else HistogramChild(self._buckets, self._clock()))
        return child

    def total(self) -> float:
        """The sum over every label set (a counter's)."""
        # A child is a CounterChild here (a counter's); the dict holds both kinds.
        counted: float = sum(c.value for c in self._children.values())
        return counted

    def values(self) -> dict[tuple[str, ...], float]:
        """A counter's values by their label values."""
        return {k: c.value for k, c in self._children.items()}

    def family(self) -> Metric:
        names = list(self.labelnames)
        if self.kind == "counter":
            counter = CounterMetricFamily(self.name, self.doc, labels=names)
            for values, c in self._children.items():
                counter.add_metric(list(values), c.value, created=c.created if self._created else None)
            return counter
        fam = HistogramMetricFamily(self.name, self.doc, labels=names)
        for values, h in self._children.items():
            cumulative, running = [], 0
            for bound, n in zip(self._buckets, h.counts, strict=True):
                running += n
                cumulative.append((floatToGoString(bound), running))
            fam.add_metric(list(values), cumulative, h.sum)
            if self._created:
                fam.add_sample(self.name + "_created", dict(zip(names, values, strict=True)), h.created)
        return fam


class _RecordedCollector(Collector):
    def __init__(self, metrics: Sequence[Recorded]):
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return [m.family() for m in self._metrics]


class _ComfyFiles(Collector):
    """What ComfyUI routes hold of their prompts' files (docs/API.md "ComfyUI over several GPUs")."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        held = GaugeMetricFamily("kiloline_comfy_files_bytes", "Bytes of a ComfyUI route's files held in memory",
                                 labels=["route"])
        count = GaugeMetricFamily("kiloline_comfy_files", "Files a ComfyUI route's store knows", labels=["route"])
        source = self._metrics.comfy_files_source
        for route, files, nbytes in source() if source is not None else ():
            held.add_metric([route], nbytes)
            count.add_metric([route], files)
        yield from (held, count)


class Metrics:
    def __init__(self, rt: Callable[[], LiveState]):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Recorded("counter", "kiloline_requests", "Finished requests by outcome", ["route", "outcome"])
        self.queue_wait = Recorded("histogram", "kiloline_queue_wait_seconds", "Time from admission to lease",
                                   ["route"], WAIT_BUCKETS)
        self.upstream = Recorded("histogram", "kiloline_upstream_seconds", "Time from dispatch to the last byte",
                                 ["route", "node"], UPSTREAM_BUCKETS)
        self.ttft = Recorded("histogram", "kiloline_ttft_seconds", "Time to first token (openai routes)", ["route"],
                             TTFT_BUCKETS)
        self.rejections = Recorded("counter", "kiloline_rejections", "Requests refused before the upstream",
                                   ["route", "reason"])
        self.failovers = Recorded("counter", "kiloline_failovers",
                                  "Requests re-queued or sent to a standby after a node failure", ["route"])
        self.continuations = Recorded("counter", "kiloline_stream_continuations",
                                      "Streams sent on to another node after theirs failed mid-answer", ["route"])
        self.reloads = Recorded("counter", "kiloline_reloads", "Config reloads", ["result"])
        for result in ("ok", "error"):
            self.reloads.labels(result)
        self.tokens = Recorded("counter", "kiloline_tokens", "LLM tokens by route and key", ["route", "key"])
        self.gpu_seconds = Recorded("counter", "kiloline_gpu_seconds",
                                    "Seconds leases held a node (the bill's GPU time), by route and key",
                                    ["route", "key"])
        # What the nodes report of the prompt (llama.cpp timings, OpenAI cached_tokens) (docs/CONFIG.md#affinity).
        self.prompt_tokens = Recorded("counter", "kiloline_prompt_tokens",
                                      "Prompt tokens the nodes reported, cached (reused) or not",
                                      ["route", "node", "cached"])
        self.mispredictions = Recorded("counter", "kiloline_affinity_mispredictions",
                                       "Predicted prefix hits whose node reported almost nothing reused",
                                       ["route", "node"])
        self.fleet_events = Recorded("counter", "kiloline_fleet_events", "Fleet events (docs/FLEET.md)", ["event"])
        self.comfy_uploads = Recorded("counter", "kiloline_comfy_uploads",
                                      "Files uploaded to a ComfyUI route's gateway", ["route"])
        #: (route, files, bytes in memory) of ComfyUI routes' files, set by the adapter (comfy_store.py)
        self.comfy_files_source: Callable[[], Iterable[tuple[str, int, int]]] | None = None
        r.register(_RecordedCollector([self.requests, self.queue_wait, self.upstream, self.ttft, self.rejections,
                                       self.failovers, self.continuations, self.reloads, self.tokens,
                                       self.prompt_tokens, self.mispredictions, self.fleet_events, self.comfy_uploads,
                                       self.gpu_seconds]))
        r.register(_LiveGauges(rt))
        r.register(_ComfyFiles(self))
        # The daemon's own process (CPU, memory, fds, start time), Python and its collector.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        Gauge("kiloline_build_info", "The running kilolined's version (always 1)", ["version"],
              registry=r).labels(__version__).set(1)

    def prompt_tokens_by_route(self) -> dict[str, tuple[float, float]]:
        """(cached, all) prompt tokens the nodes of each route reported, in one pass over the
        label sets (one pass per route would be quadratic in the routes)."""
        out: dict[str, tuple[float, float]] = {}
        for (route, _node, cached), v in self.prompt_tokens.values().items():
            c, t = out.get(route, (0.0, 0.0))
            out[route] = (c + v if cached == "true" else c, t + v)
        return out

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""Node speed as pure logic: size-normalised samples, peak-EWMA, peers and drift (docs/CONFIG.md "Slow nodes").

No I/O and no clock of its own: every call takes ``now`` (monotonic seconds), so tests drive an
hour or 36 hours of traffic in a moment. The runtime feeds one ``Sample`` per finished request
(``record``) and acts on the verdicts it gets back; what a node *is* (ok, slow, drifting,
stalled) and when it may be tried again live here, what that means for its slots lives in
``nodes.NodeState.slowed`` and ``queue.Scheduler``.

Speed is time per unit of work, so requests of different sizes compare: an LLM answer in ms per
generated token (and ms per uncached prompt token), a ComfyUI prompt in ms per sampler step
(when its progress frames gave steps) or per cost unit, any other request in ms per request —
in its client key's own series (``client_model``), since only the client knows its sizes.
Every unit is in ms so that ``min_gap_ms`` reads the same for all.

The level of one (node, route, model, unit) series is a peak-EWMA over ``samples`` requests: a
sample above the level pulls it up at twice the EWMA's weight, a faster one lets it decay at the
EWMA's rate, so a node that turns slow shows within a few requests and one that recovers has to
prove it for a while. A node is judged against the median level of the other nodes serving the
same route, model and unit, once it has served ``samples`` requests.

One evaluation is *slow* when its level is ``ratio`` × and ``min_gap_ms`` above that median
**and** the evidence of its recent samples says so: a one-sided CUSUM of log(sample ÷ median)
less log(ratio), which must reach ``EVIDENCE``. The EWMA alone is not enough: under lognormal
noise of σ 0.5 (GPU timings are that noisy) an EWMA over 20 requests wanders ±12 %, and a few
unlucky requests in a row push it over 1.5× about once every 15,000 requests. The evidence
grows by about 0.6 a request on a node 3× slower (flagged within ~8 of its requests) and
drifts down on a healthy one, so an hour of noise raises no alarm (tests/test_speed.py).
``evaluations`` slow evaluations in a row are needed to act. A node alone on its route is
judged the same way against its own history (drift.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from statistics import median

from kilolined.core.config import SlowConfig
from kilolined.scheduling.drift import HOUR_MIN, Baseline

# Units, all in milliseconds per unit of work.
MS_TOKEN = "ms/token"  # LLM decode: per generated token
MS_PROMPT_TOKEN = "ms/prompt_token"  # LLM prefill: per uncached prompt token
MS_UNIT = "ms/unit"  # ComfyUI: per cost unit of the request (§11.1)
MS_STEP = "ms/step"  # ComfyUI: per sampler step (progress events)
MS_REQUEST = "ms/request"  # anything else: per request of the same route

OK, SLOW, DRIFTING, STALLED = "ok", "slow", "drifting", "stalled"
CLIENT = "\x1f"  # joins a series' model and the client key it is kept for (client_model)
EVIDENCE = 2.5  # the CUSUM (in log units) a slow evaluation needs: ~5σ of σ-0.5 noise
HARD = 3.0  # this many times the peers' median (or a stall): the breaker opens
MIN_PROMPT_TOKENS = 16  # fewer uncached prompt tokens say more about overhead than prefill speed


@dataclass(frozen=True, slots=True)
class Sample:
    unit: str
    value: float  # ms per unit


def llm_samples(elapsed_s: float, first_s: float | None, usage: Mapping[str, object] | None,
                timings: Mapping[str, object] | None) -> list[Sample]:
    """The speed of one LLM answer: llama.cpp's own ``timings`` when it sent them, else the
    gateway's timing (time to first token for the prompt, the rest for the generated tokens)
    divided by the ``usage`` counts. Nothing when no count is known (a generic sample is taken)."""
    out: list[Sample] = []
    if timings:
        per_tok = _num(timings.get("predicted_per_token_ms"))
        n_pred = _num(timings.get("predicted_n"))
        if per_tok is not None and n_pred is not None and n_pred >= 1:
            out.append(Sample(MS_TOKEN, per_tok))
        per_prompt = _num(timings.get("prompt_per_token_ms"))
        n_prompt = _num(timings.get("prompt_n"))
        if per_prompt is not None and n_prompt is not None and n_prompt >= MIN_PROMPT_TOKENS:
            out.append(Sample(MS_PROMPT_TOKEN, per_prompt))
        if out:
            return out
    if not usage:
        return out
    done = _num(usage.get("completion_tokens"))
    prompt = _num(usage.get("prompt_tokens"))
    details = usage.get("prompt_tokens_details")
    cached = _num(details.get("cached_tokens")) if isinstance(details, dict) else None
    first = first_s if first_s is not None and 0 <= first_s <= elapsed_s else None
    if done is not None and done >= 1:
        decode_s = elapsed_s - first if first is not None and done > 1 else elapsed_s
        n = done - 1 if first is not None and done > 1 else done
        out.append(Sample(MS_TOKEN, max(0.0, decode_s) * 1000 / n))
    if first is not None and prompt is not None:
        uncached = prompt - (cached or 0)
        if uncached >= MIN_PROMPT_TOKENS:
            out.append(Sample(MS_PROMPT_TOKEN, first * 1000 / uncached))
    return out


def client_model(model: str, key: str) -> str:
    """The series a request measured whole (ms per request: its size unknown) belongs to: its
    client's own. One key's requests are compared only with the same key's on the other nodes,
    so a client sending heavier requests than the rest, or pinning them to one node, measures
    its own requests, not the node (docs/CONFIG.md "Slow nodes")."""
    return f"{model}{CLIENT}{key}"


def shown_model(model: str) -> str | None:
    """A series' model as the views show it: without the client it is kept for."""
    return model.partition(CLIENT)[0] or None


def _num(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return None
    return float(v)


@dataclass(slots=True)
class Series:
    """One (node, route, model, unit): the level, its evaluations and its hourly history."""

    level: float | None = None
    count: int = 0
    streak: int = 0  # consecutive slow evaluations
    evidence: float = 0.0  # the CUSUM of log(sample / peers' median) - log(ratio), floored at 0
    hard_streak: int = 0  # consecutive evaluations at HARD × the peers
    fine_streak: int = 0  # consecutive evaluations back within ratio (recovery)
    peers: float | None = None  # the peers' median at the last evaluation (alone: its own baseline)
    #: alone on its route (drift.py): its own history, the evidence against it and the verdict's streak
    own: Baseline = field(default_factory=lambda: Baseline())
    #: the (route, model, unit) group it belongs to (SpeedBook.groups): its peers, without a lookup
    group: dict[str, Series] | None = field(default=None, repr=False, compare=False)

    def add(self, value: float, samples: int) -> None:
        alpha = 2.0 / (samples + 1)
        if self.level is None:
            self.level = value
        elif value > self.level:
            # peak: a slower sample counts at once (twice the weight), a faster one decays
            self.level += min(1.0, 2 * alpha) * (value - self.level)
        else:
            self.level += alpha * (value - self.level)
        self.count += 1

    def warm(self, samples: int) -> bool:
        """Enough requests for the level to mean something: the EWMA's whole span (it starts
        at the first sample, which alone says little)."""
        return self.count >= samples


@dataclass(slots=True)
class NodeSpeed:
    """What the speed watch holds for one node: its state and its eject backoff."""

    state: str = OK
    ejected: bool = False  # its slots are cut now (soft: to 1; hard: its breaker opened)
    hard: bool = False  # the last eject opened its breaker
    #: while ejected: when it may be tried again (its slots come back through slow start)
    until: float = 0.0
    period: float = 0.0  # the last eject's length: doubles on repeats, as the breaker's
    ejections: int = 0
    #: the series that made it slow (route, model, unit), for the views and the alert
    cause: tuple[str, str, str] | None = None
    drifting: bool = False


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one sample decided: ``action`` is "" (nothing), "soft", "hard", "recovered" or
    "drifting"; the numbers are for the alert."""

    node: str
    action: str
    unit: str
    level: float
    peers: float | None


Key = tuple[str, str, str, str]  # node, route, model ("" when none), unit


class SpeedBook:
    """Every series of every node, and each node's speed state."""

    def __init__(self) -> None:
        self.series: dict[Key, Series] = {}
        #: (route, model, unit) -> node -> its series: the peers of a sample, without a scan
        self.groups: dict[tuple[str, str, str], dict[str, Series]] = {}
        self.nodes: dict[str, NodeSpeed] = {}

    def node(self, name: str) -> NodeSpeed:
        ns = self.nodes.get(name)
        if ns is None:
            ns = self.nodes[name] = NodeSpeed()
        return ns

    def forget(self, node: str) -> None:
        self.nodes.pop(node, None)
        for k in [k for k in self.series if k[0] == node]:
            del self.series[k]
            group = self.groups.get(k[1:])
            if group is not None:
                group.pop(node, None)
                if not group:
                    del self.groups[k[1:]]

    # --- judging ------------------------------------------------------------------------
    def record(self, node: str, route: str, model: str, sample: Sample, now: float, cfg: SlowConfig,
               ejectable: Callable[[], int]) -> Verdict | None:
        """Add one sample and evaluate the node. ``ejectable()``: how many more of the route's
        nodes may be ejected (max(1, 10 %) of them minus those already out; 0 when this is the
        last); asked only when this sample would eject, since it walks the route's nodes.

        Called for every answer: the path of a sample that changes nothing is kept short (the
        level and the hour's sums updated in place, the peers read from the series' own group,
        no node state looked up), with the same decisions as a full evaluation."""
        return self.record_value(node, route, model, sample.unit, sample.value, now, cfg, ejectable)

    def record_value(self, node: str, route: str, model: str, unit: str, value: float, now: float,
                     cfg: SlowConfig, ejectable: Callable[[], int], may_drift: bool = True) -> Verdict | None:
        """``record`` of the sample (``unit``, ``value``), without a Sample made for it: the
        speed watch's one sample per answer of a request measured whole. ``may_drift``: a series
        with no peer is judged against its own history (False: one client's series on a route
        with other nodes, whose own history says more about the client than the node)."""
        s = self.series.get((node, route, model, unit))
        if s is None:
            s = self.series[(node, route, model, unit)] = Series()
            group = self.groups.setdefault((route, model, unit), {})
            group[node] = s
            s.group = group
        samples = cfg.samples
        # the peak-EWMA (Series.add), inline
        level = s.level
        if level is None:
            s.level = level = value
        else:
            alpha = 2.0 / (samples + 1)
            level += (alpha if value <= level else min(1.0, 2 * alpha)) * (value - level)
            s.level = level
        s.count += 1
        mates = s.group
        peers = [p.level for n, p in mates.items() if n != node and p.level is not None and p.count >= samples] \
            if mates is not None and len(mates) > 1 else None
        if not peers:
            s.peers = None
            s.streak = s.hard_streak = 0
            if not may_drift:
                return None
            return self._drift(node, s, unit, level, value, now, cfg)
        s.own.learn(level, value, now, HOUR_MIN * samples)  # its baseline, should its peers go
        mid = _median(peers)
        s.peers = mid
        if s.count < samples:
            return None
        if mid > 0:
            step = math.log(max(value, 1e-9) / mid) - math.log(cfg.ratio)
            s.evidence = max(0.0, s.evidence + step)
        slow = _above(level, mid, cfg.ratio, cfg.min_gap_ms) and s.evidence >= EVIDENCE
        s.streak = s.streak + 1 if slow else 0
        hard = slow and _above(level, mid, HARD, cfg.min_gap_ms)
        s.hard_streak = s.hard_streak + 1 if hard else 0
        # Back within ratio, with no evidence left of being slower: held for `evaluations` too,
        # so that a node on one slot, served faster for being less loaded, does not flap.
        fine = level <= cfg.ratio * mid and s.evidence == 0
        s.fine_streak = s.fine_streak + 1 if fine else 0
        st = self.nodes.get(node)
        if st is None:
            if s.streak < cfg.evaluations:
                return None  # an OK node (no state yet) that is not slow enough to act on
            st = self.node(node)
        cause = (route, model, unit)
        if st.state == SLOW and st.cause == cause:
            if s.fine_streak >= cfg.evaluations:
                return self._recover(node, st, unit, level, mid)
            if s.hard_streak >= cfg.evaluations and not st.hard:
                return self._eject(node, st, "hard", cause, s, mid)
            if not st.ejected and s.streak >= cfg.evaluations:
                return self._eject(node, st, "soft", cause, s, mid)  # its trial showed it still slow
            return None
        if st.state != OK or s.streak < cfg.evaluations or ejectable() <= 0:
            return None  # (hard_streak counts a subset of streak's samples: it is never the larger)
        return self._eject(node, st, "hard" if s.hard_streak >= cfg.evaluations else "soft", cause, s, mid)

    def _eject(self, node: str, st: NodeSpeed, how: str, cause: tuple[str, str, str], s: Series,
               mid: float) -> Verdict:
        assert s.level is not None
        st.state = SLOW
        st.cause = cause
        st.ejected = True
        st.hard = how == "hard"
        st.ejections += 1
        s.streak = s.hard_streak = 0  # its evidence stays: a trial goes on from it (trial)
        return Verdict(node, how, cause[2], s.level, mid)

    def _recover(self, node: str, st: NodeSpeed, unit: str, level: float, mid: float) -> Verdict:
        st.state = OK
        st.cause = None
        st.ejected = st.hard = False
        st.period = 0.0  # a clean recovery: the next eject starts from open_sec again
        return Verdict(node, "recovered", unit, level, mid)

    def eject_period(self, node: str, now: float, open_sec: float, max_open_sec: float) -> float:
        """Start the eject's clock (the caller applied it): open_sec, doubled on each repeat
        that came before a clean recovery, up to max_open_sec. Returns the period."""
        st = self.node(node)
        st.period = min(max_open_sec, open_sec if st.period <= 0 else st.period * 2)
        st.until = now + st.period
        return st.period

    def trial(self, node: str, now: float) -> bool:
        """The eject's period is over: the node is tried again (True once, when it just ended).

        A trial does not forget: the series keeps its level and its count, so the trial's first
        request is judged, and its evidence is set to the threshold (less if it had less): each
        sample above ``ratio`` × the peers keeps it there, one below takes it under. A node still
        slow is ejected again after ``evaluations`` slow requests, for twice as long; one back to
        speed is not, and recovers once its level and evidence have come down."""
        st = self.nodes.get(node)
        if st is None or st.state != SLOW or not st.ejected or now < st.until:
            return False
        st.until = 0.0
        st.ejected = st.hard = False
        if st.cause is not None:
            route, model, unit = st.cause
            s = self.series.get((node, route, model, unit))
            if s is not None:
                s.streak = s.hard_streak = s.fine_streak = 0
                s.evidence = min(s.evidence, EVIDENCE)
        return True

    def stalled(self, node: str) -> bool:
        """A stall: the node is out at once (hard eject); False when it already was."""
        st = self.node(node)
        if st.state == STALLED or (st.state == SLOW and st.hard and st.ejected):
            return False
        st.state = STALLED
        st.ejected = st.hard = True
        st.ejections += 1
        return True

    def unstall(self, node: str) -> bool:
        """A stalled node answered a request in full again."""
        st = self.nodes.get(node)
        if st is None or st.state != STALLED:
            return False
        st.state = OK
        st.ejected = st.hard = False
        st.period = 0.0
        return True

    # --- drift ----------------------------------------------------------------------------
    def _drift(self, node: str, s: Series, unit: str, level: float, value: float, now: float,
               cfg: SlowConfig) -> Verdict | None:
        """Alone on its route: the sample against its own baseline (drift.py), at every request
        once the series has served ``samples``. Alerted once, until back within ``drift``."""
        own = s.own
        need = HOUR_MIN * cfg.samples
        if s.count < cfg.samples:
            own.learn(level, value, now, need)
            return None
        own.judge(level, value, now, cfg.drift, EVIDENCE, need)
        st = self.nodes.get(node)
        if st is not None and st.drifting:
            if own.back(level, now, cfg.drift):
                st.drifting = False  # back within drift: a later drift alerts again
            return None
        if own.streak < cfg.evaluations:
            return None
        self.node(node).drifting = True
        base = own.best(now)
        return Verdict(node, "drifting", unit, level, base[0] if base is not None else None)

    # --- views ------------------------------------------------------------------------------
    def view(self, node: str) -> dict[str, object] | None:
        """``speed`` of /admin/state: the series that matters most (the cause, else the slowest
        against its peers), or None before the node served anything measured."""
        st = self.nodes.get(node)
        mine = [(k, s) for k, s in self.series.items() if k[0] == node and s.level is not None]
        if not mine:
            if st is not None and st.state == STALLED:
                return {"unit": None, "ewma": None, "peers_median": None, "state": STALLED, "route": None,
                        "model": None}
            return None
        if st is not None and st.cause is not None:
            pick = [(k, s) for k, s in mine if k[1:] == st.cause] or mine
        else:
            pick = sorted(mine, key=lambda ks: -(ks[1].level or 0) / (ks[1].peers or ks[1].level or 1))
        (_, route, model, unit), s = pick[0]
        state = st.state if st is not None else OK
        if state == OK and st is not None and st.drifting:
            state = DRIFTING
        return {"unit": unit, "ewma": _round(s.level), "peers_median": _round(s.peers), "state": state,
                "route": route, "model": shown_model(model)}

    def levels(self) -> list[tuple[str, str, str, float]]:
        """(node, route, unit, level) of every series, for kiloline_node_speed (models averaged
        into the route's line: the metric's labels are the node, the route and the unit)."""
        acc: dict[tuple[str, str, str], list[float]] = {}
        for (n, r, _m, u), s in self.series.items():
            if s.level is not None:
                acc.setdefault((n, r, u), []).append(s.level)
        return [(n, r, u, sum(v) / len(v)) for (n, r, u), v in acc.items()]


def ejectable(route_nodes: int, ejected: int, others_serving: int) -> int:
    """How many more of a route's nodes may be ejected now: never more than max(1, 10 %) of
    them at once, and never the last one that can take work (``others_serving`` == 0)."""
    if others_serving <= 0:
        return 0
    return max(0, max(1, math.floor(route_nodes * 0.1)) - ejected)


def _median(values: list[float]) -> float:
    """statistics.median, without its generality for the usual two or three peers."""
    n = len(values)
    if n == 1:
        return values[0]
    if n == 2:
        return (values[0] + values[1]) / 2
    return median(values)


def _above(value: float, mid: float, ratio: float, gap: float) -> bool:
    return value > ratio * mid and value - mid > gap


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)

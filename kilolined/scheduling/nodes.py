"""Node state as pure logic: active health × passive breaker × slow start × drain.

No I/O and no clock of its own: every method takes ``now`` (monotonic seconds), so tests drive
time by hand. ``NodeState`` is the one writer of its fields: every change is one of its methods,
and the other modules only read them (tests/test_one_writer.py walks the package for writes).
Methods that change state return the events they caused (``node_down``, ``node_up``,
``breaker_open``, ``breaker_closed``, ``node_slow``, ``node_recovered``, or the quiet ``CHANGED``)
for the one subscriber, the runtime's ``node_events``, to share with the cluster and alert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kilolined.core.config import BreakerConfig, HealthConfig, NodeConfig
from kilolined.scheduling.models import ModelState

CLOSED, HALF_OPEN, OPEN = "closed", "half-open", "open"
BREAKER_GAUGE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}
# What the speed watch decided about a node (ops/speedwatch.py): at full speed; soft-ejected (one
# slot, ranked last); hard-ejected (its breaker opened for it); on trial after an eject (slots back
# through slow start, judged from its first request on the EWMA it kept); out after a stall.
SPEED_OK, SPEED_SLOW, SPEED_HARD, SPEED_TRIAL, SPEED_STALLED = "ok", "slow", "hard", "trial", "stalled"
SPEED_EJECTED = (SPEED_SLOW, SPEED_HARD, SPEED_STALLED)
#: The quiet event: the node's shared state changed (a drain, a trial, a verdict lifted) but
#: nothing to alert. The runtime shares it with the cluster and alerts, feeds and watches the others.
CHANGED = "node_changed"


def speed_events(old: str, new: str, note: str) -> list[str]:
    """What a change of speed verdict says, wherever it was decided: an eject (again after a
    trial, or harder) is ``node_slow``, the end of one ``node_recovered``; a stall ends quietly,
    and so does a lift by ``slow: off`` (it has no words)."""
    if new == old:
        return []
    if new in SPEED_EJECTED:
        return ["node_slow"]
    if new == SPEED_OK and old in (SPEED_SLOW, SPEED_HARD, SPEED_TRIAL) and note:
        return ["node_recovered"]
    return [CHANGED]


@dataclass
class NodeState:
    name: str
    cfg: NodeConfig
    healthy: bool = True
    drained: bool = False
    # health counters: consecutive results of the opposite kind to the current state
    check_fails: int = 0
    check_oks: int = 0
    last_check_ms: float | None = None
    last_error: str | None = None
    # breaker
    breaker: str = CLOSED
    failures: int = 0
    open_until: float = 0.0
    open_period: float = 0.0
    trial_in_flight: bool = False
    # slow start: set when the node recovers (not at gateway start, as in HAProxy)
    recovered_at: float | None = None
    #: soft-ejected for being slow (speed.py): one slot, ranked last in node choice
    slowed: bool = False
    # The speed watch's verdict, kept here rather than in its book because it is node state the
    # gateways share (cluster/nodestate.py): each gateway measures on its own, one verdict holds.
    slow_state: str = SPEED_OK
    slow_until: float = 0.0  # while ejected: when it is tried again
    slow_period: float = 0.0  # the last eject's length: doubles on repeats, back to 0 on recovery
    slow_cause: str = ""  # route, model and unit (tab-separated) of the series that made it slow
    slow_note: str = ""  # the words of the last transition: the alert another gateway sends
    retired: bool = False  # removed by a reload: gets no new work, in-flight finishes
    latencies: list[float] = field(default_factory=list)
    # The last time it was seen alive: a health check passed or a request succeeded. A request
    # the node lost goes back to it only after this moves (queue.Scheduler.barred).
    alive_at: float = -math.inf
    # The last time it was seen gone: a request lost on it (connection refused, reset or dropped
    # mid-answer) or a failed health check. Gone since it was last seen alive, a node that fails
    # a request it was sent costs that request no retry (lease.uncharged).
    lost_at: float = -math.inf
    models: ModelState = field(default_factory=ModelState)  # what it serves and holds loaded
    #: when its process started, as its health answer tells (affinity.reported_start); None: it does not
    started: float | None = None

    @property
    def label(self) -> str:
        return self.cfg.label or self.name

    @property
    def health_cfg(self) -> HealthConfig | None:
        return self.cfg.health

    @property
    def breaker_cfg(self) -> BreakerConfig:
        return self.cfg.breaker

    # --- config and life ----------------------------------------------------------------
    def configure(self, cfg: NodeConfig) -> None:
        """A reload changed the node's settings (same URL: the same node, its state kept)."""
        self.cfg = cfg

    def retire(self) -> None:
        """Removed by a reload: no new work; what runs finishes."""
        self.retired = True

    def drain(self, on: bool) -> list[str]:
        """Drained (an operator, or the fleet reclaiming a node it shrinks): no new work."""
        if self.drained == on:
            return []
        self.drained = on
        return [CHANGED]

    def saw_start(self, started: float) -> None:
        """Its health answer told a new process start (affinity.restarted decided it)."""
        self.started = started

    def note_error(self, reason: str) -> None:
        """What went wrong last, for views and alerts, without a verdict of its own."""
        self.last_error = reason

    def end_trial(self) -> None:
        """The half-open trial ended without a verdict (e.g. cancelled): another may run."""
        self.trial_in_flight = False

    def seen_alive(self, now: float) -> None:
        """A health check passed or a request succeeded here or on the cluster's word: the one
        place ``alive_at`` moves (a request the node lost goes back to it only after it does)."""
        self.alive_at = now

    def lost(self, now: float) -> None:
        """A request was lost on it (refused, reset, dropped mid-answer) or a health check failed:
        the one place ``lost_at`` moves (gone until seen alive again, lease.uncharged)."""
        self.lost_at = now

    # --- speed verdicts (ops/speedwatch.py decides them; speed.py measures) ------------
    def judge_speed(self, state: str, until: float, period: float, cause: str, note: str) -> list[str]:
        """This gateway's speed watch reached a verdict: it becomes the node's (and, through the
        events, the cluster's). ``cause``: route, model and unit, tab-separated."""
        slowed = state in (SPEED_SLOW, SPEED_HARD)
        return self._set_speed(state, slowed, until if slowed else 0.0, period, cause, note)

    def take_speed(self, state: str, slowed: bool, until: float, period: float, cause: str,
                   note: str) -> list[str]:
        """The speed verdict another gateway reached (cluster/nodestate.py)."""
        return self._set_speed(state, slowed, until, period, cause, note)

    def _set_speed(self, state: str, slowed: bool, until: float, period: float, cause: str,
                   note: str) -> list[str]:
        old = self.slow_state
        before = (self.slowed, self.slow_until, self.slow_period, self.slow_cause, self.slow_note)
        self.slow_state, self.slowed, self.slow_until = state, slowed, until
        self.slow_period, self.slow_cause, self.slow_note = period, cause, note
        events = speed_events(old, state, note)
        if not events and before != (slowed, until, period, cause, note):
            events = [CHANGED]
        return events

    def speed_trial(self, now: float) -> list[str]:
        """An ejected node's period is over: its trial (slots back through slow start)."""
        self.slowed = False
        self.slow_state = SPEED_TRIAL
        self.slow_until = 0.0
        self.recovered_at = now
        return [CHANGED]

    def clear_slow(self) -> list[str]:
        """``slow: off``: whatever the speed watch decided is lifted (quietly: no words)."""
        if self.slow_state == SPEED_OK and not self.slowed:
            return []
        self.slowed = False
        self.slow_state, self.slow_until, self.slow_period, self.slow_cause, self.slow_note = SPEED_OK, 0.0, 0.0, "", ""
        return [CHANGED]

    # --- another gateway's verdicts (cluster/nodestate.py decodes them) ----------------
    def take_health(self, up: bool, now: float) -> list[str]:
        """The leader's health checks decided (the others run none)."""
        if up == self.healthy:
            return []
        self.healthy = up
        self.check_fails = self.check_oks = 0
        if up:
            self.seen_alive(now)  # the leader's checks passed: as one passing here
        return ["node_up" if up else "node_down"]

    def take_breaker_closed(self) -> list[str]:
        if self.breaker == CLOSED:
            return []
        self.breaker = CLOSED
        self.open_period = 0.0
        self.trial_in_flight = False
        self.failures = 0
        return ["breaker_closed"]

    def take_breaker_open(self, until: float, period: float, now: float) -> list[str]:
        """Another gateway opened the breaker until ``until`` (this gateway's clock)."""
        # A re-trip (half-open trial failed) moves the end by at least a whole period; the same trip
        # read again (the sweep) moves it by the time it travelled, a few milliseconds.
        if not (self.breaker == CLOSED or until > self.open_until + period / 2):
            return []
        self.breaker = OPEN
        self.open_until = until
        self.open_period = period
        self.trial_in_flight = False
        self.failures = 0
        self.tick(now)
        return ["breaker_open"]

    def take_ramp(self, recovered_at: float | None) -> None:
        """When its slow start began, as the cluster has it (None: none runs)."""
        self.recovered_at = recovered_at

    def take_drain(self, on: bool) -> None:
        """Drained through another gateway (it said so; nothing to say here)."""
        self.drained = on

    def take_failures(self, count: int) -> None:
        """The failures in a row the cluster counted, while the breaker is closed."""
        if self.breaker == CLOSED:
            self.failures = count

    # --- breaker clock -----------------------------------------------------------------
    def tick(self, now: float) -> list[str]:
        """Advance time-driven transitions: open → half-open when the period has passed."""
        if self.breaker == OPEN and now >= self.open_until:
            self.breaker = HALF_OPEN
            self.trial_in_flight = False
        return []

    def breaker_state(self, now: float) -> str:
        self.tick(now)
        return self.breaker

    # --- can it take work ---------------------------------------------------------------
    def available(self, now: float) -> bool:
        """Up, breaker lets a request through, not drained (slots are the scheduler's business)."""
        if self.retired or self.drained or not self.healthy:
            return False
        state = self.breaker_state(now)
        if state == OPEN:
            return False
        return not (state == HALF_OPEN and self.trial_in_flight)

    def serving(self, now: float) -> bool:
        """Known good: up, breaker closed, not drained. A half-open node is only on trial, so it
        does not count for the route's mode (no "back on primary" before the trial succeeded)."""
        return not (self.retired or self.drained or not self.healthy) and self.breaker_state(now) == CLOSED

    def effective(self, configured: int, now: float) -> int:
        """Slow start: 1 → configured linearly over slow_start_sec after a recovery; 1 while
        soft-ejected for being slow."""
        if self.slowed:
            return min(configured, 1)
        ss = self.breaker_cfg.slow_start_sec
        if self.recovered_at is None or ss <= 0 or configured <= 1:
            return configured
        frac = (now - self.recovered_at) / ss
        if frac >= 1:
            self.recovered_at = None
            return configured
        return max(1, min(configured, 1 + math.floor(frac * (configured - 1))))

    def on_dispatch(self, now: float) -> bool:
        """Called when a request is leased to this node; returns True if it is the half-open trial."""
        if self.breaker_state(now) == HALF_OPEN:
            self.trial_in_flight = True
            return True
        return False

    # --- passive results ----------------------------------------------------------------
    def record_success(self, now: float, trial: bool = False) -> list[str]:
        self.failures = 0
        self.seen_alive(now)
        # While half-open only the one trial's result counts; stragglers from before the trip don't.
        if self.breaker == HALF_OPEN and trial:
            self.breaker = CLOSED
            self.trial_in_flight = False
            self.open_period = 0.0
            self.recovered_at = now
            return ["breaker_closed"]
        return []

    def record_failure(self, now: float, reason: str, trial: bool = False) -> list[str]:
        self.last_error = reason
        self.tick(now)
        if self.breaker == HALF_OPEN:
            return self._trip(now) if trial else []
        if self.breaker == OPEN:
            return []
        self.failures += 1
        if self.failures >= self.breaker_cfg.consecutive_failures:
            return self._trip(now)
        return []

    def merge_failures(self, count: int, now: float) -> list[str]:
        """Cluster mode: ``count`` consecutive failures seen on every gateway together; they
        open a closed breaker as this gateway's own would."""
        self.tick(now)
        if self.breaker != CLOSED:
            return []
        self.failures = max(self.failures, count)
        if self.failures >= self.breaker_cfg.consecutive_failures:
            return self._trip(now)
        return []

    def trip(self, now: float) -> list[str]:
        """Open the breaker now (a hard eject for slowness or a stall, speed.py); [] when it is
        open already."""
        self.tick(now)
        return [] if self.breaker == OPEN else self._trip(now)

    def _trip(self, now: float) -> list[str]:
        cfg = self.breaker_cfg
        was_closed = self.breaker == CLOSED
        self.open_period = cfg.open_sec if was_closed or not self.open_period else self.open_period * 2
        self.open_period = min(self.open_period, cfg.max_open_sec)
        self.breaker = OPEN
        self.open_until = now + self.open_period
        self.trial_in_flight = False
        self.failures = 0
        self.recovered_at = None
        return ["breaker_open"]

    # --- active health ------------------------------------------------------------------
    def record_check(self, ok: bool, now: float, latency_ms: float | None, error: str | None) -> list[str]:
        hc = self.health_cfg
        if hc is None:
            return []
        self.last_check_ms = latency_ms
        if latency_ms is not None:
            self.latencies.append(latency_ms)
            del self.latencies[:-30]
        events: list[str] = []
        if ok:
            self.check_fails = 0
            self.seen_alive(now)
            # A half-open breaker may use a health check as its one trial.
            if self.breaker_state(now) == HALF_OPEN and not self.trial_in_flight:
                events += self.record_success(now, trial=True)
            if not self.healthy:
                self.check_oks += 1
                if self.check_oks >= hc.rise:
                    self.healthy = True
                    self.check_oks = 0
                    self.recovered_at = now
                    events.append("node_up")
        else:
            self.last_error = error
            self.lost(now)
            self.check_oks = 0
            if self.breaker_state(now) == HALF_OPEN and not self.trial_in_flight:
                events += self._trip(now)
            if self.healthy:
                self.check_fails += 1
                if self.check_fails >= hc.fall:
                    self.healthy = False
                    self.check_fails = 0
                    self.recovered_at = None
                    events.append("node_down")
        return events

    def snapshot(self, now: float) -> dict[str, object]:
        return {
            "label": self.label,
            "health": "up" if self.healthy else "down",
            "breaker": self.breaker_state(now),
            "drained": self.drained,
            "last_check_ms": None if self.last_check_ms is None else round(self.last_check_ms, 1),
            "last_error": self.last_error,
        }
